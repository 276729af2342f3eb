"""A plain model made ready to train, by the one function that applies the training transforms in a fixed
order: float8 matmuls -> the device -> FSDP2 or DDP -> torch.compile. The model code stays single-device;
train, bench, tune and profile all call wrap_for_training.

    python -c "from gptopt.train.wrap import wrap_for_training; help(wrap_for_training)"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from gptopt.runtime.compile import compile_model
from gptopt.runtime.device import DevicePlan
from gptopt.train import distributed
from gptopt.train.distributed import DistInfo
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require


@dataclass
class Prepared:
    model: nn.Module  # what the step calls: maybe wrapped, maybe compiled
    raw: nn.Module  # the plain GPT underneath (weights, config, sampling)
    sharded: bool  # FSDP2: parameters are DTensors, state dicts need gathering


def wrap_for_training(
    model: nn.Module,
    plan: DevicePlan,
    info: DistInfo,
    *,
    fsdp: bool = False,
    cpu_offload: bool = False,
    compile: bool = False,
    compile_mode: str = "default",
    compile_fullgraph: bool = False,
    fp8: bool = False,
) -> Prepared:
    """The model wrapped for a training step, in place where it can be: Prepared.model is what the step calls,
    Prepared.raw the plain GPT underneath (its weights, config and sampling)."""
    raw = model
    if fp8:  # before the wrappers: FSDP2 and DDP then see the float8 layers (torchao's order)
        to_float8(model)
    if fsdp:
        if not info.enabled:  # train refuses this before writing anything; bench and tune never ask for FSDP
            raise UserError("--fsdp needs torchrun: torchrun --nproc_per_node N -m gptopt train --fsdp ...")
        if not cpu_offload:
            model.to(plan.device)
        model = distributed.wrap_fsdp(model, param_dtype=plan.amp_dtype, cpu_offload=cpu_offload)
    else:
        model.to(plan.device)
        if info.enabled and info.world_size > 1:
            model = distributed.wrap_ddp(model, plan.device)
    if compile:
        model = compile_model(model, mode=compile_mode, fullgraph=compile_fullgraph)
    return Prepared(model=model, raw=raw, sharded=fsdp)


def to_float8(model: nn.Module) -> int:
    """Train the blocks' Linear layers with float8 matmuls: torchao's Float8Linear, in place (dynamic tensorwise
    scales; weights, gradients and optimizer state stay in their dtype, so checkpoints are unchanged). The head
    stays as it is: it is tied to the embedding, and its logits are where float8's range costs the most. A
    layer with a dimension that is not a multiple of 16 stays too (float8 GEMMs need it). Returns how many
    layers were swapped. Needs the 'quant' extra; device.fp8_unavailable says where it pays."""
    convert_to_float8_training = require("torchao.float8", "quant", "--fp8").convert_to_float8_training

    def swap(module: nn.Module, name: str) -> bool:
        return (name != "lm_head" and isinstance(module, nn.Linear)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    before = sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=swap)
    return sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules()) - before
