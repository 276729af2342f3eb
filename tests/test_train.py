"""The training loop on one process: learning, metrics, checkpoints, exact resume, faults, bad input.

    pytest -q tests/test_train.py
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import exit_status, split_bytes_per_token

from gptopt import cli
from gptopt.commands import train as train_cmd
from gptopt.config import GPTConfig, TrainConfig, preset
from gptopt.data.loader import load_tokenizer
from gptopt.infer.generator import Generator, generate
from gptopt.infer.sampling import SamplingParams
from gptopt.models import checkpoint
from gptopt.models.flops import flops_per_token
from gptopt.models.gpt import GPT
from gptopt.runtime import device as dev
from gptopt.runtime.device import resolve
from gptopt.train import loop as train
from gptopt.train import step

FAST = dict(preset="debug", seq_len=32, batch_size=4, device="cpu", sample_tokens=0, tensorboard=False,
            eval_interval=0, log_interval=1, warmup_steps=2)


def run(data: Path, out: Path, **kw: Any) -> int:
    return train_cmd.main(TrainConfig(data_dir=str(data), output_dir=str(out), **{**FAST, **kw}))


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def cli_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data_dir", str(data), "--output_dir", str(out), "--preset", "debug", "--seq_len", "32",
            "--batch_size", "4", "--device", "cpu", "--sample_tokens", "0", "--no-tensorboard", "--warmup_steps", "2",
            "--eval_interval", "0", "--log_interval", "1", *extra]  # the same settings as FAST


def test_training_learns_and_logs_every_required_field(train_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run(train_data, out, max_steps=40, eval_interval=20, learning_rate=3e-3) == 0
    recs = records(out)
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
    run(train_data, tmp_path / "r", max_steps=20, warmup_steps=5, learning_rate=1e-3, min_lr=1e-4)
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "r") if "lr" in r}
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
    assert run(train_data, out, max_steps=8) == 0
    info = json.loads((out / "run.json").read_text())
    fpt = flops_per_token(GPTConfig.from_dict(info["model"]), info["seq_len"])
    peak = low
    for r in [r for r in records(out) if "mfu" in r]:  # every step is logged: the peak each one saw
        peak = max(peak, r["tokens_per_s"] * fpt)
        assert r["mfu"] <= 1.0 and r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / peak)
    summary = info["summary"]
    assert summary["peak_flops"] == pytest.approx(peak) and summary["peak_source"].count("was low") == 1
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * fpt / peak) and summary["mfu"] <= 1.0


def samples(out: Path) -> dict[int, str]:
    return {r["step"]: r["sample"] for r in records(out) if "sample" in r}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_bitwise_exact(train_data: Path, tmp_path: Path, optimizer: str) -> None:
    # dropout on, so the RNG state must be restored too, not only weights and optimizer; eval samples
    # on, so sampling must leave training's RNG stream alone (the first leg samples at step 5 too)
    kw = dict(optimizer=optimizer, dropout=0.1, save_interval=5, max_steps=10, eval_interval=3, eval_iters=2,
              sample_tokens=8)
    assert run(train_data, tmp_path / "straight", **kw) == 0
    # the first leg stops after 5 steps of the same 10-step schedule (as a crash or a signal would)
    assert run(train_data, tmp_path / "split", max_tokens=5 * 4 * 32, **kw) == 0
    assert run(train_data, tmp_path / "split", resume="auto", **kw) == 0
    straight, split = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert list(split) == list(range(1, 11))  # no step logged twice after the resume
    assert split == straight  # bitwise: == on floats
    assert samples(tmp_path / "straight") == {s: t for s, t in samples(tmp_path / "split").items() if s != 5}
    a = checkpoint.load_model(tmp_path / "straight" / "ckpt-0000010").state_dict()
    b = checkpoint.load_model(tmp_path / "split" / "ckpt-0000010").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_keeps_the_last_k_checkpoints(train_data: Path, tmp_path: Path) -> None:
    run(train_data, tmp_path / "r", max_steps=12, save_interval=2, save_total_limit=2)
    assert [d.name for d in checkpoint.checkpoint_dirs(tmp_path / "r")] == ["ckpt-0000010", "ckpt-0000012"]
    state = checkpoint.load_train_state(tmp_path / "r" / "ckpt-0000012")
    assert state["step"] == 12 and state["tokens_seen"] == 12 * 4 * 32


def test_crash_while_saving_keeps_the_previous_checkpoint(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"
    run(train_data, out, max_steps=4, save_interval=4)
    real_save = torch.save

    def crash(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        real_save({"half": torch.zeros(3)}, f)  # something reached the disk, then the process died
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        run(train_data, out, max_steps=8, save_interval=8, resume="auto")
    monkeypatch.setattr(torch, "save", real_save)
    assert [d.name for d in out.iterdir() if d.name.startswith((".ckpt", "ckpt"))] == ["ckpt-0000004"]
    assert run(train_data, out, max_steps=8, resume="auto") == 0  # the old one still resumes


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
    assert run(train_data, tmp_path / "every", max_steps=10, save_interval=10) == 0
    reads: list[int] = []
    real = train.read_all
    monkeypatch.setattr(train, "read_all", lambda results: (reads.append(len(results)), real(results))[1])
    assert run(train_data, tmp_path / "five", max_steps=10, save_interval=10, log_interval=5) == 0
    assert reads == [1, 4, 5]  # the first (compiling) step alone, then one transfer per interval
    every, five = losses(tmp_path / "every"), losses(tmp_path / "five")
    assert five == {s: every[s] for s in (1, 5, 10)}  # bitwise: the same steps were taken
    a = checkpoint.load_model(tmp_path / "every" / "ckpt-0000010").state_dict()
    b = checkpoint.load_model(tmp_path / "five" / "ckpt-0000010").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(tmp_path / "five")[-1]["tokens_seen"] == 10 * 4 * 32


def test_bf16_autocast_training_on_cpu(train_data: Path, tmp_path: Path) -> None:
    assert run(train_data, tmp_path / "r", max_steps=15, use_amp=True, amp_dtype="bf16", learning_rate=3e-3) == 0
    ls = list(losses(tmp_path / "r").values())
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
    code = run(train_data, out, max_steps=30, max_bad_steps=3, save_interval=5)
    assert code == 1
    assert "3 consecutive non-finite steps" in capsys.readouterr().err
    ls = losses(out)
    assert ls[3] != ls[3]  # NaN logged for the skipped step
    assert all(v == v for s, v in ls.items() if s not in (3, 7, 8, 9))
    # the last good checkpoint survives, and no checkpoint holds poisoned weights
    last = checkpoint.latest_checkpoint(out)
    assert last.name == "ckpt-0000005"
    assert all(torch.isfinite(t).all() for t in checkpoint.load_model(last).state_dict().values())


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_step_boundary_and_resume_continues(
    train_data: Path, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    out = tmp_path / "r"
    args = cli_args(train_data, out, "--max_steps", "100000")
    proc = subprocess.Popen([sys.executable, "-m", "gptopt", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # same thread count as this process: bitwise-equal sums
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until it is really training
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    last = checkpoint.latest_checkpoint(out)
    assert last is not None and "resume with --resume auto" in err
    stopped = checkpoint.load_train_state(last)["step"]
    assert max(losses(out)) == stopped
    # resuming continues exactly where a run that was never interrupted would be (same schedule)
    tokens = str((stopped + 3) * 4 * 32)
    assert cli.main(cli_args(train_data, out, "--max_steps", "100000", "--max_tokens", tokens, "--resume", "auto")) == 0
    assert run(train_data, tmp_path / "straight", max_steps=100000, max_tokens=int(tokens)) == 0
    assert losses(out) == losses(tmp_path / "straight")


def test_time_budget_and_max_tokens_stop_and_save(train_data: Path, tmp_path: Path) -> None:
    assert run(train_data, tmp_path / "t", max_steps=10**6, time_budget="2s") == 0
    assert checkpoint.latest_checkpoint(tmp_path / "t") is not None
    assert run(train_data, tmp_path / "m", max_steps=100, max_tokens=4 * 32 * 7) == 0
    assert max(losses(tmp_path / "m")) == 7


def test_auto_batch_size_backs_off_from_out_of_memory(
    train_data: Path, tmp_path: Path, break_forward: Callable[..., None]
) -> None:
    break_forward(lambda model, idx: idx.size(0) > 4)
    out = tmp_path / "r"
    assert run(train_data, out, batch_size=16, gradient_accumulation_steps=1, max_steps=3, auto_batch_size=True) == 0
    cfg = json.loads((out / "run.json").read_text())["config"]
    assert (cfg["batch_size"], cfg["gradient_accumulation_steps"]) == (4, 4)  # global batch 16 kept
    assert checkpoint.load_train_state(checkpoint.latest_checkpoint(out))["tokens_seen"] == 3 * 16 * 32


def test_out_of_memory_names_the_options(
    train_data: Path, tmp_path: Path, break_forward: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    break_forward(lambda model, idx: True)
    assert run(train_data, tmp_path / "r", batch_size=8, max_steps=3) == 1
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
    assert cli.main(cli_args(train_data, out, "--init_from", str(tmp_path / "hf"), "--max_steps", "3")) == 0
    model = checkpoint.load_model(checkpoint.latest_checkpoint(out))
    assert model.config.vocab_size == 400 and model.config.n_embd == 64


def test_fine_tune_from_a_training_output_dir_at_its_context(train_data: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert run(train_data, first, max_steps=20, learning_rate=3e-3) == 0
    # what `gptopt generate --model` takes: the output dir means its latest checkpoint; no --seq_len:
    # the model's own context (the debug preset's 64), not a default of 1024 it does not have
    out = tmp_path / "ft"
    assert run(train_data, out, init_from=str(first), seq_len=None, max_steps=2) == 0
    assert json.loads((out / "run.json").read_text())["seq_len"] == preset("debug").block_size == 64
    # it starts from the trained weights: its first loss is far below the first run's first loss
    assert losses(out)[1] < losses(first)[1] - 0.5


def test_fine_tune_trains_at_a_context_beyond_1024(train_data: Path, tmp_path: Path) -> None:
    checkpoint.save_model(GPT(preset("debug", block_size=1100)), tmp_path / "long")
    out = tmp_path / "ft"
    assert run(train_data, out, init_from=str(tmp_path / "long"), seq_len=None, batch_size=1, max_steps=1) == 0
    assert json.loads((out / "run.json").read_text())["seq_len"] == 1100
    assert checkpoint.load_model(checkpoint.latest_checkpoint(out)).config.block_size == 1100


def test_init_from_something_that_is_no_model_names_the_option(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(cli_args(train_data, tmp_path / "o", "--init_from", str(tmp_path / "nope"))) == 2
    err = capsys.readouterr().err
    assert "--init_from" in err and "--model" not in err


def test_the_eval_sample_is_what_generate_samples_from_the_checkpoint(train_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=4, eval_interval=4, eval_iters=2, sample_tokens=12, seed=7) == 0
    logged = samples(out)[4]
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
    assert run(train_data, tmp_path / "r", max_steps=10, profile=True) == 0
    traces = list((tmp_path / "r" / "logs" / "profile").glob("*.pt.trace.json*"))
    assert traces, "no torch.profiler trace written"


def test_tensorboard_event_files(train_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    assert run(train_data, tmp_path / "r", max_steps=3, tensorboard=True) == 0
    assert list((tmp_path / "r" / "logs").glob("events.out.tfevents.*"))


def test_graph_break_under_fullgraph_is_reported(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_forward = GPT.forward

    def forward(self: GPT, idx: torch.Tensor, targets: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        print("side effect")  # noqa: T201 - print is a graph break torch.compile cannot trace through
        return real_forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", forward)
    code = cli.main(cli_args(train_data, tmp_path / "r", "--max_steps", "2", "--compile", "--compile_fullgraph"))
    assert code == 2
    err = capsys.readouterr().err
    assert "graph break under --compile_fullgraph" in err and "drop --compile_fullgraph" in err


@pytest.mark.slow
def test_compiled_training_matches_eager(train_data: Path, tmp_path: Path) -> None:
    run(train_data, tmp_path / "eager", max_steps=5)
    run(train_data, tmp_path / "compiled", max_steps=5, compile=True)
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    for s in eager:
        assert compiled[s] == pytest.approx(eager[s], rel=1e-3)


# -- bad input: one line naming the fix, exit 2, nothing overwritten -----------------------------


def test_missing_or_empty_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(cli_args(tmp_path / "nope", tmp_path / "o")) == 2
    assert "gptopt prepare" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(cli_args(tmp_path / "empty", tmp_path / "o")) == 2
    assert "gptopt prepare" in capsys.readouterr().err


def test_token_ids_beyond_the_model_vocabulary(train_data: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    small = GPT(preset("debug", vocab_size=100))
    checkpoint.save_model(small, tmp_path / "small")
    assert cli.main(cli_args(train_data, tmp_path / "o", "--init_from", str(tmp_path / "small"))) == 2
    assert "vocabulary" in capsys.readouterr().err


def test_seq_len_beyond_the_context(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_status(cli_args(train_data, tmp_path / "o", "--seq_len", "65")) == 2
    assert "exceeds the model's context 64" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncate_state", "truncate_weights", "garbage_meta"])
def test_corrupt_checkpoint_is_refused(
    train_data: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    run(train_data, out, max_steps=2)
    ckpt = checkpoint.latest_checkpoint(out)
    target = {"truncate_state": checkpoint.TRAIN_STATE, "truncate_weights": checkpoint.WEIGHTS,
              "garbage_meta": checkpoint.META}[damage]
    blob = (ckpt / target).read_bytes()
    (ckpt / target).write_bytes(blob[: len(blob) // 2] if damage.startswith("truncate") else b"{not json")
    before = (ckpt / target).read_bytes()
    assert cli.main(cli_args(train_data, out, "--resume", str(ckpt), "--max_steps", "4")) == 2
    err = capsys.readouterr().err
    assert "corrupt" in err or "truncated" in err
    assert (ckpt / target).read_bytes() == before


def test_resume_refuses_a_preset_chosen_for_another_shape_than_the_checkpoints(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    run(train_data, out, max_steps=2)
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert cli.main(cli_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--preset", "gpt2")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gptopt train: error: --preset gpt2 does not apply to a resumed run")
    assert "the run's debug model" in err
    assert "n_layer 2" in err and "drop --preset" in err and "another --output_dir" in err
    assert sorted(p.name for p in out.iterdir()) == before and checkpoint.latest_checkpoint(out).name == "ckpt-0000002"


def test_resume_without_preset_keeps_the_checkpoints_and_a_given_default_is_refused_too(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    run(train_data, out, max_steps=2)
    capsys.readouterr()
    without = [a for a in cli_args(train_data, out) if a not in ("--preset", "debug")]
    assert cli.main([*without, "--resume", "auto", "--max_steps", "3"]) == 0  # no --preset: quiet, its own shape
    assert "--preset" not in capsys.readouterr().err
    assert checkpoint.load_model(checkpoint.latest_checkpoint(out)).config.n_layer == preset("debug").n_layer
    # tiny is what a new run is without --preset; given for a debug run, it is refused like any other
    assert cli.main([*without, "--resume", "auto", "--max_steps", "4", "--preset", "tiny"]) == 2
    assert "--preset tiny does not apply to a resumed run" in capsys.readouterr().err
    assert checkpoint.latest_checkpoint(out).name == "ckpt-0000003"


def test_resume_refuses_a_preset_of_another_family_of_the_same_size(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-tiny has tiny's size: over a GPT-2-shaped tiny run it is still another model, and refused."""
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=2, preset="tiny", seq_len=16) == 0
    before = tree(out)
    capsys.readouterr()
    assert cli.main([*cli_args(train_data, out, "--resume", "auto", "--max_steps", "3"), "--preset", "llama-tiny",
                     "--seq_len", "16"]) == 2
    err = capsys.readouterr().err
    assert "--preset llama-tiny does not apply to a resumed run" in err and "positions learned" in err
    assert "positions rope" in err and tree(out) == before


