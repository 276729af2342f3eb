"""Checkpoints on disk: model weights as safetensors plus a JSON config, written atomically.

A gptopt model directory holds `model.safetensors` and `gptopt.json` ({"format": "gptopt",
"model": GPTConfig fields, "environment": ..., plus whatever the writer adds, e.g. the tokenizer}).
`generate`, `serve`, `bench` and the Hugging Face export all read this one layout.

    python -c "from gptopt.models.checkpoint import load_model; print(load_model('out/final'))"
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from gptopt.config import GPTConfig
from gptopt.data.tokenizer import TOKENIZER
from gptopt.models import lora
from gptopt.models.compressed import unpack_state
from gptopt.models.gpt import GPT
from gptopt.models.hf_files import write_carried
from gptopt.outputs import remove, staged_dir, write_text_atomic
from gptopt.utils.errors import UserError

WEIGHTS = "model.safetensors"
META = "gptopt.json"


def is_gptopt_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / META).is_file()


def write_model_files(
    config: GPTConfig, state: dict[str, torch.Tensor], directory: Path, extra: dict[str, Any] | None = None
) -> None:
    """Weights + config into an existing directory (a staged one: outputs.staged_dir makes them durable)."""
    # The tied lm_head shares wte's storage; safetensors refuses shared tensors, so store it once. An untied one
    # (Llama's) is a weight of its own.
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()
               if k != "lm_head.weight" or not config.tie_embeddings}
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
        raise UserError(f"{directory}: not a gptopt model directory ({META} missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt JSON ({e}); the checkpoint is damaged, use an earlier one") from None
    if not isinstance(meta, dict) or meta.get("format") != "gptopt" or "model" not in meta:
        raise UserError(f"{path}: not a gptopt model config (needs format='gptopt' and a 'model' table)")
    # Checked here, so every reader (load, resume, tokenizer lookup, compress) meets one line, not a KeyError.
    try:
        GPTConfig.from_dict(meta["model"])
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: model: {e}; the checkpoint is damaged, use an earlier one") from None
    for key, kind in (("tokenizer", str), ("train_config", dict), ("compression", dict)):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise UserError(f"{path}: {key} must be a {'path' if kind is str else 'table'}, got {meta[key]!r}; "
                             "the checkpoint is damaged, use an earlier one")
    return meta


def training_data(directory: str | os.PathLike[str]) -> str | None:
    """The data_dir a gptopt model was trained on, as `gptopt train` recorded it; None when not recorded
    (a Hugging Face model, a hand-written directory)."""
    if not is_gptopt_dir(directory):
        return None
    meta = read_meta(directory)
    # the absolute path train records; older checkpoints have only the flag as given (relative to where it ran)
    data_dir = meta.get("data_dir") or (meta.get("train_config") or {}).get("data_dir")
    return str(data_dir) if isinstance(data_dir, str) and data_dir else None


def load_model(directory: str | os.PathLike[str], *, map_location: str | torch.device = "cpu",
               merge_lora: bool = True) -> GPT:
    """A GPT from a gptopt model directory; every key and shape is checked against the config. A LoRA run's
    checkpoint (meta.json's "lora") comes with its adapters merged into the weights, or without them
    (merge_lora False: the frozen weights a resumed run adapts further)."""
    directory = Path(directory)
    meta = read_meta(directory)
    config = GPTConfig.from_dict(meta["model"])
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{directory}: {WEIGHTS} is missing")
    try:
        state = load_file(str(weights), device=str(map_location))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise UserError(f"{weights}: cannot read weights ({e}); the file is truncated or corrupt") from None
    if meta.get("compression"):  # written by gptopt compress: integers + scales, dequantised here
        state = unpack_state(state, meta["compression"], str(weights))
    if meta.get("lora") and merge_lora:
        adapter = directory / lora.ADAPTER
        try:
            tensors = load_file(str(adapter), device=str(map_location))
        except Exception as e:
            raise UserError(f"{adapter}: cannot read the LoRA adapters ({e}); the checkpoint is incomplete") from None
        state = lora.merge_into(state, tensors, meta["lora"]["alpha"], meta["lora"]["rank"])
    model = GPT(config)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_embeddings}
    check_state(expected, state, str(weights))
    model.load_state_dict(state, strict=False)  # a tied lm_head is loaded through wte
    return model


def check_state(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: str) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped key."""
    for key, ref in expected.items():
        if key not in got:
            raise UserError(f"{where}: missing weight {key!r} (expected shape {tuple(ref.shape)})")
        if tuple(got[key].shape) != tuple(ref.shape):
            raise UserError(
                f"{where}: weight {key!r} has shape {tuple(got[key].shape)}, the config needs {tuple(ref.shape)}"
            )
    extra = sorted(set(got) - set(expected))
    if extra:
        raise UserError(f"{where}: unexpected weight {extra[0]!r} ({len(extra)} unexpected in all)")


# ----------------------------------------------------------------------------------------------
# Training checkpoints: a model directory plus train_state.pt, named ckpt-<step>.
#
# A run's checkpoints form a lineage: each one's gptopt.json lists the names of the checkpoints of
# its chain, itself last. Resuming from an earlier checkpoint starts a new branch; the later
# checkpoints of the abandoned branch are not in its lineage, so retention (which keeps the last K
# of the current lineage) never deletes the new run's checkpoints in their favour, nor them in its.
# The output dir's `latest` file names the checkpoint the run wrote last: what --resume auto,
# generate and serve take, whatever step numbers other branches reached.

TRAIN_STATE = "train_state.pt"
TRAIN_STATE_KEYS = ("step", "tokens_seen", "optimizer", "rng")  # what resuming reads (train._restore)
PREFIX = "ckpt-"
LATEST = "latest"  # a one-line text file in the output dir: the name of the run's newest checkpoint


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def _step(d: Path) -> int:
    return int(d.name[len(PREFIX) :])


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
    return sorted(found, key=_step)


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint output_dir's `latest` file names; without one (a folder written before gptopt kept
    it, or a pointer to a checkpoint since deleted), the largest step."""
    root = Path(output_dir)
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    dirs = checkpoint_dirs(root)
    by_name = {d.name: d for d in dirs}
    if name in by_name:
        return by_name[name]
    return dirs[-1] if dirs else None


def lineage(directory: str | os.PathLike[str]) -> list[str]:
    """The names of the checkpoints of directory's chain, itself last. A checkpoint written before
    lineages were recorded: the checkpoints beside it up to its step (a run then had one branch)."""
    directory = Path(directory)
    recorded = read_meta(directory).get("lineage")
    if isinstance(recorded, list) and recorded and all(isinstance(n, str) for n in recorded):
        return list(recorded)
    return [d.name for d in checkpoint_dirs(directory.parent) if _step(d) <= _step(directory)] or [directory.name]


def abandoned_after(directory: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints beside directory at later steps that are not of its lineage: an earlier run went on
    from here (or elsewhere) and a resume from directory abandons that branch."""
    directory = Path(directory)
    chain = set(lineage(directory))
    return [d for d in checkpoint_dirs(directory.parent) if _step(d) > _step(directory) and d.name not in chain]


