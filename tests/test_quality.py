"""Time to quality: train --target_loss, --lr_decay_steps, --align_documents, and bench --mode quality.

    pytest -q tests/test_quality.py
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import last_json_line

from gptopt import cli
from gptopt.bench import quality
from gptopt.commands import train as train_cmd
from gptopt.config import BenchConfig, GPTConfig, TrainConfig, arch_overrides, preset
from gptopt.data import loader as data
from gptopt.infer.measure import STOPPED
from gptopt.models import checkpoint
from gptopt.train import validation
from gptopt.train.metrics import Progress

FAST = dict(preset="debug", seq_len=32, batch_size=4, device="cpu", sample_tokens=0, tensorboard=False,
            log_interval=1, warmup_steps=2, learning_rate=3e-3, save_interval=0)


def run(data_dir: Path, out: Path, **kw: Any) -> int:
    return train_cmd.main(TrainConfig(data_dir=str(data_dir), output_dir=str(out), **{**FAST, **kw}))


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evals(out: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records(out) if "val_loss" in r}


@pytest.fixture(scope="module")
def curve(train_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The val losses of the debug run every target test trains (same seed, same steps: same losses)."""
    out = tmp_path_factory.mktemp("curve") / "run"
    assert run(train_data, out, max_steps=40, eval_interval=5) == 0
    return evals(out)


def test_training_stops_at_the_first_evaluation_at_or_below_the_target(
        train_data: Path, tmp_path: Path, curve: dict[int, float]) -> None:
    target = curve[10] + 1e-6  # first reached at step 10 (the curve falls there)
    assert curve[5] > target
    out = tmp_path / "run"
    assert run(train_data, out, max_steps=40, eval_interval=5, target_loss=target) == 0
    info = json.loads((out / "run.json").read_text())
    t = info["target"]
    assert t["reached"] and t["loss"] == target and t["steps_to_target"] == 10 and t["val_loss"] <= target
    assert t["tokens_to_target"] == 10 * 4 * 32  # steps x micro-batch x seq_len
    steps = [r for r in records(out) if "step_time_s" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))  # it stopped there
    # the training steps' wall time, evals left out: the logged step times summed; without the first step
    assert t["time_to_target_s"] == pytest.approx(sum(r["step_time_s"] for r in steps), rel=1e-9)
    excl = t["time_to_target_s"] - steps[0]["step_time_s"]
    assert t["time_to_target_excl_compile_s"] == pytest.approx(excl, rel=1e-9)
    assert any(r.get("target") == t for r in records(out))  # metrics.jsonl says the same
    assert info["summary"]["step"] == 10 and info["summary"]["best_val_loss"] == t["val_loss"]
    assert checkpoint.latest_checkpoint(out).name.endswith("10")  # the model that reached it is saved


def test_a_target_not_reached_reports_the_best_val_loss_and_evaluations_come_without_an_interval(
        train_data: Path, tmp_path: Path, curve: dict[int, float]) -> None:
    out = tmp_path / "run"
    assert run(train_data, out, max_steps=30, target_loss=0.01) == 0  # no --eval_interval: derived from the run
    assert sorted(evals(out)) == [10, 20, 30]
    t = json.loads((out / "run.json").read_text())["target"]
    assert t == {"loss": 0.01, "reached": False, "time_to_target_s": None, "time_to_target_excl_compile_s": None,
                 "tokens_to_target": None, "steps_to_target": None, "best_val_loss": min(evals(out).values())}


