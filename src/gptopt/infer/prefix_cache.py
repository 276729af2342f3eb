"""Prefix caching over the KV cache's slots: which tokens each slot's keys and values belong to, and which slot a
new prompt can start from, so that a prompt sharing its beginning with one seen before prefills only the rest.

    pytest -q tests/test_prefix_cache.py

A slot keeps what its last sequence wrote after that sequence ends, until another takes the slot: the cache
the memory plan already sized holds the prefixes, at no memory of its own. A new prompt is matched token by
token against every slot's tokens (running sequences' too); the longest match is copied into its own slot
(or used where it lies, when that is its own slot), and its prefill starts after it. A slot given to a new
sequence first moves what it holds to the free slot used least recently (or holding nothing), so what is
evicted is always the least recently used prefix, while new sequences still take the lowest free slot and
the running rows stay packed at the front (a decode of consecutive rows reads the cache without a gather).
llama.cpp's server reuses its slots' prefixes the same way; vLLM and SGLang share pages of one pool instead.

Keys and values depend only on the tokens at and before their position, so a reused prefix gives the same
continuation as a prefill of the whole prompt: the same tokens greedily, the same distribution sampled (what
differs is the rounding of a forward of another shape, as between prefill chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["MIN_COPY", "SlotPrefixes", "common_prefix"]

# Shared tokens under which a prompt recomputes its prefix rather than copy it from another slot: a copy of a
# few positions costs two small copies a layer, more than those positions add to a prefill forward. vLLM's
# pages hold 16 tokens, its smallest unit of reuse, too.
MIN_COPY = 16

# Tokens compared as one slice before the loop narrows down to the first difference
_STRIDE = 64


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens a and b share from their start."""
    n = min(len(a), len(b))
    i = 0
    while i + _STRIDE <= n and a[i : i + _STRIDE] == b[i : i + _STRIDE]:  # list slices compare in C
        i += _STRIDE
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPrefixes:
    """The tokens whose keys and values each cache slot holds, from position 0 on, and when each was last used.

    The Generator reports every write (`wrote`) and every slot it frees (`touch`); `best` finds the longest
    cached prefix of a prompt, `victim` the free slot whose prefix is evicted next."""

    def __init__(self, slots: int, max_len: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        # A prompt leaves room for one new token, so a prefix never covers the cache's last position (where
        # the rows of a padded or bucketed forward that are not a sequence's write).
        self.limit = max_len - 2
        # Where a prompt was scored (prompt_logprobs, k alternatives): entry j is token j + 1's TokenLogprob at
        # position j, so a slot of n tokens holds at most n - 1. A request that scores its prompt (each of
        # lm-evaluation-harness's choices does) reuses a prefix only with its entries.
        self.scores: list[list[Any]] = [[] for _ in range(slots)]
        self.score_k = [-1] * slots  # -1: not scored
        self._used_at = [0] * slots
        self._clock = 0

    def wrote(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        """`tokens` were written at positions start.. of `slot`: what lay from `start` on is gone. A write past
        the slot's known tokens leaves them alone (the positions between hold no token this knows)."""
        held = self.tokens[slot]
        if start <= len(held):
            del held[start:]
            held.extend(tokens)
            del self.scores[slot][max(start - 1, 0) :]  # token `start`'s entry is at position start - 1

    def keep(self, slot: int, n: int) -> None:
        """Only the first n tokens of `slot` stay valid (a new sequence writes after them)."""
        del self.tokens[slot][n:]
        del self.scores[slot][max(n - 1, 0) :]

    def set(self, slot: int, tokens: Sequence[int], scores: Sequence[Any] = (), k: int = -1) -> None:
        """`slot` now holds `tokens` (a copy from another slot), and their prompt's entries with k alternatives."""
        self.tokens[slot] = list(tokens)
        self.scores[slot], self.score_k[slot] = list(scores[: max(len(tokens) - 1, 0)]), k

    def score(self, slot: int, entries: Sequence[Any], k: int) -> None:
        """`slot`'s tokens were prefilled as a scored prompt: entries[j] is token j + 1's, with k alternatives."""
        self.scores[slot] = list(entries[: max(len(self.tokens[slot]) - 1, 0)])
        self.score_k[slot] = k

    def clear(self) -> None:
        for held, scores in zip(self.tokens, self.scores, strict=True):
            held.clear()
            scores.clear()

    def touch(self, slot: int) -> None:
        """`slot`'s prefix was used now (its sequence ended, or a prompt reused it)."""
        self._clock += 1
        self._used_at[slot] = self._clock

    def best(self, prompt: Sequence[int], k: int | None = None) -> tuple[int, int]:
        """(slot, n): the slot holding the longest prefix of `prompt`, n tokens of it, at most all but the prompt's
        last token (whose logits the prefill must make); n is 0 where no slot shares a token. k: the prompt is
        scored with k alternatives, so only a prefix scored with as many counts, as far as its entries reach."""
        slot, n = 0, 0
        for s, held in enumerate(self.tokens):
            if held and held[0] == prompt[0]:
                m = self.reusable(s, prompt, k)
                if m > n:
                    slot, n = s, m
        return slot, n

    def reusable(self, slot: int, prompt: Sequence[int], k: int | None = None) -> int:
        """Tokens of `prompt` that `slot` can give it (best's rule for one slot)."""
        shared = common_prefix(prompt, self.tokens[slot])
        m = min(shared, len(prompt) - 1, self.limit)
        if k is not None:  # token m's entry too: it must be the prompt's token m, and the slot must have scored it
            m = min(m, shared - 1, len(self.scores[slot])) if self.score_k[slot] >= k else 0
        return max(m, 0)

    def relocate(self, slot: int, free: Sequence[int], prompt: Sequence[int]) -> tuple[int, int] | None:
        """Before a sequence of `prompt` takes `slot`: where what the slot holds moves to, and how many tokens of it
        (the caller copies their keys and values), or None where it stays or goes. It stays where the prompt
        reuses nearly all of it in place, or another slot holds nearly all of it too; it goes where every other
        free slot holds a prefix used more recently (then it is the least recently used) or one the prompt
        takes."""
        held = self.tokens[slot][: self.limit]
        if len(held) < MIN_COPY or common_prefix(prompt, held) >= len(held) - MIN_COPY:
            return None
        if any(s != slot and common_prefix(held, t) >= len(held) - MIN_COPY for s, t in enumerate(self.tokens)):
            return None
        # never onto the prefix the prompt itself will take: that one is used now, not the least recently
        dst = self.victim([s for s in free if common_prefix(prompt, self.tokens[s]) < MIN_COPY], exclude=slot)
        if dst is None or self.tokens[dst] and self._used_at[dst] > self._used_at[slot]:
            return None
        self.tokens[dst], self._used_at[dst] = held, self._used_at[slot]
        self.scores[dst], self.score_k[dst] = self.scores[slot][: max(len(held) - 1, 0)], self.score_k[slot]
        return dst, len(held)

    def victim(self, free: Sequence[int], exclude: int) -> int | None:
        """The free slot, other than `exclude`, whose prefix goes first: one holding nothing, else the one used
        least recently; None when there is none."""
        others = [s for s in free if s != exclude]
        if not others:
            return None
        return min(others, key=lambda s: (bool(self.tokens[s]), self._used_at[s]))
