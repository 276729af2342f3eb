"""A decode step's attention read from the KV blocks where they lie, on CPUs: one pass over each row's keys and
values, none gathered first.

    pytest -q tests/test_paged_attention.py

The generic path (kv_cache.py) gathers each row's blocks into one tensor and hands it to SDPA: a copy of every
attended key and value, each step. A decode step's attention is little arithmetic on many bytes, so that copy would
cost as much as the attention itself at long contexts, where the keys outweigh the weights. vLLM's CPU build and
llama.cpp read their blocks in place with kernels of their own; torch has none for CPUs outside a compiled
FlexAttention, so this is a small C++ kernel (one (row, key/value head) per task: its query heads' scores over the
row's positions, the softmax, the weighted values), in cpu_kernels.py's extension, built on first use and cached by
CPU kind. Where it cannot be built (no compiler, no ninja), `kernel()` is None and the generic path serves, after
one log line saying so and why.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from gptopt.infer import cpu_kernels

__all__ = ["decode_attention", "decode_attention_qkv", "kernel"]


@functools.cache
def kernel() -> Any:
    """The built kernels (cpu_kernels.extension(): paged_decode), or None where they cannot be built or
    GPTOPT_PAGED_KERNEL=0 turns this one off."""
    if os.environ.get("GPTOPT_PAGED_KERNEL", "1") == "0":
        return None
    return cpu_kernels.extension()


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(hs)) v of a decode step, q (B, nh, 1, hs), each row over its first lengths[b] positions
    of the blocks tables[b] lists: (B, nh, 1, hs) in q's dtype. None where the kernel does not apply (not a CPU,
    not float32 or bfloat16, not built): the caller gathers instead."""
    if q.device.type != "cpu" or k_pool.dtype not in (torch.float32, torch.bfloat16):
        return None
    k = kernel()
    if k is None:
        return None
    B, nh, _, hs = q.shape
    out = k.paged_decode(q.reshape(B, nh, hs).float().contiguous(), k_pool, v_pool, tables, lengths, hs**-0.5)
    return out.view(B, nh, 1, hs).to(q.dtype)


def decode_attention_qkv(qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, write: torch.Tensor,
                         tables: torch.Tensor, lengths: torch.Tensor, nh: int, nkv: int) -> torch.Tensor:
    """A decode step's attention from c_attn's output qkv (B, 1, W), its queries and keys rotated: each row's key
    and value written to its pool row write[b], then decode_attention's softmax over the row's blocks, in one call.
    (B, 1, nh x hs) in qkv's dtype. Only where kernel() is built and the pools are qkv's dtype (serves_qkv)."""
    B, hs = qkv.shape[0], k_pool.shape[-1]
    out = kernel().paged_decode_qkv(qkv.view(B, -1), k_pool, v_pool, write, tables, lengths, nh, nkv, hs**-0.5)
    return out.view(B, 1, nh * hs)
