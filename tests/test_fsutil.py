"""Published directories: readable by other accounts under the usual umask, and never half-written.

    pytest -q tests/test_fsutil.py
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gptopt import checkpoint, hf
from gptopt.config import PrepareConfig
from gptopt.corpus import prepare
from gptopt.fsutil import staged_dir
from gptopt.model import GPT


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_published(directory: Path) -> None:
    """0755 and 0644 throughout, as mkdir and open give under umask 022; no temporary sibling left."""
    assert mode(directory) == 0o755
    for path in directory.rglob("*"):
        assert mode(path) == (0o755 if path.is_dir() else 0o644), path
    assert [p.name for p in directory.parent.iterdir() if p.name.startswith(".")] == []


def _checkpoint(model: GPT, out: Path) -> Path:
    return checkpoint.save_checkpoint(out / "run", 1, model.config, model.state_dict(), {"step": 1})


def _model_dir(model: GPT, out: Path) -> Path:
    return checkpoint.save_model(model, out / "model")


def _hf_export(model: GPT, out: Path) -> Path:
    return hf.export_hf(model, out / "hf")


def _prepared(model: GPT, out: Path) -> Path:
    (out / "text.txt").write_text("one line of text\n" * 200 + "and another\n" * 200)
    return prepare(PrepareConfig(input=str(out / "text.txt"), output_dir=str(out / "data"), vocab_size=260))


def _staged(model: GPT, out: Path) -> Path:  # the ONNX export's path, without its minute of tracing
    with staged_dir(out / "onnx") as tmp:
        (tmp / "model.onnx").write_bytes(b"graph")
    return out / "onnx"


@pytest.mark.parametrize("write", [_checkpoint, _model_dir, _hf_export, _prepared, _staged])
def test_published_directories_are_readable_by_other_accounts(
        write: Callable[[GPT, Path], Path], debug_model: GPT, tmp_path: Path, umask_022: None) -> None:
    published = write(debug_model, tmp_path)
    if published.name == "run":
        published = checkpoint.latest_checkpoint(published)
        assert_published(published.parent)
    assert_published(published)


def test_an_interrupted_write_leaves_the_old_directory_and_no_temporary_one(tmp_path: Path,
                                                                            debug_model: GPT) -> None:
    target = checkpoint.save_model(debug_model, tmp_path / "model")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(KeyboardInterrupt), staged_dir(target, replace=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert torch.equal(checkpoint.load_model(target).transformer.wte.weight, debug_model.transformer.wte.weight)


def test_a_replacement_swaps_the_whole_directory(tmp_path: Path) -> None:
    with staged_dir(tmp_path / "out") as tmp:
        (tmp / "old.txt").write_text("old")
    with staged_dir(tmp_path / "out", replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_without_replace_a_filled_target_is_never_replaced(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with staged_dir(target) as tmp:  # an empty directory is taken, as a missing one
        target.mkdir()
        (tmp / "a.txt").write_text("a")
    assert (target / "a.txt").read_text() == "a"
    with pytest.raises(FileExistsError, match="not empty"), staged_dir(target) as tmp:
        (tmp / "b.txt").write_text("b")
    assert [p.name for p in target.iterdir()] == ["a.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
