"""The optimizer: AdamW with weight-decay groups (fused kernel where available), or Muon for the hidden
weight matrices with AdamW for the rest; and the warmup + cosine schedule.

    python -c "import gptopt.train.optim as o; print([round(o.lr_at(s, 6e-4, 6e-5, 10, 100), 6) for s in (0, 50, 100)])"
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from gptopt.utils.errors import UserError

# Moonshot's scaling ("Muon is Scalable for LLM Training"): Muon's update is scaled to the RMS of an
# AdamW update, so Muon's learning rate and weight decay live on AdamW's scale (torch.optim.Muon's
# default, "original", would want rates some 50x larger: a second set of numbers to tune).
MUON_ADJUST_LR = "match_rms_adamw"


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """What Muon updates: the 2-D weights of the Linear layers inside the Transformer blocks (attention
    c_attn / c_proj, MLP c_fc / c_proj). Never the embeddings nor the head tied to them: a row of an
    embedding is a lookup, not a map whose singular values Newton-Schulz should even out."""
    return [m.weight for block in model.transformer.h for m in block.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad]


def param_groups(model: nn.Module, weight_decay: float, skip: Sequence[nn.Parameter] = ()) -> list[dict]:
    """Decay matrices (Linear weights, embeddings); not biases or LayerNorm gains, which are 1-D.
    skip: parameters another optimizer owns."""
    skipped = {id(p) for p in skip}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skipped]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def fused_available(device_type: str) -> bool:
    # torch's fused AdamW runs one kernel for all parameters (CUDA, and CPU since 2.4).
    return "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu", "mps")


def make_adamw(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
    fused: bool = True,
    skip: Sequence[nn.Parameter] = (),
) -> tuple[torch.optim.AdamW, bool]:
    """AdamW over the decay groups (less skip); returns (optimizer, whether the fused kernel is used)."""
    use_fused = fused and fused_available(device_type)
    opt = torch.optim.AdamW(
        param_groups(model, weight_decay, skip), lr=lr, betas=betas, eps=1e-8, **({"fused": True} if use_fused else {})
    )
    return opt, use_fused


class MuonAdamW:
    """Muon over the blocks' weight matrices and AdamW over everything else, as one optimizer.

    torch (2.13) has no public way to join two optimizers, and the step, the GradScaler and the
    checkpoints each want one object: they see the param_groups of both (Muon's first; the same
    dicts, so setting group["lr"] reaches the optimizer that owns it), one step, one zero_grad and
    one state dict. The GradScaler needs nothing more: unscale_ walks param_groups, and its step
    calls step() only when no gradient of either part is inf/NaN.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self, state)
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


AnyOptimizer = torch.optim.Optimizer | MuonAdamW


def make_optimizer(
    model: nn.Module,
    *,
    kind: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
    fused: bool = True,
    muon_lr: float | None = None,
    muon_momentum: float = 0.95,
) -> tuple[AnyOptimizer, bool]:
    """--optimizer adamw|muon over model's parameters; returns (optimizer, whether AdamW's fused kernel is used)."""
    if kind == "adamw":
        return make_adamw(model, lr=lr, weight_decay=weight_decay, betas=betas, device_type=device_type, fused=fused)
    if kind != "muon":
        raise UserError(f"--optimizer must be adamw or muon, got {kind!r}")
    hidden = muon_params(model)
    muon = torch.optim.Muon(hidden, lr=lr if muon_lr is None else muon_lr, weight_decay=weight_decay,
                            momentum=muon_momentum, nesterov=True, adjust_lr_fn=MUON_ADJUST_LR)
    adamw, use_fused = make_adamw(model, lr=lr, weight_decay=weight_decay, betas=betas, device_type=device_type,
                                  fused=fused, skip=hidden)
    return MuonAdamW(muon, adamw), use_fused


def kind_of(optimizer: AnyOptimizer) -> str:
    return "muon" if isinstance(optimizer, MuonAdamW) else "adamw"


def check_state(optimizer: AnyOptimizer, state: dict[str, Any]) -> None:
    """Refuse an optimizer state written by the other --optimizer (its tensors would not fit this one's)."""
    saved = "muon" if isinstance(state, dict) and set(state) == {"muon", "adamw"} else "adamw"
    ours = kind_of(optimizer)
    if saved != ours:
        raise UserError(
            f"the checkpoint's optimizer state is --optimizer {saved}'s, this run's is --optimizer {ours}: resume with "
            f"--optimizer {saved}, or start a new run from the checkpoint's weights with --init_from CHECKPOINT"
        )


def group_lrs(optimizer: AnyOptimizer, *, lr: float, min_lr: float, muon_lr: float | None) -> list[tuple[float, float]]:
    """Each param group's (peak, final) learning rate for the schedule, in param_groups' order. Muon's
    groups keep their own peak and end at the same share of it as AdamW's (min_lr / lr)."""
    n_muon = len(optimizer.muon.param_groups) if isinstance(optimizer, MuonAdamW) else 0
    muon_peak = lr if muon_lr is None else muon_lr
    muon = (muon_peak, muon_peak * min_lr / lr)
    return [muon] * n_muon + [(lr, min_lr)] * (len(optimizer.param_groups) - n_muon)


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warmup to max_lr over warmup_steps, then cosine down to min_lr at decay_steps, then flat."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
