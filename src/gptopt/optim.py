"""AdamW with weight-decay groups (fused kernel where available) and the warmup + cosine schedule.

    python -c "from gptopt.optim import lr_at; print([round(lr_at(s, 6e-4, 6e-5, 10, 100), 6) for s in (0, 5, 10, 50, 100)])"
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (Linear weights, embeddings); not biases or LayerNorm gains, which are 1-D."""
    params = [p for p in model.parameters() if p.requires_grad]
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
) -> tuple[torch.optim.AdamW, bool]:
    """AdamW over the decay groups; returns (optimizer, whether the fused kernel is used)."""
    use_fused = fused and fused_available(device_type)
    opt = torch.optim.AdamW(
        param_groups(model, weight_decay), lr=lr, betas=betas, eps=1e-8, **({"fused": True} if use_fused else {})
    )
    return opt, use_fused


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warmup to max_lr over warmup_steps, then cosine down to min_lr at decay_steps, then flat."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
