"""The training loop on one process: it learns, its figures (metrics, MFU, the summary), accumulation, bf16, bad
steps, --auto_batch_size and the out-of-memory advice, fine-tuning, profiling.

    pytest -q tests/test_train.py
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TRAIN_FAST, eval_samples, split_bytes_per_token, train_args, train_losses, train_records, train_run

from gptopt import cli
from gptopt.commands import train as train_cmd
from gptopt.config import GPTConfig, TrainConfig, preset
from gptopt.data.loader import load_tokenizer
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models import checkpoint
from gptopt.models.flops import flops_per_token
from gptopt.models.gpt import GPT
from gptopt.runtime import device as dev
from gptopt.runtime.device import resolve
from gptopt.train import loop as train
from gptopt.train import step


def test_training_learns_and_logs_every_required_field(train_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train_run(train_data, out, max_steps=40, eval_interval=20, learning_rate=3e-3) == 0
    recs = train_records(out)
    steps = [r for r in recs if "loss" in r]
    for key in ("step", "loss", "lr", "tokens_per_s", "mfu", "step_time_s", "data_wait_frac", "grad_norm",
                "peak_mem_bytes"):
        assert key in steps[0], key
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert sum(r["loss"] for r in steps[-5:]) / 5 < steps[0]["loss"] - 0.5  # it learns
    evals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[1]["val_loss"] < evals[0]["val_loss"]
    assert evals[1]["val_ppl"] == pytest.approx(2.718281828 ** evals[1]["val_loss"], rel=1e-6)
    # bits per byte: the val loss over the val split's UTF-8 bytes per token (decoded here whole)
    assert evals[1]["val_bpb"] == pytest.approx(evals[1]["val_loss"] / math.log(2) / split_bytes_per_token(train_data))
    info = json.loads((out / "run.json").read_text())
    assert info["peak_source"].startswith("measured matmul peak")
    assert info["environment"]["torch"] == torch.__version__
    assert info["host_memory_reuse"] is dev.reuse_host_memory(False)  # on where glibc allows, and set back after
    # the closing summary, for scripts: the step count and the median of the logged step times
    summary = info["summary"]
    assert summary["step"] == 40 and summary["peak_source"].startswith("measured matmul peak")
    median = sorted(r["step_time_s"] for r in steps[1:])[19]  # 39 timed steps: the first pays warm-up
    assert summary["median_step_s"] == pytest.approx(median, rel=0.05)
    assert 0 < summary["mfu"] < 1 and summary["peak_memory_bytes"] > 0
    # the final checkpoint loads as a model for generate/serve
    model = checkpoint.load_model(checkpoint.latest_checkpoint(out))
    assert model.config.n_layer == preset("debug").n_layer


def test_lr_follows_warmup_then_cosine(train_data: Path, tmp_path: Path) -> None:
    train_run(train_data, tmp_path / "r", max_steps=20, warmup_steps=5, learning_rate=1e-3, min_lr=1e-4)
    lrs = {r["step"]: r["lr"] for r in train_records(tmp_path / "r") if "lr" in r}
    assert lrs[1] == pytest.approx(2e-4)  # (step 0 + 1) / 5 of the peak
    assert lrs[5] == pytest.approx(1e-3)
    assert lrs[20] < lrs[10] < lrs[6]
    assert lrs[20] >= 1e-4


def test_no_step_claims_more_than_the_peak_and_every_figure_takes_one_peak(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peak measured low (a slow moment of a shared machine) is raised by the first step faster than it:
    no metrics.jsonl record (nor the bar, which shows the same figure) says MFU above 1, and the summary
    states its MFU against the peak the last records took, not a measurement of its own."""
    low = 1e6  # FLOP/s: far below what any step of the debug model achieves
    monkeypatch.setattr(dev, "measured_matmul_flops", lambda device, dtype, remeasure=False: low)
    out = tmp_path / "run"
    assert train_run(train_data, out, max_steps=8) == 0
    info = json.loads((out / "run.json").read_text())
    fpt = flops_per_token(GPTConfig.from_dict(info["model"]), info["seq_len"])
    peak = low
    for r in [r for r in train_records(out) if "mfu" in r]:  # every step is logged: the peak each one saw
        peak = max(peak, r["tokens_per_s"] * fpt)
        assert r["mfu"] <= 1.0 and r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / peak)
    summary = info["summary"]
    assert summary["peak_flops"] == pytest.approx(peak) and summary["peak_source"].count("was low") == 1
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * fpt / peak) and summary["mfu"] <= 1.0


