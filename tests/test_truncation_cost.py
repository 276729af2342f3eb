"""benchmarks/truncation_cost.py: what top-k and top-p rows cost against a plain sampled row.

    pytest -q tests/test_truncation_cost.py
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import load_script

truncation_cost = load_script("truncation_cost")
ROOT = Path(__file__).resolve().parents[1]


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> list[dict]:
    monkeypatch.setattr("sys.argv", ["truncation_cost.py", *args])
    truncation_cost.main()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_each_spread_gets_every_setting_timed_against_its_own_plain_row(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _run(monkeypatch, capsys, "--vocab", "300", "--rows", "3", "--rounds", "2", "--spread", "4", "1")
    assert [(r["vocab"], r["rows"], r["spread"]) for r in lines] == [(300, 3, 4.0), (300, 3, 1.0)]
    for r in lines:
        mine = r["this tree"]
        assert set(mine) == set(truncation_cost.SETTINGS)
        assert all(figure["ms"] > 0 and figure["x_plain"] > 0 for figure in mine.values())
    # a more peaked row: a larger largest probability
    assert lines[0]["largest_probability"][1] > lines[1]["largest_probability"][1]


def test_a_baseline_revision_is_timed_beside_this_tree_or_refused_by_name(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    (line,) = _run(monkeypatch, capsys, "--vocab", "200", "--rows", "2", "--rounds", "1", "--spread", "3",
                   "--baseline", "HEAD")
    assert set(line["HEAD"]) == set(line["this tree"]) == set(truncation_cost.SETTINGS)
    with pytest.raises(SystemExit, match="--baseline no-such-rev: git cannot show its sampler"):
        _run(monkeypatch, capsys, "--baseline", "no-such-rev", "--rounds", "1")


@pytest.mark.parametrize(("args", "reason"), [
    (["--vocab", "1"], "--vocab must be >= 2"),
    (["--rows", "0"], "--rows and --rounds >= 1"),
    (["--spread", "wide"], "argument --spread: invalid float value: 'wide'"),
])
def test_a_bad_argument_is_refused_with_exit_2_and_the_reason(
        args: list[str], reason: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, capsys, *args)
    assert e.value.code == 2 and reason in capsys.readouterr().err