def _other_data(text_dir: Path, out: Path, **kw: Any) -> Path:
    """Data of another tokenizer: a BPE trained on other text (kw: prepare's options)."""
    import sysconfig

    from gptopt.config import PrepareConfig
    from gptopt.data.corpus import tokenize_corpus

    text_dir.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/encoder.py", "csv.py", "string.py", "ast.py"):
        (text_dir / f"{Path(name).name}.txt").write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    return tokenize_corpus(PrepareConfig(input=str(text_dir), output_dir=str(out), val_fraction=0.3,
                                         **{"vocab_size": 300, **kw}))


def test_a_run_never_resumes_or_starts_from_a_model_on_another_tokenizers_data(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The quick start's model, then `gptopt prepare` of the user's own text (a BPE of its own): --resume auto and
    --init_from on that data are refused, naming the fix, which then works: prepare with the model's tokenizer."""
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=2) == 0
    mine = _other_data(tmp_path / "texts", tmp_path / "mine")
    before = tree(out)
    capsys.readouterr()
    assert cli.main(cli_args(mine, out, "--resume", "auto", "--max_steps", "3")) == 2
    err = capsys.readouterr().err
    ckpt = checkpoint.latest_checkpoint(out)
    assert "was tokenized with another tokenizer than the run's checkpoint" in err and "nothing was written" in err
    assert f"--tokenizer {ckpt / 'tokenizer.json'}" in err and tree(out) == before
    assert cli.main(cli_args(mine, tmp_path / "ft", "--init_from", str(out), "--max_steps", "2")) == 2
    assert "another tokenizer than --init_from" in capsys.readouterr().err and not (tmp_path / "ft").exists()
    # the fix: the same text, tokenized with the model's own tokenizer
    fixed = _other_data(tmp_path / "texts2", tmp_path / "fixed", tokenizer=str(ckpt / "tokenizer.json"))
    assert cli.main(cli_args(fixed, out, "--resume", "auto", "--max_steps", "3")) == 0
    assert checkpoint.latest_checkpoint(out).name == "ckpt-0000003"