def test_gradient_accumulation_equals_the_full_batch() -> None:
    plan = resolve("cpu", "fp32")
    a, b = GPT(preset("debug")), GPT(preset("debug"))
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 512, (8, 16))
    y = torch.randint(0, 512, (8, 16))
    total = step.forward_backward(a, x, y, plan, None, accum=1)
    parts = sum(step.forward_backward(b, x[i : i + 4], y[i : i + 4], plan, None, accum=2) for i in (0, 4))
    torch.testing.assert_close(parts, total)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_loop_reads_the_device_once_a_log_interval_and_trains_as_when_reading_every_step(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert train_run(train_data, tmp_path / "every", max_steps=10, save_interval=10) == 0
    reads: list[int] = []
    real = train.read_all
    monkeypatch.setattr(train, "read_all", lambda results: (reads.append(len(results)), real(results))[1])
    assert train_run(train_data, tmp_path / "five", max_steps=10, save_interval=10, log_interval=5) == 0
    assert reads == [1, 4, 5]  # the first (compiling) step alone, then one transfer per interval
    every, five = train_losses(tmp_path / "every"), train_losses(tmp_path / "five")
    assert five == {s: every[s] for s in (1, 5, 10)}  # bitwise: the same steps were taken
    a = checkpoint.load_model(tmp_path / "every" / "ckpt-0000010").state_dict()
    b = checkpoint.load_model(tmp_path / "five" / "ckpt-0000010").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert train_records(tmp_path / "five")[-1]["tokens_seen"] == 10 * 4 * 32


def test_bf16_autocast_training_on_cpu(train_data: Path, tmp_path: Path) -> None:
    assert train_run(train_data, tmp_path / "r", max_steps=15, use_amp=True, amp_dtype="bf16", learning_rate=3e-3) == 0
    ls = list(train_losses(tmp_path / "r").values())
    assert all(torch.isfinite(torch.tensor(ls)))
    assert ls[-1] < ls[0]
    assert json.loads((tmp_path / "r" / "run.json").read_text())["environment"]["amp_dtype"] == "bf16"


def test_nan_steps_are_skipped_then_the_run_stops(
    train_data: Path, tmp_path: Path, break_forward: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    calls = {"n": 0}

    def poisoned(model: GPT, idx: torch.Tensor) -> bool:
        calls["n"] += 1
        # step 3 is poisoned once (skipped, training goes on); from step 7 on every step is
        return model.training and (calls["n"] == 3 or calls["n"] >= 7)

    break_forward(poisoned, "nan")
    out = tmp_path / "r"
    code = train_run(train_data, out, max_steps=30, max_bad_steps=3, save_interval=5)
    assert code == 1
    assert "3 consecutive non-finite steps" in capsys.readouterr().err
    ls = train_losses(out)
    assert ls[3] != ls[3]  # NaN logged for the skipped step
    assert all(v == v for s, v in ls.items() if s not in (3, 7, 8, 9))
    # the last good checkpoint survives, and no checkpoint holds poisoned weights
    last = checkpoint.latest_checkpoint(out)
    assert last.name == "ckpt-0000005"
    assert all(torch.isfinite(t).all() for t in checkpoint.load_model(last).state_dict().values())


def test_auto_batch_size_backs_off_from_out_of_memory(
    train_data: Path, tmp_path: Path, break_forward: Callable[..., None]
) -> None:
    break_forward(lambda model, idx: idx.size(0) > 4)
    out = tmp_path / "r"
    given = TrainConfig(data_dir=str(train_data), output_dir=str(out),
                        **{**TRAIN_FAST, "batch_size": 16, "max_steps": 3, "auto_batch_size": True})
    assert train_cmd.main(given) == 0
    cfg = json.loads((out / "run.json").read_text())["config"]
    assert (cfg["batch_size"], cfg["gradient_accumulation_steps"]) == (4, 4)  # global batch 16 kept
    assert (given.batch_size, given.gradient_accumulation_steps) == (16, 1)  # the caller's config is left as it was
    assert checkpoint.load_train_state(checkpoint.latest_checkpoint(out))["tokens_seen"] == 3 * 16 * 32


def test_out_of_memory_names_the_options(
    train_data: Path, tmp_path: Path, break_forward: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    break_forward(lambda model, idx: True)
    assert train_run(train_data, tmp_path / "r", batch_size=8, max_steps=3) == 1
    err = capsys.readouterr().err
    assert "out of memory at micro-batch 8" in err
    for fix in ("--batch_size 4 --gradient_accumulation_steps 2", "--gradient_checkpointing", "--auto_batch_size"):
        assert fix in err


def test_fine_tune_from_a_hugging_face_directory(train_data: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64,
                                                              vocab_size=400))
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "ft"
    assert cli.main(train_args(train_data, out, "--init_from", str(tmp_path / "hf"), "--max_steps", "3")) == 0
    model = checkpoint.load_model(checkpoint.latest_checkpoint(out))
    assert model.config.vocab_size == 400 and model.config.n_embd == 64


def test_fine_tune_from_a_training_output_dir_at_its_context(train_data: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert train_run(train_data, first, max_steps=20, learning_rate=3e-3) == 0
    # what `gptopt generate --model` takes: the output dir means its latest checkpoint; no --seq_len:
    # the model's own context (the debug preset's 64), not a default of 1024 it does not have
    out = tmp_path / "ft"
    assert train_run(train_data, out, init_from=str(first), seq_len=None, max_steps=2) == 0
    assert json.loads((out / "run.json").read_text())["seq_len"] == preset("debug").block_size == 64
    # it starts from the trained weights: its first loss is far below the first run's first loss
    assert train_losses(out)[1] < train_losses(first)[1] - 0.5


def test_fine_tune_trains_at_a_context_beyond_1024(train_data: Path, tmp_path: Path) -> None:
    checkpoint.save_model(GPT(preset("debug", block_size=1100)), tmp_path / "long")
    out = tmp_path / "ft"
    assert train_run(train_data, out, init_from=str(tmp_path / "long"), seq_len=None, batch_size=1, max_steps=1) == 0
    assert json.loads((out / "run.json").read_text())["seq_len"] == 1100
    assert checkpoint.load_model(checkpoint.latest_checkpoint(out)).config.block_size == 1100


def test_init_from_something_that_is_no_model_names_the_option(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(train_args(train_data, tmp_path / "o", "--init_from", str(tmp_path / "nope"))) == 2
    err = capsys.readouterr().err
    assert "--init_from" in err and "--model" not in err


def test_the_eval_sample_is_what_generate_samples_from_the_checkpoint(train_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=4, eval_interval=4, eval_iters=2, sample_tokens=12, seed=7) == 0
    logged = eval_samples(out)[4]
    # the step's checkpoint, generate's default sampling seeded with --seed + step, from a document start
    plan = resolve("cpu", "fp32")
    gen = Generator(checkpoint.load_model(out / "ckpt-0000004"), plan, max_batch_size=1)
    tok = load_tokenizer(train_data / "tokenizer.json")
    ids = generate(gen, [[tok.token_to_id("<|endoftext|>")]], SamplingParams(max_new_tokens=12, seed=7 + 4))[0]
    assert len(ids) == 12  # an end-of-text does not cut the sample short
    assert logged == tok.decode(ids)
    assert logged  # a real sample, not an empty string that any implementation would match


def test_the_playbook_command_line_parses() -> None:
    parser = cli.build_parser("train", TrainConfig)
    cfg = cli.parse_config("train", TrainConfig, "--model_name gpt2 --batch_size 8 --use_compile --use_amp "
                           "--profile --output_dir ./checkpoints".split(), parser)
    assert (cfg.init_from, cfg.batch_size, cfg.compile, cfg.use_amp, cfg.profile, cfg.output_dir) == (
        "gpt2", 8, True, True, True, "./checkpoints")


def test_profile_writes_a_trace(train_data: Path, tmp_path: Path) -> None:
    assert train_run(train_data, tmp_path / "r", max_steps=10, profile=True) == 0
    traces = list((tmp_path / "r" / "logs" / "profile").glob("*.pt.trace.json*"))
    assert traces, "no torch.profiler trace written"


def test_tensorboard_event_files(train_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    assert train_run(train_data, tmp_path / "r", max_steps=3, tensorboard=True) == 0
    assert list((tmp_path / "r" / "logs").glob("events.out.tfevents.*"))


def test_graph_break_under_fullgraph_is_reported(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_forward = GPT.forward

    def forward(self: GPT, idx: torch.Tensor, targets: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        print("side effect")  # noqa: T201 - print is a graph break torch.compile cannot trace through
        return real_forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", forward)
    code = cli.main(train_args(train_data, tmp_path / "r", "--max_steps", "2", "--compile", "--compile_fullgraph"))
    assert code == 2
    err = capsys.readouterr().err
    assert "graph break under --compile_fullgraph" in err and "drop --compile_fullgraph" in err


@pytest.mark.slow
def test_compiled_training_matches_eager(train_data: Path, tmp_path: Path) -> None:
    train_run(train_data, tmp_path / "eager", max_steps=5)
    train_run(train_data, tmp_path / "compiled", max_steps=5, compile=True)
    eager, compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    for s in eager:
        assert compiled[s] == pytest.approx(eager[s], rel=1e-3)
