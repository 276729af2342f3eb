"""The Llama and Qwen3 families in gptopt's one model module: Hugging Face parity on random weights, written to
local directories the tests create; GPT-2's own paths are the other test modules'.

    pytest -q tests/test_families.py
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import CHAT, chat_model_dir, hf_family_model
from tokenizers import Tokenizer

from gptopt.config import GPTConfig
from gptopt.models import hf
from gptopt.models.gpt import GPT, rotary

transformers = pytest.importorskip("transformers")

@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_hugging_face_model_of_the_family_loads_with_its_logits(kind: str, tmp_path: Path) -> None:
    theirs = hf_family_model(kind)
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


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cached_decoding_gives_the_full_forwards_logits(kind: str, attention: str, tmp_path: Path) -> None:
    """Rotary positions and grouped key/value heads through the KV cache: a prompt, then one token at a time, on
    both attention paths (each attends a decode step's grouped queries over the key/value heads as stored)."""
    from gptopt.infer.kv_cache import PagedKVCache

    hf_family_model(kind).save_pretrained(tmp_path / kind)
    model = hf.load_pretrained(tmp_path / kind, attention=attention).eval()
    assert model.config.attention == attention
    x = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = PagedKVCache(model.config, 5, 4, device="cpu", dtype=torch.float32)  # 4-token blocks
    assert cache.k[0].shape[2] == model.config.kv_heads  # the cache holds the key/value heads only
    table = torch.tensor([[3, 1, 4]])  # the sequence's blocks, in no particular order in the pool

    def at(p: torch.Tensor) -> list:  # the layers writing positions p (1, T), attending to 0..max(p)
        return cache.layers(table[0, p[0] // 4] * 4 + p[0] % 4, table, int(p.max()) + 1)

    with torch.no_grad():
        full = model(x)
        p = torch.arange(8)[None]
        steps = [model(x[:, :8], pos=p, kv_cache=at(p), attn_mask=cache.mask(p, 8))]
        for t in range(8, 12):
            p = torch.tensor([[t]])
            steps.append(model(x[:, t:t + 1], pos=p, kv_cache=at(p), attn_mask=cache.mask(p, t + 1)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_grouped_query_decode_step_reads_the_cache_as_stored(attention: str) -> None:
    """Under grouped-query attention a decode step never repeats the cached keys and values to every query head:
    beside the keys and values it gathers from its blocks, what it allocates stays under one such copy (the copy
    is the step's largest tensor where it is made)."""
    from conftest import LiveBytes

    from gptopt.infer.generator import Generator
    from gptopt.runtime.device import resolve

    config = GPTConfig(n_layer=1, n_head=6, n_kv_head=2, n_embd=192, block_size=512, vocab_size=64, bias=False,
                       positions="rope", norm="rmsnorm", mlp="swiglu", intermediate_size=256, attention=attention)
    gen = Generator(GPT(config).eval(), resolve("cpu", quiet=True), max_batch_size=4, max_len=512)
    S, rows = 256, [0, 1, 2, 3]
    with torch.no_grad():
        for row in rows:
            gen.prefill(row, [1] * (S - 1))
        with LiveBytes() as live:
            gen.decode(rows, [1] * len(rows), [S - 1] * len(rows))
    repeated = len(rows) * config.n_head * S * config.head_dim * 4  # fp32 keys of every query head
    gathered = 2 * len(rows) * config.kv_heads * S * config.head_dim * 4  # each row's blocks' keys and values
    assert live.peak < gathered + repeated, (live.peak, gathered, repeated)


def test_what_gptopt_cannot_represent_is_refused_with_the_reason(tmp_path: Path) -> None:
    theirs = hf_family_model("llama", rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    theirs.save_pretrained(tmp_path / "scaled")
    with pytest.raises(ValueError, match="scaled rotary"):
        hf.load_pretrained(tmp_path / "scaled")


def test_a_config_holding_rope_scaling_and_rope_parameters_rotates_as_transformers_reads_it(tmp_path: Path) -> None:
    """transformers takes a rope_scaling that is set in place of rope_parameters, theta and all: beside a plain
    rope_parameters, a llama3 rope_scaling is scaled there, so it is refused here (never loaded as plain rotary),
    and a plain rope_scaling beside rope_parameters of another theta gives transformers' logits."""
    hf_family_model("llama").save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    x = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(1))
    for scaling in (llama3, {"rope_type": "default"}):
        (tmp_path / "m" / "config.json").write_text(json.dumps(
            {**config, "rope_scaling": scaling, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        assert theirs.config.rope_parameters["rope_type"] == scaling["rope_type"]
        if scaling is llama3:
            with pytest.raises(ValueError, match="scaled rotary"):
                hf.load_pretrained(tmp_path / "m")
            continue
        ours = hf.load_pretrained(tmp_path / "m").eval()
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(input_ids=x).logits, rtol=0, atol=1e-4)


def test_an_end_id_that_is_no_id_is_refused_naming_the_file_and_the_field(
        debug_tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eos_token_id "x" in config.json or generation_config.json: generate refuses naming the file and the field,
    where it skipped the value and let a reply run past its end; so does loading config.json's model for any
    command (hf.load_pretrained), whether or not it reads the end ids."""
    from gptopt import cli

    d = chat_model_dir("qwen3", debug_tokenizer, tmp_path / "qwen3")
    for name in ("config.json", "generation_config.json"):
        good = (d / name).read_text()
        (d / name).write_text(json.dumps({**json.loads(good), "eos_token_id": "x"}))
        capsys.readouterr()
        assert cli.main(["generate", "--model", str(d), "--device", "cpu", "--max_new_tokens", "1", "hi"]) == 2
        err = capsys.readouterr().err
        assert f"{d / name}: eos_token_id must be a token id or a list of them, not 'x'" in err, err
        if name == "config.json":
            with pytest.raises(ValueError, match="config.json: eos_token_id must be a token id"):
                hf.load_pretrained(d)
        (d / name).write_text(good)


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
    from gptopt.infer.generator import Generator
    from gptopt.infer.sampling import SamplingParams
    from gptopt.infer.scheduler import generate
    from gptopt.runtime.device import resolve

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


def greedy_text(directory: Path, ids: list[int], n: int, stop: tuple[int, ...] = ()) -> str:
    """The Generator's greedy text after ids, from the directory as inference loads it: what the server must send."""
    from gptopt.infer.generator import Generator
    from gptopt.infer.load import load_for_inference
    from gptopt.infer.sampling import SamplingParams
    from gptopt.infer.scheduler import generate
    from gptopt.runtime.device import resolve

    plan = resolve("cpu", quiet=True)  # the weights' default dtype, as generate and serve load them
    model, tok = load_for_inference(str(directory), tokenizer=None, plan=plan)
    out = generate(Generator(model, plan, max_batch_size=1), [ids],
                   SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=stop))
    return tok.decode(out[0])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_serve_answers_a_chat_models_directory_greedily_through_its_own_template_to_its_end_of_turn(
        kind: str, debug_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenAI routes over a Llama 3 / Qwen3 directory: completions and chat, streamed or not, are the
    Generator's greedy text; chat's prompt is the token ids transformers' apply_chat_template makes of the
    directory's template (one BOS, from the template), and the template's end-of-turn token ends the reply."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_helpers import end_of_text_after, sse

    from gptopt.config import ServeConfig
    from gptopt.serve.app import create_app
    from gptopt.serve.server import serve_in_thread

    d = chat_model_dir(kind, debug_tokenizer, tmp_path / kind)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "def fib(n):"}]
    chat_ids = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    end = theirs.convert_tokens_to_ids(CHAT[kind][3])
    ends = (theirs.convert_tokens_to_ids("<|endoftext|>"), end)  # end of text, or of the turn
    assert chat_ids.count(end) == 2 and theirs.decode(chat_ids).count("<|begin_of_text|>") == (kind == "llama")
    prompt = "def parse_args(self):"
    n = 8
    want = greedy_text(d, theirs(prompt)["input_ids"], n)
    want_chat = greedy_text(d, chat_ids, n, ends)
    app = create_app(ServeConfig(model=str(d), device="cpu", max_batch_size=2, engine_process=False))
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}"
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert (card["id"], card["chat"]) == (kind, True)
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want != ""
        streamed = sse(httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60))
        assert "".join(f["choices"][0]["text"] for f in streamed[:-1]) == want
        body = {"messages": messages, "max_tokens": n, "temperature": 0}
        got = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert got["choices"][0]["message"]["content"] == want_chat != ""
        assert got["usage"]["prompt_tokens"] == len(chat_ids)
        streamed = sse(httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60))
        assert "".join(c["delta"].get("content", "") for f in streamed[:-1] for c in f["choices"]) == want_chat
        end_of_text_after(app.state.engine.generator, monkeypatch, len(chat_ids), 3, end)  # the model ends its turn
        ended = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        # two tokens of text and the end of turn, which usage counts as OpenAI and vLLM do
        assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == 3
        assert ended["choices"][0]["message"]["content"] == greedy_text(d, chat_ids, 2)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_generate_chat_on_a_chat_models_directory_sends_its_templates_tokens_and_prints_the_greedy_reply(
        kind: str, debug_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("jinja2")
    from conftest import run_chat

    d = chat_model_dir(kind, debug_tokenizer, tmp_path / kind)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "def fib(n):"}]
    chat_ids = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ends = tuple(theirs.convert_tokens_to_ids(t) for t in ("<|endoftext|>", CHAT[kind][3]))
    rc, out, err, prompts = run_chat(["--model", str(d), "--max_new_tokens", "8", "Be terse."], "def fib(n):\n",
                                     monkeypatch, capsys)
    assert rc == 0, err
    assert prompts == [chat_ids]
    assert out.split("\n")[0] == greedy_text(d, chat_ids, 8, ends)  # not splitlines: the reply may hold \x1d


def test_serve_answers_a_llama_shaped_gptopt_checkpoint_with_its_generators_greedy_text(
        train_data: Path, debug_tokenizer: Tokenizer, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from conftest import make_varied_model

    from gptopt.config import ServeConfig
    from gptopt.models.checkpoint import save_model
    from gptopt.serve.app import create_app
    from gptopt.serve.server import serve_in_thread

    d = save_model(make_varied_model(debug_tokenizer.get_vocab_size(), "llama"), tmp_path / "m",
                   {"tokenizer": str(train_data / "tokenizer.json")})
    prompt = "def parse_args(self):"
    want = greedy_text(d, debug_tokenizer.encode(prompt).ids, 8)
    app = create_app(ServeConfig(model=str(d), device="cpu", max_batch_size=2, engine_process=False))
    with serve_in_thread(app) as server:
        got = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", timeout=60,
                         json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert got["choices"][0]["text"] == want != ""


def test_zero_init_starts_every_block_as_the_identity_and_an_untied_head_at_zero() -> None:
    """modded-nanogpt's init: the residual stream leaves each block as it came, and the untied head predicts
    the uniform distribution; a tied head stays the embedding."""
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, positions="rope", mlp="relu2",
                    tie_embeddings=False, zero_init=True)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 64, (2, 8))
    x = model.transformer.wte(idx)
    rope = rotary(model.inv_freq, torch.arange(8))
    with torch.no_grad():
        for block in model.transformer.h:
            assert torch.equal(block(x, None, None, rope), x)
        logits = model(idx)
    assert torch.count_nonzero(logits) == 0
    tied = GPT(GPTConfig(**{**cfg.to_dict(), "tie_embeddings": True}))
    assert tied.lm_head.weight.abs().sum() > 0 and tied.transformer.h[0].mlp.c_proj.weight.abs().sum() == 0


def test_a_rotary_model_cast_to_bf16_keeps_its_frequencies_in_fp32() -> None:
    """Rounded to bf16, the rotary frequencies turn the angles of far positions visibly wrong; transformers keeps
    them in fp32 too."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, positions="rope"))
    exact = model.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, exact)
    assert model.lm_head.weight.dtype == torch.bfloat16
    model.half()
    assert torch.equal(model.inv_freq, exact)


def test_rmsnorm_under_bf16_autocast_takes_the_fused_kernel_in_fp32_and_keeps_its_inputs_dtype() -> None:
    """As transformers' Llama and Qwen3 norms: the variance and scaling in fp32 whatever the input, the result
    rounded once to the input's dtype; a bf16 input with the fp32 weight would miss the fused kernel (torch warns)."""
    norm = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=64, norm="rmsnorm",
                         layer_norm_epsilon=1e-6)).transformer.ln_f
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(8, 64) * 30).to(torch.bfloat16)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("error")
        y = norm(x)
    exact = torch.nn.functional.rms_norm(x.float(), (64,), norm.weight.detach(), 1e-6)
    assert y.dtype == torch.bfloat16 and torch.equal(y, exact.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_hugging_face_export_of_a_chat_model_keeps_its_template_and_its_own_end_ids(
        kind: str, debug_tokenizer: Tokenizer, tmp_path: Path) -> None:
    """export --format hf of a Llama 3 or Qwen3 chat folder: tokenizer_config.json and its chat template come
    along, and the model's own bos and eos ids (its end of turn among them), not the tokenizer's end-of-text."""
    from gptopt import cli

    d = chat_model_dir(kind, debug_tokenizer, tmp_path / kind)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    end_of_turn = theirs.convert_tokens_to_ids(CHAT[kind][3])
    eos = [end_of_turn, theirs.convert_tokens_to_ids("<|endoftext|>")]
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos}))
    out = tmp_path / "out"
    assert cli.main(["export", "--model", str(d), "--format", "hf", "--output_dir", str(out)]) == 0
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert generation.eos_token_id == eos and generation.bos_token_id == 1
    exported = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "def fib(n):"}]
    assert exported.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == CHAT[kind][3]
