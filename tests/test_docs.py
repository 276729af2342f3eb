"""The docs a user reads agree with the program: every command line shown parses, every option the
command reference names exists, its options tables are the program's, and every link leads somewhere.

    pytest -q tests/test_docs.py
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
from conftest import load_script

from gptopt import cli

ROOT = Path(__file__).resolve().parents[1]
README, COMMANDS_DOC = ROOT / "README.md", ROOT / "docs" / "commands.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
# Pages read as they are today; dated reports keep the command lines as they were run.
CURRENT = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)  # indented too: a block in a list item
# Flags of other programs that the command reference names beside gptopt's (torchrun's rendezvous).
FOREIGN_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--rdzv_backend", "--rdzv_endpoint"}


def _shell_lines(text: str) -> list[str]:
    """The lines of the page's code blocks, continuations joined and comments and prompts cut."""
    lines: list[str] = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            lines.append(line)
    return lines


def _gptopt_argv(line: str) -> list[str] | None:
    """`gptopt VERB ...` (also after a pipe, `torchrun ... -m gptopt`), as argv after `gptopt`; else None."""
    for part in line.split("|"):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            return None
        for i, word in enumerate(words):
            if word == "gptopt" and (i == 0 or words[i - 1] == "-m"):
                return words[i + 1:]
    return None


def _command_lines(page: Path) -> list[list[str]]:
    text = page.read_text(encoding="utf-8")
    lines = _shell_lines(text)
    if page == README:  # its headline table's commands too, each the whole command that reproduces a figure
        lines += re.findall(r"`(gptopt [^`]+)`", FENCE.sub("", text))
    found = [argv for line in lines if (argv := _gptopt_argv(line))]
    return [argv for argv in found if argv and argv[0] in cli.COMMANDS and "..." not in argv]  # ...: elided


def _parse(argv: list[str]) -> object:
    """What `gptopt VERB ARGS` makes of its arguments (the config it would run with), without running it.
    A `--config FILE` is left out: the files the pages name (best.toml, ...) are written by earlier steps."""
    verb, rest = argv[0], argv[1:]
    if "--config" in rest:
        at = rest.index("--config")
        rest = rest[:at] + rest[at + 2:]
    cls = cli._load(cli.COMMANDS[verb].config)
    return cli.parse_config(verb, cls, rest, cli.build_parser(verb, cls))


@pytest.mark.parametrize("page", CURRENT, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_gptopt_command_line_a_page_shows_parses_as_written(page: Path) -> None:
    lines = _command_lines(page)
    for argv in lines:
        try:
            _parse(argv)
        except SystemExit as e:
            pytest.fail(f"{page.name}: `gptopt {shlex.join(argv)}` is refused (exit {e.code})")


def test_the_readme_shows_the_playbooks_own_training_command_line() -> None:
    playbook = "train --model_name gpt2 --batch_size 8 --use_compile --use_amp --profile --output_dir ./checkpoints"
    assert playbook.split() in _command_lines(README)
    cfg = _parse(playbook.split())
    assert (cfg.init_from, cfg.batch_size, cfg.compile, cfg.use_amp, cfg.profile) == ("gpt2", 8, True, True, True)


def _python_names(page: Path) -> set[str]:
    """The dotted gptopt names a page gives users: `gptopt.x.y` in its text, `from gptopt.x import a, b` in its code."""
    text = page.read_text(encoding="utf-8")
    names = {n for n in re.findall(r"`(gptopt(?:\.\w+)+)", text) if not n.endswith(".json")}  # gptopt.json: a file
    for module, imported in re.findall(r"^from (gptopt(?:\.\w+)*) import ([\w, ]+)$", text, re.M):
        names |= {f"{module}.{name.strip()}" for name in imported.split(",")}
    return names


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes down from it
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", [README, COMMANDS_DOC, ROOT / "docs" / "design.md"], ids=lambda p: p.name)
def test_every_python_name_a_page_gives_users_imports(page: Path) -> None:
    names = _python_names(page)
    assert not [name for name in sorted(names) if not _resolves(name)]


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"(?m)^## ", text)
    return {part.split("\n", 1)[0].strip(): part for part in parts[1:]}


