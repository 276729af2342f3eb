"""benchmarks/adamw_sweep.py: AdamW's settings for a wall-time budget, each run's horizon the steps that fit it.

    pytest -q tests/test_adamw_sweep.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

adamw_sweep = load_script("adamw_sweep")


def _run(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr("sys.argv", ["adamw_sweep.py", *args])
    adamw_sweep.main()


def test_each_run_trains_the_steps_its_budget_buys_and_the_table_is_best_first(
        train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    # step times given (no timing runs): 0.06 s at 5 ms a step buys 12 steps, at 10 ms 6
    args = ["--data_dir", str(train_data), "--out", str(out), "--budget_s", "0.06", "--settings", "2x32,4x32",
            "--step_ms", "2x32=5,4x32=10", "--lrs", "3e-3", "--warmups", "2", "--eval_every", "3",
            "--eval_iters", "1", "--", "--preset", "debug", "--device", "cpu"]
    _run(monkeypatch, *args)
    rows = json.loads((out / "sweep.json").read_text())
    assert sorted((r["setting"], r["lr"]) for r in rows) == [("2x32", 3e-3), ("4x32", 3e-3)]
    for r in rows:
        run = json.loads((out / f"{r['setting']}-lr{r['lr']:g}-w2" / "run.json").read_text())
        assert run["summary"]["step"] == r["steps"] == {"2x32": 12, "4x32": 6}[r["setting"]]
        assert run["config"]["learning_rate"] == r["lr"] and run["config"]["max_steps"] == r["steps"]
        assert r["curve"][-1] == [r["steps"], r["final_val_loss"]]  # the last eval is the end of the horizon
    losses = [r["final_val_loss"] for r in rows]
    assert losses == sorted(losses)
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x32" in line]
    assert [line.split(" | ")[0][2:] for line in table] == [r["setting"] for r in rows]
    # a finished run is read again, not rerun
    logs = {p: p.stat().st_mtime_ns for p in out.glob("*.log")}
    _run(monkeypatch, *args)
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.log")} == logs
