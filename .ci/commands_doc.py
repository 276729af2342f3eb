"""docs/commands.md's options tables, generated from the commands' own options (what `--help` prints).

    python .ci/commands_doc.py            # rewrite the tables in docs/commands.md
    python .ci/commands_doc.py --check    # exit 1 and name the commands whose table is out of date

Each command's section holds one block between `<!-- options: VERB -->` and `<!-- /options -->`; the
rows come from the config dataclass that `gptopt VERB --help` is built from (gptopt.cli), so an option
added, renamed or re-explained in the code shows here as a failing tests/test_docs.py until the page is
rewritten. Only the blocks are touched: the prose around them is the author's.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from gptopt import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
BLOCK = re.compile(r"(<!-- options: (\w+) -->\n)(.*?)(<!-- /options -->)", re.S)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: object) -> str:
    if value is None or value == "":
        return ""
    return f"`{value}`" if not isinstance(value, bool) else ("on" if value else "off")


def options_table(verb: str) -> str:
    """The Markdown table of `gptopt VERB`'s options: name (and old spellings), default, help, choices."""
    cls = cli._load(cli.COMMANDS[verb].config)
    rows = ["| option | default | what it does |", "|---|---|---|",
            "| `--config FILE.toml` | | read options from a TOML file; flags override it |"]
    for f, kind, _ in cli.cli_fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.metadata.get("positional"):
            name = f"`{f.name.upper()}` (positional)"
        elif kind is bool:
            name = f"`--{f.name}` / `--no-{f.name}`"
        else:
            choices = f.metadata.get("choices")
            value = "{" + ",".join(map(str, choices)) + "}" if choices else kind.__name__.upper()
            name = f"`--{f.name} {value}`"
        aliases = f.metadata.get("aliases", ())  # bare field names, as config.opt takes them: "use_compile"
        if aliases:
            spell = (lambda a: f"`--{a}` / `--no-{a}`") if kind is bool else (lambda a: f"`--{a}`")
            name += " (also " + ", ".join(spell(a) for a in aliases) + ")"
        rows.append(f"| {_cell(name)} | {_cell(_default(default))} | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """text with every options block rewritten from the program."""
    return BLOCK.sub(lambda m: m.group(1) + options_table(m.group(2)) + m.group(4), text)


def stale(text: str) -> list[str]:
    """The commands whose block differs from the program, and those that have no block."""
    blocks = {m.group(2): m.group(3) for m in BLOCK.finditer(text)}
    return [verb for verb in cli.COMMANDS if blocks.get(verb) != options_table(verb)]


def main(argv: list[str]) -> int:
    text = DOC.read_text(encoding="utf-8")
    if "--check" in argv:
        verbs = stale(text)
        if verbs:
            print(f"{DOC}: the options of {', '.join(verbs)} are out of date; run python .ci/commands_doc.py",
                  file=sys.stderr)
        return int(bool(verbs))
    DOC.write_text(render(text), encoding="utf-8")
    missing = [verb for verb in cli.COMMANDS if f"<!-- options: {verb} -->" not in text]
    if missing:
        print(f"no options block for {', '.join(missing)}: add `<!-- options: VERB -->` and "
              "`<!-- /options -->` to its section", file=sys.stderr)
    return int(bool(missing))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