def _option_strings(verb: str) -> set[str]:
    cls = cli._load(cli.COMMANDS[verb].config)
    parser = cli.build_parser(verb, cls)
    return {s for action in parser._actions for s in action.option_strings}


def test_the_command_reference_has_a_section_for_every_command() -> None:
    sections = _sections(COMMANDS_DOC.read_text(encoding="utf-8"))
    assert [verb for verb in cli.COMMANDS if verb not in sections] == []


def test_every_option_the_command_reference_names_in_its_text_is_an_option_of_that_command() -> None:
    unknown = []
    for verb, section in _sections(COMMANDS_DOC.read_text(encoding="utf-8")).items():
        prose = FENCE.sub("", section.split("<!-- options:")[0])
        for span in re.findall(r"`([^`\n]+)`", prose):
            words = span.split()
            if words[0] == "gptopt" and len(words) > 1:
                owner = words[1]  # another command's line, quoted in this one's section
            elif words[0].startswith("--"):
                owner = verb
            else:
                continue  # another program's line (tensorboard, torchrun, curl)
            if owner not in cli.COMMANDS:
                continue
            flags = {w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][a-z0-9_-]*(=\S*)?", w)}
            unknown += [f"{verb}: `{span}` ({flag} is no option of gptopt {owner})"
                        for flag in sorted(flags - _option_strings(owner) - FOREIGN_FLAGS)]
    assert not unknown, "\n".join(unknown)


def test_each_options_table_names_every_spelling_the_command_takes() -> None:
    text = COMMANDS_DOC.read_text(encoding="utf-8")
    missing = []
    for verb in cli.COMMANDS:
        table = text.split(f"<!-- options: {verb} -->", 1)[1].split("<!-- /options -->", 1)[0]
        named = set(re.findall(r"`(--[a-z][\w-]*)[ `]", table))
        missing += [f"{verb}: {s}" for s in sorted(_option_strings(verb) - named - {"-h", "--help"})]
    assert not missing, ", ".join(missing)


def test_the_command_references_options_tables_are_the_programs_options() -> None:
    doc = load_script("commands_doc")
    assert doc.stale(COMMANDS_DOC.read_text(encoding="utf-8")) == [], \
        "docs/commands.md's options tables are out of date: run python .ci/commands_doc.py"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: " + ", ".join(broken)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"(?m)^#+ (.+)$", FENCE.sub("", page.read_text(encoding="utf-8")))
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_and_the_current_figures_stay_short_enough_to_read() -> None:
    # A newcomer reads the README in five minutes; the figures page holds current figures only (history
    # goes to benchmarks/, one dated report per study).
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250
    assert len((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()) <= 300


# A report a source file cites: `benchmarks/2026-12-05-x.md`, and the section after it where one is quoted,
# `benchmarks/2026-12-05-x.md, "A heading"`. Comments keep the rule and point here for the figures behind it.
CITATION = re.compile(r"benchmarks/(\d{4}-\d\d-\d\d-[\w.-]+?\.md)(?:, \"([^\"]+)\")?")


def _citations(text: str) -> list[tuple[str, str]]:
    """(report, section or '') of each report a Python file cites, its comments' lines joined as one text."""
    joined = " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())
    return CITATION.findall(joined)


def test_the_citation_reader_joins_a_comments_lines() -> None:
    text = ('# the rule (benchmarks/2026-12-02-a.md, "The compiled\n    # decode at every batch size"); and\n'
            "x = 1  # benchmarks/2026-12-03-b.md\n")
    assert _citations(text) == [("2026-12-02-a.md", "The compiled decode at every batch size"),
                                ("2026-12-03-b.md", "")]


def test_every_report_and_section_the_source_cites_exists() -> None:
    broken = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        for report, section in _citations(path.read_text(encoding="utf-8")):
            dest = ROOT / "benchmarks" / report
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: benchmarks/{report}")
                continue
            headings = re.findall(r"(?m)^#+ (.+)$", FENCE.sub("", dest.read_text(encoding="utf-8")))
            if section and not any(section in " ".join(h.split()) for h in headings):
                broken.append(f'{path.relative_to(ROOT)}: benchmarks/{report}, "{section}" (no such heading)')
    assert not broken, "citations of reports that lead nowhere:\n" + "\n".join(broken)
