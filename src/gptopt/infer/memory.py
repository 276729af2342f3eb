"""A generator's memory, estimated before it is allocated: the weights, the KV cache and the largest
forward; and a server's default KV-cache slots, as many as fit.

    python -c "import gptopt.infer.memory as m, gptopt.config as c; print(m.inference_bytes(c.preset('tiny'), 8, 256))"
"""

from __future__ import annotations

import torch

from gptopt.config import GPTConfig
from gptopt.models.flops import param_count
from gptopt.runtime.memory import F32, Estimate, itemsize, largest_batch


def inference_bytes(config: GPTConfig, slots: int, max_len: int, *, dtype: torch.dtype | None = None) -> Estimate:
    """Peak bytes of a Generator with `slots` sequences of up to max_len tokens, weights in `dtype`
    (None: fp32): the weights, the KV cache, and the largest forward (a max_len prefill, a full decode)."""
    P, C, L, H, V = param_count(config), config.n_embd, config.n_layer, config.n_head, config.vocab_size
    w = itemsize(dtype)
    # a prefill of max_len tokens: the residual, q/k/v, the MLP's hidden layer (12 C per token, one
    # layer live at a time) and eager attention's scores (several fp32 copies of one layer's)
    prefill = max_len * 12 * C * w + 3 * F32 * H * max_len * max_len
    # a decode step of every slot: the same per token, the scores over the cache, a gather of one
    # layer's keys and values for non-consecutive slots, and fp32 logits
    kv = config.kv_heads * config.head_dim  # a position's keys in one layer: grouped-query attention keeps fewer
    decode = slots * (12 * C * w + 3 * F32 * H * max_len + (w + F32) * V) + 2 * slots * max_len * kv * w
    return Estimate({
        "weights": P * w,
        "KV cache": 2 * L * slots * max_len * kv * w,  # keys and values, every layer
        "forward": prefill + decode,
    })


# Default KV-cache slots of a server (auto_slots): CPU decode steps stop gaining throughput well before
# 64 rows; a GPU's at a few hundred rows of a GPT-2-class model, where the step turns compute-bound.
AUTO_SLOTS = {"cpu": 64, "cuda": 256}
AUTO_SLOTS_SHARE = 0.5  # of the free memory: the rest stays for the allocator's slack and the machine's other work


def auto_slots(config: GPTConfig, max_len: int, device: torch.device, *, dtype: torch.dtype | None = None) -> int:
    """A server's default KV-cache slots: as many as fit in AUTO_SLOTS_SHARE of the memory free now (the
    weights are loaded), with their forwards (inference_bytes), up to AUTO_SLOTS for the device; at least 1
    (a model that does not fit even so is refused by `require` with its figures)."""
    cap = AUTO_SLOTS.get(device.type, AUTO_SLOTS["cpu"])
    return max(1, largest_batch(lambda n: inference_bytes(config, n, max_len, dtype=dtype).without("weights"),
                                device, cap, share=AUTO_SLOTS_SHARE))
