"""gptopt bench: rung selection, the results contract, loss checks, out-of-memory rungs, reports.

    pytest -q tests/test_bench.py
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import exit_status, last_json_line

from gptopt import cli
from gptopt.bench import ladder, report
from gptopt.bench.ladder import Bench, select_rungs
from gptopt.config import BenchConfig, TrainConfig
from gptopt.runtime import device, memory_check


def bench_args(data: Path, out: Path, rungs: str, *extra: str) -> list[str]:
    return ["bench", "--preset", "debug", "--seq_len", "32", "--batch_size", "4", "--warmup", "1", "--device", "cpu",
            "--data_dir", str(data), "--output_dir", str(out), "--rungs", rungs, *extra]


def test_default_ladder_is_the_playbook_order() -> None:
    assert [r.name for r in select_rungs("default")] == ["hf", "eager", "sdpa", "amp", "compile", "compile_amp", "all"]
    assert [r.name for r in select_rungs("eager,ckpt,eager")] == ["eager", "ckpt"]
    assert "batch_sweep" in [r.name for r in select_rungs("all")]


def test_unknown_rung_lists_the_valid_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as e:
        select_rungs("eager,turbo")
    for name in ("hf", "compile_amp", "ckpt", "batch_sweep"):
        assert name in str(e.value)
    assert cli.main(bench_args(tmp_path, tmp_path / "o", "turbo")) == 2
    assert "unknown rung 'turbo'" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("rungs", ["", " , "])
def test_rungs_naming_no_rung_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, rungs: str
) -> None:
    out = tmp_path / "b"
    assert cli.main(["bench", "--mode", mode, "--device", "cpu", "--data_dir", str(tmp_path / "no_data"),
                     "--output_dir", str(out), "--rungs", rungs]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--rungs {rungs!r} names no rung" in err[0]
    assert "valid rungs: " in err[0] and ("eager" if mode == "train" else "kv") in err[0]
    assert not out.exists() and not (tmp_path / "no_data").exists()


@pytest.mark.parametrize("argv, context", [
    (["--preset", "debug", "--seq_len", "100"], "64 (preset debug)"),
    (["--seq_len", "100000"], "256 (preset tiny)"),  # the CPU's default preset
    (["--mode", "infer", "--preset", "debug", "--seq_len", "65"], "64 (preset debug)"),
    (["--mode", "quality", "--preset", "debug", "--seq_len", "100", "--target_loss", "5", "--seeds", "1",
      "--recipes", "adamw"], "64 (preset debug)"),
])
def test_a_seq_len_beyond_the_models_context_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], context: str
) -> None:
    """As train refuses it: not measured at the context and written into best.toml as if that had been asked."""
    out = tmp_path / "b"
    assert exit_status(["bench", "--device", "cpu", "--data_dir", str(tmp_path / "no_data"), "--output_dir", str(out),
                        *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    n, c = argv[argv.index("--seq_len") + 1], context.split()[0]
    said = f"--seq_len {n} exceeds the model's context {context}: use --seq_len {c} or less"
    assert len(err) == 1 and err[0].endswith(said)
    assert not out.exists() and not (tmp_path / "no_data").exists()  # nothing written, no data read or prepared


def test_unknown_preset_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--preset", "gpt3"])
    assert e.value.code == 2
    assert "gpt2-medium" in capsys.readouterr().err


def force_bf16_policy(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    """The CPU policy of a machine with (True: bf16 autocast) or without (False: fp32) native bf16."""
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: fast)


def test_bench_writes_the_contract_and_a_best_toml_train_accepts(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    force_bf16_policy(monkeypatch, True)  # the amp rung changes something, so every rung is measured
    out = tmp_path / "b"
    assert cli.main(bench_args(train_data, out, "hf,eager,sdpa,amp", "--json")) == 0
    stdout = capsys.readouterr().out
    last = last_json_line(stdout)
    results = json.loads((out / "results.json").read_text())
    assert last["rungs"] == json.loads(json.dumps(results["rungs"]))
    # the matmul peak measured here, or a rung faster than it (bf16 emulated where the CPU has none)
    assert results["peak_flops"] > 0 and "measured matmul peak" in results["peak_source"]
    names = [r["name"] for r in results["rungs"]]
    assert names == ["hf", "eager", "sdpa", "amp"]
    for r in results["rungs"]:
        for key in ("name", "tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes", "loss", "loss_ok",
                    "speedup_vs_baseline"):
            assert key in r, key
        assert r["status"] == "ok" and r["loss_ok"] is True
        assert len(r["step_times_s"]) == 10
        assert r["step_time_p10_s"] <= r["step_time_s"] <= r["step_time_p90_s"]
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
    assert results["rungs"][0]["speedup_vs_baseline"] == 1.0
    # identical weights and batches: gptopt's eager fp32 rung computes the HF baseline's loss
    assert results["rungs"][1]["loss"] == pytest.approx(results["rungs"][0]["loss"], rel=1e-4)
    for f in ("report.md", "results.csv", "best.toml"):
        assert (out / f).is_file()
    assert "## Recommendation" in (out / "report.md").read_text()
    # best.toml is a config `gptopt train` takes as it is
    parser = cli.build_parser("train", TrainConfig)
    cfg = cli.parse_config("train", TrainConfig, ["--config", str(out / "best.toml")], parser)
    best = next(r for r in results["rungs"] if r["name"] == results["best"])
    assert (cfg.use_amp, cfg.attention, cfg.batch_size) == (best["config"]["use_amp"], best["config"]["attention"], 4)
    assert results["best"] != "hf"  # the baseline is never the recommendation
    assert cli.main(["train", "--config", str(out / "best.toml"), "--output_dir", str(tmp_path / "t"),
                     "--max_steps", "2", "--sample_tokens", "0", "--no-tensorboard"]) == 0


def test_best_toml_is_the_config_the_winning_rung_trained_under(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gptopt train --config best.toml` is the winning rung's run: its model, data, length, seed and device."""
    trained: list[TrainConfig] = []  # what each measured rung's step got, in the ladder's order
    real_step = ladder.TrainStep
    monkeypatch.setattr(ladder, "TrainStep", lambda model, raw, plan, cfg, *a: (trained.append(cfg),
                                                                              real_step(model, raw, plan, cfg, *a))[1])
    out = tmp_path / "b"
    assert cli.main(bench_args(train_data, out, "eager,sdpa", "--seed", "7")) == 0
    results = json.loads((out / "results.json").read_text())
    winner = trained[[r["name"] for r in results["rungs"]].index(results["best"])]
    loaded = cli.parse_config("train", TrainConfig, ["--config", str(out / "best.toml")],
                              cli.build_parser("train", TrainConfig))
    assert loaded == winner
    assert (loaded.preset, loaded.data_dir, loaded.seq_len, loaded.seed, loaded.device) == \
        ("debug", str(train_data), 32, 7, "cpu")


