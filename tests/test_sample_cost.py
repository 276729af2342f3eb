"""benchmarks/sample_cost.py: the sampling step's cost, plain rows against rows constrained by a JSON schema.

    pytest -q tests/test_sample_cost.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

pytest.importorskip("llguidance")  # the constrained rows need the serve extra
sample_cost = load_script("sample_cost")


def _run(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr("sys.argv", ["sample_cost.py", *args])
    sample_cost.main()


def test_each_vocabulary_gets_a_plain_and_a_constrained_figure_named_by_its_tokenizer(
        train_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    given = str(train_data / "tokenizer.json")  # a BPE of 320, as `gptopt prepare` writes one
    _run(monkeypatch, "--tokenizer", given, "--vocab", "300", "--rows", "2", "--rounds", "1", "--steps", "2")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tokenizer"], r["vocab"]) for r in lines] == [(given, 320), ("stdlib BPE 300", 300)]
    for row in lines:
        assert (row["rows"], row["temperature"]) == (2, 0.0)
        assert isinstance(row["plain_ms"], float) and isinstance(row["constrained_ms"], float)


@pytest.mark.parametrize(("args", "reason"), [
    (["--vocab", "8k"], "argument --vocab: invalid int value: '8k'"),
    (["--rows", "sixteen"], "argument --rows: invalid int value: 'sixteen'"),
    (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
])
def test_a_bad_argument_is_refused_with_exit_2_and_the_reason(
        args: list[str], reason: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, *args)
    assert e.value.code == 2
    assert reason in capsys.readouterr().err
