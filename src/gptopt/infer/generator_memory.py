"""A generator's memory, estimated before it is allocated: the weights, the KV cache and the largest
forward; and a server's default KV-cache slots, as many as fit.

    python -c "import gptopt.infer.generator_memory as m; print(m.inference_bytes(m.GPTConfig(), 8, 256))"
"""

from __future__ import annotations

import torch

from gptopt.config import GPTConfig
from gptopt.models.flops import param_count
from gptopt.models.gpt import CAUSAL_SPLIT_MIN
from gptopt.runtime.memory_check import F32, Estimate, itemsize, largest_batch


def live_widths(config: GPTConfig, *, decode: bool = False) -> tuple[int, int, int]:
    """What a forward holds per token at its widest points (no gradients: one layer's tensors at a time), in
    elements: (the residual, its norm and the new residual; attention's: c_attn's output, the rotated or normed
    queries and keys, under grouped-query attention the keys and values repeated to every query head where SDPA
    takes a prompt (a decode step and the eager path read them as stored, the queries regrouped instead), the
    output and its transpose; the MLP's: GELU's input and output, SwiGLU's activation, up projection and product).
    decode: a decode step's widths (one token a row)."""
    C, A, K, H = config.n_embd, config.n_head * config.head_dim, config.kv_heads * config.head_dim, config.mlp_hidden
    moved = config.positions == "rope" or config.qk_norm
    grouped = config.kv_heads != config.n_head
    repeated = grouped and config.attention != "eager" and not decode
    regrouped = grouped and not repeated and not moved  # a copy of the queries (a view of c_attn's output before)
    attention = (A + 2 * K) + (A + K if moved else 0) + (2 * A if repeated else 0) + (A if regrouped else 0) + 2 * A
    return 3 * C, attention, (3 if config.mlp == "swiglu" else 2) * H


def inference_bytes(config: GPTConfig, slots: int, max_len: int, *, dtype: torch.dtype | None = None) -> Estimate:
    """Peak bytes of a Generator with `slots` sequences of up to max_len tokens, weights in `dtype`
    (None: fp32): the weights, the KV cache, and the larger forward (a max_len prefill, a decode step of every
    slot over the whole cache), each from the model's shapes (live_widths)."""
    P, L, H, V = param_count(config), config.n_layer, config.n_head, config.vocab_size
    K = config.kv_heads * config.head_dim
    w = itemsize(dtype)
    base, attention, mlp = live_widths(config)
    _, row_widths, _ = live_widths(config, decode=True)
    eager = config.attention == "eager"
    # a prefill of max_len tokens: eager attention also holds one layer's scores and the softmax beside them (three
    # quarters of them from CAUSAL_SPLIT_MIN tokens: the two query blocks)
    scores = 2 * w * H * max_len * max_len * (3 / 4 if max_len >= CAUSAL_SPLIT_MIN else 1) if eager else 0
    # rotary in a model cast to a 16-bit dtype: its products with the fp32 cos and sin are fp32 before the cast back,
    # the queries' width of them, and the keys' too where QK-norm's fp32 output is what is rotated
    A = config.n_head * config.head_dim
    rotary = F32 * (A + (K if config.qk_norm else 0)) if config.positions == "rope" and w < F32 else 0
    prefill = max_len * w * base + max(max_len * (w * attention + rotary) + int(scores), max_len * w * mlp)
    # a decode step of every slot: the same per row; over the whole cache, a gather of one layer's keys and values
    # for non-consecutive slots (never repeated per query head), the scores; and fp32 logits
    cache = max_len * w * 2 * K
    row_attention = w * row_widths + rotary + cache + (2 * w * H * max_len if eager else 0)
    decode = slots * (w * base + max(row_attention, w * mlp) + F32 * V)
    return Estimate({
        "weights": P * w,
        "KV cache": 2 * L * slots * max_len * K * w,  # keys and values of the key/value heads, every layer
        "forward": max(prefill, decode),
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
