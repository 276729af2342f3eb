"""gptopt export (and infer/onnx_decoder.py under it): ONNX through onnxruntime and Hugging Face through
transformers give PyTorch's logits; bad input is refused before anything is written.

    pytest -q tests/test_export.py

One ONNX export (the dynamo exporter, several seconds) is shared by the module: the debug preset with wide
random weights, so greedy text changes every token and two implementations cannot agree by accident.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_varied_model
from tokenizers import Tokenizer

from gptopt import cli
from gptopt.commands import export
from gptopt.config import preset
from gptopt.infer import onnx_decoder
from gptopt.infer.generator import Generator
from gptopt.infer.onnx_decoder import OrtDecoder, export_onnx
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models import hf
from gptopt.models.checkpoint import save_model
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TOL = 1e-4


@pytest.fixture(scope="module")
def onnx_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("onnx") / "export"
    assert cli.main(["export", "--model", str(model_dir), "--output_dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def decoder(onnx_dir: Path) -> OrtDecoder:
    return OrtDecoder(onnx_dir / "model.onnx", block_size=64)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> GPT:
    return hf.load_pretrained(model_dir).eval()


def test_export_writes_the_graph_its_description_and_the_tokenizer(
    onnx_dir: Path, debug_tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sorted(p.name for p in onnx_dir.iterdir()) == [".gptopt-output.json", "gptopt_onnx.json", "model.onnx",
                                                          "tokenizer.json"]  # the first: gptopt's mark
    meta = json.loads((onnx_dir / "gptopt_onnx.json").read_text())
    assert meta["exporter"] == "dynamo" and meta["opset"] == 18 and meta["model"]["n_layer"] == 2
    inputs = {i["name"]: i["shape"] for i in meta["inputs"]}
    outputs = {o["name"]: o["shape"] for o in meta["outputs"]}
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs["attention_mask"] == ["batch", "total_sequence"]
    assert inputs["past_value_1"] == ["batch", 2, "past_sequence", 32]
    assert outputs["logits"] == ["batch", "sequence", debug_tokenizer.get_vocab_size()]
    assert outputs["present_key_0"] == ["batch", 2, "total_sequence", 32]
    check = meta["check"]
    assert check["prefill_max_abs_diff"] <= check["allowed_abs_diff"]
    assert check["decode_max_abs_diff"] <= check["allowed_abs_diff"]
    shipped = Tokenizer.from_file(str(onnx_dir / "tokenizer.json"))
    assert shipped.encode("def f(x): return x").ids == debug_tokenizer.encode("def f(x): return x").ids
    assert meta["eot_token_id"] == debug_tokenizer.token_to_id("<|endoftext|>")


@torch.no_grad()
def test_onnx_logits_match_pytorch_across_batch_lengths_and_decode_steps(
    decoder: OrtDecoder, model: GPT
) -> None:
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    for lengths in ([9], [12, 5], [3, 20, 11]):  # batch 1, 2, 3; padded rows; other lengths than the export's
        prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
        logits, mask, pos, past = decoder.prefill(prompts)
        L = logits.shape[1]
        for r, p in enumerate(prompts):
            ref = model(torch.tensor([p]))[0].numpy()
            assert np.abs(logits[r, L - len(p) :] - ref).max() <= TOL * np.abs(ref).max()
        for _ in range(2):  # two decode steps on the present tensors of the step before
            nxt = torch.randint(0, V, (len(prompts),), generator=g).tolist()
            prompts = [[*p, t] for p, t in zip(prompts, nxt, strict=True)]
            mask, pos = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1), pos[:, -1:] + 1
            step, past = decoder.forward(np.array(nxt)[:, None], mask, pos, past)
            assert step.shape == (len(prompts), 1, V) and past[0].shape[2] == mask.shape[1]
            for r, p in enumerate(prompts):
                ref = model(torch.tensor([p]))[0, -1].numpy()
                assert np.abs(step[r, 0] - ref).max() <= TOL * np.abs(ref).max()


def test_onnxruntime_greedy_tokens_equal_gptopt_greedy_tokens(decoder: OrtDecoder, model: GPT) -> None:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (10, 4)]
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=2, max_len=64)
    want = generate(gen, prompts, SamplingParams(max_new_tokens=24, temperature=0.0, top_k=None))
    got = decoder.greedy(prompts, 24)
    assert got == want
    assert len(set(got[0])) > 3  # varied text: agreement is not one repeated token
    with pytest.raises(ValueError, match="exceed the model's context"):
        decoder.greedy(prompts, 60)


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])  # an export each
def test_a_llama_or_qwen3_checkpoint_exports_to_onnx_with_its_key_value_heads_and_decodes_alike(
    family: str, train_data: Path, debug_tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rotary positions in the graph, a cache of the key/value heads (fewer than the query heads), Qwen3's
    QK-norm and heads sized apart from the width: the export's own check passes, and onnxruntime's greedy
    tokens are gptopt's."""
    model = make_varied_model(debug_tokenizer.get_vocab_size(), family)
    source = save_model(model, tmp_path / "m", {"tokenizer": str(train_data / "tokenizer.json")})
    out = tmp_path / "onnx"
    assert cli.main(["export", "--model", str(source), "--output_dir", str(out)]) == 0, capsys.readouterr().err
    assert "onnxruntime matches PyTorch" in capsys.readouterr().out
    meta = json.loads((out / "gptopt_onnx.json").read_text())
    inputs = {i["name"]: i["shape"] for i in meta["inputs"]}
    assert inputs["past_key_1"] == ["batch", 2, "past_sequence", model.config.head_dim]  # 2 of the 4 heads
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 4)]
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=2, max_len=64)
    want = generate(gen, prompts, SamplingParams(max_new_tokens=16, temperature=0.0, top_k=None))
    got = OrtDecoder(out / "model.onnx", block_size=64).greedy(prompts, 16)
    assert got == want and len(set(got[0])) > 3


