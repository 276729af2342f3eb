"""Log-probabilities in OpenAI's shapes: the legacy completions object and chat's `logprobs.content`.

    pytest -q tests/test_logprobs.py

The numbers come from the Generator (sampling.TokenLogprob: log_softmax of the model's raw logits,
before penalty, temperature, top-k and top-p). This module only names the tokens and places them in
the text: `Vocab` gives a token's text and bytes, `CompletionLogprobs` builds one choice's `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset` as its tokens arrive, `chat_content` the entries
of a chat choice; CompletionChoice and ChatChoice give each engine event's text and logprobs object.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer, decoders

from gptopt.infer.sampling import TokenLogprob
from gptopt.serve.events import Event

__all__ = ["ChatChoice", "CompletionChoice", "CompletionLogprobs", "Vocab", "chat_content"]


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _byte_level_chars()


class Vocab:
    """A token id's text and UTF-8 bytes, as OpenAI shows them; cached, since a request repeats tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = isinstance(getattr(tokenizer, "decoder", None), decoders.ByteLevel)
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        """The token's own bytes: a piece of a multi-byte character is not valid UTF-8 on its own."""
        if token not in self._bytes:
            piece = self.tokenizer.id_to_token(token) or ""
            if self._byte_level and all(c in _BYTE_OF for c in piece):
                self._bytes[token] = bytes(_BYTE_OF[c] for c in piece)
            else:
                self._bytes[token] = self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")
        return self._bytes[token]

    def text(self, token: int) -> str:
        """The token's text; OpenAI's "bytes:\\xNN..." for a token that is not whole characters."""
        raw = self.bytes_of(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CompletionLogprobs:
    """One completion choice's `logprobs` object (OpenAI's legacy shape), built as its tokens arrive.

    `add` takes tokens in text order (an echoed prompt first, then the new tokens) and returns the
    object for just those (a stream chunk's); `whole` is every token's. text_offset is where each
    token's text starts in the choice's text: a token inside a multi-byte character points at the
    character's start, and none points past the text shown so far (a stop string is cut from it)."""

    FIELDS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.all: dict[str, list[Any]] = {f: [] for f in self.FIELDS}
        self._done = 0  # characters of whole text before the ids in _tail
        self._tail: list[int] = []

    def _offset(self, token: int, decode: Any) -> int:
        # Decoding only the tokens since the last whole character keeps this O(1) a token. While the text
        # ends in U+FFFD the character may still be completing: the token belongs to it. Once it does not, the
        # token's text starts where the text before it stops agreeing with the text with it: a character the
        # token completes begins before it, and a byte nothing completed stays U+FFFD, a character of the text.
        before = decode(self._tail)
        self._tail.append(token)
        text = decode(self._tail)
        if text.endswith("\ufffd"):
            return self._done + len(before.rstrip("\ufffd"))
        offset = self._done + len(os.path.commonprefix([before, text]))
        self._done, self._tail = self._done + len(text), []
        return offset

    def add(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None], *, shown: int,
            skip_special: bool = True) -> dict[str, list[Any]]:
        """These tokens (entries[i] for ids[i]; None: no logprob, as for a prompt's first token), placed in
        text of which `shown` characters exist so far. skip_special: whether the text leaves out special
        tokens (the completion does; an echoed prompt of token ids shows them)."""
        def decode(xs: list[int]) -> str:
            return self.vocab.tokenizer.decode(xs, skip_special_tokens=skip_special)

        out: dict[str, list[Any]] = {f: [] for f in self.FIELDS}
        for token, e in zip(ids, entries, strict=True):
            out["tokens"].append(self.vocab.text(token))
            out["text_offset"].append(min(self._offset(token, decode), shown))
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            # The k most likely and the token itself (OpenAI includes it), most likely first; of two
            # tokens with one text, the likelier one's number stays.
            pairs = sorted([*e.top, *([] if any(t == e.token for t, _ in e.top) else [(e.token, e.logprob)])],
                           key=lambda p: -p[1])
            top: dict[str, float] = {}
            for t, v in pairs:
                top.setdefault(self.vocab.text(t), v)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(top)
        for f in self.FIELDS:
            self.all[f] += out[f]
        return out

    def start_at(self, offset: int) -> None:
        """The next token's text starts at `offset` (after an echoed prompt: the completion follows it)."""
        self._done, self._tail = offset, []


def chat_content(vocab: Vocab, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI chat's `choices[].logprobs.content`: per token {token, logprob, bytes, top_logprobs}, its
    top_logprobs the k most likely tokens (request's top_logprobs), most likely first."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": vocab.text(token), "logprob": logprob, "bytes": list(vocab.bytes_of(token))}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]


class CompletionChoice:
    """One completion choice's echo and `logprobs` object, event by event (a stream's chunks, or the one
    event the server's collect() gathers). With logprobs the echoed prompt goes out with the first event, which
    carries the prompt's log-probabilities; without, a stream sends it at once."""

    def __init__(self, vocab: Vocab, prompt: list[int], echo: str | None, logprobs: bool) -> None:
        self.prompt, self.echo = prompt, echo
        self.logprobs = CompletionLogprobs(vocab) if logprobs else None
        self.shown = 0  # characters of the choice's text so far

    def chunk(self, ev: Event) -> tuple[str, dict[str, list[Any]] | None]:
        """The text this event adds (the echo before the first) and its tokens' logprobs object."""
        fmt = self.logprobs
        if fmt is None:
            return ev.text, None
        text, part = ev.text, {f: [] for f in CompletionLogprobs.FIELDS}
        if self.echo is not None:  # the first event: the prompt's tokens first, its first without a logprob
            text, self.shown = self.echo + text, len(self.echo)
            entries: list[Any] = [None, *(ev.prompt_logprobs or [])]
            part = fmt.add(self.prompt, entries + [None] * (len(self.prompt) - len(entries)), shown=self.shown,
                           skip_special=False)
            fmt.start_at(self.shown)
            self.echo = None
        self.shown += len(ev.text)
        new = fmt.add([e.token for e in ev.logprobs or []], ev.logprobs or [], shown=self.shown)
        return text, {f: part[f] + new[f] for f in CompletionLogprobs.FIELDS}


class ChatChoice:
    """A chat choice's `logprobs` object ({"content": [...]}), event by event, or None when not asked."""

    echo = None  # a chat echoes nothing

    def __init__(self, vocab: Vocab, logprobs: bool, stop_ids: tuple[int, ...]) -> None:
        self.vocab, self.logprobs, self.stop_ids = vocab, logprobs, stop_ids

    def chunk(self, ev: Event) -> tuple[str, dict[str, list[Any]] | None]:
        if not self.logprobs:
            return ev.text, None
        # The stop token that ends a reply (end-of-text, the template's eos) is no part of its content.
        entries = [e for e in ev.logprobs or [] if e.token not in self.stop_ids]
        return ev.text, {"content": chat_content(self.vocab, entries)}
