"""train --auto_batch_size: the largest micro-batch that fits this device, with the accumulation that keeps the
global batch. search() returns its choice; the run takes it (the config it was given is left as it was).

    python -c "from gptopt.train.auto_batch import find_batch_size; print(find_batch_size(lambda b: None, 16, 8))"

A size the memory estimate rules out is never tried (on a CPU trying it could get the process OOM-killed); the
sizes tried run one forward and backward of the real model, and an out-of-memory error moves on to the next.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from gptopt.config import TrainConfig
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.runtime.memory_check import is_oom
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")


@dataclasses.dataclass(frozen=True)
class BatchChoice:
    batch_size: int  # the micro-batch
    accumulation: int  # micro-batches per optimizer step: the global batch over batch_size


def find_batch_size(try_batch: Callable[[int], None], global_batch: int, largest: int,
                    fits: Callable[[int], bool] | None = None) -> int:
    """Largest divisor of global_batch (<= largest) for which try_batch does not run out of memory;
    a size `fits` rules out (the memory estimate) is not tried: on a CPU trying it could be OOM-killed."""
    for b in sorted((d for d in range(1, global_batch + 1) if global_batch % d == 0 and d <= largest), reverse=True):
        if fits is not None and not fits(b):
            log.info(f"auto batch size: micro-batch {b} would not fit (memory estimate)")
            continue
        try:
            try_batch(b)
            return b
        except Exception as e:
            if not is_oom(e):
                raise
            log.info(f"auto batch size: micro-batch {b} does not fit")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    raise UserError("not even a micro-batch of 1 fits: use --gradient_checkpointing, --use_amp, or a smaller model")


def search(model: GPT, plan: DevicePlan, cfg: TrainConfig, seq_len: int,
           fits: Callable[[int, str], bool]) -> BatchChoice:
    """The micro-batch and accumulation for cfg's global batch (micro-batch x accumulation). The model moves to the
    device (it trains there); its config is left as it was.

    fits(batch, loss): whether the memory estimate admits that micro-batch with that loss. On a GPU the search
    starts from the whole global batch; on a CPU from cfg's micro-batch (more rows buy a CPU little). Under --loss
    auto it searches with the chunked loss, the leaner one; the run's setup then keeps the full loss where it fits
    the batch found."""
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    largest = global_batch if plan.device.type == "cuda" else cfg.batch_size
    model = model.to(plan.device)
    config = model.config
    loss = "chunked" if cfg.loss == "auto" else config.loss

    def try_batch(b: int) -> None:
        x = torch.randint(0, config.vocab_size, (b, seq_len), device=plan.device)
        try:
            with plan.autocast():
                out = model(x, x)
            out.backward()
        finally:
            model.zero_grad(set_to_none=True)

    model.config = dataclasses.replace(config, loss=loss)  # a switch of the forward alone: no module changes
    try:
        b = find_batch_size(try_batch, global_batch, largest, lambda b: fits(b, loss))
    finally:
        model.config = config
    return BatchChoice(b, global_batch // b)
