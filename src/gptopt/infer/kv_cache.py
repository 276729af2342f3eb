"""The KV cache: preallocated keys and values of every layer for a fixed number of slots, each row written at
its own positions, so that sequences of different lengths share one forward.

    python -c "from gptopt.infer.kv_cache import KVCache; help(KVCache)"
"""

from __future__ import annotations

import torch

from gptopt.config import GPTConfig
from gptopt.models.gpt import KVCacheLayer


class _LayerView:
    """One layer of a KVCache as one forward sees it: these rows, writing at these positions."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | slice, flat: torch.Tensor,
                 length: int) -> None:
        self.k, self.v, self.rows, self.flat, self.length = k, v, rows, flat, length

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Each row writes at its own positions: rows at different lengths share one forward. One
        # index_copy_ into the cache seen as rows of head_dim: faster on a CPU than the equivalent
        # cache[rows, :, positions] = ..., whose indexing around a slice takes a general scatter
        # (benchmarks/2026-12-04-serving-vs-transformers.md, "Where an engine iteration's time goes").
        hs = k.size(-1)
        self.k.view(-1, hs).index_copy_(0, self.flat, k.reshape(-1, hs).to(self.k.dtype))  # k: (B, nh, T, hs)
        self.v.view(-1, hs).index_copy_(0, self.flat, v.reshape(-1, hs).to(self.v.dtype))
        return self.k[self.rows, :, : self.length], self.v[self.rows, :, : self.length]  # (B, nh, S, hs)


class KVCache:
    """Preallocated keys/values for `slots` sequences of up to `max_len` tokens, every layer:
    (slots, n_kv_head, max_len, hs), n_kv_head the model's key/value heads (fewer than its query heads under
    grouped-query attention)."""

    def __init__(self, config: GPTConfig, slots: int, max_len: int, *, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        shape = (slots, config.kv_heads, max_len, config.head_dim)  # grouped-query attention keeps fewer heads
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.slots, self.max_len, self.n_kv_head, self.device = slots, max_len, config.kv_heads, torch.device(device)

    def layers(self, rows: torch.Tensor | slice, positions: torch.Tensor,
               length: int | None = None) -> list[KVCacheLayer]:
        """Per-layer views for one forward. rows: (B,) slot indices, or a slice of consecutive slots (the
        layers then return views of the cache, no gather copy). positions: (B, T) being written.
        length: return only the first `length` positions (more than any written), so fewer keys are attended."""
        if isinstance(rows, slice):
            # not rows.indices(): it would make a compiled decode's row count a constant (one graph per count)
            assert rows.step in (None, 1), "a slice of rows must be consecutive"
            start, stop = rows.start or 0, self.slots if rows.stop is None else rows.stop
            index = torch.arange(start, stop, device=self.device)
        else:
            index = rows
        # (B, nh, T): the row of each written key in the cache viewed as (slots * nh * max_len, hs)
        heads = torch.arange(self.n_kv_head, device=self.device)
        flat = ((index[:, None, None] * self.n_kv_head + heads[None, :, None]) * self.max_len + positions[:, None, :])
        flat = flat.reshape(-1)
        length = self.max_len if length is None else length
        return [_LayerView(k, v, rows, flat, length) for k, v in zip(self.k, self.v, strict=True)]

    def copy(self, src: int, dst: int, n: int) -> None:
        """Slot `dst`'s first n positions become `src`'s, every layer (a cached prefix taken over)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :n].copy_(k[src, :, :n])
            v[dst, :, :n].copy_(v[src, :, :n])

    def mask(self, positions: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """(B, 1, T, length) bool, True where the key's position <= the query's: each row sees its own past only."""
        keys = torch.arange(self.max_len if length is None else length, device=positions.device)
        return (keys <= positions[..., None]).unsqueeze(1)
