"""The one place that applies runtime transforms to a plain model, in a fixed order:
device -> FSDP2 or DDP -> torch.compile. (Quantisation, for inference, swaps modules before compile.)

The model code stays single-device; train, bench and tune all call this.

    python -c "from gptopt.prepare_model import compile_model; help(compile_model)"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gptopt import distributed
from gptopt.device import DevicePlan
from gptopt.distributed import DistInfo


@dataclass
class Prepared:
    model: nn.Module  # what the step calls: maybe wrapped, maybe compiled
    raw: nn.Module  # the plain GPT underneath (weights, config, sampling)
    sharded: bool  # FSDP2: parameters are DTensors, state dicts need gathering


def compile_model(model: nn.Module, *, mode: str = "default", fullgraph: bool = False,
                  freezing: bool = False) -> nn.Module:
    """torch.compile. freezing (inference only, default mode): inductor treats the weights as constants
    and folds what is computed from them alone (their transposes, layout changes) into the graph once;
    later weight updates are not seen, and folded copies cost memory beside the weights."""
    if freezing:
        if mode != "default":
            raise ValueError(f"freezing works with the default compile mode only, not {mode!r}")
        return torch.compile(model, fullgraph=fullgraph, options={"freezing": True})
    # "default" is passed as None: torch.compile's own default, without the mode lookup
    return torch.compile(model, mode=None if mode == "default" else mode, fullgraph=fullgraph)


def prepare(
    model: nn.Module,
    plan: DevicePlan,
    info: DistInfo,
    *,
    fsdp: bool = False,
    cpu_offload: bool = False,
    use_compile: bool = False,
    compile_mode: str = "default",
    compile_fullgraph: bool = False,
) -> Prepared:
    raw = model
    if fsdp:
        if not info.enabled:
            raise ValueError("--fsdp needs torchrun: torchrun --nproc_per_node N -m gptopt train --fsdp ...")
        if not cpu_offload:
            model.to(plan.device)
        model = distributed.wrap_fsdp(model, param_dtype=plan.amp_dtype, cpu_offload=cpu_offload)
    else:
        model.to(plan.device)
        if info.enabled and info.world_size > 1:
            model = distributed.wrap_ddp(model, plan.device)
    if use_compile:
        model = compile_model(model, mode=compile_mode, fullgraph=compile_fullgraph)
    return Prepared(model=model, raw=raw, sharded=fsdp)


def inference_layout(model: nn.Module, device_type: str) -> nn.Module:
    """Store each Linear's weight (out, in) column-major on CPUs, in place: same values, same state dict.

    F.linear multiplies by weight.T; with this layout that operand is contiguous, and the CPU BLAS's
    small-batch matrix-vector path runs much faster on it (tiny, batch-1 decode: 274 against 206
    tokens/s of CPU time per thread; the 8192 x 256 lm_head alone 233 against 659 us). GPUs' GEMMs
    take either layout at full speed, so they are left alone. Inference only: the weights must not
    train afterwards (the optimizer would see a strided layout). Quantised weights (tensor
    subclasses, packed modules) are left as they are.
    """
    if device_type != "cpu":
        return model
    with torch.no_grad():
        for module in model.modules():
            w = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) and type(w.data) is torch.Tensor and w.is_floating_point() and w.dim() == 2:
                w.data = w.data.t().contiguous().t()  # the Parameter object stays: ties (lm_head = wte) hold
    return model


def graph_break_reason(exc: BaseException) -> str | None:
    """The reason torch.compile gave up under fullgraph=True, or None if exc is something else."""
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover
        return None
    kinds = tuple(k for k in (getattr(dynamo_exc, "Unsupported", None), getattr(dynamo_exc, "UserError", None)) if k)
    if isinstance(exc, kinds):
        return str(exc).strip().splitlines()[0]
    return None