def test_hf_export_loads_in_transformers_with_the_same_logits_and_tokenizer(
    model_dir: Path, model: GPT, debug_tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert cli.main(["export", "--model", str(model_dir), "--format", "hf", "--output_dir", str(out)]) == 0
    assert "transformers matches" in capsys.readouterr().out
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 17))
    with torch.no_grad():
        assert (loaded(input_ids=idx).logits - model(idx)).abs().max().item() <= TOL
    text = "for i in range(10):"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text).input_ids == debug_tokenizer.encode(text).ids
    # an earlier export may be replaced on request, and only then
    assert cli.main(["export", "--model", str(model_dir), "--format", "hf", "--output_dir", str(out)]) == 2
    assert cli.main(["export", "--model", str(model_dir), "--format", "hf", "--output_dir", str(out),
                     "--overwrite"]) == 0


def test_a_hugging_face_export_tells_transformers_where_text_ends(
    train_data: Path, debug_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    eot = debug_tokenizer.token_to_id("<|endoftext|>")
    model = make_varied_model(debug_tokenizer.get_vocab_size())
    with torch.no_grad():  # every position's last hidden state is eot's embedding: eot is always the argmax
        model.transformer.wte.weight[eot] *= 10
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(model.transformer.wte.weight[eot])
    source = save_model(model, tmp_path / "m", {"tokenizer": str(train_data / "tokenizer.json")})
    out = tmp_path / "hf"
    assert cli.main(["export", "--model", str(source), "--format", "hf", "--output_dir", str(out)]) == 0
    config = transformers.AutoConfig.from_pretrained(str(out))
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert (config.bos_token_id, config.eos_token_id) == (eot, eot)  # GPT-2 uses <|endoftext|> for both
    assert (generation.bos_token_id, generation.eos_token_id) == (eot, eot)
    assert not generation.do_sample and generation.temperature in (None, 1.0)  # no sampling settings invented
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = torch.tensor([debug_tokenizer.encode("def f(x):").ids])
    with torch.no_grad():
        ids = loaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert ids[0, prompt.shape[1]:].tolist() == [eot]  # stopped at the end-of-text, not after 8 tokens


def test_a_hugging_face_export_without_an_end_of_text_token_writes_no_ids(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import models

    # GPT-2's vocabulary size, but no <|endoftext|>: the ids come from the tokenizer, never from the size
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50257)}, unk_token="w0"))
    model = GPT(preset("debug", vocab_size=words.get_vocab_size())).eval()
    export.export_hf_checked(model, tmp_path / "hf", tokenizer=words)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    assert not (tmp_path / "hf" / "generation_config.json").exists()
    assert transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(
        str(tmp_path / "hf"))).eos_token_id is None


