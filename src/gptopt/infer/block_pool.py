"""The KV cache's blocks: which are free, who holds each, and which full blocks hold a known run of tokens.

    pytest -q tests/test_block_pool.py

The cache is one pool of `block_size`-token blocks (kv_cache.PagedKVCache holds their keys and values); a sequence
holds the blocks its tokens fill, listed in its block table, so memory goes to tokens written, not to a whole
context reserved per request. vLLM's block pool and SGLang's token pool rest on the same idea.

Prefix caching. A block whose `block_size` tokens are all written is registered under its key: the block before it
(its id and the generation of that id, so a block reused for other tokens never passes for the old one) and its
own tokens. A prompt's longest cached prefix is the chain of registered blocks that match its full blocks one by
one, each checked token for token (a dict keyed by the tokens themselves: no hash collision can give a wrong
hit). A hit takes a reference to the block: sequences that share a prefix share its blocks, one copy. Full blocks
are never written again, so a shared block needs no copy-on-write; a sequence's writes go to blocks of its own.

A block nobody references goes to the free queue's tail, still registered: the least recently freed is handed
out (and loses its registration) first, so cached prefixes live until their memory is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from gptopt.utils.errors import UserError

__all__ = ["NULL_BLOCK", "BlockPool", "NoFreeBlocks"]

# Block 0 is no sequence's: padding tokens write there and unused block-table entries point there, so a forward of
# a fixed shape (a padded prefill, a bucketed decode) never writes into a sequence's blocks. Masked, never attended.
NULL_BLOCK = 0

# The registration key of a block: (the block before it, that block's generation, its tokens)
Key = tuple[int, int, tuple[int, ...]]


class NoFreeBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for: the scheduler preempts, or the request waits."""


class BlockPool:
    """`num_blocks` usable blocks (ids 1..num_blocks; 0 is NULL_BLOCK), with reference counts, a free queue in
    least-recently-freed order, and the registry of full blocks' tokens (when `caching`)."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise UserError(f"a KV block pool needs at least one block of at least one token, got {num_blocks} "
                            f"blocks of {block_size}")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.refs = [0] * (num_blocks + 1)
        self.generation = [0] * (num_blocks + 1)  # bumped each time a block is handed out for new tokens
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks + 1))
        self._key: dict[int, Key] = {}  # registered block -> its key
        self._blocks: dict[Key, int] = {}  # key -> registered block
        # A full block whose key another block had already (a prefix computed twice at once) -> that block and its
        # generation then: the keys of the blocks after it name the registered one, so a lookup follows one chain
        # (and once that block is reclaimed for other tokens, its new generation matches no key made so).
        self._same: dict[int, tuple[int, int]] = {}
        # A scored prompt's entries (prompt_logprobs) of the positions a block holds, with their k alternatives:
        # a later prompt that asks for them takes them with the block (lm-evaluation-harness's choices).
        self.scores: dict[int, tuple[int, list[Any]]] = {}

    # -- counts ------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """Blocks no sequence references (cached ones included: they are reclaimed when needed)."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """The share of blocks sequences hold, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.used / self.num_blocks

    @property
    def cached(self) -> int:
        """Registered blocks (held or free): prefixes a prompt may hit."""
        return len(self._key)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- handing out and taking back ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks for new tokens, the least recently freed first (their registrations end)."""
        if n > len(self._free):
            raise NoFreeBlocks(f"{n} KV blocks asked for, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._unregister(b)
            self.generation[b] += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def take(self, blocks: Sequence[int]) -> None:
        """One more reference to each (a cached prefix hit): a free one leaves the free queue."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._free[b]
            self.refs[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One reference fewer to each. Blocks nobody holds join the free queue, last block first: a sequence's
        tail is then reclaimed before its beginning, which more prompts share."""
        for b in reversed(blocks):
            if b == NULL_BLOCK:
                continue
            if self.refs[b] < 1:
                raise RuntimeError(f"KV block {b} released more often than it was taken")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b] = None

    # -- prefix caching ----------------------------------------------------------------------
    def _parent(self, blocks: Sequence[int], i: int) -> tuple[int, int]:
        if i == 0:
            return NULL_BLOCK, 0
        b = blocks[i - 1]
        return self._same.get(b, (b, self.generation[b]))

    def register(self, blocks: Sequence[int], tokens: Sequence[int], start: int) -> None:
        """Blocks start.. of a sequence's table (`blocks`), each full of its tokens (tokens[i * block_size:]), are
        cached under their keys. A key some other block holds already keeps that block: a prefix computed twice at
        once is cached once (the second copy is freed as a plain block), and the blocks after it chain on."""
        if not self.caching:
            return
        bs = self.block_size
        for i in range(start, len(tokens) // bs):
            b = blocks[i]
            if b in self._key or b in self._same:
                continue
            key = (*self._parent(blocks, i), tuple(tokens[i * bs : (i + 1) * bs]))
            if key in self._blocks:
                canon = self._blocks[key]
                self._same[b] = (canon, self.generation[canon])
            else:
                self._blocks[key], self._key[b] = b, key

    def score(self, block: int, k: int, entries: list[Any]) -> None:
        """A scored prompt's entries of the positions `block` holds, with k alternatives, kept with the block (or
        the registered block of the same tokens) where it has none with as many."""
        b, generation = self._same.get(block, (block, self.generation[block]))
        if generation != self.generation[b]:  # the registered copy was reclaimed for other tokens
            return
        if b in self._key and (b not in self.scores or self.scores[b][0] < k):
            self.scores[b] = (k, entries)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The registered blocks that hold tokens' longest prefix of whole blocks, in order (no reference taken)."""
        if not self.caching:
            return []
        bs, hit = self.block_size, []
        for i in range(len(tokens) // bs):
            b = self._blocks.get((*self._parent(hit, i), tuple(tokens[i * bs : (i + 1) * bs])))
            if b is None:
                break
            hit.append(b)
        return hit

    def forget(self) -> None:
        """Every registration dropped (a warm-up's prompts are no one's)."""
        self._key.clear()
        self._blocks.clear()
        self._same.clear()
        self.scores.clear()

    def _unregister(self, b: int) -> None:
        self._same.pop(b, None)
        key = self._key.pop(b, None)
        if key is not None:
            del self._blocks[key]
        self.scores.pop(b, None)

    def check_idle(self) -> None:
        """Raise if any block is still referenced: with no sequence running, every block is free (a leak test)."""
        held = [b for b in range(1, self.num_blocks + 1) if self.refs[b]]
        if held or len(self._free) != self.num_blocks:
            raise AssertionError(f"KV blocks still referenced with no sequence running: {held[:20]}")
