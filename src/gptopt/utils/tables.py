"""Figures as text: the terminal and Markdown tables, compact JSON and TOML that bench, tune and
compress print and write.

    python -c "from gptopt.utils.tables import text_table; print(text_table(['a', 'b'], [['x', '1']]))"
"""

from __future__ import annotations

import json
import math
from typing import Any


def fmt(v: Any, kind: str) -> str:
    """A figure as the tables show it; kind: int, ms, pct, x, mib, s, or anything else (4 decimals)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "int":
        return f"{v:,.0f}"
    if kind == "ms":
        return f"{v * 1e3:,.1f}"
    if kind == "pct":
        return f"{v:.1%}"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "mib":
        return f"{v / 2**20:,.0f}"
    if kind == "s":
        return f"{v:.1f}"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def text_table(head: list[str], body: list[list[str]]) -> str:
    """Aligned columns for the terminal: the first left-aligned, the figures right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in pairs)

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def md_table(head: list[str], body: list[list[str]]) -> list[str]:
    def row(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return [row(head), "|" + "---|" * len(head), *map(row, body)]


def to_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, default=str, separators=(",", ":"))


def toml_text(opts: dict[str, Any], header: tuple[str, ...]) -> str:
    """Flat `key = value` lines under comment lines: what `gptopt train --config` reads."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a valid TOML basic string
        return repr(v)

    return "\n".join([*header, *(f"{k} = {value(v)}" for k, v in opts.items() if v is not None)]) + "\n"
