"""Compression of a GPT's Linear layers: int8 / int4 quantisation, magnitude and 2:4 pruning, and the rebuilding
of a compressed checkpoint's quantised modules for this device (its format on disk: models/compressed.py).

`gptopt compress` (commands/compress.py) applies these transforms and measures them. `load_for_inference`
(load.py) sees a checkpoint's `compression` record and calls `restore`, so generate and serve
load a compressed directory like any other.

    gptopt compress --model out --output_dir out-int8 --quantize int8-dynamic
    python -c "import torch; from gptopt.infer.quantize import mask_2_4; print(mask_2_4(torch.randn(2, 8)))"
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.utils.prune as torch_prune

from gptopt.config import QUANTIZE_METHODS, parse_prune
from gptopt.models.compressed import FORMAT, _version, block_linears, int4_group_size, int8_per_channel
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.utils.errors import UserError
from gptopt.utils.extras import has, require

__all__ = ["METHODS", "check_supported", "compress_model", "int4_unsupported", "mask_2_4", "parse_prune",
           "quantize_int4", "quantize_int8", "restore"]

log = logging.getLogger("gptopt")

METHODS = QUANTIZE_METHODS
SPARSE_2_4 = "2:4"
# NO_INDUCTOR_CONFIG: torchao's configs would set inductor's "recommended" options (coordinate-descent
# tuning) for the whole process and never set them back: every later compile in it (bench's next rungs,
# a server's other models) would tune each kernel, and rungs would compare differently compiled code.


def _sm80(plan: DevicePlan) -> bool:
    return plan.device.type == "cuda" and torch.cuda.get_device_capability(plan.device) >= (8, 0)


def _where(plan: DevicePlan) -> str:
    if plan.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(plan.device)
        return f"{torch.cuda.get_device_name(plan.device)} (compute capability {major}.{minor})"
    return f"this {plan.device.type}"


def int4_unsupported(plan: DevicePlan, dtype: torch.dtype | None, instead: str) -> str | None:
    """Why torchao's int4 weight-only kernel (tinygemm) cannot run on plan.device in `dtype`, as one line
    ending in the fix (`instead` where the device is the problem); None where it can. dtype None: any.
    The one rule for int4: compress, generate, serve and bench --mode infer all ask it."""
    if not _sm80(plan):
        return (f"int4-weight needs an NVIDIA GPU of compute capability 8.0 or newer (torchao's int4 "
                f"kernel), not {_where(plan)}; {instead}")
    if dtype is not None and dtype != torch.bfloat16:
        return (f"int4-weight runs bf16 weights (torchao's tinygemm kernel), not "
                f"{str(dtype).removeprefix('torch.')}; use --dtype auto or bf16")
    return None


def check_supported(quantize: str | None, prune: float | str | None, plan: DevicePlan) -> None:
    """Refuse, before any work, what this device cannot run: the reason and what to use instead."""
    if quantize is not None and quantize not in METHODS:
        raise UserError(f"unknown --quantize {quantize!r}; choose one of: none, {', '.join(METHODS)}")
    if quantize == "int4-weight" and (problem := int4_unsupported(plan, None, "use --quantize int8-dynamic on CPUs, "
                                                                                 "int8-weight on GPUs")):
        raise UserError(problem)
    if prune == SPARSE_2_4 and quantize is not None:
        raise UserError("--prune 2:4 together with --quantize is not supported; choose one of them")
    if prune == SPARSE_2_4 and not _sm80(plan):
        raise UserError(f"--prune 2:4 needs an NVIDIA GPU of compute capability 8.0 or newer: semi-structured sparse "
                         f"kernels exist only there, and {_where(plan)} would run the pruned weights dense, with no "
                         "speed gain; use --prune FRACTION here, or run compress on such a GPU")
    if quantize in ("int8-weight", "int4-weight") or (quantize == "int8-dynamic" and plan.device.type != "cpu"):
        require("torchao.quantization", "quant", f"--quantize {quantize}")


# ----------------------------------------------------------------------------------------------
# Integers: computed in fp32 on the CPU, so the same weights give the same integers on any device


# ----------------------------------------------------------------------------------------------
# Pruning


def prune_magnitude(model: GPT, fraction: float) -> None:
    """Zero the `fraction` smallest-magnitude weights of every block Linear (torch.nn.utils.prune's L1
    criterion, layer by layer), made permanent: plain weights with zeros, no masks or hooks left."""
    for layer in block_linears(model).values():
        torch_prune.l1_unstructured(layer, "weight", amount=fraction)
        torch_prune.remove(layer, "weight")


def mask_2_4(w: torch.Tensor) -> torch.Tensor:
    """True at the 2 largest-magnitude weights of every group of 4 consecutive inputs (the last dim): the
    2:4 pattern of NVIDIA's sparse tensor cores. Exactly 2 per group; ties go to the lower index."""
    if w.shape[-1] % 4:
        raise UserError(f"2:4 sparsity needs an input width divisible by 4, got shape {tuple(w.shape)}")
    groups = w.detach().abs().reshape(-1, 4)
    keep = groups.sort(dim=-1, descending=True, stable=True).indices[:, :2]
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True).view(w.shape)