def test_contradicting_flags(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(cli_args(train_data, tmp_path / "o", "--use_amp", "--amp_dtype", "fp16")) == 2
    assert "fp16 autocast on a CPU" in capsys.readouterr().err
    assert cli.main(cli_args(train_data, tmp_path / "o", "--fsdp")) == 2
    assert "torchrun" in capsys.readouterr().err and not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as e:
        cli.main(cli_args(train_data, tmp_path / "o", "--cpu_offload"))
    assert e.value.code == 2
    assert "--cpu_offload needs --fsdp" in capsys.readouterr().err


def test_existing_run_is_not_overwritten(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    run(train_data, out, max_steps=2)
    before = (checkpoint.latest_checkpoint(out) / checkpoint.WEIGHTS).read_bytes()
    assert cli.main(cli_args(train_data, out, "--max_steps", "2")) == 2
    assert "--resume auto" in capsys.readouterr().err
    assert (out / "ckpt-0000002" / checkpoint.WEIGHTS).read_bytes() == before
    assert cli.main(cli_args(train_data, out, "--max_steps", "3", "--overwrite")) == 0
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000003"]


# -- nothing a user owns is lost: each test starts from a folder holding something that must survive ----


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes): what a refused command must leave exactly as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_validates_first_and_keeps_the_old_run_until_the_new_one_has_a_checkpoint(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], break_forward: Callable[..., None]
) -> None:
    out = tmp_path / "ow"
    assert run(train_data, out, max_steps=4, save_interval=2) == 0
    (out / "notes.txt").write_text("the user's own file")
    before = tree(out)
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000002", "ckpt-0000004"]
    # a bad argument: refused before anything is moved or deleted
    assert exit_status(cli_args(train_data, out, "--max_steps", "20", "--overwrite", "--seq_len", "100000")) == 2
    assert "exceeds the model's context" in capsys.readouterr().err
    assert tree(out) == before
    # a new run that fails before its first checkpoint: the old run is back, as it was
    break_forward(lambda model, idx: model.training, "nan")
    assert run(train_data, out, max_steps=20, overwrite=True, max_bad_steps=1) == 1
    assert tree(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".gptopt-old")]