def test_an_output_dir_where_no_folder_can_be_made_is_one_line(model_dir: Path, model: GPT, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # /proc passes a permission check as root, yet no folder can be made in it
    assert cli.main(["export", "--model", str(model_dir), "--format", "hf", "--output_dir", "/proc/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gptopt export: error: --output_dir /proc/x"), err

    def no_staging(target: Path, **kw: object) -> None:  # a folder that vanished or turned read-only since
        raise FileNotFoundError(2, "No such file or directory", str(target.parent / f".{target.name}.tmp-1"))

    monkeypatch.setattr(onnx_decoder, "staged_dir", no_staging)  # the staging both exports use
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"--output_dir .*hf: cannot create a folder there \(No such file"):
        export.export_hf_checked(model, tmp_path / "hf")


def test_a_hugging_face_dir_without_tokenizer_files_exports_without_one_and_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=128,
                                  bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hfsrc")
    out = tmp_path / "hf"
    assert cli.main(["export", "--model", str(tmp_path / "hfsrc"), "--format", "hf", "--output_dir", str(out)]) == 0
    assert "no tokenizer.json" in capsys.readouterr().out  # and no hub lookup for GPT-2's
    assert sorted(p.name for p in out.iterdir()) == [".gptopt-output.json", "config.json", "model.safetensors"]


def test_a_mismatch_fails_loudly_and_writes_nothing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    real = hf.export_hf

    def corrupted(model: GPT, directory: Path, **kw: object) -> Path:  # an exporter bug: other weights reach the files
        other = GPT(model.config)
        return real(other, directory, **kw)

    monkeypatch.setattr(export.hf, "export_hf", corrupted)
    out = tmp_path / "hf"
    assert cli.main(["export", "--model", str(model_dir), "--format", "hf", "--output_dir", str(out)]) == 1
    assert "logits differ from PyTorch's" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no output, no staging directory left behind


def test_the_torchscript_exporter_is_the_fallback_when_dynamo_fails(
    debug_model: GPT, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = torch.onnx.export

    def no_dynamo(*args: object, dynamo: bool = True, **kwargs: object) -> object:
        if dynamo:
            raise RuntimeError("simulated dynamo failure")
        return real(*args, dynamo=False, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", no_dynamo)
    meta = export_onnx(debug_model, tmp_path / "ts")
    assert meta["exporter"] == "torchscript" and meta["tokenizer"] is None
    assert meta["check"]["decode_max_abs_diff"] <= meta["check"]["allowed_abs_diff"]
    assert {o["name"]: o["shape"] for o in meta["outputs"]}["present_value_1"] == ["batch", 2, "total_sequence", 32]


# ----------------------------------------------------------------------------------------------
# Bad input: one line with the fix, exit 2, nothing overwritten


def _export(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.main(["export", *argv])
    return rc, capsys.readouterr().err


def test_a_non_empty_output_dir_is_never_touched(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):  # --overwrite replaces earlier exports only
        for fmt in ("onnx", "hf"):
            rc, err = _export(capsys, "--model", str(model_dir), "--format", fmt, "--output_dir", str(out), *extra)
            assert rc == 2 and len(err.strip().splitlines()) == 1
            # --overwrite would not replace it either: said at once, never advised and then refused
            assert "not marked as gptopt's" in err and "pass --overwrite" not in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    rc, err = _export(capsys, "--model", str(model_dir), "--output_dir", str(out / "notes.txt"))
    assert rc == 2 and "is a file" in err


def downloaded_hf_folder(root: Path, model: GPT) -> Path:
    """What a Hugging Face download looks like: weights, config, model card, tokenizer config; no gptopt mark."""
    hf.export_hf(model, root)
    (root / ".gptopt-output.json").unlink()
    (root / "README.md").write_text("---\nlicense: mit\n---\n# my fine-tuned model\n")
    (root / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return root


def test_overwrite_never_replaces_a_hugging_face_folder_gptopt_did_not_write(
    model_dir: Path, model: GPT, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = downloaded_hf_folder(tmp_path / "downloaded", model)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, err = _export(capsys, "--model", str(model_dir), "--format", "hf", "--output_dir", str(out), "--overwrite")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "not marked as gptopt's" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downloaded"]


def test_overwrite_replaces_gptopt_exports_only_while_they_hold_nothing_else(
    model_dir: Path, model: GPT, onnx_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert _export(capsys, "--model", str(model_dir), "--format", "hf", "--output_dir", str(out))[0] == 0
    (out / "notes.txt").write_text("keep me")
    rc, err = _export(capsys, "--model", str(model_dir), "--format", "hf", "--output_dir", str(out), "--overwrite")
    assert rc == 2 and "holds files gptopt did not write (notes.txt)" in err
    assert (out / "notes.txt").read_text() == "keep me" and (out / "model.safetensors").is_file()
    # An ONNX export of an earlier version (no mark; its gptopt_onnx.json lists its files) counts as gptopt's.
    legacy = tmp_path / "onnx"
    legacy.mkdir()
    for p in onnx_dir.iterdir():
        if p.name != ".gptopt-output.json":
            (legacy / p.name).write_bytes(p.read_bytes())
    rc, err = _export(capsys, "--model", str(model_dir), "--output_dir", str(legacy), "--overwrite")
    assert rc == 0, err
    assert (legacy / ".gptopt-output.json").is_file()


def test_an_opset_the_exporter_gets_wrong_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--opset", "17"])
    assert e.value.code == 2 and "--opset must be >= 18" in capsys.readouterr().err


def test_a_directory_that_is_no_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = _export(capsys, "--model", str(empty), "--output_dir", str(tmp_path / "o"))
    assert rc == 2 and "no checkpoint or model files" in err and "gptopt train" in err
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, err = _export(capsys, "--model", str(llama), "--output_dir", str(tmp_path / "o"))
    assert rc == 2 and "lacks num_hidden_layers, hidden_size, num_attention_heads, vocab_size" in err
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    rc, err = _export(capsys, "--model", str(mistral), "--output_dir", str(tmp_path / "o"))
    assert rc == 2 and "model_type is 'mistral', not 'gpt2'" in err
    assert not (tmp_path / "o").exists()


def test_a_missing_extra_names_the_install_line(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    rc, err = _export(capsys, "--model", str(model_dir), "--output_dir", str(tmp_path / "o"))
    assert rc == 2 and "pip install 'gptopt[onnx]'" in err
    monkeypatch.setitem(sys.modules, "transformers", None)
    rc, err = _export(capsys, "--model", str(model_dir), "--format", "hf", "--output_dir", str(tmp_path / "o"))
    assert rc == 2 and "pip install 'gptopt[hf]'" in err
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_too_large_for_the_model_is_refused(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = save_model(GPT(preset("debug", vocab_size=100)), tmp_path / "small")
    rc, err = _export(capsys, "--model", str(small), "--tokenizer", str(train_data / "tokenizer.json"),
                      "--output_dir", str(tmp_path / "o"))
    assert rc == 2 and "do not belong together" in err


def test_a_tokenizer_smaller_than_the_model_beyond_padding_is_refused(
    debug_model: GPT, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    large = save_model(debug_model, tmp_path / "large")  # the debug preset's 512 rows; the data's 320 tokens
    for fmt in ("hf", "onnx"):
        rc, err = _export(capsys, "--model", str(large), "--tokenizer", str(train_data / "tokenizer.json"),
                          "--format", fmt, "--output_dir", str(tmp_path / "o"))
        assert rc == 2 and "the tokenizer has 320 tokens, the model 512" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "o").exists()
