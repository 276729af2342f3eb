"""Tokens -> text that ends at a stop string: StopChecker, an incremental detokenizer (vLLM's scheme), and
unescape, the shell escapes a --stop string may use.

    python -c "from gptopt.infer.stop import unescape; print(repr(unescape('a\\\\nb')))"
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tokenizers import Tokenizer


def unescape(text: str) -> str:
    """The escapes a shell cannot type easily (\\n, \\t, \\r, \\\\) -> their characters; other text as it is."""
    return re.sub(r"\\[ntr\\]", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group()[1]], text)


class StopChecker:
    """Incremental detokenizer: a growing list of token ids -> text safe to show, ended at a stop string.

    Byte-level BPE splits multi-byte characters (emoji, accents) across tokens, so text ending in
    U+FFFD (an incomplete UTF-8 sequence) is held back until a later token completes it. A stop
    string may span tokens, so the longest tail that could begin one is held back too. The text
    before a stop string is emitted; the stop string and anything after it never are.

        checker = StopChecker(tokenizer, ("\\n\\n",))
        for token in stream(gen, ids, params):
            print(checker.add(token), end="")
            if checker.stopped:
                break
        print(checker.finish())
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        # Each stop string's proper prefixes by their last character, longest first: the tail held back
        # is found by trying only the prefixes that end as the text does, not every prefix of every string.
        self._prefixes: dict[str, list[str]] = {}
        for p in sorted({s[:k] for s in self.stop for k in range(1, len(s))}, key=len, reverse=True):
            self._prefixes.setdefault(p[-1], []).append(p)
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False
        # ids[_prefix:_read] is text already accounted for: decoding a short window, not the whole
        # list, keeps each step O(1) and still gives the decoder its context (vLLM's scheme).
        self._prefix = self._read = 0
        self._pending = ""  # decoded but held back: it may be the start of a stop string

    def add(self, token: int) -> str:
        """Take one token; the new text that is safe to show now (often "")."""
        if self.stopped:
            return ""
        self.ids.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The held-back rest, when no more tokens come (an incomplete character stays U+FFFD)."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self.tokenizer.decode  # skips special tokens (<|endoftext|>) by default
        before, after = decode(self.ids[self._prefix : self._read]), decode(self.ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # an incomplete character: wait for the token that completes it
        self._prefix, self._read = self._read, len(self.ids)
        text = self._pending + after[len(before) :]
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self._pending, self.stopped = text[: min(hits)], "", True
        else:  # hold back the longest tail that may begin a stop string
            hold = 0 if final or not text else next(
                (len(p) for p in self._prefixes.get(text[-1], ()) if text.endswith(p)), 0)
            out, self._pending = text[: len(text) - hold], text[len(text) - hold :]
        self.text += out
        return out
