"""Checkpoints on disk: model weights as safetensors plus a JSON config, written atomically.

A gptopt model directory holds `model.safetensors` and `gptopt.json` ({"format": "gptopt",
"model": GPTConfig fields, "environment": ..., plus whatever the writer adds, e.g. the tokenizer}).
`generate`, `serve`, `bench` and the Hugging Face export all read this one layout.

    python -c "from gptopt.checkpoint import load_model; print(load_model('out/final'))"
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gptopt.config import GPTConfig
from gptopt.fsutil import staged_dir
from gptopt.model import GPT
from gptopt.quantize import unpack_state

WEIGHTS = "model.safetensors"
META = "gptopt.json"


def is_gptopt_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / META).is_file()


def write_model_files(
    config: GPTConfig, state: dict[str, torch.Tensor], directory: Path, extra: dict[str, Any] | None = None
) -> None:
    """Weights + config into an existing directory (a staged one: fsutil.staged_dir makes them durable)."""
    # The tied lm_head shares wte's storage; safetensors refuses shared tensors, so store it once.
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items() if k != "lm_head.weight"}
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    meta = {"format": "gptopt", "model": config.to_dict(), **(extra or {})}
    with open(directory / META, "w") as fh:
        json.dump(meta, fh, indent=2, sort_keys=True, default=str)


def save_model(model: GPT, directory: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
    """Write a model directory atomically (replacing an old one): either the old or the new, never half."""
    target = Path(directory)
    with staged_dir(target, replace=True) as tmp:
        write_model_files(model.config, model.state_dict(), tmp, extra)
    return target


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / META
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{directory}: not a gptopt model directory ({META} missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt JSON ({e}); the checkpoint is damaged, use an earlier one") from None
    if not isinstance(meta, dict) or meta.get("format") != "gptopt" or "model" not in meta:
        raise ValueError(f"{path}: not a gptopt model config (needs format='gptopt' and a 'model' table)")
    # Checked here, so every reader (load, resume, tokenizer lookup, compress) meets one line, not a KeyError.
    try:
        GPTConfig.from_dict(meta["model"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: model: {e}; the checkpoint is damaged, use an earlier one") from None
    for key, kind in (("tokenizer", str), ("train_config", dict), ("compression", dict)):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise ValueError(f"{path}: {key} must be a {'path' if kind is str else 'table'}, got {meta[key]!r}; "
                             "the checkpoint is damaged, use an earlier one")
    return meta


def training_data(directory: str | os.PathLike[str]) -> str | None:
    """The data_dir a gptopt model was trained on, as `gptopt train` recorded it; None when not recorded
    (a Hugging Face model, a hand-written directory)."""
    if not is_gptopt_dir(directory):
        return None
    data_dir = (read_meta(directory).get("train_config") or {}).get("data_dir")
    return str(data_dir) if data_dir else None


def load_model(directory: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> GPT:
    """A GPT from a gptopt model directory; every key and shape is checked against the config."""
    directory = Path(directory)
    meta = read_meta(directory)
    config = GPTConfig.from_dict(meta["model"])
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{directory}: {WEIGHTS} is missing")
    try:
        state = load_file(str(weights), device=str(map_location))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise ValueError(f"{weights}: cannot read weights ({e}); the file is truncated or corrupt") from None
    if meta.get("compression"):  # written by gptopt compress: integers + scales, dequantised here
        state = unpack_state(state, meta["compression"], str(weights))
    model = GPT(config)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    check_state(expected, state, str(weights))
    model.load_state_dict(state, strict=False)  # lm_head is tied to wte and loaded through it
    return model


def check_state(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: str) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped key."""
    for key, ref in expected.items():
        if key not in got:
            raise ValueError(f"{where}: missing weight {key!r} (expected shape {tuple(ref.shape)})")
        if tuple(got[key].shape) != tuple(ref.shape):
            raise ValueError(
                f"{where}: weight {key!r} has shape {tuple(got[key].shape)}, the config needs {tuple(ref.shape)}"
            )
    extra = sorted(set(got) - set(expected))
    if extra:
        raise ValueError(f"{where}: unexpected weight {extra[0]!r} ({len(extra)} unexpected in all)")


# ----------------------------------------------------------------------------------------------
# Training checkpoints: a model directory plus train_state.pt, named ckpt-<step>, the last K kept.

TRAIN_STATE = "train_state.pt"
PREFIX = "ckpt-"


def checkpoint_dirs(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in output_dir, oldest first. Temporary (in-progress) dirs are never listed."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith(PREFIX) and d.name[len(PREFIX) :].isdigit():
            if (d / META).is_file() and (d / TRAIN_STATE).is_file():
                found.append(d)
    return sorted(found, key=lambda d: int(d.name[len(PREFIX) :]))


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(
    output_dir: str | os.PathLike[str],
    step: int,
    config: GPTConfig,
    model_state: dict[str, torch.Tensor],
    train_state: dict[str, Any],
    *,
    meta: dict[str, Any] | None = None,
    keep: int = 3,
) -> Path:
    """Write ckpt-<step> atomically (fsutil.staged_dir), then drop all but the last `keep`.

    A crash in the middle leaves the previous checkpoints untouched and no partial ckpt-<step>.
    """
    root = Path(output_dir)
    target = root / f"{PREFIX}{step:07d}"
    with staged_dir(target, replace=True) as tmp:
        write_model_files(config, model_state, tmp, {**(meta or {}), "step": step})
        torch.save(train_state, tmp / TRAIN_STATE)
    for old in checkpoint_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_train_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The train state of a checkpoint, through the safe (weights_only) unpickler only."""
    path = Path(directory) / TRAIN_STATE
    if not path.is_file():
        raise ValueError(f"{directory}: not a training checkpoint ({TRAIN_STATE} missing)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle opcodes, disallowed globals
        raise ValueError(f"{path}: cannot read the train state ({e}); the checkpoint is corrupt, use an earlier one") from None
