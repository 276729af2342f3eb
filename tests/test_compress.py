"""gptopt compress: the quality measures are right, every run writes a checkpoint the other verbs load
plus its report, and bad input exits 2 with the fix and nothing written.

    pytest -q tests/test_compress.py

The model is `trained_out` (the debug preset after 2 training steps on train_data), on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch
from conftest import last_json_line, split_bytes_per_token
from tokenizers import Tokenizer

from gptopt import cli
from gptopt.commands.compress import mean_kl, memory_bytes, perplexity_and_kl
from gptopt.config import CompressConfig
from gptopt.data.loader import BatchDataset, open_data
from gptopt.infer.load import load_for_inference
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

CPU = resolve("cpu", quiet=True)


def compress_cli(model: Path, data: Path | None, output: Path, *extra: str) -> list[str]:
    """data None: no --data_dir, so compress scores on the data the model was trained on."""
    return ["compress", "--model", str(model), "--output_dir", str(output),
            *(["--data_dir", str(data)] if data else []), "--device", "cpu", "--eval_tokens", "1024", "--repeats", "1",
            *extra]


# ----------------------------------------------------------------------------------------------
# Quality measures


def test_mean_kl_of_known_distributions() -> None:
    p, r = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.9, 0.1]])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert mean_kl(p.log(), r.log()).item() == pytest.approx(expected, rel=1e-6)
    # logits, not probabilities
    assert mean_kl(p.log() + 3.0, r.log() - 1.0).item() == pytest.approx(expected, rel=1e-6)


def test_a_model_against_itself_scores_kl_0_and_its_own_perplexity(trained_out: Path, train_data: Path) -> None:
    model, _ = load_for_inference(str(trained_out), tokenizer=None, plan=CPU)
    ds = BatchDataset(open_data(train_data), "val", 4, 32, seed=0)
    res = perplexity_and_kl(model, model, ds.eval_batches("val", 3), CPU.device)
    assert res["kl"] == 0.0 and res["perplexity"] == res["perplexity_reference"] and res["tokens"] == 3 * 4 * 32
    with torch.no_grad():  # the model's own loss on the same windows
        loss = torch.stack([model(x, y) for x, y in ds.eval_batches("val", 3)]).mean().item()
    assert res["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_a_perturbed_model_scores_worse(trained_out: Path, train_data: Path) -> None:
    model, _ = load_for_inference(str(trained_out), tokenizer=None, plan=CPU)
    noisy = GPT(model.config).eval()
    noisy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in noisy.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.1)
    ds = BatchDataset(open_data(train_data), "val", 4, 32, seed=0)
    res = perplexity_and_kl(model, noisy, ds.eval_batches("val", 3), CPU.device)
    assert res["kl"] > 0.01 and res["perplexity"] > res["perplexity_reference"]


# ----------------------------------------------------------------------------------------------
# Runs


def _report(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_int8_dynamic_writes_a_loadable_checkpoint_and_a_full_report(
        trained_out: Path, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "int8"
    old_umask = os.umask(0o022)
    try:  # no --data_dir: trained_out was trained on train_data (not the default corpus), and its checkpoint says so
        assert cli.main(compress_cli(trained_out, None, out, "--quantize", "int8-dynamic", "--json")) == 0
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # another account (the server's) can read it
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    stdout = capsys.readouterr().out
    assert "size on disk" in stdout and "decode tokens/s, batch 8" in stdout and "mean KL" in stdout
    last = last_json_line(stdout)
    report = _report(out)
    assert last == report
    assert report["eval"]["data_dir"] == str(train_data.resolve())
    assert sorted(p.name for p in out.iterdir()) == [".gptopt-output.json", "gptopt.json", "model.safetensors",
                                                     "results.json", "tokenizer.json"]  # the first: the mark
    meta = checkpoint.read_meta(out)
    assert meta["compression"]["quantize"] == "int8-dynamic" and meta["compression"]["versions"]["torch"]
    for side in ("original", "compressed"):
        r = report[side]
        assert r["disk_bytes"] > 0 and r["memory_bytes"] > 0 and r["prefill_s"] > 0 and r["perplexity"] > 1
        assert set(r["decode_tokens_per_s"]) == {"1", "8"} and min(r["decode_tokens_per_s"].values()) > 0
    assert report["ratios"]["disk"] < 0.5 and report["ratios"]["memory"] < 0.9
    assert 0 < report["compressed"]["kl_divergence"] < 0.05
    assert abs(report["ratios"]["perplexity_increase"]) < 0.05
    # bits per byte beside perplexity: log2 of it over the val split's UTF-8 bytes per token (decoded here whole)
    assert "bits per byte (val)" in stdout
    for side in ("original", "compressed"):
        assert report[side]["bits_per_byte"] == pytest.approx(
            math.log2(report[side]["perplexity"]) / split_bytes_per_token(train_data), rel=1e-6)
    # The output is a checkpoint like any other: generate loads it and finds its tokenizer.
    assert cli.main(["generate", "--model", str(out), "--device", "cpu", "--temperature", "0",
                     "--max_new_tokens", "5", "import"]) == 0
    assert "5 tokens" in capsys.readouterr().err


def test_pruning_says_plainly_that_it_brings_no_speed(trained_out: Path, train_data: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p50"
    assert cli.main(compress_cli(trained_out, train_data, out, "--prune", "0.5")) == 0
    assert "no speed or memory gain" in capsys.readouterr().out
    report = _report(out)
    assert report["compression"]["prune"] == 0.5 and report["compression"]["quantize"] is None
    assert report["ratios"]["memory"] == pytest.approx(1.0)  # the zeros are stored and held as they are
    assert report["compressed"]["kl_divergence"] > 0
    model, _ = load_for_inference(str(out), tokenizer=None, plan=CPU)
    w = model.transformer.h[0].mlp.c_fc.weight
    assert (w == 0).float().mean().item() == pytest.approx(0.5, abs=1e-3)


def test_int8_weight_runs_through_torchao(trained_out: Path, train_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    out = tmp_path / "w8"
    assert cli.main(compress_cli(trained_out, train_data, out, "--quantize", "int8-weight")) == 0
    assert _report(out)["method"] == "int8-weight"
    model, _ = load_for_inference(str(out), tokenizer=None, plan=CPU)
    assert type(model.transformer.h[0].attn.c_attn.weight).__name__ == "Int8Tensor"


def test_serve_loads_a_compressed_checkpoint(trained_out: Path, train_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from gptopt.config import ServeConfig
    from gptopt.serve.app import create_app
    from gptopt.serve.server import serve_in_thread

    out = tmp_path / "served"
    assert cli.main(compress_cli(trained_out, train_data, out, "--quantize", "int8-dynamic")) == 0
    with serve_in_thread(create_app(ServeConfig(model=str(out), device="cpu", max_batch_size=2))) as server:
        r = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", json={"prompt": "import", "max_tokens": 4},
                       timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ----------------------------------------------------------------------------------------------
# Bad input: one line with the fix, exit 2, nothing written


@pytest.mark.parametrize(("extra", "message"), [
    (["--quantize", "int4-weight"], "int4-weight needs an NVIDIA GPU"),
    (["--prune", "2:4"], "2:4 needs an NVIDIA GPU"),
])
def test_a_method_this_device_cannot_run_exits_2(trained_out: Path, train_data: Path, tmp_path: Path,
                                                 extra: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c"
    assert cli.main(compress_cli(trained_out, train_data, out, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fraction", ["0", "1", "1.2", "-0.5", "most"])
def test_a_fraction_outside_0_1_exits_2(trained_out: Path, train_data: Path, tmp_path: Path, fraction: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(compress_cli(trained_out, train_data, tmp_path / "c", "--prune", fraction))
    assert e.value.code == 2
    assert "--prune must be a fraction in (0, 1)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_directory_without_a_model_exits_2(train_data: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    assert cli.main(compress_cli(tmp_path / "notes", train_data, tmp_path / "c", "--quantize", "int8-dynamic")) == 2
    assert "no checkpoint or model files" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_an_output_that_exists_and_is_not_empty_is_never_overwritten(
        trained_out: Path, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(compress_cli(trained_out, train_data, out, "--quantize", "int8-dynamic")) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli.main(compress_cli(trained_out, train_data, out, "--quantize", "int8-dynamic", "--overwrite")) == 2
    assert "not marked as gptopt's" in capsys.readouterr().err  # --overwrite replaces compress's own output only
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temporary directory left either


def test_the_output_is_checked_before_the_model_is_loaded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # No model at --model (a folder that holds none): an output error must come first, so no model loading was
    # needed to reach it.
    (tmp_path / "no-model").mkdir()
    (tmp_path / "file").write_text("x")
    assert cli.main(compress_cli(tmp_path / "no-model", None, tmp_path / "file", "--quantize", "int8-dynamic")) == 2
    assert "--output_dir" in (err := capsys.readouterr().err) and "is a file" in err
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == tmp_path else real(p, mode, **kw))
    assert cli.main(compress_cli(tmp_path / "no-model", None, tmp_path / "c", "--quantize", "int8-dynamic")) == 2
    err = capsys.readouterr().err
    assert "cannot write in" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()


def test_output_still_names_the_output_dir_and_errors_name_output_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --output is --output_dir's old name: command lines written for it still run, and are told the new name
    (tmp_path / "no-model").mkdir()
    (tmp_path / "file").write_text("x")
    argv = ["compress", "--model", str(tmp_path / "no-model"), "--output", str(tmp_path / "file"),
            "--quantize", "int8-dynamic", "--device", "cpu"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--output_dir" in err and "is a file" in err and len(err.strip().splitlines()) == 1


def test_nothing_to_do_and_a_missing_output_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ([["compress", "--output_dir", "x"], "nothing to do"],
                          [["compress", "--quantize", "int8-dynamic"], "--output_dir is required"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_compressed_model_is_refused(trained_out: Path, train_data: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from gptopt.commands import compress

    first = tmp_path / "first"
    assert cli.main(compress_cli(trained_out, train_data, first, "--quantize", "int8-dynamic")) == 0
    with pytest.raises(ValueError, match="already compressed .*compress the original"):
        compress.main(CompressConfig(model=str(first), output_dir=str(tmp_path / "again"), data_dir=str(train_data),
                                     quantize="int8-dynamic", device="cpu"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first"]


def test_data_of_another_tokenizer_of_the_same_size_is_refused_with_the_fix(
        trained_out: Path, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for name in ("meta.json", "train.bin", "val.bin"):
        (other / name).write_bytes((train_data / name).read_bytes())
    tok = json.loads((train_data / "tokenizer.json").read_text())
    merges = tok["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]  # the same vocabulary, ids and size; other merge priorities
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert cli.main(compress_cli(trained_out, other, tmp_path / "x", "--quantize", "int8-dynamic")) == 2
    err = capsys.readouterr().err
    assert "another tokenizer than the model's" in err and f"--data_dir {train_data}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_memory_bytes_counts_a_tied_weight_once(trained_out: Path) -> None:
    model, _ = load_for_inference(str(trained_out), tokenizer=None, plan=CPU)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    itemsize = model.transformer.wte.weight.element_size()  # fp32, or bf16 on a CPU with native bf16
    assert memory_bytes(model) == itemsize * model.num_params() + buffers


def test_a_llama_shaped_checkpoint_compresses_to_one_that_loads_generates_and_is_measured_against_it(
        train_data: Path, debug_tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SwiGLU's c_gate pruned and quantised with the other block Linears, RMSNorm without biases, and the
    model's own (untied) lm_head kept: quantised on its own, never lost."""
    from conftest import family_config

    torch.manual_seed(0)
    model = GPT(family_config("llama", debug_tokenizer.get_vocab_size())).eval()
    source = checkpoint.save_model(model, tmp_path / "llama", {"tokenizer": str(train_data / "tokenizer.json"),
                                                                "data_dir": str(train_data)})
    out = tmp_path / "int8"
    assert cli.main(compress_cli(source, None, out, "--quantize", "int8-dynamic", "--prune", "0.25", "--json")) == 0
    report = last_json_line(capsys.readouterr().out)
    assert report["compression"]["layers"] == "every block Linear and lm_head"
    assert 0 < report["compressed"]["kl_divergence"] < 0.05 and report["ratios"]["disk"] < 0.5
    assert report["original"]["bits_per_byte"] is not None and report["compressed"]["bits_per_byte"] is not None
    loaded = checkpoint.load_model(out)  # dequantised: the stored grid, pruned zeros included
    gate = loaded.transformer.h[0].mlp.c_gate.weight
    assert (gate == 0).float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert not torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)
    assert (loaded.lm_head.weight - model.lm_head.weight).abs().max() <= model.lm_head.weight.abs().max() / 127
    assert cli.main(["generate", "--model", str(out), "--device", "cpu", "--temperature", "0",
                     "--max_new_tokens", "5", "import"]) == 0
    assert "5 tokens" in capsys.readouterr().err