def test_overwrite_replaces_the_run_and_nothing_else(train_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "ow"
    assert run(train_data, out, max_steps=4, save_interval=2) == 0
    (out / "notes.txt").write_text("the user's own file")
    assert run(train_data, out, max_steps=3, overwrite=True) == 0
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000003"]
    assert max(losses(out)) == 3 and (out / "notes.txt").read_text() == "the user's own file"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gptopt-output.json"]


def test_resuming_an_earlier_checkpoint_keeps_the_new_branch_and_points_latest_at_it(
    train_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gptopt.infer.load import model_source

    out = tmp_path / "tl"
    assert run(train_data, out, max_steps=30, save_interval=10) == 0
    with caplog.at_level("WARNING", logger="gptopt"):
        assert cli.main(cli_args(train_data, out, "--resume", str(out / "ckpt-0000010"), "--max_steps", "17",
                                 "--save_interval", "5", "--save_total_limit", "1")) == 0
    assert "ckpt-0000020, ckpt-0000030 belong to an abandoned branch" in caplog.text
    # retention kept the last of the new lineage (10 -> 15 -> 17) and left the abandoned branch alone
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000017", "ckpt-0000020", "ckpt-0000030"]
    assert checkpoint.latest_checkpoint(out) == out / "ckpt-0000017"
    assert model_source(str(out)) == out / "ckpt-0000017"  # what generate --model / serve load
    assert checkpoint.lineage(out / "ckpt-0000017") == ["ckpt-0000010", "ckpt-0000015", "ckpt-0000017"]
    # --resume auto continues the new branch, not the larger step of the old one
    assert run(train_data, out, max_steps=18, resume="auto") == 0
    assert checkpoint.load_train_state(checkpoint.latest_checkpoint(out))["step"] == 18
    assert max(losses(out)) == 18


def test_a_run_that_stopped_before_its_first_checkpoint_is_not_written_over(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], break_forward: Callable[..., None]
) -> None:
    out = tmp_path / "r"
    with pytest.MonkeyPatch.context() as mp:  # the earlier run died at its first step: metrics, no checkpoint
        mp.setattr(train.Trainer, "_train_one", lambda *a: (_ for _ in ()).throw(RuntimeError("lost the device")))
        assert run(train_data, out, max_steps=5) == 1
    assert (out / "run.json").is_file() and checkpoint.latest_checkpoint(out) is None
    before = tree(out)
    assert cli.main(cli_args(train_data, out, "--max_steps", "2")) == 2
    err = capsys.readouterr().err
    assert "holds a training run" in err and "--resume auto" in err and "--overwrite" in err
    assert tree(out) == before
    # a folder with only the user's files is written beside them
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert run(train_data, mine, max_steps=2) == 0
    assert (mine / "notes.txt").read_text() == "keep" and checkpoint.latest_checkpoint(mine) is not None


def test_sigterm_to_the_process_group_saves_and_leaves_no_staging_folder(train_data: Path, tmp_path: Path) -> None:
    # a scheduler (or torchrun, or Ctrl-C) signals the whole group: the loader's workers too, which used to
    # die first and take the run down mid-step, without its stop checkpoint
    out = tmp_path / "r"
    args = cli_args(train_data, out, "--max_steps", "100000", "--save_interval", "1", "--num_workers", "2")
    proc = subprocess.Popen([sys.executable, "-m", "gptopt", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gptopt-output.json"]
    stopped = checkpoint.load_train_state(checkpoint.latest_checkpoint(out))["step"]
    # a writer killed mid-save (kill -9) leaves its staging folder: the next run there removes it at start
    leftover = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys; from pathlib import Path; from gptopt.outputs import staged_dir\n"
        "with staged_dir(Path(sys.argv[1])) as tmp:\n"
        "    (tmp / 'model.safetensors').write_bytes(b'half'); os.kill(os.getpid(), signal.SIGKILL)"),
        str(out / "ckpt-0000999")], capture_output=True)
    assert leftover.returncode == -signal.SIGKILL
    assert [p.name for p in out.iterdir() if p.name.startswith(".ckpt-0000999.tmp-")]
    assert cli.main(cli_args(train_data, out, "--max_steps", str(stopped), "--resume", "auto")) == 0  # nothing to train
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gptopt-output.json"]
    assert cli.main(cli_args(train_data, out, "--max_steps", str(stopped + 2), "--resume", "auto")) == 0
    assert max(losses(out)) == stopped + 2


