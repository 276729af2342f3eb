"""The training step: one function that train, bench, tune and profile all run, so what is measured
is what trains.

    python -c "import gptopt.train.step as s; help(s.TrainStep)"

One step = `accumulation` micro-steps of forward and backward (the loss divided by the accumulation
count, DDP/FSDP gradient sync only on the last), then the optimizer step: unscale (fp16), clip the
global gradient norm, and a finite check that skips the update when the loss or the norm is NaN/Inf:
on the device with the fused AdamW (its found_inf flag), so the step never waits for the device and
the loop reads many steps' figures at once; otherwise after one host sync that reads both. The
optimizer is the TrainConfig's (optim.py: AdamW with decay on matrices only, or Muon for the blocks'
matrices and AdamW for the rest), each parameter group on the warmup + cosine schedule towards its
own peak learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.profiler import record_function

from gptopt.config import TrainConfig
from gptopt.data import loader as data
from gptopt.models.gpt import document_mask
from gptopt.models.loss import IGNORE_INDEX
from gptopt.runtime.device import DevicePlan, sdpa_backends
from gptopt.runtime.torch_private import graph_break_reason, skip_step_if
from gptopt.train import distributed
from gptopt.train.distributed import DistInfo
from gptopt.train.optim import group_lrs, lr_at, make_optimizer
from gptopt.utils.errors import UserError

# Names the step's one host sync in traces: `gptopt profile` does not count it as an avoidable sync.
READOUT_RANGE = "gptopt::readout"

# (micro-step index) -> (inputs, targets) already on the device, or (inputs, targets, positions) of packed
# conversations (data.loader.ChatRows); the caller times its own data waits
NextBatch = Callable[[int], "tuple[torch.Tensor, ...]"]


LOADER_FIELDS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")  # TrainConfig's DataLoader


def loader_options(cfg: TrainConfig, device_type: str) -> dict[str, Any]:
    """The DataLoader settings a TrainConfig trains with (train, bench, tune and profile feed the step alike):
    the fields it gives, the device's defaults (data.default_loader_settings) for those it leaves None. Without
    worker processes nothing is prefetched or kept alive, as DataLoader (and TrainConfig) require."""
    opts = data.default_loader_settings(device_type)
    opts.update({k: getattr(cfg, k) for k in LOADER_FIELDS if getattr(cfg, k) is not None})
    if not opts["num_workers"]:
        opts.update(prefetch_factor=None, persistent_workers=False)
    return opts


def forward_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, plan: DevicePlan,
    scaler: torch.amp.GradScaler | None, accum: int, *, pos: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """One micro-step: the loss is divided by the accumulation count so the summed gradients are
    those of the mean over the whole global batch; or, given its `weight` (chat_weights), multiplied by it.
    pos: packed conversations' positions, each attending to itself alone (document_mask). Returns that scaled
    loss, detached."""
    try:
        with plan.autocast():
            if pos is None:
                loss = model(x, y)
            else:
                loss = model(x, y, pos=pos, attn_mask=document_mask(pos))
            loss = loss / accum if weight is None else loss * weight
    except Exception as e:
        reason = graph_break_reason(e)
        if reason:
            raise UserError(
                f"graph break under --compile_fullgraph: {reason}; drop --compile_fullgraph to let torch.compile "
                "split the graph"
            ) from e
        raise
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return loss.detach()


def chat_weights(batches: list[tuple[torch.Tensor, ...]], info: DistInfo) -> torch.Tensor:
    """Each micro-batch's loss weight when their targets differ in number (chat data: only the assistant's
    tokens count): its count of targets over the step's, every micro-batch of every rank, times world_size (DDP and
    FSDP average the ranks' gradients). The weighted means then sum to the mean over every supervised token of the
    global batch, whatever the accumulation and the ranks. On the device: no host sync."""
    counts = torch.stack([(b[1] != IGNORE_INDEX).sum() for b in batches]).float()
    total = distributed.all_reduce_sum(counts.sum(), info)
    return counts * info.world_size / total.clamp(min=1)


class StepResult:
    """A step's loss (the mean over the global batch: all micro-steps, all ranks), its global gradient norm before
    clipping, and whether it was applied (False: skipped as non-finite; under fp16 the GradScaler skips overflow
    steps itself: True, with an inf grad_norm).

    Where the optimizer skips a non-finite step on the device (on_device), the three stay there until first
    read: the loop reads many steps' at once (read_all), so the host never waits for the device mid-run."""

    def __init__(self, values: torch.Tensor | tuple[float, float, bool]) -> None:
        self._values = values  # (loss, grad_norm, finite): a device tensor of 3, or read

    @property
    def on_device(self) -> bool:
        return isinstance(self._values, torch.Tensor)

    def _read(self) -> tuple[float, float, bool]:
        if isinstance(self._values, torch.Tensor):
            read_all([self])
        assert not isinstance(self._values, torch.Tensor)
        return self._values

    @property
    def loss(self) -> float:
        return self._read()[0]

    @property
    def grad_norm(self) -> float:
        return self._read()[1]

    @property
    def finite(self) -> bool:
        return self._read()[2]


