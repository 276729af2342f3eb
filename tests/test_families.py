"""The Llama and Qwen3 families in gptopt's one model module: Hugging Face parity on random weights, written to
local directories the tests create; GPT-2's own paths are the other test modules'.

    pytest -q tests/test_families.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptopt import hf
from gptopt.config import GPTConfig
from gptopt.model import GPT

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, rms_norm_eps=1e-6)


def hf_model(kind: str, **kw: object) -> torch.nn.Module:
    """A random transformers model of the family: Llama with grouped-query attention and its own head; Qwen3 with
    heads sized apart from the width (as Qwen3-0.6B's) and a tied head."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, rope_theta=50000.0, tie_word_embeddings=False,
                                       **kw)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                                   tie_word_embeddings=True, **kw)
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_hugging_face_model_of_the_family_loads_with_its_logits(kind: str, tmp_path: Path) -> None:
    theirs = hf_model(kind)
    theirs.save_pretrained(tmp_path / kind)
    ours = hf.load_pretrained(tmp_path / kind).eval()
    c = ours.config
    assert (c.positions, c.norm, c.mlp, c.kv_heads, c.qk_norm, c.tie_embeddings) == (
        "rope", "rmsnorm", "swiglu", 2, kind == "qwen3", kind == "qwen3")
    x = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(input_ids=x).logits
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cached_decoding_gives_the_full_forwards_logits(kind: str, tmp_path: Path) -> None:
    """Rotary positions and grouped key/value heads through the KV cache: a prompt, then one token at a time."""
    from gptopt.generator import KVCache

    hf_model(kind).save_pretrained(tmp_path / kind)
    model = hf.load_pretrained(tmp_path / kind).eval()
    x = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model.config, 1, 32, device="cpu", dtype=torch.float32)
    assert cache.k[0].shape[1] == model.config.kv_heads  # the cache holds the key/value heads only
    rows = torch.tensor([0])
    with torch.no_grad():
        full = model(x)
        steps = [model(x[:, :8], pos=torch.arange(8)[None], kv_cache=cache.layers(rows, torch.arange(8)[None]),
                       attn_mask=cache.mask(torch.arange(8)[None]))]
        for t in range(8, 12):
            p = torch.tensor([[t]])
            steps.append(model(x[:, t:t + 1], pos=p, kv_cache=cache.layers(rows, p), attn_mask=cache.mask(p)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-4)


def test_what_gptopt_cannot_represent_is_refused_with_the_reason(tmp_path: Path) -> None:
    theirs = hf_model("llama", rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    theirs.save_pretrained(tmp_path / "scaled")
    with pytest.raises(ValueError, match="scaled rotary"):
        hf.load_pretrained(tmp_path / "scaled")


def test_the_family_trains_and_gpt2s_module_keeps_its_weights() -> None:
    llama = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=300, bias=False,
                          positions="rope", norm="rmsnorm", mlp="swiglu", intermediate_size=96,
                          tie_embeddings=False))
    x = torch.randint(0, 300, (2, 32))
    loss = llama(x, x)
    loss.backward()
    assert all(p.grad is not None for p in llama.parameters())
    assert "transformer.wpe.weight" not in llama.state_dict() and not any("bias" in k for k in llama.state_dict())


@pytest.mark.parametrize(("name", "kind", "shape"), [
    ("smollm2-135m", "llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    ("qwen3-0.6b", "qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True)),
])
def test_the_published_models_presets_have_their_parameters(name: str, kind: str, shape: dict) -> None:
    from gptopt.config import preset

    make = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    with torch.device("meta"):
        theirs = make[1](make[0](**shape))
        ours = GPT(preset(name))
    assert ours.num_params() == theirs.num_parameters()
    assert hf.config_from_llama({**shape, "model_type": kind}).kv_heads == preset(name).kv_heads


def test_bench_trains_a_llama_shaped_preset_against_its_transformers_model(train_data: Path,
                                                                          tmp_path: Path) -> None:
    from gptopt.bench.ladder import Bench, select_rungs
    from gptopt.config import BenchConfig

    bench = Bench(BenchConfig(preset="llama-tiny", seq_len=32, batch_size=4, warmup=1, device="cpu",
                              data_dir=str(train_data), output_dir=str(tmp_path / "b")))
    summary = bench.run(select_rungs("hf,sdpa"))
    rungs = {r["name"]: r for r in summary["rungs"]}
    assert rungs["hf"]["status"] == "ok" and rungs["sdpa"]["status"] == "ok" and rungs["sdpa"]["loss_ok"]
    assert rungs["sdpa"]["losses"][-1] < rungs["sdpa"]["losses"][0]


@pytest.mark.parametrize("qwen", [False, True])
def test_a_llama_shaped_model_exports_to_a_folder_transformers_loads_and_generates_from_alike(
    qwen: bool, tmp_path: Path
) -> None:
    from gptopt.device import resolve
    from gptopt.generator import Generator, SamplingParams, generate

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=300,
                          vocab_pad_multiple=64, bias=False, positions="rope", rope_theta=5e4, norm="rmsnorm",
                          mlp="swiglu", intermediate_size=96, qk_norm=qwen, tie_embeddings=qwen)).eval()
    hf.export_hf(model, tmp_path / "out", eot=0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == ("Qwen3ForCausalLM" if qwen else "LlamaForCausalLM")
    x = torch.randint(1, 300, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(x), theirs(input_ids=x).logits, rtol=0, atol=1e-4)
        want = theirs.generate(x, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    gen = Generator(model, resolve("cpu", "fp32", quiet=True), max_batch_size=1)
    ours = generate(gen, [x[0].tolist()], SamplingParams(max_new_tokens=12, temperature=0.0))
    assert ours[0] == want[0, 10:].tolist()