def test_generate_uses_the_checkpoints_tokenizer_from_any_working_directory(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from gptopt.infer.load import load_for_inference

    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(train_data, here / "data" / "stdlib")
    monkeypatch.chdir(here)  # trained with a relative --data_dir, as the default data/stdlib is
    assert run(Path("data/stdlib"), Path("out"), max_steps=2) == 0
    other = load_tokenizer(train_data / "tokenizer.json")
    other.add_tokens(["another corpus's token"])
    (there / "data" / "stdlib").mkdir(parents=True)
    other.save(str(there / "data" / "stdlib" / "tokenizer.json"))
    monkeypatch.chdir(there)
    _, tok = load_for_inference(str(here / "out"), tokenizer=None, plan=resolve("cpu", "fp32"))
    assert tok.get_vocab() == load_tokenizer(train_data / "tokenizer.json").get_vocab()
    (there / "data" / "stdlib" / "tokenizer.json").unlink()  # and with nothing in this folder at all
    _, tok = load_for_inference(str(here / "out"), tokenizer=None, plan=resolve("cpu", "fp32"))
    assert tok.get_vocab_size() == 320
    # and the data it was trained on, which compress and bench evaluate on by default
    assert checkpoint.training_data(checkpoint.latest_checkpoint(here / "out")) == str(here / "data" / "stdlib")


@pytest.mark.parametrize("bad", ["output_is_a_file", "output_unwritable", "resume_missing", "resume_not_a_checkpoint",
                                 "init_from_missing"])
def test_bad_arguments_write_and_delete_nothing(
    train_data: Path, tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=2) == 0
    (out / "notes.txt").write_text("the user's own file")
    target, extra, expect = out, [], ""
    if bad == "output_is_a_file":
        target, expect = out / "notes.txt", "is a file"
    elif bad == "output_unwritable":
        (out / "locked").mkdir()
        (out / "locked").chmod(0o555)
        if os.geteuid() == 0:  # root writes anywhere: let the OS say no as it does to everyone else
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == out / "locked" else real(p, mode))
        target, expect = out / "locked" / "new", "permission denied"
    elif bad == "resume_missing":
        extra, expect = ["--resume", str(tmp_path / "nope")], "no such directory"
    elif bad == "resume_not_a_checkpoint":
        (tmp_path / "empty").mkdir()
        extra, expect = ["--resume", str(tmp_path / "empty")], "not a training checkpoint"
    else:
        target, extra, expect = tmp_path / "new", ["--init_from", str(tmp_path / "nope")], "--init_from"
    before = tree(tmp_path)
    assert cli.main(cli_args(train_data, target, "--max_steps", "4", *extra)) == 2
    assert expect in capsys.readouterr().err
    assert tree(tmp_path) == before
    assert not (tmp_path / "new").exists()