def test_a_rung_trains_under_every_train_option_it_overrides_and_best_toml_keeps_them(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rung is TrainConfig fields over the bench's base: any of train's options, carried under its own name."""
    trained: list[TrainConfig] = []
    real_step = ladder.TrainStep
    monkeypatch.setattr(ladder, "TrainStep", lambda model, raw, plan, cfg, *a: (trained.append(cfg),
                                                                              real_step(model, raw, plan, cfg, *a))[1])
    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"))
    bench = Bench(cfg)
    rung = ladder.Rung("no_decay", "no weight decay, a short warmup, another learning rate",
                       {**ladder.NAIVE, "weight_decay": 0.0, "warmup_steps": 5, "grad_clip": 0.5,
                        "learning_rate": 2e-3})
    summary = bench.run([rung])
    (ran,) = trained
    # what train makes of those options: min_lr too follows the rung's learning rate
    assert ran == TrainConfig(preset="debug", data_dir=str(train_data), seq_len=32, batch_size=4, seed=cfg.seed,
                              device="cpu", **rung.overrides, persistent_workers=False, loss="full")
    assert ran.min_lr == pytest.approx(2e-4)
    out = tmp_path / "b"
    out.mkdir()
    report.write_all(summary, out, ladder.best_train_config(summary))
    loaded = cli.parse_config("train", TrainConfig, ["--config", str(out / "best.toml")],
                              cli.build_parser("train", TrainConfig))
    assert loaded == ran and (loaded.weight_decay, loaded.warmup_steps, loaded.grad_clip) == (0.0, 5, 0.5)


def test_no_rung_claims_more_than_the_peak(train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peaks measured low at both moments (a slow machine): the fastest rung's rate is the peak then, so no
    rung's MFU exceeds 1, and the report says which rate it took."""
    monkeypatch.setattr(device, "measured_matmul_flops", lambda dev, dtype, remeasure=False: 1e6)
    out = tmp_path / "b"
    assert cli.main(bench_args(train_data, out, "eager,sdpa")) == 0
    results = json.loads((out / "results.json").read_text())
    assert max(r["mfu"] for r in results["rungs"]) == pytest.approx(1.0)
    assert all(r["mfu"] <= 1.0 for r in results["rungs"])
    assert "the fastest rung" in results["peak_source"] and "was low" in results["peak_source"]


def test_plots_are_written_with_the_plot_extra(train_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert cli.main(bench_args(train_data, tmp_path / "b", "eager,sdpa")) == 0
    for name in ("throughput.png", "memory.png", "step_times.png"):
        assert (tmp_path / "b" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_second_bench_into_the_same_folder_is_refused_before_measuring(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "b"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli.main(bench_args(train_data, out, "eager")) == 0
    first = (out / "results.json").read_text()
    capsys.readouterr()

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before the output folder was checked")

    with monkeypatch.context() as m:
        m.setattr(ladder, "Bench", no_measuring)
        assert cli.main(bench_args(train_data, out, "eager")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass --overwrite" in err and "--output_dir" in err
    assert (out / "results.json").read_text() == first
    # The inference ladder's report goes beside the training ladder's: no conflict, nothing to overwrite.
    report.check_output_dir(out, "infer", overwrite=False)

    # --overwrite: a failure while the new report is written puts the old one back ...
    def disk_full(*args: object) -> None:
        (out / "results.json").write_text("half")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(report, "_write_all", disk_full)
        with pytest.raises(OSError):
            ladder.main(BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu",
                                    data_dir=str(train_data), output_dir=str(out), rungs="eager", overwrite=True))
    assert (out / "results.json").read_text() == first
    # ... and a finished one replaces gptopt's files only.
    assert cli.main(bench_args(train_data, out, "eager", "--overwrite")) == 0
    assert (out / "results.json").read_text() != first and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".gptopt-output.json"]


def test_a_rung_that_computes_something_else_fails_the_loss_check(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = Bench._build

    def build(self: Bench, rung: ladder.Rung, attention: str) -> torch.nn.Module:
        model = real_build(self, rung, attention)
        if rung.name == "amp":  # a "fast" rung that silently breaks the model
            with torch.no_grad():
                model.transformer.wte.weight.mul_(30.0)
        return model

    monkeypatch.setattr(Bench, "_build", build)
    force_bf16_policy(monkeypatch, True)  # under the fp32 policy the amp rung is sdpa's step and is not run
    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"), rungs="eager,sdpa,amp")
    bench = Bench(cfg)
    summary = bench.run(select_rungs(cfg.rungs))
    amp = next(r for r in summary["rungs"] if r["name"] == "amp")
    assert amp["loss_ok"] is False and amp["status"] == "failed" and "departs" in amp["note"]
    assert summary["best"] in ("eager", "sdpa")


@pytest.mark.policy
def test_the_all_rung_takes_the_device_attention_unless_its_rung_failed(train_data: Path, tmp_path: Path) -> None:
    # On CPUs SDPA's flash kernel can win the eager fp32 rungs and still lose the compiled bf16 step:
    # `all` follows the device policy (what `gptopt train --attention auto` runs), not that ranking:
    # eager attention where its autocast is bf16 (a CPU with native bf16), SDPA where it stays fp32.
    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"))
    bench = Bench(cfg)
    all_rung = next(r for r in ladder.LADDER if r.name == "all")

    def after(**status: str) -> str:
        bench.results = [SimpleNamespace(name=name, status=s) for name, s in status.items()]
        return bench.config(all_rung).attention

    bf16 = bench.config(all_rung).use_amp  # the CPU policy: bf16 autocast where the CPU has it natively
    own, other = ("eager", "sdpa") if bf16 else ("sdpa", "eager")
    assert after(eager="ok", sdpa="ok") == own
    assert after(**{own: "oom", other: "ok"}) == other  # the policy's kernel did not fit: the other one
    assert after(eager="oom", sdpa="oom") == own


def test_out_of_memory_rung_is_reported_and_the_bench_goes_on(
    train_data: Path, tmp_path: Path, break_forward: Callable[..., None]
) -> None:
    break_forward(lambda model, idx: model.config.attention == "sdpa" and model.training)
    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"), rungs="eager,sdpa")
    summary = Bench(cfg).run(select_rungs(cfg.rungs))
    status = {r["name"]: (r["status"], r["note"]) for r in summary["rungs"]}
    assert status["sdpa"][0] == "oom" and "out of memory at micro-batch 4" in status["sdpa"][1]
    assert status["eager"][0] == "ok" and summary["best"] == "eager"


def test_a_rung_estimated_not_to_fit_is_reported_before_it_allocates_and_the_bench_goes_on(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"), rungs="eager,sdpa")
    bench = Bench(cfg)
    # the full loss named: under auto a rung whose full logits do not fit would train on the chunked loss
    chosen = [r.but(r.name, r.what, loss="full") for r in select_rungs(cfg.rungs)]
    eager, sdpa = (bench.memory_estimate(bench.config(r)).total for r in chosen)
    assert sdpa < eager  # eager attention keeps its scores
    # free memory between the two: eager's estimate is over it, sdpa's under
    free = int((sdpa + eager) / 2 / memory_check.REFUSE_ABOVE)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (free, "available RAM"))
    built: list[str] = []
    real_build = Bench._build
    monkeypatch.setattr(Bench, "_build", lambda self, rung, cfg: (built.append(rung.name),
                                                                   real_build(self, rung, cfg))[1])
    summary = bench.run(chosen)
    rungs = {r["name"]: r for r in summary["rungs"]}
    assert built == ["sdpa"]  # the refused rung allocated nothing
    note = rungs["eager"]["note"]
    assert rungs["eager"]["status"] == "oom" and "out of memory at micro-batch 4 (estimated, not run)" in note
    assert f"needs about {memory_check.gib(eager)}" in note and f"but {memory_check.gib(free)} is available RAM" in note
    assert rungs["sdpa"]["status"] == "ok" and summary["best"] == "sdpa"


def test_an_absurd_batch_is_reported_out_of_memory_not_killed(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "b"
    args = bench_args(train_data, out, "eager,sdpa", "--json")
    # within the static limit (config.MAX_BATCH); 64 MiB free cannot hold it, as a real machine could not hold
    # a step that needs more than its RAM: the estimate refuses it before anything is allocated
    args[args.index("--batch_size") + 1] = "4096"
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (64 * 2**20, "available RAM"))
    assert cli.main(args) == 1  # no rung ran, so there is no best
    results = json.loads((out / "results.json").read_text())
    assert [(r["name"], r["status"]) for r in results["rungs"]] == [("eager", "oom"), ("sdpa", "oom")]
    assert all("GiB" in r["note"] and "estimated, not run" in r["note"] for r in results["rungs"])
    assert "estimated, not run" in capsys.readouterr().out


def test_missing_hf_extra_skips_the_baseline_with_the_install_line(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ladder, "has", lambda module: module != "transformers")
    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"), rungs="hf,eager")
    summary = Bench(cfg).run(select_rungs(cfg.rungs))
    hf = summary["rungs"][0]
    assert hf["status"] == "skipped" and "pip install 'gptopt[hf]'" in hf["note"]
    assert summary["baseline"] == "eager"


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_a_rung_the_device_policy_makes_identical_is_reported_not_measured(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    fast_bf16: bool,
) -> None:
    force_bf16_policy(monkeypatch, fast_bf16)
    measured: list[str] = []
    real_run_rung = Bench.run_rung

    def run_rung(self: Bench, rung: ladder.Rung, *args: Any, **kw: Any) -> ladder.RungResult:
        measured.append(rung.name)
        return real_run_rung(self, rung, *args, **kw)

    monkeypatch.setattr(Bench, "run_rung", run_rung)
    out = tmp_path / "b"
    assert cli.main(bench_args(train_data, out, "sdpa,amp")) == 0
    printed = capsys.readouterr().out
    amp = json.loads((out / "results.json").read_text())["rungs"][1]
    if fast_bf16:  # bf16 autocast: a different step, measured and compared
        assert measured == ["sdpa", "amp"]
        assert amp["status"] == "ok" and amp["speedup_vs_baseline"] is not None and amp["same_as"] is None
        return
    # fp32 policy: autocast would change nothing, so the rung is sdpa's step again
    assert measured == ["sdpa"]
    said = "identical to sdpa on this device (autocast resolves to fp32)"
    assert amp["status"] == "identical" and amp["same_as"] == "sdpa" and said in amp["note"]
    assert amp["tokens_per_s"] is None and amp["speedup_vs_baseline"] is None and amp["speedup_vs_previous"] is None
    assert said in printed and said in (out / "report.md").read_text()
    amp_row = next(line for line in printed.splitlines() if line.startswith("amp "))
    assert "x" not in amp_row.replace("identical", "")  # no speedup column filled in


def test_an_interrupt_during_dynamos_first_import_stays_an_interrupt(
        train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.machinery
    import sys
    import types

    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"), rungs="eager")
    bench = Bench(cfg)
    # What a Ctrl-C leaves when it lands while torch first imports torch._dynamo: a module in
    # sys.modules, still initialising, without reset().
    half = types.ModuleType("torch._dynamo")
    half.__spec__ = importlib.machinery.ModuleSpec("torch._dynamo", None)
    half.__spec__._initializing = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo", half)
    monkeypatch.setattr(torch, "_dynamo", half, raising=False)

    def interrupted(*args: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Bench, "_build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.run_rung(select_rungs("eager")[0])


def test_rungs_list_prints_every_rung(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--rungs", "list"]) == 0
    out = capsys.readouterr().out
    for r in ladder.LADDER + ladder.OPTIONAL:
        assert r.name in out


@pytest.mark.slow
def test_the_default_ladder_with_compiled_rungs(train_data: Path, tmp_path: Path) -> None:
    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(tmp_path / "b"), rungs="default")
    summary = Bench(cfg).run(select_rungs(cfg.rungs))
    # identical: an amp rung where autocast resolves to fp32 (a CPU without native bf16), reported, not re-measured
    assert all(r["status"] in ("ok", "skipped", "identical") for r in summary["rungs"]), summary["rungs"]
    assert any(r["status"] == "ok" and r["name"].startswith("compile") for r in summary["rungs"])
    assert summary["best"] is not None


def test_the_report_goes_to_the_folder_that_was_checked(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--output_dir ~/b`: the folder whose old report --overwrite sets aside is the one the new report goes to."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert cli.main(bench_args(train_data, Path("~/b"), "eager")) == 0
    assert cli.main(bench_args(train_data, Path("~/b"), "eager", "--overwrite")) == 0
    assert (tmp_path / "home" / "b" / "report.md").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []


def test_ctrl_c_keeps_the_rungs_measured_so_far(train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A long ladder stopped by Ctrl-C (or a time limit's SIGINT) still writes its report: the rungs
    measured before it with their figures, the rest marked as not measured."""
    real = Bench.run_rung

    def stop_at_sdpa(self: Bench, rung: ladder.Rung) -> ladder.RungResult:
        if rung.name == "sdpa":
            raise KeyboardInterrupt
        return real(self, rung)

    monkeypatch.setattr(Bench, "run_rung", stop_at_sdpa)
    out = tmp_path / "b"
    assert cli.main(bench_args(train_data, out, "eager,sdpa,amp", "--json")) == 130
    summary = json.loads((out / "results.json").read_text())
    assert last_json_line(capsys.readouterr().out) == summary
    status = {r["name"]: (r["status"], r["note"]) for r in summary["rungs"]}
    assert status["eager"][0] == "ok" and summary["rungs"][0]["tokens_per_s"] > 0
    assert status["sdpa"] == status["amp"] == ("skipped", ladder.STOPPED)


def test_sigterm_stops_the_ladder_as_ctrl_c_does_and_exits_143(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler's SIGTERM mid-ladder: the report of the rungs measured so far is written, and the exit code says
    which signal stopped it."""
    import os
    import signal
    import time

    def unhandled(signum: int, frame: Any) -> None:
        raise AssertionError("SIGTERM reached the test's own handler: bench did not handle it")

    signal.signal(signal.SIGTERM, unhandled)  # the test runner's process outlives a bench that does not handle it
    real = Bench.run_rung

    def term_at_sdpa(self: Bench, rung: ladder.Rung) -> ladder.RungResult:
        if rung.name == "sdpa":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode, well within this
        return real(self, rung)

    monkeypatch.setattr(Bench, "run_rung", term_at_sdpa)
    out = tmp_path / "b"
    assert cli.main(bench_args(train_data, out, "eager,sdpa,amp")) == 143
    status = {r["name"]: r["status"] for r in json.loads((out / "results.json").read_text())["rungs"]}
    assert status == {"eager": "ok", "sdpa": "skipped", "amp": "skipped"}


def test_building_a_ladder_sets_no_process_switch(train_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TF32 is the command's to set where it starts (bench/main.py, tune): a ladder built in a notebook or by tune
    leaves torch's matmul precision as its caller had it, even on a device whose plan chooses TF32."""
    import dataclasses

    from gptopt.bench import setup

    real = setup.resolve
    monkeypatch.setattr(setup, "resolve", lambda *a, **k: dataclasses.replace(real(*a, **k), tf32=True))
    had = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        setup.Setup.from_config(BenchConfig(data_dir=str(train_data), device="cpu", preset="debug"))
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(had)