def prune_2_4(model: GPT) -> None:
    """Apply mask_2_4 to every block Linear through torch.nn.utils.prune, made permanent (dense zeros)."""
    for layer in block_linears(model).values():
        torch_prune.custom_from_mask(layer, "weight", mask_2_4(layer.weight))
        torch_prune.remove(layer, "weight")


def sparsify_2_4(model: GPT) -> int:
    """Swap each block Linear's 2:4-pruned weight for torch's semi-structured sparse tensor (CUDA only);
    the number swapped. A layer whose shape or dtype the kernels refuse stays dense, logged."""
    from torch.sparse import to_sparse_semi_structured

    swapped = 0
    for name, layer in block_linears(model).items():
        try:
            layer.weight = nn.Parameter(to_sparse_semi_structured(layer.weight.detach()), requires_grad=False)
            swapped += 1
        except (RuntimeError, ValueError) as e:
            log.warning("%s stays dense: %s", name, str(e).splitlines()[0])
    return swapped


# ----------------------------------------------------------------------------------------------
# The record and the state on disk


def compress_model(model: GPT, quantize: str | None, prune: float | str | None) -> dict[str, Any]:
    """Prune `model` in place (quantisation happens in pack_state); the record gptopt.json keeps."""
    if isinstance(prune, float):
        prune_magnitude(model, prune)
    elif prune == SPARSE_2_4:
        prune_2_4(model)
    record: dict[str, Any] = {
        "format": FORMAT, "quantize": quantize, "prune": prune,
        "layers": "every block Linear"
                  + ((" and lm_head" + (" (stored through wte)" if model.config.tie_embeddings else ""))
                     if quantize in ("int8-weight", "int8-dynamic") else ""),
        "versions": {"torch": torch.__version__, "torchao": _version("torchao")},
    }
    if quantize in ("int8-weight", "int8-dynamic"):
        record["stored"] = "int8, symmetric per output channel: w = weight * weight_scale"
    if quantize == "int4-weight":
        record["int4_group_size"] = g = int4_group_size(model)
        record["stored"] = f"int4 packed two per byte, per group of {g} inputs: w = weight_min + q * weight_scale"
    return record


# ----------------------------------------------------------------------------------------------
# Rebuilding the device's modules


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _ao_dynamic_linear(layer: nn.Linear, q: torch.Tensor, scale: torch.Tensor) -> nn.Module:
    """torch.ao's dynamic int8 Linear (fbgemm / onednn kernels) holding exactly q and scale."""
    import torch.ao.nn.quantized.dynamic as nnqd

    with warnings.catch_warnings():
        # torch deprecates its quantized tensors (still shipped, and the CPU int8 path that decodes faster
        # than fp32: benchmarks/2026-12-02-compression.md):
        # the warning is for torch's users at large, not for a gptopt user who asked for int8.
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        weight = torch.quantize_per_channel(q.float() * scale[:, None], scale.double(),
                                            torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        out = nnqd.Linear(layer.in_features, layer.out_features, bias_=layer.bias is not None, dtype=torch.qint8)
        out.set_weight_bias(weight, None if layer.bias is None else layer.bias.detach().float())
    return out


def _torchao_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, dynamic: bool) -> torch.Tensor:
    """torchao's Int8Tensor holding exactly q and scale; dynamic: activations quantised per token too."""
    ao = require("torchao.quantization", "quant", "int8 quantisation")
    if not hasattr(ao, "Int8Tensor"):
        raise UserError(f"torchao {_version('torchao')} has no Int8Tensor (0.18 is tested): pip install -U torchao")
    from torchao.quantization.quantize_.workflows import QuantizeTensorToInt8Kwargs

    act = QuantizeTensorToInt8Kwargs(granularity=ao.PerRow()) if dynamic else None
    s = scale.view(-1, 1).float()
    return ao.Int8Tensor(q, s, [1, q.shape[1]], dtype, zero_point=torch.zeros_like(s, dtype=torch.int8),
                         act_quant_kwargs=act)