# -- what a run may write over ---------------------------------------------------------------------


def test_resume_auto_never_writes_over_a_users_files_of_a_runs_names(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "u"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 5, "note": "mine"}\n')
    (out / "run.json").write_text('{"mine": true}\n')
    before = tree(out)
    # --resume, --overwrite or neither: the same refusal at once, never advice that then refuses
    for extra in (["--resume", "auto"], ["--overwrite"], []):
        assert cli.main(cli_args(train_data, out, "--max_steps", "2", *extra)) == 2
        err = capsys.readouterr().err
        assert "which gptopt did not write" in err and "pass --" not in err, err
        assert tree(out) == before


def test_overwrite_keeps_a_users_file_inside_the_runs_folders(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=2) == 0
    (out / "ckpt-0000002" / "notes.txt").write_text("the user's, inside a checkpoint")
    before = tree(out)
    assert cli.main(cli_args(train_data, out, "--max_steps", "2", "--overwrite")) == 2
    assert "ckpt-0000002/notes.txt" in capsys.readouterr().err
    assert tree(out) == before


def test_each_kind_of_output_keeps_a_folder_of_its_own(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=2) == 0
    before = tree(out)
    (tmp_path / "text.txt").write_text("some words of text\n" * 300)
    assert cli.main(["prepare", "--input", str(tmp_path / "text.txt"), "--output_dir", str(out),
                     "--vocab_size", "300"]) == 2  # shards beside a run would take over its mark
    assert "holds gptopt train-run output" in capsys.readouterr().err
    assert tree(out) == before
    assert cli.main(cli_args(train_data, train_data, "--max_steps", "2")) == 2  # and a run into the data folder
    assert "holds gptopt prepared-data output" in capsys.readouterr().err


