"""The compressed checkpoint format: how a quantised model's weights lie on disk (model.safetensors) and come
back. A quantised layer's `weight` holds the integers and `weight_scale` (for int4 also `weight_min`) their
per-channel or per-group parameters, so the file really shrinks. The tied lm_head is quantised through wte: one
set of per-row int8 scales serves the embedding lookup (dequantised) and the output projection (quantised); an
untied one (Llama's) is an int8 layer of its own. Pruned weights are stored as they are, zeros. Every loader
dequantises the state (unpack_state: a plain fp32 GPT whose weights lie on the stored grid); infer/quantize.py
turns that into the device's quantised modules with the same integers.

    python -c "import torch, gptopt.models.compressed as c; print(c.int8_per_channel(torch.randn(2, 4)))"
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
import torch.nn as nn

from gptopt.config import QUANTIZE_METHODS
from gptopt.models.gpt import GPT
from gptopt.utils.errors import UserError

FORMAT = 1  # version of the on-disk layout; a checkpoint of a newer one is refused with the fix
INT4_GROUP_SIZES = (128, 64, 32)  # the largest that divides every layer's input width is used
_SCALE, _MIN = "_scale", "_min"  # suffixes of a quantised weight's key: weight_scale, weight_min
_TINY = 1e-12  # an all-zero row (padding, a pruned-away channel) keeps a finite scale


def block_linears(model: GPT) -> dict[str, nn.Linear]:
    """The Transformer blocks' Linear layers (c_attn, c_proj, c_fc, SwiGLU's c_gate, mlp.c_proj of each block) by
    name. lm_head is not among them: tied to the embedding, pruning it would prune wte too; untied (Llama's), it is
    kept whole as the embedding is, and int8 quantises it as a layer of its own (pack_state)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("transformer.h.")}


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: q (out, in) int8 in [-127, 127] and scale (out,) fp32, w ~ q * scale.
    Idempotent: quantising q * scale again gives q and scale back."""
    w = w.detach().float().cpu()
    scale = w.abs().amax(dim=1).clamp(min=_TINY) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int4_groupwise(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group_size` inputs (tinygemm's grid): q (out, in) uint8 in [0, 15],
    scale and minimum (out, in // group_size) fp32, w ~ minimum + q * scale."""
    w = w.detach().float().cpu()
    groups = w.view(w.shape[0], -1, group_size)  # (out, in / g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=_TINY)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view_as(w), scale, lo


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two int4 values per byte, the even input in the low nibble: (out, in) -> (out, in / 2) uint8."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def int4_group_size(model: GPT) -> int:
    widths = {m.in_features for m in block_linears(model).values()}
    for g in INT4_GROUP_SIZES:
        if all(w % g == 0 for w in widths):
            return g
    raise UserError(f"int4-weight needs input widths divisible by one of {INT4_GROUP_SIZES}; "
                     f"this model has {sorted(widths)}")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(record: dict[str, Any]) -> str:
    """'int8-dynamic', 'pruned 50%', 'int8-weight + pruned 2:4', ..."""
    prune = record.get("prune")
    parts = [record["quantize"]] if record.get("quantize") else []
    parts += [f"pruned {prune:.0%}" if isinstance(prune, float) else f"pruned {prune}"] if prune else []
    return " + ".join(parts) or "uncompressed"


def pack_state(model: GPT, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors to write: quantised layers as integers plus their scales; the rest as it is."""
    tied = model.config.tie_embeddings
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight" or not tied}
    if record["quantize"] in ("int8-weight", "int8-dynamic"):
        for name in [*block_linears(model), "transformer.wte", *([] if tied else ["lm_head"])]:
            state[f"{name}.weight"], state[f"{name}.weight{_SCALE}"] = int8_per_channel(state[f"{name}.weight"])
    elif record["quantize"] == "int4-weight":
        for name in block_linears(model):
            q, scale, lo = int4_groupwise(state[f"{name}.weight"], record["int4_group_size"])
            state[f"{name}.weight"] = pack_int4(q)
            state[f"{name}.weight{_SCALE}"], state[f"{name}.weight{_MIN}"] = scale, lo
    return state


def check_record(record: dict[str, Any], where: str) -> None:
    if record.get("format", 0) > FORMAT:
        raise UserError(f"{where}: compressed by a newer gptopt (format {record['format']}, this one reads "
                         f"{FORMAT}); upgrade gptopt: pip install -U gptopt")
    if record.get("quantize") not in (None, *QUANTIZE_METHODS):
        raise UserError(f"{where}: unknown compression {record.get('quantize')!r}; upgrade gptopt")


def unpack_state(state: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """The fp32 state a GPT loads: every quantised weight dequantised (onto the stored grid)."""
    check_record(record, where)
    out = dict(state)
    for key in [k for k in state if k.endswith(f".weight{_SCALE}")]:
        weight, scale = key.removesuffix(_SCALE), out.pop(key).float()
        if weight not in out:
            raise UserError(f"{where}: {key} has no {weight} beside it; the checkpoint is damaged")
        try:
            if record.get("quantize") == "int4-weight":
                lo, q = out.pop(weight + _MIN).float(), unpack_int4(out[weight]).float()
                groups = q.view(q.shape[0], scale.shape[1], -1)
                out[weight] = (lo[..., None] + groups * scale[..., None]).view_as(q)
            else:
                out[weight] = out[weight].float() * scale[:, None]
        except (KeyError, RuntimeError, IndexError) as e:
            raise UserError(f"{where}: cannot dequantise {weight} ({e}); the checkpoint is damaged") from None
    return out
