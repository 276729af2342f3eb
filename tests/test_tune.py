"""gptopt tune: the search order, pruning, out-of-memory and broken candidates, the time and memory
budgets, and the outputs (tune.toml that train takes, the report, the --json line).

    pytest -q tests/test_tune.py

Real runs use the debug preset and a small space; the search logic is also driven by a fake
measurement (settings -> tokens/s) and a fake clock, so no assertion depends on this machine's speed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import last_json_line

from gptopt import cli
from gptopt.bench.ladder import Bench, Rung, RungResult
from gptopt.commands import tune, tune_report
from gptopt.commands.tune import Tuner
from gptopt.commands.tune_report import write_all
from gptopt.config import TrainConfig, TuneConfig
from gptopt.runtime import device

STAGES = ["reference", "baseline", "precision", "optimizer", "loader", "loss", "micro-batch", "checkpointing",
          "compile", "confirm"]


def tune_args(data: Path, out: Path, *extra: str) -> list[str]:
    # global batch 256 tokens = 8 sequences of 32
    return ["tune", "--preset", "debug", "--seq_len", "32", "--global_batch_tokens", "256", "--steps", "3",
            "--warmup", "1", "--device", "cpu", "--data_dir", str(data), "--output_dir", str(out), *extra]


def tune_config(data: Path, out: Path, **kw: Any) -> TuneConfig:
    base = dict(preset="debug", seq_len=32, global_batch_tokens=256, steps=3, warmup=1, device="cpu",
                data_dir=str(data), output_dir=str(out))
    return TuneConfig(**{**base, **kw})


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


BATCH_SPEED = {1: 0.3, 2: 0.5, 4: 0.7, 8: 0.85, 16: 1.0, 32: 1.2, 64: 1.1, 128: 1.0}


def fake_measurements(monkeypatch: pytest.MonkeyPatch, batch_speed: dict[int, float] = BATCH_SPEED,
                      memory_mib: Any = None, clock: FakeClock | None = None) -> list[dict[str, Any]]:
    """Bench.run_rung replaced by a model of the machine: tokens/s and memory from the settings alone.
    Returns the settings of every candidate actually run."""
    calls: list[dict[str, Any]] = []

    def speed(s: dict[str, Any]) -> float:
        tps = 1000.0 * batch_speed[s["batch_size"]]
        tps *= 1.5 if s["use_amp"] else 1.0
        tps *= 0.9 if s["attention"] == "sdpa" else 1.0
        tps *= 1.05 if s["fused_optimizer"] else 1.0
        tps *= 0.9 if s["gradient_checkpointing"] else 1.0
        tps *= 0.95 if s["loss"] == "chunked" else 1.0
        tps *= 0.8 if s["hf"] else 1.0
        if s["compile"]:
            tps *= {"default": 1.3, "max-autotune-no-cudagraphs": 1.25}[s["compile_mode"]]
        return tps

    def run_rung(self: Bench, rung: Rung, batch_size: int | None = None, *, stop: Any = None) -> RungResult:
        cfg = self.config(rung, batch_size)
        s = {**dataclasses.asdict(cfg), "hf": rung.hf}
        calls.append(s)
        if clock is not None:
            clock.t += 60.0 if cfg.compile else 10.0
        mem = int((memory_mib(s) if memory_mib else 1) * 2**20)
        tps = speed(s)
        st = cfg.batch_size * cfg.gradient_accumulation_steps * self.seq_len / tps
        return self.result(rung, cfg, compile_s=2 * st, step_time_s=st, step_time_p10_s=st, step_time_p90_s=st,
                           step_times_s=[st] * self.steps, tokens_per_s=tps, mfu=tps * self.fpt / self.peak,
                           peak_mem_bytes=mem, reserved_mem_bytes=mem, data_wait_frac=0.001, loss=7.0)

    monkeypatch.setattr(Bench, "run_rung", run_rung)
    return calls


def by_name(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in summary["candidates"]}


@pytest.mark.policy
def test_search_settles_cheap_axes_first_and_prunes_what_cannot_win(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_measurements(monkeypatch)
    # 128 sequences: the reference runs gptopt's default micro-batch 16 x accumulation 8
    summary = Tuner(tune_config(train_data, tmp_path / "t", global_batch_tokens=128 * 32)).run()
    c = by_name(summary)
    stages = [x["stage"] for x in summary["candidates"]]
    assert stages == sorted(stages, key=STAGES.index)  # eager axes, then micro-batch, then compile
    assert c["defaults"]["config"]["batch_size"] == 16 and c["defaults"]["config"]["gradient_accumulation_steps"] == 8
    assert not c["defaults"]["config"]["use_amp"] and c["defaults"]["loss_ok"] is True
    # micro-batch grows while faster (32), stops at the first slower one (64), and the next is pruned
    assert c["micro-batch 32"]["status"] == "ok" and c["micro-batch 64"]["status"] == "ok"
    assert c["micro-batch 128"]["status"] == "pruned" and "already slower than 32" in c["micro-batch 128"]["note"]
    assert c["checkpointing"]["status"] == "pruned" and "fit without it" in c["checkpointing"]["note"]
    loaders = [x for x in summary["candidates"] if x["stage"] == "loader"]
    assert loaders and all(x["status"] == "pruned" and "waits for batches" in x["note"] for x in loaders)
    # compile modes on the best eager settings, bench's `all` rung among them; no CUDA graphs on a CPU
    compiled = [x for x in summary["candidates"] if x["stage"] == "compile"]
    assert [x["name"] for x in compiled] == ["compile default", "bench 'all' rung",
                                             "compile max-autotune-no-cudagraphs"]
    best = summary["best"]["config"]
    assert (best["batch_size"], best["gradient_accumulation_steps"], best["use_amp"], best["attention"]) == (
        32, 4, True, "eager")
    assert (best["compile"], best["compile_mode"], best["fused_optimizer"]) == (True, "default", True)
    assert c["chunked loss"]["status"] == "ok" and best["loss"] == "full"  # measured, and slower here
    # train's defaults run fp32 here, so SDPA attention (device.default_attention), which this machine slows
    assert summary["gain_vs_defaults"] == pytest.approx(1.5 * 1.2 * 1.3 / 0.9)
    assert summary["gain_vs_hf"] == pytest.approx(1.5 * 1.2 * 1.3 / 0.8 * 1.05)
    # no settings are measured twice (the fp32 eager candidate is the reference itself), except the two
    # fastest: the confirmation round measures them again, back to back
    keys = [json.dumps(s, sort_keys=True) for s in calls]
    assert len(keys[:-2]) == len(set(keys[:-2])) and set(keys[-2:]) <= set(keys[:-2])
    assert [x["name"] for x in summary["candidates"][-2:]] == ["compile default (again)",
                                                               "compile max-autotune-no-cudagraphs (again)"]
    assert summary["best"]["name"] == "compile default (again)"


def test_no_candidate_claims_more_than_the_peak(train_data: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fake_measurements(monkeypatch)
    monkeypatch.setattr(device, "measured_matmul_flops", lambda dev, dtype, remeasure=False: 1.0)  # measured low
    summary = Tuner(tune_config(train_data, tmp_path / "t", global_batch_tokens=128 * 32, axes="amp")).run()
    assert all(c["mfu"] <= 1.0 for c in summary["candidates"] if c["mfu"] is not None)
    assert summary["best"]["mfu"] == pytest.approx(1.0) and "was low" in summary["peak_source"]


@pytest.mark.policy
def test_checkpointing_only_where_memory_runs_out_and_it_buys_a_faster_micro_batch(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    speeds = {**BATCH_SPEED, 64: 1.5}  # 64 would be fastest, but needs 64 MiB without checkpointing
    fake_measurements(monkeypatch, speeds,
                      memory_mib=lambda s: s["batch_size"] / (4 if s["gradient_checkpointing"] else 1))
    monkeypatch.setattr(Tuner, "_memory_limit", lambda self: 40 * 2**20)
    summary = Tuner(tune_config(train_data, tmp_path / "t", global_batch_tokens=128 * 32,
                                axes="amp,batch,checkpointing")).run()
    c = by_name(summary)
    assert c["micro-batch 64"]["status"] == "oom" and "over the memory budget" in c["micro-batch 64"]["note"]
    assert c["checkpointing, micro-batch 64"]["status"] == "ok"
    assert c["checkpointing, micro-batch 128"]["status"] == "ok"  # measured, and slower: the growth stops there
    best = summary["best"]["config"]
    assert (best["gradient_checkpointing"], best["batch_size"], best["gradient_accumulation_steps"]) == (True, 64, 2)


def test_time_budget_is_honoured_and_the_search_still_ends_with_a_winner(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    calls = fake_measurements(monkeypatch, clock=clock)  # 10 s per eager candidate, 60 s per compiled one
    tuner = Tuner(tune_config(train_data, tmp_path / "t", time_budget="100s"), clock=clock)
    summary = tuner.run()
    assert summary["elapsed_s"] <= 100
    over = [x for x in summary["candidates"] if x["status"] == "over budget"]
    assert over and all("of the budget left" in x["note"] for x in over)
    assert all(x["stage"] == "compile" for x in over)  # a compile (about 60 s) no longer fits
    assert not any(s["compile"] for s in calls)
    assert summary["best"]["tokens_per_s"] > 0
    write_all(summary, tmp_path / "t")
    assert (tmp_path / "t" / "tune.toml").is_file()


def test_a_tiny_budget_still_measures_the_reference(train_data: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    calls = fake_measurements(monkeypatch, clock=clock)
    summary = Tuner(tune_config(train_data, tmp_path / "t", time_budget="5s"), clock=clock).run()
    assert len(calls) == 1 and summary["best"]["name"] == "defaults"
    assert all(x["status"] in ("over budget", "pruned") for x in summary["candidates"][1:])


@pytest.mark.parametrize(("cpu_per_wall_s", "pruned"), [(1.0 * torch.get_num_threads(), True), (0.3, False)])
def test_a_slow_candidate_is_pruned_unless_the_cpu_was_busy(
    cpu_per_wall_s: float, pruned: bool, train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_measurements(monkeypatch)
    tuner = Tuner(tune_config(train_data, tmp_path / "t", warmup=1))
    tuner.best = (Rung("b", ""), RungResult(name="b", what="", step_time_s=1.0, step_time_p90_s=1.0))
    wall = [0.0]
    monkeypatch.setattr(tune, "_wall", lambda: wall[0])
    monkeypatch.setattr(tune, "_cpu_seconds", lambda: wall[0] * cpu_per_wall_s)
    stop = tuner._stop_hook(prune=True, deadline=True, share=(share := []))
    verdicts = []
    for i, times in [(1, []), (2, [2.0]), (3, [2.0, 2.0])]:  # each step 2x the best's p90
        verdicts.append(stop(i, times))
        wall[0] += 2.0
    assert verdicts[:2] == [None, None]
    assert (verdicts[2] is not None and verdicts[2][0] == "pruned") is pruned
    assert share[-1] == pytest.approx(cpu_per_wall_s / torch.get_num_threads())


@pytest.mark.policy
def test_tune_writes_a_toml_train_accepts_a_report_and_the_json_line(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t"
    assert cli.main(tune_args(train_data, out, "--axes", "amp", "--json", "--seed", "7")) == 0
    last = last_json_line(capsys.readouterr().out)
    assert last["best"]["tokens_per_s"] > 0 and last["best"]["config"]["preset"] == "debug"
    statuses = {"ok", "rejected", "oom", "pruned", "over budget", "failed", "skipped"}
    assert last["candidates"] and all(c["status"] in statuses for c in last["candidates"])
    assert last["candidates"][0]["name"] == "defaults" and last["candidates"][0]["loss_ok"] is True
    if last["hf"] is not None:
        assert last["gain_vs_hf"] == pytest.approx(last["best"]["tokens_per_s"] / last["hf"]["tokens_per_s"])
    for f in ("tune.toml", "tune_report.md", "tune_results.json", "tune_results.csv"):
        assert (out / f).is_file(), f
    report = (out / "tune_report.md").read_text()
    assert "## Every candidate" in report and all(c["name"] in report for c in last["candidates"])
    # tune.toml is a config `gptopt train` takes as it is, with the global batch kept
    cfg = cli.parse_config("train", TrainConfig, ["--config", str(out / "tune.toml")],
                           cli.build_parser("train", TrainConfig))
    best = last["best"]["config"]
    assert "compile" in cli.tomllib.loads((out / "tune.toml").read_text())  # the option's name, not its old one
    assert cfg.batch_size * cfg.gradient_accumulation_steps * cfg.seq_len == 256
    assert (cfg.batch_size, cfg.use_amp, cfg.attention, cfg.compile) == (
        best["batch_size"], best["use_amp"], best["attention"], best["compile"])
    assert (cfg.seed, cfg.device, cfg.preset) == (7, "cpu", "debug")  # the winner's run: its weights, batches, device
    assert cli.main(["train", "--config", str(out / "tune.toml"), "--output_dir", str(tmp_path / "train"),
                     "--max_steps", "2", "--sample_tokens", "0", "--eval_interval", "0", "--no-tensorboard"]) == 0


def replaying_tuner(summary: dict[str, Any]) -> Callable[[TuneConfig], Any]:
    """A Tuner that measures nothing and returns summary: what the output handling does with a finished search."""
    def make(cfg: TuneConfig) -> Any:
        bench = SimpleNamespace(preset=summary["preset"], seq_len=summary["seq_len"])
        return SimpleNamespace(bench=bench, global_batch=summary["global_batch"], run=lambda: summary)
    return make


def test_a_second_tune_into_the_same_folder_needs_overwrite_and_keeps_the_users_files(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "t"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli.main(tune_args(train_data, out, "--axes", "amp")) == 0
    first = (out / "tune_results.json").read_text()
    summary = json.loads(first)
    capsys.readouterr()

    def no_search(cfg: TuneConfig) -> None:
        raise AssertionError("searched before the output folder was checked")

    monkeypatch.setattr(tune, "Tuner", no_search)
    assert cli.main(tune_args(train_data, out, "--axes", "amp")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass --overwrite" in err
    assert (out / "tune_results.json").read_text() == first

    monkeypatch.setattr(tune, "Tuner", replaying_tuner({**summary, "elapsed_s": 1234.0}))
    monkeypatch.setattr(tune_report, "_write", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):  # the new report failed: the old one is back
        tune.main(tune_config(train_data, out, overwrite=True))
    assert (out / "tune_results.json").read_text() == first
    monkeypatch.undo()
    monkeypatch.setattr(tune, "Tuner", replaying_tuner({**summary, "elapsed_s": 1234.0}))
    assert cli.main(tune_args(train_data, out, "--axes", "amp", "--overwrite")) == 0
    assert json.loads((out / "tune_results.json").read_text())["elapsed_s"] == 1234.0
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_out_of_memory_candidates_are_recorded_and_the_search_goes_on(
    train_data: Path, tmp_path: Path, break_forward: Callable[..., None]
) -> None:
    break_forward(lambda model, idx: model.training and idx.size(0) > 2)
    out = tmp_path / "t"
    summary = Tuner(tune_config(train_data, out, axes="batch,checkpointing")).run()
    status = [(x["stage"], x["batch_size"], x["status"]) for x in summary["candidates"]]
    # the reference backs off 8 -> 4 -> 2; checkpointing is tried where memory ran out (4), and fails there too
    assert status[:3] == [("reference", 8, "oom"), ("reference", 4, "oom"), ("reference", 2, "ok")]
    assert "out of memory at micro-batch 8" in summary["candidates"][0]["note"]
    assert ("checkpointing", 4, "oom") in status
    best = summary["best"]["config"]
    assert (best["batch_size"], best["gradient_accumulation_steps"]) == (2, 4)  # the largest that fits
    write_all(summary, out)
    cfg = cli.parse_config("train", TrainConfig, ["--config", str(out / "tune.toml")],
                           cli.build_parser("train", TrainConfig))
    assert (cfg.batch_size, cfg.gradient_accumulation_steps) == (2, 4)


@pytest.mark.policy
def test_a_candidate_that_corrupts_the_loss_is_rejected_and_never_wins(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = Bench._build

    def build(self: Bench, rung: Rung, cfg: TrainConfig) -> torch.nn.Module:
        model = real_build(self, rung, cfg)
        if cfg.use_amp:  # a "fast" setting that silently computes something else
            with torch.no_grad():
                model.transformer.wte.weight.mul_(30.0)
        return model

    monkeypatch.setattr(Bench, "_build", build)
    monkeypatch.setattr(tune, "PRUNE_SLOWER", float("inf"))  # it must run to the loss check, however slow
    summary = Tuner(tune_config(train_data, tmp_path / "t", axes="amp")).run()
    bf16 = next(c for name, c in by_name(summary).items() if name.endswith(" bf16"))
    assert bf16["status"] == "rejected" and bf16["loss_ok"] is False
    assert "departs from the fp32 reference" in bf16["note"]
    assert summary["best"]["config"]["use_amp"] is False


@pytest.mark.parametrize(("extra", "message"), [
    (["--axes", "amp,turbo"], "unknown tune axes ['turbo']"),
    (["--memory_budget", "1.5"], "--memory_budget"),
    (["--time_budget", "soon"], "is not a duration"),
    (["--steps", "2"], "--steps must be in [3, 100000], got 2"),
])
def test_bad_options_exit_2(extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(tune_args(tmp_path, tmp_path / "o", *extra))
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_global_batch_must_be_whole_sequences(train_data: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(tune_args(train_data, tmp_path / "o", "--global_batch_tokens", "100")) == 2
    assert "not a multiple of the sequence length 32: use 96" in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_candidates_run_and_can_win(train_data: Path, tmp_path: Path) -> None:
    summary = Tuner(tune_config(train_data, tmp_path / "t", axes="amp,compile", time_budget="10m")).run()
    compiled = [x for x in summary["candidates"] if x["stage"] == "compile"]
    assert compiled and all(x["status"] in ("ok", "pruned", "over budget") for x in compiled)
    assert any(x["status"] == "ok" and x["loss_ok"] for x in compiled)



@pytest.mark.parametrize("prunable", [True, False])
def test_benchs_all_rung_is_measured_in_full_however_slow_its_first_steps(
    prunable: bool, train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_measurements(monkeypatch)
    fake = Bench.run_rung
    wall = [0.0]
    monkeypatch.setattr(tune, "_wall", lambda: wall[0])
    monkeypatch.setattr(tune, "_cpu_seconds", lambda: wall[0] * torch.get_num_threads())  # a quiet machine
    verdicts: list[Any] = []

    def run_rung(self: Bench, rung: Rung, batch_size: int | None = None, *, stop: Any = None) -> RungResult:
        stop(1, [])
        wall[0] += 200.0
        verdicts.append(stop(3, [100.0, 100.0]))  # two timed steps of 100 s: far slower than the best
        return fake(self, rung, batch_size, stop=stop)

    monkeypatch.setattr(Bench, "run_rung", run_rung)
    tuner = Tuner(tune_config(train_data, tmp_path / "t", warmup=1))
    tuner.best = (Rung("b", ""), RungResult(name="b", what="", step_time_s=1.0, step_time_p90_s=1.0))
    tuner.measure("compile", Rung("slow start", "", {"compile": True, "use_amp": True, "batch_size": 4}),
                  prunable=prunable)
    assert (verdicts[0] is not None and verdicts[0][0] == "pruned") is prunable
