"""Bits per byte: a language model's loss in a unit that does not depend on its tokenizer.

    python -c "from gptopt.data import bpb, loader; print(bpb.bytes_per_token(loader.TokenData('data/stdlib'), 'val'))"

A loss in nats per token rewards a tokenizer that cuts text into fewer, longer tokens: two models with
different vocabularies cannot be compared by it. Per byte of UTF-8 text they can:
bits/byte = loss_nats / ln 2 * tokens / bytes. train's evaluations and compress's report show it.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from gptopt.data.loader import TokenData

__all__ = ["bits_per_byte", "bytes_per_token"]

CHUNK = 1 << 16  # tokens decoded at a time: a short list for Python, a few hundred kB of text
# Tokens decoded at most per split: a split up to this size is decoded whole; a larger one in
# SAMPLE_TOKENS // CHUNK slices spread evenly over it, which estimates the ratio far closer than the
# loss itself is measured, and bounds the first evaluation's cost on a large val split, whose whole
# decoding would take long.
SAMPLE_TOKENS = 1 << 22

# The ratio of each split, per TokenData: computed once (decoding takes a moment), gone with the data.
_RATIOS: weakref.WeakKeyDictionary[TokenData, dict[str, float | None]] = weakref.WeakKeyDictionary()


def bits_per_byte(loss_nats: float, bytes_per_token: float | None) -> float | None:
    """A mean cross-entropy in nats per token, as bits per byte of the text; None without the byte ratio."""
    if bytes_per_token is None:
        return None
    return loss_nats / math.log(2) / bytes_per_token


def bytes_per_token(data: TokenData, split: str) -> float | None:
    """UTF-8 bytes of text per token in a split, from decoding its tokens with the data's tokenizer.

    End-of-text tokens count 0 bytes (they are no text). None where the data stores no tokenizer
    (nanoGPT's train.bin/val.bin: tiktoken or a character map, unknown here) or the split is empty.
    A slice boundary that cuts a multi-byte character counts it as U+FFFD: a few bytes in 64k tokens.
    """
    ratios = _RATIOS.setdefault(data, {})
    if split not in ratios:
        ratios[split] = _ratio(data, split)
    return ratios[split]


def _ratio(data: TokenData, split: str) -> float | None:
    tok = data.tokenizer()
    tokens = data.tokens(split)
    n = len(tokens)
    if tok is None or n == 0:
        return None
    if n <= SAMPLE_TOKENS:
        starts = range(0, n, CHUNK)
    else:
        starts = np.linspace(0, n - CHUNK, SAMPLE_TOKENS // CHUNK).astype(np.int64).tolist()
    decoded = nbytes = 0
    for s in starts:
        ids = tokens[s : s + CHUNK].tolist()
        nbytes += len(tok.decode(ids).encode("utf-8"))  # decode skips special tokens: end-of-text is 0 bytes
        decoded += len(ids)
    return nbytes / decoded if nbytes else None
