"""The blocklist: text refused in prompts and cut from generated output, matched in bounded time.

    pytest -q tests/test_serve_guard.py -k blocklist

A blocklist file holds one rule a line; blank lines and lines starting with '#' are skipped:

    forbidden words        a plain term: found anywhere in the text, ignoring case, taken literally
    re:secr[e3]t           `re:` and a regular expression (Python's syntax), also ignoring case

Generated text is streamed, and streaming cannot take text back: the last characters wait until no
match can start in them (TextFilter). So a rule must have a longest match, at most MAX_HOLDBACK
characters with what its assertions read past it (`$`, `\\b`, a lookahead): `a{1,20}`, not `a+`. Its
anchors mean the output's end: `$` matches only once the output is complete.

Plain terms are the common case and cannot be slow. A regular expression can backtrack
exponentially ((a|a){1,60}$ tries 2**40 ways to fail on forty a's and a '!'), so every search runs
under the `regex` module's timeout, with the GIL released (concurrent=True) so the event loop and
the engine thread go on meanwhile. A search that runs out of time counts as a match: the prompt is
refused, or the output is cut, and only the request that sent that text pays for it. (The regex
module counts CPU time; app.py also bounds the wait for a prompt check by the wall clock.)
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

regex = require("regex", "serve", "gptopt serve")
try:  # Python's own parser of its regular expression syntax: how long a rule's matches may be
    from re import _constants as _sre
    from re import _parser
except ImportError:  # Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

log = logging.getLogger(__name__)

REGEX_PREFIX = "re:"
# A prompt check is off the event loop (app.py), so it may take a while before it refuses; a check of
# new output runs on the event loop as the text arrives (output.py), where every stream of that loop waits for it.
PROMPT_CHECK_SECONDS = 1.0
OUTPUT_CHECK_SECONDS = 0.05
# Characters a rule's match may span, with what its assertions read past it. Held-back output reaches the
# client only once it is decided, so a rule that needs more would keep most of a reply from streaming.
MAX_HOLDBACK = 1000
# How far past its position an assertion reads: `$` the end or a newline just before it, `\Z` the end,
# `\b` and `\B` the next character.
_AT_REACH = {_sre.AT_END: 2, _sre.AT_END_STRING: 1, _sre.AT_BOUNDARY: 1, _sre.AT_NON_BOUNDARY: 1}
_REPEATS = tuple(getattr(_sre, op) for op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                 if hasattr(_sre, op))  # POSSESSIVE_REPEAT: Python 3.11+
_REGEX_LOOKING = set("\\[]()|*+?{}^$")  # characters that suggest a line was meant as a regular expression


class CheckTimeout(Exception):
    """A blocklist search ran past its time limit; callers treat the text as blocked."""


def extent(source: str) -> tuple[int, int]:
    """(the longest match of the regular expression `source`, how far past a match's end its assertions may
    read); a ValueError saying why when their sum has no bound within MAX_HOLDBACK."""
    try:
        parsed = _parser.parse(source, re.IGNORECASE)
    except (re.error, RecursionError, OverflowError):
        raise UserError(f"{source!r} uses syntax that Python's re does not read, so how long its matches "
                         "may be cannot be told; write it in Python's syntax") from None
    width, reach = parsed.getwidth()[1], _reach(parsed)
    if width + reach > MAX_HOLDBACK:
        unbounded = width + reach >= _sre.MAXREPEAT
        why = ("has no longest match (a repeat without an upper bound: +, *, {n,})" if unbounded
               else f"may match {width + reach} characters")
        raise UserError(f"{source!r} {why}, and generated text is held back at most {MAX_HOLDBACK} "
                         "characters until no match can start in it; bound the repeats, e.g. {1,20} for +")
    return width, reach


def _reach(pattern: Any) -> int:
    """How far past the position where it is tried a parsed pattern's assertions may read: anchors and
    word boundaries at its end, lookaheads."""
    reach = 0
    for op, av in pattern:
        if op is _sre.AT:
            reach = max(reach, _AT_REACH.get(av, 0))
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            direction, inner = av  # direction 1: a lookahead, which reads the text its pattern spans
            reach = max(reach, (inner.getwidth()[1] if direction == 1 else 0) + _reach(inner))
        elif op is _sre.BRANCH:
            reach = max([reach, *(_reach(p) for p in av[1])])
        elif op is _sre.GROUPREF_EXISTS:
            reach = max([reach, *(_reach(p) for p in av[1:] if p is not None)])
        elif op is _sre.SUBPATTERN or op in _REPEATS:
            reach = max(reach, _reach(av[-1]))
        elif op is getattr(_sre, "ATOMIC_GROUP", None):
            reach = max(reach, _reach(av))
    return reach


class Blocklist:
    """Plain terms and regular expressions (see the module docstring), searched with a time limit."""

    def __init__(self, terms: list[str] | tuple[str, ...] = (), patterns: list[str] | tuple[str, ...] = (),
                 *, timeout: float = PROMPT_CHECK_SECONDS) -> None:
        self.terms, self.sources = tuple(terms), tuple(patterns)
        self.timeout = timeout  # seconds first_blocked may take over one request's prompts
        flags = regex.IGNORECASE
        # The terms in one alternation of escaped literals: one pass over the text, nothing to backtrack.
        literal = "|".join(regex.escape(t) for t in sorted(self.terms, key=len, reverse=True))
        extents = [extent(p) for p in self.sources]
        # Each search with how far past a match's end it may read: a match is decided once that much follows.
        # One per expression: their group numbers stay their own.
        self._searches = ([(regex.compile(literal, flags), 0)] if self.terms else []) + [
            (regex.compile(p, flags), reach) for p, (_, reach) in zip(self.sources, extents, strict=True)]
        # Output is released only once no match can start in it: a match's length and what it reads past it.
        self.holdback = max([len(t) for t in self.terms] + [width + reach for width, reach in extents],
                            default=0)

    def __bool__(self) -> bool:
        return bool(self._searches)

    def find(self, text: str, pos: int = 0, *, timeout: float, final: bool = True) -> int | None:
        """Where the first match at or after `pos` starts, or None; CheckTimeout past `timeout` seconds.

        final=False: `text` is output that goes on, where `$` would match at its end so far, a `\\b` or a
        negative lookahead short of the text that decides it. A match counts only once enough text follows
        it to decide it; when one does, the first match found, decided or not, is where the text is cut."""
        return self._find(text, pos, time.monotonic() + timeout, timeout, final)

    def _find(self, text: str, pos: int, deadline: float, limit: float, final: bool = True) -> int | None:
        first, decided = None, final
        for search, reach in self._searches:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckTimeout(f"the blocklist check took longer than {limit:g} s")
            try:
                m = search.search(text, pos, timeout=left, concurrent=True)
            except TimeoutError:
                raise CheckTimeout(f"the blocklist check took longer than {limit:g} s") from None
            if m is not None:
                decided = decided or m.end() + reach <= len(text)
                first = m.start() if first is None else min(first, m.start())
        return first if decided else None

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
        raise UserError(f"--blocklist {path}: cannot read it as UTF-8 text ({e})") from None
    terms, patterns = [], []
    for i, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith(REGEX_PREFIX):
            if len(line) > MAX_HOLDBACK:
                raise UserError(f"--blocklist {path}:{i}: the term is {len(line)} characters, and generated "
                                 f"text is held back at most {MAX_HOLDBACK} until no match can start in it; "
                                 "shorten it")
            terms.append(line)
            continue
        source = line[len(REGEX_PREFIX):].strip()
        try:
            compiled = regex.compile(source, regex.IGNORECASE)
        except regex.error as e:
            raise UserError(f"--blocklist {path}:{i}: not a valid regular expression ({e})") from None
        try:
            empty = compiled.search("", timeout=PROMPT_CHECK_SECONDS) is not None
        except TimeoutError:
            empty = True
        if empty:
            raise UserError(f"--blocklist {path}:{i}: {source!r} matches the empty string, so it would block "
                             "every prompt; make it match at least one character")
        try:
            extent(source)
        except ValueError as e:
            raise UserError(f"--blocklist {path}:{i}: {e}") from None
        patterns.append(source)
    for term in terms:
        if _REGEX_LOOKING & set(term):
            log.warning("--blocklist %s: %r is matched as plain text; write 're:%s' for a regular expression",
                        path, term, term)
    return Blocklist(terms, patterns)


class TextFilter:
    """Cuts generated text at the first blocklist match, holding back what could still become one.

    Stop strings are handled by stop.StopChecker; this works on its output. Streaming cannot take
    text back, so the last `holdback` characters wait until the match is decided: the longest match a
    rule makes, with what it reads past it. Until the output is complete its end is not the output's end
    (`$` does not match there). Each search starts `holdback` characters before the unreleased text, so
    its cost per token stays bounded however long the output grows; a search past OUTPUT_CHECK_SECONDS
    cuts the text where nothing was released yet.
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
            cut = self.blocklist.find(self.text, start, timeout=self.timeout, final=final)
        except CheckTimeout:
            cut = self.sent  # undecided in time: treated as a match
        if cut is not None:
            out, self.sent = self.text[self.sent : max(cut, self.sent)], len(self.text)
            return out, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent : end], end
        return out, False