def test_a_signal_before_the_first_checkpoint_gives_the_overwritten_run_back(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=4, save_interval=2) == 0
    before = tree(out)
    real = train.Trainer._train_one

    def interrupted(self: train.Trainer, progress: Any) -> None:  # Ctrl-C during the first step
        real(self, progress)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(train.Trainer, "_train_one", interrupted)
    assert run(train_data, out, max_steps=20, save_interval=10, overwrite=True, seed=7) == 130
    assert tree(out) == before  # the mistaken --overwrite is undone, its interrupt checkpoint with it


def test_a_metrics_file_that_is_not_gptopts_stops_a_resume_with_the_fix(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    assert run(train_data, out, max_steps=2) == 0
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write("not json\n")
    assert cli.main(cli_args(train_data, out, "--max_steps", "4", "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: a line is not one of gptopt's metrics records" in err and "Traceback" not in err


def test_arch_trains_a_new_design_over_the_preset_and_a_resumed_run_keeps_its_own(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    design = "positions=rope,qk_norm=true,mlp=relu2,tie_embeddings=false,zero_init=true"
    assert cli.main(cli_args(train_data, out, "--max_steps", "2", "--arch", design)) == 0
    model = checkpoint.load_model(checkpoint.latest_checkpoint(out))
    c = model.config
    assert (c.positions, c.qk_norm, c.mlp, c.tie_embeddings, c.zero_init) == ("rope", True, "relu2", False, True)
    assert (c.n_layer, c.n_embd) == (preset("debug").n_layer, preset("debug").n_embd)  # the preset's sizes
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    # resumed under another design: refused, nothing written; its own design (or none) goes on
    assert cli.main(cli_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--arch", "mlp=gelu")) == 2
    err = capsys.readouterr().err
    assert "--arch mlp=gelu does not apply to a resumed run" in err and "mlp=relu2" in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert cli.main(cli_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--arch", design)) == 0


@pytest.mark.parametrize("arch, problem", [
    ("mlp=swish", "--arch: mlp must be one of gelu, swiglu, relu2"),
    ("n_layer=2", "'n_layer=2' is not FIELD=VALUE of a block field"),
    ("qk_norm=maybe", "qk_norm takes true or false"),
    ("n_kv_head=3", "must be a multiple of n_kv_head"),
])
def test_a_bad_arch_is_refused_naming_the_field_before_anything_is_written(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str, problem: str
) -> None:
    out = tmp_path / "r"
    with pytest.raises(SystemExit) as e:  # argparse's exit: the config is checked as the flags are read
        cli.main(cli_args(train_data, out, "--max_steps", "2", "--arch", arch))
    assert e.value.code == 2 and problem in capsys.readouterr().err and not out.exists()


def test_ctrl_c_is_said_at_once_and_a_second_one_stops_at_once_without_a_checkpoint(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    real = train.Trainer._train_one
    calls = {"n": 0}

    def interrupted(self: train.Trainer, progress: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # a long step: Ctrl-C, then Ctrl-C again before it ends
            os.kill(os.getpid(), signal.SIGINT)
            assert "stopping after this step" in capsys.readouterr().err  # said before the step goes on
            os.kill(os.getpid(), signal.SIGINT)
        real(self, progress)

    monkeypatch.setattr(train.Trainer, "_train_one", interrupted)
    assert cli.main(cli_args(train_data, out, "--max_steps", "20", "--save_interval", "1")) == 130
    assert "stopped (Ctrl-C)" in capsys.readouterr().err
    assert checkpoint.latest_checkpoint(out).name == "ckpt-0000002"  # the interrupted third step left none