def read_all(results: list[StepResult]) -> None:
    """Bring the values of every result still on the device to the host in one transfer (one host sync)."""
    waiting = [r for r in results if isinstance(r._values, torch.Tensor)]
    if not waiting:
        return
    with record_function(READOUT_RANGE):
        rows = torch.stack([r._values.float() for r in waiting]).tolist()  # type: ignore[union-attr]
    for r, (loss, norm, finite) in zip(waiting, rows, strict=True):
        r._values = (loss, norm, bool(finite))


class TrainStep:
    """The optimizer, the GradScaler and the learning-rate schedule of one run, and its step.

    `model` is what runs forward (compiled, DDP- or FSDP-wrapped); `raw` owns the parameters. Neither
    is changed here beyond the optimizer update.
    """

    def __init__(self, model: nn.Module, raw: nn.Module, plan: DevicePlan, cfg: TrainConfig,
                 info: DistInfo | None = None) -> None:
        self.model, self.raw, self.plan, self.cfg = model, raw, plan, cfg
        self.info = info or DistInfo()
        self.accum = cfg.gradient_accumulation_steps
        self.optimizer, self.fused = make_optimizer(
            raw, kind=cfg.optimizer, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
            device_type=plan.device.type, fused=cfg.fused_optimizer and not cfg.cpu_offload, muon_lr=cfg.muon_lr,
            muon_momentum=cfg.muon_momentum,
        )
        # (peak, final) learning rate of each param group: Muon's and AdamW's keep their own peaks
        assert cfg.min_lr is not None  # set by TrainConfig
        self.group_lrs = group_lrs(self.optimizer, lr=cfg.learning_rate, min_lr=cfg.min_lr, muon_lr=cfg.muon_lr)
        self.scaler = torch.amp.GradScaler(plan.device.type) if plan.use_grad_scaler else None
        # AdamW's fused kernel takes a found_inf flag and skips the update on the device when it is set (as it does
        # for the GradScaler): the finite check then needs no host sync, and the step's results stay on the device
        self.skips_on_device = (self.scaler is None and self.fused and isinstance(self.optimizer, torch.optim.AdamW))

    def lr(self, step: int) -> float:
        """AdamW's learning rate at step (what metrics.jsonl logs as `lr`)."""
        cfg = self.cfg
        return lr_at(step, cfg.learning_rate, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps)

    def __call__(self, step: int, next_batch: NextBatch) -> StepResult:
        """Train on one global batch at optimizer step `step` (0-based: it sets that step's learning rate)."""
        cfg = self.cfg
        for group, (peak, final) in zip(self.optimizer.param_groups, self.group_lrs, strict=True):
            group["lr"] = lr_at(step, peak, final, cfg.warmup_steps, cfg.decay_steps)
        # summed in place as each micro-step ends: a CUDA-graph output is overwritten by the next replay
        loss_sum = torch.zeros((), device=self.plan.device)
        sync_ranks = self.info.world_size > 1
        batches = [next_batch(micro) for micro in range(self.accum)]
        weights = chat_weights(batches, self.info) if len(batches[0]) == 3 else None
        with sdpa_backends(cfg.sdpa_backend):
            for micro, (x, y, *pos) in enumerate(batches):
                with distributed.no_sync(self.model, sync_ranks and micro < self.accum - 1):
                    loss_sum += forward_backward(self.model, x, y, self.plan, self.scaler, self.accum,
                                                 pos=pos[0] if pos else None,
                                                 weight=weights[micro] if weights is not None else None)
        return self.update(loss_sum)

    def update(self, loss_sum: torch.Tensor) -> StepResult:
        """Unscale, clip, then step unless the loss or the norm is non-finite: decided on the device where the
        fused AdamW takes the flag (skips_on_device), else after reading both (the step's one host sync)."""
        opt, scaler, cfg = self.optimizer, self.scaler, self.cfg
        if scaler is not None:
            scaler.unscale_(opt)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        loss_sum = distributed.all_reduce_mean(loss_sum, self.info)
        values = torch.stack([loss_sum.float(), grad_norm.float().to(loss_sum.device)])
        if self.skips_on_device:
            finite = values.isfinite().all()
            with skip_step_if(opt, (~finite).float()):  # read by the fused kernel
                opt.step()
            opt.zero_grad(set_to_none=True)
            return StepResult(torch.cat([values, finite.float().unsqueeze(0)]))
        with record_function(READOUT_RANGE):
            loss_val, norm_val = values.tolist()
        # Under fp16 an inf norm is the GradScaler's business (it skips the step and lowers the scale).
        finite = math.isfinite(loss_val) and (scaler is not None or math.isfinite(norm_val))
        if finite:
            (scaler.step(opt) if scaler is not None else opt.step())
        if scaler is not None:
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return StepResult((loss_val, norm_val, finite))
