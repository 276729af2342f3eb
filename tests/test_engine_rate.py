"""benchmarks/engine_rate.py: the serving engine's rate without HTTP, from closed-loop clients.

    pytest -q tests/test_engine_rate.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

engine_rate = load_script("engine_rate")


@pytest.mark.parametrize("thread", [False, True])
def test_every_request_makes_its_tokens_and_the_clients_share_decode_steps(
        model_dir: Path, capsys: pytest.CaptureFixture[str], thread: bool) -> None:
    argv = ["--model", str(model_dir), "--device", "cpu", "--clients", "4", "--requests", "8", "--max_tokens", "6",
            "--prompt_tokens", "5", "--max_batch_size", "4"] + (["--thread"] if thread else [])
    assert engine_rate.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["requests_done"], out["complete"], out["tokens"], out["errors"]) == (8, True, 48, 0)
    assert out["engine_thread"] == ("own" if thread else "main")
    # 8 requests of 6 tokens: 5 decode steps each alone, 40 in all; four at a time share them
    assert out["decode_steps"] <= 20 and out["mean_decode_sequences"] > 2


def test_a_run_past_its_deadline_stops_and_says_it_is_incomplete(
        model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(model_dir), "--device", "cpu", "--clients", "2", "--requests", "100000",
            "--max_tokens", "6", "--prompt_tokens", "5", "--max_batch_size", "2", "--timeout", "0.5"]
    assert engine_rate.main(argv) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["complete"] is False and 0 < out["requests_done"] < 100000
    assert "requests done" in captured.err and "not the engine's rate" in captured.err


def test_bad_arguments_are_refused_with_the_reason(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_rate.main(["--model", str(model_dir), "--device", "cpu", "--clients", "9", "--requests", "8"]) == 2
    assert "clients must be in 1..requests (8)" in capsys.readouterr().err
    too_many = ["--clients", "100", "--requests", "100", "--max_batch_size", "2"]  # 2 slots + 64 may wait
    assert engine_rate.main(["--model", str(model_dir), "--device", "cpu", *too_many]) == 2
    assert "at most the engine's 66 places" in capsys.readouterr().err
    assert engine_rate.main(["--model", "/nonexistent/model"]) == 2
    assert "/nonexistent/model: no such directory" in capsys.readouterr().err
