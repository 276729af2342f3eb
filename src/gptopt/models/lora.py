"""LoRA: low-rank adapters on a GPT's projections, trained while the model's own weights stay frozen (train
--lora_rank), merged into the weights for everything that runs the model, and written as a peft adapter folder.

    python -c "import gptopt.models.lora as l; help(l.add_lora)"

A checkpoint of a LoRA run holds the frozen weights as they were (model.safetensors, so a resumed run continues
bit for bit), the adapters in gptopt's names (ADAPTER), meta.json's "lora" (rank, alpha, targets), and the same
adapters in peft's names and config (PEFT_WEIGHTS, PEFT_CONFIG; models.hf.peft_adapter) where the model maps onto a
Hugging Face family:
`PeftModel.from_pretrained(base, CHECKPOINT)` loads them over the exported base. checkpoint.load_model merges the
adapters into the weights, so generate, serve, eval, compress and export run the fine-tuned model as any other.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# The projections adapted: the attention's (c_attn's queries, keys and values, c_proj) and the MLP's, as peft's
# "all-linear" (the head and the embedding are left alone)
TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_gate", "mlp.c_proj")
ADAPTER = "lora.safetensors"  # the adapters in gptopt's module names: <module>.lora_A, <module>.lora_B
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


class LoRALinear(nn.Linear):
    """nn.Linear whose frozen weight gets a trainable low-rank update, y = x W^T + b + scale (x A^T) B^T, with
    scale = alpha / rank: A (rank, in) drawn as peft draws it, B (out, rank) zero, so training starts from the
    model as it was."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw: dict[str, Any] = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


def add_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """`model` (a GPT) with each TARGETS projection of each block a LoRALinear, in place, and every other
    parameter frozen: only the adapters train."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:  # type: ignore[union-attr]
        for name in TARGETS:
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name)
            linear = getattr(parent, child, None)
            if isinstance(linear, nn.Linear) and not isinstance(linear, LoRALinear):
                setattr(parent, child, LoRALinear(linear, rank, alpha))
    return model


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor, by its name in the model's state dict."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA model's state dict -> (the frozen weights, the adapters)."""
    lora = {k: v for k, v in state.items() if k.endswith((".lora_A", ".lora_B"))}
    return {k: v for k, v in state.items() if k not in lora}, lora


def merge_into(state: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], alpha: float,
               rank: int) -> dict[str, torch.Tensor]:
    """The frozen weights `state` with every adapter of `lora` added (W + alpha / rank B A), in W's dtype."""
    out = dict(state)
    for key in lora:
        if key.endswith(".lora_A"):
            module = key.removesuffix(".lora_A")
            A, B = lora[key].float(), lora[module + ".lora_B"].float()
            w = out[module + ".weight"]
            out[module + ".weight"] = (w.float() + B @ A * (alpha / rank)).to(w.dtype)
    return out