def _restore_int8(model: GPT, quantize: str, plan: DevicePlan, dtype: torch.dtype) -> GPT:
    names = [*block_linears(model), "lm_head"]
    layers = dict(model.named_modules())
    ints = {n: int8_per_channel(layers[n].weight) for n in names}  # before any cast: the integers on disk
    if quantize == "int8-dynamic" and plan.device.type == "cpu" and has("torch.ao.nn.quantized.dynamic"):
        if dtype != torch.float32:
            raise UserError("int8-dynamic on a CPU runs torch.ao's dynamic int8 Linear, which takes fp32 "
                             "activations; use --dtype auto (fp32 on CPUs)")
        for n in names:
            _set_module(model, n, _ao_dynamic_linear(layers[n], *ints[n]))
        return model
    if quantize == "int8-weight" and plan.device.type == "cpu":
        log.warning("int8-weight on a CPU: torchao's int8 weight-only Linear measured no faster than fp32 on CPUs, "
                    "eager or compiled (docs/benchmarks.md); int8-dynamic is the CPU path")
    model = model.to(plan.device, dtype)
    for n in names:
        q, s = ints[n]
        layers[n].weight = nn.Parameter(_torchao_int8(q.to(plan.device), s.to(plan.device), dtype,
                                                      dynamic=quantize == "int8-dynamic"), requires_grad=False)
    return model  # lm_head's new weight unties it from wte, which stays a plain embedding


def restore(model: GPT, record: dict[str, Any], plan: DevicePlan, dtype: torch.dtype) -> GPT:
    """A compressed checkpoint's model as loaded (fp32, on the CPU, weights on the stored grid) as the
    device runs it: in `dtype` on plan.device, quantised modules or sparse weights rebuilt."""
    quantize, prune = record.get("quantize"), record.get("prune")
    if quantize in ("int8-weight", "int8-dynamic"):
        return _restore_int8(model, quantize, plan, dtype)
    if quantize == "int4-weight" and _sm80(plan):
        return quantize_int4(model, plan, dtype, record["int4_group_size"])  # the grid on disk is tinygemm's
    if quantize == "int4-weight":
        log.warning("int4-weight checkpoint on %s: torchao's int4 kernel needs an NVIDIA GPU of compute capability "
                    "8.0 or newer; running the dequantised weights (same outputs, no int4 speed or memory gain)",
                    _where(plan))
    model = model.to(plan.device, dtype)
    if prune == SPARSE_2_4:
        if _sm80(plan) and dtype in (torch.float16, torch.bfloat16):
            log.info("2:4 sparsity: %d Linear layers run torch's semi-structured sparse kernels", sparsify_2_4(model))
        else:
            log.warning("2:4-pruned checkpoint on %s in %s: semi-structured sparse kernels need an NVIDIA GPU of "
                        "compute capability 8.0 or newer and fp16/bf16 weights; running dense, with no speed gain",
                        _where(plan), str(dtype).removeprefix("torch."))
    return model


def quantize_int8(model: GPT, plan: DevicePlan) -> GPT:
    """torchao int8 weight-only on every Linear, on the fly: half of bf16's bytes read per decode step
    (gpt-fast's int8)."""
    quant = require("torchao.quantization", "quant", "--quantize int8-weight")
    if plan.device.type == "cpu":
        log.warning("--quantize int8-weight on a CPU: torchao's int8 kernels measured slower than fp32 on CPUs "
                    "(docs/benchmarks.md, compression); running it as asked, compare tokens/s with --quantize none")
    quant.quantize_(model, quant.Int8WeightOnlyConfig(set_inductor_config=False))  # see NO_INDUCTOR_CONFIG
    return model


def quantize_int4(model: GPT, plan: DevicePlan, dtype: torch.dtype, group_size: int) -> GPT:
    """torchao int4 weight-only on every block Linear (tinygemm: asymmetric, per group of `group_size` inputs),
    the model moved to plan.device in bf16 first: a quarter of bf16's weight bytes read per decode step.
    Used on the fly (generate and serve --quantize int4-weight, bench's int4 rung) and by restore for a compressed
    checkpoint, whose weights already lie on this grid. lm_head stays bf16: tied, it is the embedding."""
    problem = int4_unsupported(plan, dtype, "use --quantize int8-weight instead")
    if problem:
        raise UserError(problem)
    ao = require("torchao.quantization", "quant", "--quantize int4-weight")
    model = model.to(plan.device, dtype)
    names = set(block_linears(model))
    config = ao.Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                     set_inductor_config=False)  # see NO_INDUCTOR_CONFIG
    ao.quantize_(model, config, filter_fn=lambda _, name: name in names)
    return model
