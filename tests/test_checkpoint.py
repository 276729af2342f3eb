"""Training checkpoints on disk: lineage, retention, the `latest` pointer and its fallback.

    pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptopt.models import checkpoint
from gptopt.models.gpt import GPT


def save(out: Path, step: int, model: GPT, parent: list[str] | None = None, keep: int = 3) -> Path:
    return checkpoint.save_checkpoint(out, step, model.config, model.state_dict(), {"step": step}, keep=keep,
                                      parent=parent or [])


def names(out: Path) -> list[str]:
    return [d.name for d in checkpoint.checkpoint_dirs(out)]


def test_retention_deletes_only_older_checkpoints_of_the_current_lineage(debug_model: GPT, tmp_path: Path) -> None:
    for step in (10, 20, 30):  # a first run
        save(tmp_path, step, debug_model, checkpoint.lineage(tmp_path / f"ckpt-{step - 10:07d}") if step > 10 else [])
    first = checkpoint.lineage(tmp_path / "ckpt-0000010")
    save(tmp_path, 15, debug_model, first, keep=1)  # a resume from step 10
    assert names(tmp_path) == ["ckpt-0000015", "ckpt-0000020", "ckpt-0000030"]
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "ckpt-0000015"
    assert checkpoint.abandoned_after(tmp_path / "ckpt-0000015") == [tmp_path / "ckpt-0000020",
                                                                     tmp_path / "ckpt-0000030"]
    assert (tmp_path / checkpoint.LATEST).read_text() == "ckpt-0000015\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging, trash or pointer temp left


def test_latest_falls_back_to_the_largest_step(debug_model: GPT, tmp_path: Path) -> None:
    for step in (1, 2):
        save(tmp_path, step, debug_model)
    (tmp_path / checkpoint.LATEST).unlink()  # a folder written before gptopt kept the pointer
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "ckpt-0000002"
    (tmp_path / checkpoint.LATEST).write_text("ckpt-0000007\n")  # names a checkpoint since deleted
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "ckpt-0000002"
    (tmp_path / checkpoint.LATEST).write_text("ckpt-0000001\n")
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "ckpt-0000001"


def test_a_checkpoint_without_a_recorded_lineage_continues_the_steps_beside_it(debug_model: GPT,
                                                                                tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save(tmp_path, step, debug_model)
    for d in checkpoint.checkpoint_dirs(tmp_path):  # as gptopt wrote them before lineages were recorded
        meta = checkpoint.read_meta(d)
        del meta["lineage"]
        checkpoint.write_model_files(debug_model.config, debug_model.state_dict(), d, {k: v for k, v in meta.items()
                                                                                      if k not in ("format", "model")})
    assert checkpoint.lineage(tmp_path / "ckpt-0000002") == ["ckpt-0000001", "ckpt-0000002"]


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_the_tokenizer_travels_in_the_checkpoint(
    debug_model: GPT, tmp_path: Path, debug_tokenizer: object, with_tokenizer: bool
) -> None:
    path = checkpoint.save_checkpoint(tmp_path, 1, debug_model.config, debug_model.state_dict(),
                                      {"w": torch.zeros(1)}, tokenizer=debug_tokenizer if with_tokenizer else None)
    assert (path / "tokenizer.json").is_file() == with_tokenizer


@pytest.mark.parametrize("state", [{"a": 1}, [1, 2], {"step": "x", "tokens_seen": 0, "optimizer": {}, "rng": {}}])
def test_a_train_state_of_the_wrong_shape_is_named(debug_model: GPT, tmp_path: Path, state: object) -> None:
    path = save(tmp_path / "run", 2, debug_model)
    torch.save(state, path / checkpoint.TRAIN_STATE)
    with pytest.raises(ValueError, match="not a gptopt train state"):
        checkpoint.load_train_state(path)


@pytest.mark.parametrize("overrides", [{}, {"attention": "eager"}])
def test_a_llama_shaped_models_own_head_survives_saving_and_loading(overrides: dict, tmp_path: Path) -> None:
    from conftest import make_varied_model

    from gptopt.models import hf

    model = make_varied_model(300, "llama")  # untied: lm_head is a weight of its own
    checkpoint.save_model(model, tmp_path / "m")
    loaded = hf.load_pretrained(tmp_path / "m", **overrides).eval()
    x = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-4)  # eager and SDPA round apart
