"""The paged KV cache: keys and values of every layer in one pool of fixed-size blocks, written through a slot
mapping and read through block tables, so sequences of different lengths, sharing blocks or not, run in one
forward.

    python -c "from gptopt.infer.kv_cache import PagedKVCache; help(PagedKVCache)"

Which block holds what is block_pool.py's; this holds the tensors. A forward's attention gathers each row's
blocks, in its table's order, into the (B, kv_heads, S, head_dim) keys and values the model's attention takes
(models/gpt.py's KVCacheLayer), and masks every key past the row's own position: table entries beyond a row's
blocks point at NULL_BLOCK, which is masked like any key not yet written.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gptopt.config import GPTConfig
from gptopt.infer import paged_attention
from gptopt.models.gpt import KVCacheLayer

__all__ = ["PagedKVCache"]


class _LayerView:
    """One layer of the pool as one forward sees it: new keys written at `write`, and `read`'s blocks attended."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, write: torch.Tensor, read: torch.Tensor | None,
                 length: int, tables: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> None:
        """read: the rows' block tables flattened, (B x W,), or None. tables, lengths: a decode step's (B, W) block
        tables and (B,) keys per row, for the attention that reads the blocks in place (paged_attention.py)."""
        self.k, self.v, self.write, self.read, self.length = k, v, write, read, length
        self.tables, self.lengths = tables, lengths

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """A decode step's attention over the blocks where they lie, after writing k and v; None where the kernel
        does not serve (not a decode step, not a CPU, not built): the model then calls update and SDPA."""
        if self.lengths is None or q.shape[2] != 1 or paged_attention.kernel() is None:
            return None
        self._write(k, v)
        assert self.tables is not None
        return paged_attention.decode_attention(q, self.k, self.v, self.tables, self.lengths)

    def serves_qkv(self, x: torch.Tensor) -> bool:
        """Whether attend_qkv serves the attention of x (B, T, C), before its c_attn product: a decode step (one
        token a row) on the CPU kernel, in the pool's dtype."""
        return self.lengths is not None and x.shape[1] == 1 and x.dtype == self.k.dtype and \
            x.device.type == "cpu" and paged_attention.kernel() is not None

    def attend_qkv(self, qkv: torch.Tensor, nh: int, nkv: int) -> torch.Tensor:
        """A decode step's attention straight from c_attn's output (B, 1, W), contiguous (serves_qkv): the keys and
        values written and the blocks read in one kernel, with none of the per-head views and copies in between.
        (B, 1, nh x hs)."""
        assert self.tables is not None and self.lengths is not None
        return paged_attention.decode_attention_qkv(qkv, self.k, self.v, self.write, self.tables, self.lengths, nh, nkv)

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        B, nkv, T, hs = k.shape
        # one index_copy_ per pool: the tokens' rows of (blocks x block_size, nkv, hs)
        self.k.view(-1, nkv, hs).index_copy_(0, self.write, k.transpose(1, 2).reshape(B * T, nkv, hs).to(self.k.dtype))
        self.v.view(-1, nkv, hs).index_copy_(0, self.write, v.transpose(1, 2).reshape(B * T, nkv, hs).to(self.v.dtype))

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, nkv, T, hs = k.shape  # (B, nkv, T, hs)
        self._write(k, v)
        if self.read is None:  # a prompt from position 0 alone: it attends to its own keys, as computed
            return k, v
        # each row's blocks in table order, a whole block per copy (index_select copies contiguous slices, where
        # indexing with the (B, W) table copies element by element)
        S = self.read.numel() // B * self.k.shape[1]
        keys = torch.index_select(self.k, 0, self.read).view(B, S, nkv, hs)[:, : self.length]
        values = torch.index_select(self.v, 0, self.read).view(B, S, nkv, hs)[:, : self.length]
        return keys.transpose(1, 2), values.transpose(1, 2)  # (B, nkv, S, hs)


def _zeros(shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Zeros, not empty: a masked key's value still enters the gathered attention's weighted sum (times zero), and
    NaN garbage would not vanish. On a CPU from calloc (numpy's zeros), whose large allocations are pages the kernel
    maps zeroed on first touch: a pool of gigabytes is ready at once, where writing its zeros took seconds, and
    its memory is taken as blocks are first used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    raw = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class PagedKVCache:
    """Keys and values of `blocks` blocks of `block_size` tokens, every layer: (blocks, block_size, kv_heads,
    head_dim) each, kv_heads the model's key/value heads (fewer than its query heads under grouped-query
    attention). Block 0 is block_pool.NULL_BLOCK."""

    def __init__(self, config: GPTConfig, blocks: int, block_size: int, *, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        shape = (blocks, block_size, config.kv_heads, config.head_dim)
        self.k = [_zeros(shape, device, dtype) for _ in range(config.n_layer)]
        self.v = [_zeros(shape, device, dtype) for _ in range(config.n_layer)]
        self.blocks, self.block_size, self.device = blocks, block_size, torch.device(device)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.k + self.v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layers(self, write: torch.Tensor, read: torch.Tensor | None, length: int, *,
               lengths: torch.Tensor | None = None) -> list[KVCacheLayer]:
        """Per-layer views for one forward. write: (B x T,) the pool row (block x block_size + offset) of each
        token's keys, row-major over (B, T). read: (B, W) each row's block table, W x block_size >= length, or
        None for a forward that attends to its own keys alone. length: keys attended per row. lengths: for a
        decode step, (B,) keys each row attends, so its attention may read the blocks in place."""
        flat = None if read is None else read.reshape(-1)  # (B x W,): read once for every layer
        tables = None if lengths is None or read is None else read.contiguous()
        return [_LayerView(k, v, write, flat, length, tables, lengths) for k, v in zip(self.k, self.v, strict=True)]

    @staticmethod
    def mask(positions: torch.Tensor, length: int) -> torch.Tensor:
        """(B, 1, T, length) bool, True where the key's position <= the query's: each row sees its own past only."""
        keys = torch.arange(length, device=positions.device)
        return (keys <= positions[..., None]).unsqueeze(1)