def test_the_time_to_target_spans_a_resume(train_data: Path, tmp_path: Path, curve: dict[int, float]) -> None:
    out = tmp_path / "run"
    assert run(train_data, out, max_steps=40, max_tokens=5 * 4 * 32, eval_interval=5) == 0  # the schedule of 40
    target = curve[10] + 1e-6
    assert run(train_data, out, max_steps=40, eval_interval=5, target_loss=target, resume="auto") == 0
    t = json.loads((out / "run.json").read_text())["target"]
    steps = [r for r in records(out) if "step_time_s" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert t["steps_to_target"] == 10
    assert t["time_to_target_s"] == pytest.approx(sum(r["step_time_s"] for r in steps), rel=1e-9)
    # each process's first step (the compile, the warm-up) is left out of the other figure
    firsts = steps[0]["step_time_s"] + steps[5]["step_time_s"]
    assert t["time_to_target_excl_compile_s"] == pytest.approx(t["time_to_target_s"] - firsts, rel=1e-9)


def test_a_target_without_evaluations_is_refused(train_data: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--data_dir", str(train_data), "--output_dir", str(tmp_path / "x"), "--target_loss", "3",
            "--eval_interval", "0"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "--eval_interval 0" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_lr_decay_steps_ends_the_cosine_early_and_stays_at_min_lr(train_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run(train_data, out, max_steps=16, eval_interval=0, lr_decay_steps=8, min_lr=3e-4) == 0
    lrs = {r["step"]: r["lr"] for r in records(out) if "lr" in r}  # the lr of step s is logged as s + 1
    assert lrs[5] > lrs[7] > 3e-4
    assert all(lrs[s] == pytest.approx(3e-4) for s in range(9, 17))


def test_aligned_windows_start_at_document_boundaries(train_data: Path) -> None:
    tokens_data = data.open_data(train_data)
    eot = tokens_data.eot_id
    ds = data.BatchDataset(tokens_data, "train", 8, 32, seed=0, align=True)
    tokens = np.asarray(tokens_data.tokens("train"))
    starts = ds.document_starts()
    assert starts[0] == 0 and all(tokens[s] == eot for s in starts[1:]) and len(starts) >= 3
    for step in range(5):
        x, y = ds[step]
        assert all(int(row[0]) == eot or np.array_equal(row.numpy(), tokens[:32]) for row in x)
        assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    # the same batches in a DataLoader worker (the dataset is pickled there)
    assert all((pickle.loads(pickle.dumps(ds))[s][0] == ds[s][0]).all() for s in range(3))
    plain = data.BatchDataset(tokens_data, "train", 8, 32, seed=0)
    assert not all(int(row[0]) == eot for step in range(5) for row in plain[step][0])  # anywhere, without align


def test_align_documents_needs_end_of_text_tokens(tmp_path: Path) -> None:
    d = tmp_path / "nanogpt"
    d.mkdir()
    for split in ("train", "val"):
        np.arange(5000, dtype=np.uint16).tofile(d / f"{split}.bin")  # nanoGPT shards: no tokenizer, no eot
    with pytest.raises(ValueError, match="end-of-text"):
        data.BatchDataset(data.open_data(d), "train", 4, 32, seed=0, align=True)


# -- bench --mode quality ---------------------------------------------------------------------------


def _fake(ladder: quality.Ladder, recipe: str, times: list[float], steps: int = 100) -> None:
    flags = ladder.flags.get(recipe, {})
    for i, t in enumerate(times):
        config = TrainConfig(preset=ladder.preset, seed=ladder.seeds[i], target_loss=ladder.target, **flags)
        ladder.runs.append(quality.Run(recipe, ladder.seeds[i], flags, Path("x"), reached=True,
                                       time_s=t, time_excl_compile_s=t - 1, tokens=steps * 64, steps=steps,
                                       best_val_loss=4.9, config=dataclasses.asdict(config)))


def test_the_ladder_reports_ratios_and_welchs_test_against_adamw(tmp_path: Path) -> None:
    pytest.importorskip("scipy", reason="the stats extra")
    cfg = BenchConfig(mode="quality", preset="tiny", output_dir=str(tmp_path), device="cpu", target_loss=5.0,
                      recipes="adamw,muon,aligned,schedule,best")
    ladder = quality.Ladder(cfg)
    assert ladder.names == ["adamw", "muon", "aligned", "schedule", "best"] and ladder.seeds == [1337, 1338, 1339]
    adamw = quality.CHANGES["adamw"][1]
    _fake(ladder, "adamw", [20.0, 21.0, 22.0], steps=300)
    _fake(ladder, "muon", [10.0, 11.0, 12.0])
    _fake(ladder, "aligned", [30.0, 31.0, 35.0])
    assert ladder._derive("schedule") == {**adamw, "lr_decay_steps": 300}  # the baseline's rates and warmup kept
    ladder.flags["schedule"] = ladder._derive("schedule")
    _fake(ladder, "schedule", [15.0, 16.0, 17.0], steps=200)
    best = ladder._derive("best")  # muon and schedule beat AdamW; aligned did not
    # muon's rates, and the decay ending at muon's steps after muon's own short warmup
    assert best == {**quality.CHANGES["muon"][1], "lr_decay_steps": 100}
    ladder.flags["muon"] = {"optimizer": "muon"}  # with train's warmup of 100, that does not fit before it: half
    assert ladder._derive("best") == {**adamw, "optimizer": "muon", "lr_decay_steps": 100, "warmup_steps": 50}
    # AdamW quicker than twice train's warmup: schedule's own runs warm up for half its decay, Muon's stays
    ladder.flags["muon"] = quality.CHANGES["muon"][1]
    ladder.flags["schedule"] = {"lr_decay_steps": 150, "warmup_steps": 75}
    assert ladder._derive("best") == {**quality.CHANGES["muon"][1], "lr_decay_steps": 100}
    s = ladder.summary()
    by = {r["recipe"]: r for r in s["recipes"]}
    assert by["muon"]["vs_adamw"] == pytest.approx(11 / 21) and by["aligned"]["vs_adamw"] == pytest.approx(32 / 21)
    assert by["adamw"]["minutes_mean"] == pytest.approx(21 / 60) and by["adamw"]["minutes_sd"] == pytest.approx(1 / 60)
    assert s["best"] == "muon"
    w = s["welch"]
    assert w["recipe"] == "muon" and w["t"] == pytest.approx(-10 / (2 / 3) ** 0.5)  # (11 - 21) / sqrt(1/3 + 1/3)
    assert w["p_value"] < 0.001 and w["significant"]
    toml = quality.best_toml(s)
    assert toml is not None and 'optimizer = "muon"' in toml and "target_loss = 5.0" in toml


def test_best_leaves_out_a_change_ahead_of_adamw_by_noise(tmp_path: Path) -> None:
    """The seconds a real ladder recorded (2026-12-04 21:07 UTC): the schedule's mean was ahead of AdamW's by
    noise alone, far from significance, and ending Muon's decay at its own steps then cost it steps. Best is
    Muon's recipe alone."""
    pytest.importorskip("scipy", reason="the stats extra")
    cfg = BenchConfig(mode="quality", preset="tiny", output_dir=str(tmp_path), device="cpu",
                      recipes="adamw,muon,schedule,best")
    ladder = quality.Ladder(cfg)
    _fake(ladder, "adamw", [58.5, 63.3, 63.3], steps=240)
    _fake(ladder, "muon", [40.9, 38.6, 40.7], steps=120)
    ladder.flags["schedule"] = ladder._derive("schedule")
    _fake(ladder, "schedule", [54.0, 61.4, 64.6], steps=240)
    assert ladder._derive("best") == quality.CHANGES["muon"][1]
    assert ladder._beats("muon") and not ladder._beats("schedule")


def test_when_nothing_beats_adamw_adamw_stays_the_recommendation(tmp_path: Path) -> None:
    cfg = BenchConfig(mode="quality", preset="tiny", output_dir=str(tmp_path), device="cpu", recipes="adamw,muon")
    ladder = quality.Ladder(cfg)
    _fake(ladder, "adamw", [20.0, 21.0, 22.0])
    _fake(ladder, "muon", [21.0, 22.0, 23.0])  # fewer steps, slower steps: later to the target
    s = ladder.summary()
    assert s["best"] is None and s["welch"] is None and quality.best_toml(s) is None
    assert "the best recipe is AdamW" in quality.markdown(s, [], None)


def test_a_recipe_gives_up_at_1_5x_adamws_steps_on_the_same_schedule(tmp_path: Path) -> None:
    """A recipe that never reaches the target (aligned windows on the stdlib corpus) stops at 1.5x AdamW's
    steps on its seed instead of running the whole cap; its learning rate still decays over the cap, as
    AdamW's did, so up to there it trains as it would have."""
    cfg = BenchConfig(mode="quality", preset="tiny", output_dir=str(tmp_path), device="cpu", seeds=2)
    ladder = quality.Ladder(cfg)
    _fake(ladder, "adamw", [20.0], steps=115)  # seed 1337 only: AdamW has not run seed 1338 yet

    def argv(recipe: str, seed: int) -> dict[str, str]:
        run = quality.Run(recipe, seed, ladder.flags.get(recipe, {}), tmp_path / "r", ladder._cap(recipe, seed))
        args = quality.train_argv(cfg, run, 4.2, ladder.max_steps, None, ladder.sizes)[4:]  # after "-m gptopt train"
        return {a: b for a, b in zip(args, [*args[1:], ""], strict=True) if a.startswith("--")}

    ladder.flags["aligned"] = {"align_documents": True}  # a recipe without a decay of its own
    aligned = argv("aligned", 1337)
    assert aligned["--max_steps"] == "173" and aligned["--lr_decay_steps"] == "1000"
    assert argv("aligned", 1338)["--max_steps"] == "1000"  # no AdamW figure for that seed: the cap stands
    assert argv("adamw", 1337)["--max_steps"] == "1000"
    ladder.flags["schedule"] = {"lr_decay_steps": 115, "warmup_steps": 57}  # a recipe's own decay is kept
    assert argv("schedule", 1337)["--lr_decay_steps"] == "115"
    ladder.runs[0].reached = False  # AdamW missed the target on that seed: nothing to measure a cap by
    assert argv("aligned", 1337)["--max_steps"] == "1000"


def test_a_cap_at_or_beyond_max_steps_is_no_cap_and_a_warmup_only_schedule_stays_so(tmp_path: Path) -> None:
    cfg = BenchConfig(mode="quality", preset="tiny", output_dir=str(tmp_path), device="cpu", max_steps=80)
    ladder = quality.Ladder(cfg)
    _fake(ladder, "adamw", [20.0], steps=60)  # 1.5 x 60 = 90 > 80: the run's own max_steps stops it first
    assert ladder._cap("aligned", 1337) is None
    ladder.runs[0].steps = 40
    ladder.flags["aligned"] = {"align_documents": True}  # train's warmup and no decay of its own
    run = quality.Run("aligned", 1337, ladder.flags["aligned"], tmp_path / "r", ladder._cap("aligned", 1337))
    args = quality.train_argv(cfg, run, 4.2, ladder.max_steps, None, ladder.sizes)
    # train's warmup (100) outlasts the 80 steps: no decay to keep, and no --lr_decay_steps that train refuses
    assert args[args.index("--max_steps") + 1] == "60" and "--lr_decay_steps" not in args
    train_cfg = cli.parse_config("train", TrainConfig, args[4:], cli.build_parser("train", TrainConfig))
    assert train_cfg.max_steps == 60 and train_cfg.align_documents  # what the child process would run


# The ladder of the end-to-end tests, run once: the training ladder's best.toml in its folder (step settings
# every run takes), seeds 7 and 8.
LADDER_ARGV = ["bench", "--mode", "quality", "--preset", "debug", "--seq_len", "32", "--batch_size", "4", "--device",
               "cpu", "--target_loss", "5.5", "--seeds", "2", "--seed", "7", "--recipes", "adamw,schedule",
               "--max_steps", "40"]
STEP_SETTINGS = 'attention = "sdpa"\nfused_optimizer = false\nnum_workers = 0\n'


@pytest.fixture(scope="module")
def ladder_out(train_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quality ladder's folder. Its schedule runs (after AdamW's) count at most half AdamW's fastest time, so
    that recipe wins whatever the machine's speed: train's defaults (lr 1e-3, warmup 100) get the debug model
    to 5.5 within 40 steps, every seed."""
    pytest.importorskip("scipy", reason="the stats extra")
    out = tmp_path_factory.mktemp("quality") / "bench"
    out.mkdir()
    (out / "best.toml").write_text(STEP_SETTINGS)
    real_read = quality.read_run
    adamw: list[float] = []

    def read_run(run: quality.Run) -> None:
        real_read(run)
        if run.recipe == "adamw" and run.time_s is not None:
            adamw.append(run.time_s)
        if run.recipe == "schedule" and run.time_s is not None:
            run.time_s = min(adamw) / (2 + run.seed % 2)  # two seeds, two times: Welch's test needs a spread

    with pytest.MonkeyPatch.context() as m:
        m.setattr(quality, "read_run", read_run)
        assert cli.main([*LADDER_ARGV, "--data_dir", str(train_data), "--output_dir", str(out)]) == 0
    return out


def test_the_ladder_end_to_end_trains_each_recipe_and_seed_and_writes_its_report(
        train_data: Path, ladder_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ladder_out
    res = json.loads((out / "quality_results.json").read_text())
    assert [(r["recipe"], r["seed"]) for r in res["runs"]] == [("adamw", 7), ("adamw", 8), ("schedule", 7),
                                                                ("schedule", 8)]
    # the decay ends at AdamW's median steps; train's warmup of 100 cut to half of them
    adamw_steps = sorted(r["steps_to_target"] for r in res["runs"] if r["recipe"] == "adamw")
    median = round(sum(adamw_steps) / 2)
    assert res["recipes"][1]["flags"] == {**quality.CHANGES["adamw"][1], "lr_decay_steps": median,
                                          "warmup_steps": median // 2}
    assert all(r["reached"] and r["steps_to_target"] is not None and r["curve"] for r in res["runs"])
    report = (out / "quality_report.md").read_text()
    assert "| adamw | 7 | yes |" in report and "native bf16" in report
    # again without --overwrite: refused before any training
    capsys.readouterr()
    before = (out / "quality_results.json").read_text()
    argv = [*LADDER_ARGV, "--data_dir", str(train_data), "--output_dir", str(out)]
    assert cli.main(argv) == 2 and "--overwrite" in capsys.readouterr().err
    assert (out / "quality_results.json").read_text() == before


def test_quality_best_toml_is_the_winning_recipes_run(train_data: Path, ladder_out: Path, tmp_path: Path) -> None:
    """`gptopt train --config quality_best.toml` trains what the winning recipe's run of the first seed trained:
    the same preset, data, seed, the training ladder's step settings, the recipe, its step cap and evaluations."""
    res = json.loads((ladder_out / "quality_results.json").read_text())
    assert res["best"] == "schedule"
    loaded = cli.parse_config("train", TrainConfig, ["--config", str(ladder_out / "quality_best.toml")],
                              cli.build_parser("train", TrainConfig))
    # the config that run's `gptopt train` process recorded, less where it wrote (a new run writes elsewhere)
    ran = json.loads((ladder_out / "runs" / "schedule-seed7" / "run.json").read_text())["config"]
    assert loaded == dataclasses.replace(TrainConfig(**ran), output_dir=TrainConfig().output_dir, overwrite=False)
    assert (loaded.preset, loaded.data_dir, loaded.seed, loaded.attention, loaded.target_loss) == \
        ("debug", str(train_data), 7, "sdpa", 5.5)
    assert cli.main(["train", "--config", str(ladder_out / "quality_best.toml"), "--output_dir", str(tmp_path / "t"),
                     "--max_steps", "2", "--no-tensorboard"]) == 0


def test_ctrl_c_keeps_the_runs_measured_so_far(train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A quality ladder stopped by Ctrl-C (or a time limit's SIGINT) still writes its report: the runs measured
    before it with their figures, the rest marked as not measured, and exit status 130."""

    def train(self: quality.Ladder, run: quality.Run, bar: object = None) -> None:
        if run.recipe != "adamw":  # Ctrl-C during the second run
            raise KeyboardInterrupt
        run.reached, run.time_s, run.steps, run.tokens = True, 20.0, 100, 12800

    monkeypatch.setattr(quality.Ladder, "_train", train)
    out = tmp_path / "b"
    argv = ["bench", "--mode", "quality", "--preset", "debug", "--device", "cpu", "--target_loss", "5.5",
            "--seeds", "1", "--recipes", "adamw,muon,aligned,best", "--data_dir", str(train_data),
            "--output_dir", str(out), "--json"]
    assert cli.main(argv) == 130
    summary = json.loads((out / "quality_results.json").read_text())
    assert last_json_line(capsys.readouterr().out) == summary
    runs = {r["recipe"]: r for r in summary["runs"]}
    assert runs["adamw"]["reached"] and runs["adamw"]["time_to_target_s"] == 20.0 and runs["adamw"]["skipped"] is None
    stopped = ("muon", "aligned", "best")
    assert [(n, runs[n]["skipped"]) for n in stopped] == [(n, STOPPED) for n in stopped]
    report = (out / "quality_report.md").read_text()
    assert f"| muon | 1337 | skipped: {STOPPED} |" in report and "| adamw | 1337 | yes |" in report
    assert summary["best"] is None and not (out / "quality_best.toml").exists()


def test_lr_decay_steps_sets_every_optimizer_groups_rate(tmp_path: Path) -> None:
    """Not only the logged lr: each parameter group the optimizer steps with (AdamW's and Muon's alike)."""
    import torch

    from gptopt.models.gpt import GPT
    from gptopt.runtime.device import resolve
    from gptopt.train.step import TrainStep

    cfg = TrainConfig(preset="debug", max_steps=16, lr_decay_steps=8, warmup_steps=2, learning_rate=3e-3,
                      min_lr=3e-4, optimizer="muon", device="cpu")
    model = GPT(preset("debug", vocab_size=64))
    ts = TrainStep(model, model, resolve("cpu", quiet=True), cfg)
    x = torch.randint(0, 64, (2, 8))
    ts(10, lambda micro: (x, x))
    # past step 8 every group sits at its own final rate (max_steps, 16, would still have it decaying)
    groups = ts.optimizer.param_groups
    assert len(groups) >= 2
    assert all(g["lr"] == pytest.approx(final) for g, (_, final) in zip(groups, ts.group_lrs, strict=True))


def test_a_decay_that_ends_inside_the_warmup_is_refused() -> None:
    with pytest.raises(ValueError, match="--lr_decay_steps"):
        TrainConfig(warmup_steps=100, lr_decay_steps=50)


def test_a_diverged_evaluation_neither_reaches_the_target_nor_becomes_the_best() -> None:
    progress = Progress()
    validation.record(progress, float("nan"), target_loss=3.0, metrics=None)
    assert progress.target is None and progress.best_val is None
    validation.record(progress, 2.5, target_loss=3.0, metrics=None)
    assert progress.target is not None and progress.best_val == 2.5


def test_resuming_a_run_that_reached_its_target_trains_no_further(
        train_data: Path, tmp_path: Path, curve: dict[int, float]) -> None:
    out = tmp_path / "run"
    target = curve[10] + 1e-6
    assert run(train_data, out, max_steps=40, eval_interval=5, target_loss=target) == 0
    first = json.loads((out / "run.json").read_text())["target"]
    assert run(train_data, out, max_steps=40, eval_interval=5, target_loss=target, resume="auto") == 0
    assert [r["step"] for r in records(out) if "step_time_s" in r] == list(range(1, 11))
    assert json.loads((out / "run.json").read_text())["target"] == first


@pytest.mark.parametrize("argv, problem", [
    (["--seeds", "5"], "add --mode quality"),
    (["--recipes", "muon"], "add --mode quality"),
    (["--target_loss", "4.0"], "add --mode quality"),
    (["--mode", "infer", "--seeds", "2"], "add --mode quality"),
    (["--mode", "quality", "--rungs", "kv"], "--mode quality takes --recipes"),
])
def test_a_ladders_options_given_to_another_ladder_are_refused_naming_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], problem: str) -> None:
    """An option another mode would ignore is refused before any work, not silently dropped."""
    with pytest.raises(SystemExit) as e:  # argparse's exit: the config is checked as the flags are read
        cli.main(["bench", "--output_dir", str(tmp_path / "b"), *argv])
    assert e.value.code == 2 and problem in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("spec", ["", " , "])
def test_recipes_naming_no_recipe_are_refused_before_anything_is_written(
        spec: str, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q"
    argv = ["bench", "--mode", "quality", "--preset", "debug", "--target_loss", "5", "--device", "cpu",
            "--data_dir", str(train_data), "--output_dir", str(out), "--recipes", spec]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "names no recipe" in err and "adamw" in err, err
    assert not out.exists()


def test_modern_is_the_speedrun_block_with_muon_and_each_ablation_takes_away_only_its_change(tmp_path: Path) -> None:
    """What `--recipes modern,no-rope,...` trains, as each run's `gptopt train` process reads its flags: the
    ablation's model and optimizer are modern's but for the one change it names."""
    cfg = BenchConfig(mode="quality", preset="tiny", output_dir=str(tmp_path), device="cpu", recipes="all")
    ladder = quality.Ladder(cfg)

    def trained(recipe: str) -> tuple[GPTConfig, TrainConfig]:
        run = quality.Run(recipe, 1337, ladder.flags[recipe], tmp_path / "r")
        args = quality.train_argv(ladder.cfg, run, 3.0, ladder.max_steps, None, ladder.sizes)[4:]
        train_cfg = cli.parse_config("train", TrainConfig, args, cli.build_parser("train", TrainConfig))
        return preset(train_cfg.preset, **arch_overrides(train_cfg.arch)), train_cfg

    model, opt = trained("modern")
    assert (model.positions, model.qk_norm, model.mlp, model.tie_embeddings, model.zero_init) == \
        ("rope", True, "relu2", False, True)
    assert opt.optimizer == "muon" and opt.use_amp and (opt.batch_size, opt.seq_len) == (16, 256)
    adamw_model, adamw = trained("adamw")
    assert adamw_model == preset("tiny") and adamw.optimizer == "adamw"
    changed = {"no-rope": {"positions"}, "no-qk_norm": {"qk_norm"}, "no-relu2": {"mlp"},
               "no-untied": {"tie_embeddings"}, "no-zero_init": {"zero_init"}, "no-muon": set()}
    assert set(changed) == set(quality.ABLATIONS) and all(n in ladder.names for n in changed)
    for name, fields in changed.items():
        m, o = trained(name)
        assert {f for f in m.to_dict() if getattr(m, f) != getattr(model, f)} == fields, name
        same_opt = dataclasses.replace(o, arch=opt.arch, output_dir=opt.output_dir)
        if name == "no-muon":  # AdamW at the baseline's rates, on modern's horizon
            assert o.optimizer == "adamw" and o.learning_rate == adamw.learning_rate
            assert o.warmup_steps == adamw.warmup_steps and o.lr_decay_steps == opt.lr_decay_steps
        else:
            assert same_opt == opt, name


def test_the_bar_shows_a_running_runs_latest_evaluation_even_while_a_line_is_being_written(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert quality._latest_eval(metrics) is None  # the run has not written yet
    metrics.write_text('{"step": 10, "loss": 5.1}\n{"step": 10, "val_loss": 5.0}\n{"step": 20, "loss": 4.8}\n'
                       '{"step": 20, "val_lo')
    assert quality._latest_eval(metrics) == (10, 5.0)
