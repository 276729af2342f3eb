"""The blocklist: text refused in prompts and cut from generated output, matched in bounded time.

    pytest -q tests/test_serve.py -k blocklist

A blocklist file holds one rule a line; blank lines and lines starting with '#' are skipped:

    forbidden words        a plain term: found anywhere in the text, ignoring case, taken literally
    re:secr[e3]t           `re:` and a regular expression (Python's syntax), also ignoring case

Plain terms are the common case and cannot be slow. A regular expression can backtrack
exponentially ((a|a)+$ over forty a's would run for years), so every search runs under the `regex`
module's timeout, with the GIL released (concurrent=True) so the event loop and the engine thread
go on meanwhile. A search that runs out of time counts as a match: the prompt is refused, or the
output is cut, and only the request that sent that text pays for it. (The regex module counts CPU
time; app.py also bounds the wait for a prompt check by the wall clock.)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gptopt.extras import require

regex = require("regex", "serve", "gptopt serve")

log = logging.getLogger(__name__)

REGEX_PREFIX = "re:"
# A prompt check is off the event loop (app.py), so it may take a while before it refuses; a check of
# new output runs on the engine thread between decode steps, where every running request waits for it.
PROMPT_CHECK_SECONDS = 1.0
OUTPUT_CHECK_SECONDS = 0.05
_REGEX_LOOKING = set("\\[]()|*+?{}^$")  # characters that suggest a line was meant as a regular expression


class CheckTimeout(Exception):
    """A blocklist search ran past its time limit; callers treat the text as blocked."""


class Blocklist:
    """Plain terms and regular expressions (see the module docstring), searched with a time limit."""

    def __init__(self, terms: list[str] | tuple[str, ...] = (), patterns: list[str] | tuple[str, ...] = (),
                 *, timeout: float = PROMPT_CHECK_SECONDS) -> None:
        self.terms, self.sources = tuple(terms), tuple(patterns)
        self.timeout = timeout  # seconds first_blocked may take over one request's prompts
        flags = regex.IGNORECASE
        # The terms in one alternation of escaped literals: one pass over the text, nothing to backtrack.
        literal = "|".join(regex.escape(t) for t in sorted(self.terms, key=len, reverse=True))
        self._searches = ([regex.compile(literal, flags)] if self.terms else []) + [
            regex.compile(p, flags) for p in self.sources]  # one each: their group numbers stay their own
        # Output is released only once no match can start in it; for a term that is its length. For a
        # regular expression the source length is the estimate (exact for literal ones).
        self.holdback = max((len(x) for x in (*self.terms, *self.sources)), default=0)

    def __bool__(self) -> bool:
        return bool(self._searches)

    def find(self, text: str, pos: int = 0, *, timeout: float) -> int | None:
        """Where the first match at or after `pos` starts, or None; CheckTimeout past `timeout` seconds."""
        return self._find(text, pos, time.monotonic() + timeout, timeout)

    def _find(self, text: str, pos: int, deadline: float, limit: float) -> int | None:
        first = None
        for search in self._searches:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckTimeout(f"the blocklist check took longer than {limit:g} s")
            try:
                m = search.search(text, pos, timeout=left, concurrent=True)
            except TimeoutError:
                raise CheckTimeout(f"the blocklist check took longer than {limit:g} s") from None
            if m is not None and (first is None or m.start() < first):
                first = m.start()
        return first

    def first_blocked(self, texts: list[str]) -> int | None:
        """The index of the first text with a match, or None; CheckTimeout past self.timeout for all of them."""
        deadline = time.monotonic() + self.timeout
        for i, text in enumerate(texts):
            if self._find(text, 0, deadline, self.timeout) is not None:
                return i
        return None


def load_blocklist(path: str | None) -> Blocklist:
    """The rules of the file at `path` (none without one); a bad line is a ValueError naming it."""
    if not path:
        return Blocklist()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--blocklist {path}: cannot read it as UTF-8 text ({e})") from None
    terms, patterns = [], []
    for i, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith(REGEX_PREFIX):
            terms.append(line)
            continue
        source = line[len(REGEX_PREFIX):].strip()
        try:
            compiled = regex.compile(source, regex.IGNORECASE)
        except regex.error as e:
            raise ValueError(f"--blocklist {path}:{i}: not a valid regular expression ({e})") from None
        try:
            empty = compiled.search("", timeout=PROMPT_CHECK_SECONDS) is not None
        except TimeoutError:
            empty = True
        if empty:
            raise ValueError(f"--blocklist {path}:{i}: {source!r} matches the empty string, so it would block "
                             "every prompt; make it match at least one character")
        patterns.append(source)
    for term in terms:
        if _REGEX_LOOKING & set(term):
            log.warning("--blocklist %s: %r is matched as plain text; write 're:%s' for a regular expression",
                        path, term, term)
    return Blocklist(terms, patterns)


class TextFilter:
    """Cuts generated text at the first blocklist match, holding back what could still become one.

    Stop strings are handled by generate.StopChecker; this works on its output. Streaming cannot take
    text back, so the last `holdback` characters wait until the match is decided. Each search starts
    `holdback` characters before the unreleased text, so its cost per token stays bounded however long
    the output grows; a search past OUTPUT_CHECK_SECONDS cuts the text where nothing was released yet.
    """

    def __init__(self, blocklist: Blocklist, timeout: float = OUTPUT_CHECK_SECONDS) -> None:
        self.blocklist, self.timeout = blocklist, timeout
        self.holdback = blocklist.holdback
        self.text = ""  # everything received
        self.sent = 0  # characters of self.text already released

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text to release now, matched?). After a match nothing more is released."""
        if not text and not final:
            return "", False  # nothing new: no new match, and no more text may be released
        self.text += text
        start = max(0, self.sent - self.holdback)
        try:
            cut = self.blocklist.find(self.text, start, timeout=self.timeout)
        except CheckTimeout:
            cut = self.sent  # undecided in time: treated as a match
        if cut is not None:
            out, self.sent = self.text[self.sent : max(cut, self.sent)], len(self.text)
            return out, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent : end], end
        return out, False
