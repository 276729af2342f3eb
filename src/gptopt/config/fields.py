"""The option machinery every config shares: the named upper limits, `opt` (a field with its help and its
range), and check_fields, which holds every field to its type, finiteness and range when a config is made.

    python -c "from gptopt.config.fields import check_fields, opt; help(check_fields)"
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from dataclasses import field
from typing import Any

from gptopt.utils.errors import UserError

# Validation. Every field is checked when a config is made (from flags, TOML, JSON or code), so a
# bad value stops a command before it reads or writes anything. A field's range lives in its
# metadata (ge / gt / le / lt); the upper limits below are far beyond any GPT-2-class use: they
# catch a typo (three zeros too many) that would otherwise fail minutes later, out of memory or
# deep inside a library, after the work done so far is lost.

MAX_BATCH = 1 << 16  # sequences in a batch: GPT-2's 0.5M-token batch is 512 x 1024, this is 128x that
MAX_SEQ_LEN = 1 << 20  # tokens in a sequence: 1024x GPT-2's context
MAX_VOCAB = 1 << 24  # 64x the largest tokenizers in use (~256k)
MAX_LAYERS = 1024  # GPT-2 XL has 48 blocks
MAX_WIDTH = 1 << 16  # n_embd / n_head: GPT-3 175B is 12288 wide with 96 heads
MAX_PAD_MULTIPLE = 4096  # tensor cores want 64 or 128
MAX_STEPS = 10**9  # optimizer or timed steps: GPT-2 trained for ~0.8M
MAX_TOKENS = 10**15  # training tokens: 1000x GPT-3's 300B
MAX_NEW_TOKENS = 1 << 20  # generated tokens per request or prompt: as long as the longest context
MAX_THREADS = 4096  # torch threads of one process: past the cores of the largest servers sold
MAX_SLOTS = 4096  # requests a server runs at once: far past where one GPU's decode step stops gaining throughput
# Worker processes or threads: beyond 4 per core they only contend for the cores and each costs memory.
MAX_WORKERS = max(8, 4 * (os.cpu_count() or 1))
MAX_SEED = 2**63 - 1  # numpy's and torch's generators accept seeds in [0, 2**63)
MAX_SECONDS = 7 * 86400.0  # a timeout of a week: larger values overflow event-loop timers


def opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, cli: bool = True,
        ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
        hint: str | None = None, verbatim: bool = False, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with the help text and allowed values (choices, or a range: >= ge, > gt,
    <= le, < lt) that the CLI shows and check_fields enforces; hint: the fix an out-of-range value
    is told, where the range alone does not say it; verbatim: the CLI keeps '' and 'none' as text
    rather than reading them as None (a secret given as an unset "$VAR" must not vanish); aliases:
    other names the CLI accepts for it, as flags and as --config keys (old spellings that command
    lines and files already written still use; --help names the field first)."""
    extra = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, hint=hint).items() if v is not None}
    if verbatim:
        extra["verbatim"] = True
    if aliases:
        extra["aliases"] = tuple(aliases)
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli, **extra})


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as `int`, `str | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported option type {tp}")
        return args[0], True
    return tp, False


@functools.cache
def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's (scalar type, optional?) of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: _base_type(hints[f.name]) for f in dataclasses.fields(cls)}


def range_text(meta: Any) -> str:
    """A range as the refusals say it: 'in [0, 2]', '>= 1', '< 0.5'."""
    def num(x: float) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)

    lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    hi = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if lo and hi:
        return f"in {lo[0]}{num(lo[1])}, {num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {num(lo[1])}"
    assert hi is not None
    return f"{'<=' if hi[0] == ']' else '<'} {num(hi[1])}"


def type_ok(value: Any, kind: type) -> bool:
    """Whether value is an option of type kind: bool is an int to Python, never to a user; an int is a fine float."""
    if isinstance(value, bool) and kind is not bool:
        return False
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def check_fields(obj: Any, prefix: str = "--") -> None:
    """Raise ValueError naming the first field whose value has the wrong type, is not finite (floats:
    NaN and infinities are never a setting) or lies outside its range or choices. prefix: how the
    message names a field (--flag for command options, bare for stored model configs)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kind, optional = field_types(type(obj))[f.name]
        name = f"{prefix}{f.name}"
        if value is None and optional:
            continue
        if not type_ok(value, kind):
            raise UserError(f"{name} must be {kind.__name__}{' or none' if optional else ''}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise UserError(f"{name} must be a finite number, got {value}")
        meta = f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            raise UserError(f"{name} must be one of {', '.join(meta['choices'])}; got {value!r}")
        if kind in (int, float) and not (
            ("ge" not in meta or value >= meta["ge"]) and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"]) and ("lt" not in meta or value < meta["lt"])
        ):
            hint = f"; {meta['hint']}" if "hint" in meta else ""
            raise UserError(f"{name} must be {range_text(meta)}, got {value}{hint}")