def save_checkpoint(
    output_dir: str | os.PathLike[str],
    step: int,
    config: GPTConfig,
    model_state: dict[str, torch.Tensor],
    train_state: dict[str, Any],
    *,
    meta: dict[str, Any] | None = None,
    keep: int = 3,
    parent: Sequence[str] = (),
    tokenizer: Tokenizer | None = None,
    files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write ckpt-<step> atomically (outputs.staged_dir), point `latest` at it, then drop all but the last
    `keep` checkpoints of its lineage (parent: the lineage of the checkpoint the run continues; a fresh
    run's is empty). tokenizer: stored in the checkpoint, so generate and serve find it from anywhere.
    files: what the model keeps of the one it was trained from (hf_files.carried: its chat template, special
    tokens and end ids).

    A crash in the middle leaves the previous checkpoints untouched and no partial ckpt-<step>.
    """
    root = Path(output_dir)
    name = checkpoint_name(step)
    chain = [n for n in parent if n != name] + [name]
    target = root / name
    with staged_dir(target, replace=True) as tmp:
        write_model_files(config, model_state, tmp, {**(meta or {}), "step": step, "lineage": chain})
        if tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER))
        write_carried(files or {}, tmp)
        torch.save(train_state, tmp / TRAIN_STATE)
    write_text_atomic(root / LATEST, name + "\n")  # before retention: `latest` never names a deleted checkpoint
    mine = set(chain)
    for old in [d for d in checkpoint_dirs(root) if d.name in mine][:-keep]:
        remove(old)  # renamed away first: a half-deleted checkpoint is never listed as one
    return target


def load_train_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The train state of a checkpoint, through the safe (weights_only) unpickler only."""
    path = Path(directory) / TRAIN_STATE
    if not path.is_file():
        raise UserError(f"{directory}: not a training checkpoint ({TRAIN_STATE} missing)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle opcodes, disallowed globals
        raise UserError(f"{path}: cannot read the train state ({e}); "
                         "the checkpoint is corrupt, use an earlier one") from None
    missing = [k for k in TRAIN_STATE_KEYS if k not in state] if isinstance(state, dict) else list(TRAIN_STATE_KEYS)
    if missing or not all(isinstance(state[k], int) for k in ("step", "tokens_seen")):
        what = f"has no {', '.join(missing)}" if missing else "has a step count that is not a number"
        raise UserError(f"{path}: not a gptopt train state ({what}); the checkpoint is damaged, use an earlier one")
    return state
