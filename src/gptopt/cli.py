"""The command line: one verb -> function table; every option comes from a config dataclass.

    gptopt --help
    gptopt doctor --smoke --config my.toml --device cpu

Precedence: dataclass default < --config FILE.toml < flags on the command line. Unknown options,
bad values (config.check_fields: types, finite floats, ranges) and unknown TOML keys exit 2 with one
line naming the option and the fix, before the command reads or writes anything. A file the command
cannot read or write ends it the same way. An option's old names (config.opt's aliases) still work,
as flags and as TOML keys, so command lines and files written before a rename keep working; a TOML
table that gives both names of one option is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gptopt import __version__
from gptopt.config import field_types, range_text, type_ok
from gptopt.runtime.signals import CTRL_C_EXIT
from gptopt.utils.errors import UserError
from gptopt.utils.extras import MissingExtra
from gptopt.utils.logs import setup_logging
from gptopt.utils.paths import looks_local, missing_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclasses.dataclass(frozen=True)
class Command:
    config: str  # "module:Class" of its config dataclass
    run: str  # "module:function" taking the config, returning the exit status
    help: str


# Entries are imported only when their verb runs, so `gptopt --help` is fast and a verb whose
# extra is missing does not break the others.
# Set (to anything): every error keeps its traceback, those of what the user gave included
DEBUG_ENV = "GPTOPT_DEBUG"

COMMANDS: dict[str, Command] = {
    "doctor": Command("gptopt.config:DoctorConfig", "gptopt.commands.doctor:run",
                      "check this machine's setup and name the fixes"),
    "prepare": Command("gptopt.config:PrepareConfig", "gptopt.commands.prepare:main",
                       "tokenize a corpus into train/val token shards"),
    "train": Command("gptopt.config:TrainConfig", "gptopt.commands.train:main",
                     "train or fine-tune, on one device or many (torchrun)"),
    "bench": Command("gptopt.config:BenchConfig", "gptopt.bench.main:main",
                     "measure every optimisation against the naive baseline"),
    "profile": Command("gptopt.config:ProfileConfig", "gptopt.commands.profile:main",
                       "find where the time goes, and what to change"),
    "generate": Command("gptopt.config:GenerateConfig", "gptopt.commands.generate:main",
                        "generate text from a checkpoint, streaming"),
    "serve": Command("gptopt.config:ServeConfig", "gptopt.serve.server:main",
                     "HTTP API: /generate, OpenAI /v1/completions, /metrics"),
    "loadtest": Command("gptopt.config:LoadtestConfig", "gptopt.commands.loadtest:main",
                        "drive a /v1/completions server; TTFT, TPOT, throughput"),
    "compress": Command("gptopt.config:CompressConfig", "gptopt.commands.compress:main",
                        "quantise or prune a model; measure size, speed and quality against it"),
    "export": Command("gptopt.config:ExportConfig", "gptopt.commands.export:main",
                      "write the model as ONNX (for onnxruntime) or a Hugging Face dir, checked"),
    "tune": Command("gptopt.config:TuneConfig", "gptopt.commands.tune:main",
                    "search the settings for the fastest training step; writes tune.toml"),
    "eval": Command("gptopt.config:EvalConfig", "gptopt.commands.eval:main",
                    "score a model on HellaSwag: acc, and acc_norm per byte of each ending (lm-eval's)"),
}


def _load(ref: str) -> Any:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _parse_value(kind: type, optional: bool, name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if optional and text.lower() in ("none", "null", ""):
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} for --{name}, got {text!r}") from None

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def cli_fields(cls: type) -> list[tuple[dataclasses.Field[Any], type, bool]]:
    types = field_types(cls)
    return [(f, *types[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def option_help(f: dataclasses.Field) -> str:
    """An option's --help: its text, then its default where the text does not give it (an unset default that
    means "decided later" says nothing more), and its range where it has one."""
    text = f.metadata.get("help", "")
    default = f.default if f.default is not dataclasses.MISSING else None
    notes = [] if default is None or re.search(r"\bdefault:", text) else [f"default: {default}"]
    limits = {k: f.metadata[k] for k in ("ge", "gt", "le", "lt") if k in f.metadata}
    if limits:
        notes.append(range_text(limits))
    return f"{text} ({'; '.join(notes)})" if notes else text


def other_mode(f: dataclasses.Field, mode: str | None) -> bool:
    """An option of another mode than the one given (its help begins "--mode NAME:"): bench --mode quality --help
    lists quality's options, not infer's."""
    m = re.match(r"--mode (\w+):", f.metadata.get("help", ""))
    return mode is not None and m is not None and m.group(1) != mode


def add_options(parser: argparse.ArgumentParser, cls: type, mode: str | None = None) -> None:
    for f, kind, optional in cli_fields(cls):
        help_text = argparse.SUPPRESS if other_mode(f, mode) else option_help(f)
        if f.metadata.get("positional"):
            parser.add_argument(f.name, nargs="?", help=help_text)
            continue
        flags = [f"--{name}" for name in (f.name, *f.metadata.get("aliases", ()))]  # the field's own name first
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(
                *flags,
                type=_parse_value(kind, optional and not f.metadata.get("verbatim"), f.name),
                choices=f.metadata.get("choices"),
                metavar=kind.__name__.upper() if not f.metadata.get("choices") else None,
                help=help_text,
            )


def load_toml(path: str, cls: type, verb: str | None = None) -> dict[str, Any]:
    """Options from a TOML file: flat `key = value` keys, then those of a [verb] table over them.

    Other tables are ignored (one file may configure several verbs); unknown keys are errors.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--config {path} is a folder; give the TOML file in it, e.g. {path}/best.toml") from None
    except PermissionError:
        raise UserError(f"--config {path}: cannot read it (permission denied); fix its permissions or copy it "
                         "somewhere readable") from None
    except OSError as e:
        raise UserError(f"--config {path}: cannot read it ({e.strerror or e}); give a readable TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--config {path}: not valid TOML ({e})") from None
    flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
    section = data.get(verb, {}) if verb else {}
    return {**_check_toml(path, flat, cls), **_check_toml(path, section, cls)}


def aliases(cls: type) -> dict[str, str]:
    """Each old name of cls's options -> the option's name (config.opt's aliases)."""
    return {alias: f.name for f, _, _ in cli_fields(cls) for alias in f.metadata.get("aliases", ())}


def _check_toml(path: str, table: dict[str, Any], cls: type) -> dict[str, Any]:
    fields = {f.name: kind for f, kind, _ in cli_fields(cls)}
    old_names = aliases(cls)
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = old_names.get(key, key)  # files written before a rename keep loading
        if name not in fields:
            raise UserError(f"--config {path}: unknown option {key!r}; valid: {', '.join(sorted(fields))}")
        if name in values:  # the same table cannot say which of the two it means
            alias = key if key != name else next(k for k in table if old_names.get(k) == name)
            raise UserError(f"--config {path}: {name} and {alias} are one option ({alias} is its old name): "
                             f"keep {name} alone")
        kind = fields[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not type_ok(value, kind):
            raise UserError(f"--config {path}: {name} must be {kind.__name__}, got {value!r}")
        values[name] = value
    return values


class _Parser(argparse.ArgumentParser):
    """argparse with a bad input reported as one line, as every gptopt error is: the usage block that
    argparse prints first would bury the message (a command's usage runs to dozens of lines)."""

    def error(self, message: str) -> NoReturn:
        self.fail(f"{message}; see `{self.prog} --help`")

    def fail(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_config(verb: str, cls: type, argv: Sequence[str], parser: argparse.ArgumentParser) -> Any:
    ns = vars(parser.parse_args(argv))
    config_path = ns.pop("config", None)
    # Our own messages already name the fix; argparse's (unknown flag, bad choice) get a --help pointer.
    fail = parser.fail if isinstance(parser, _Parser) else parser.error
    values: dict[str, Any] = {}
    if config_path:
        try:
            values.update(load_toml(config_path, cls, verb))
        except ValueError as e:
            fail(str(e))
    values.update(ns)  # only the flags given: the parser's defaults are suppressed
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        fail(str(e))


def build_parser(verb: str, cls: type, mode: str | None = None) -> argparse.ArgumentParser:
    """The verb's parser; mode: the --mode given, whose options alone --help lists (a mode's own start "--mode")."""
    cmd = COMMANDS[verb]
    parser = _Parser(
        prog=f"gptopt {verb}", description=cmd.help, argument_default=argparse.SUPPRESS, allow_abbrev=False
    )
    parser.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file; flags override it")
    add_options(parser, cls, mode)
    return parser


def given_mode(args: Sequence[str]) -> str | None:
    """The value of --mode on the command line, if any (--mode X or --mode=X)."""
    for i, a in enumerate(args):
        if a == "--mode" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--mode="):
            return a.split("=", 1)[1]
    return None


def top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {verb:<10} {cmd.help}" for verb, cmd in COMMANDS.items())
    parser = _Parser(
        prog="gptopt",
        description="Make GPT-2-class Transformers train, benchmark, profile, generate and serve fast.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"commands:\n{lines}\n\n`gptopt COMMAND --help` lists a command's options.",
        usage="gptopt [-h] [--version] COMMAND [options]",
    )
    parser.add_argument("--version", action="version", version=f"gptopt {__version__}")
    parser.add_argument("command", nargs="?", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    if not argv or argv[0].startswith("-"):
        top = top_parser()
        top.parse_args(argv)
        top.print_help()
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in COMMANDS:
        print(f"gptopt: unknown command {verb!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    cls = _load(COMMANDS[verb].config)
    parser = build_parser(verb, cls, given_mode(rest))
    config = parse_config(verb, cls, rest, parser)
    try:
        check_model_paths(verb, config)
        run = _load(COMMANDS[verb].run)
        return int(run(config) or 0)
    except MissingExtra as e:
        print(f"gptopt {verb}: {e}", file=sys.stderr)
        return 2
    except (UserError, FileNotFoundError, FileExistsError) as e:  # what the user gave: one line and the fix
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"gptopt {verb}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # The net under the commands' own checks: a folder that turned out unwritable, a full disk.
        line = os_error_line(e, output_flag(config))
        if line is None or os.environ.get(DEBUG_ENV):
            raise
        print(f"gptopt {verb}: error: {line}", file=sys.stderr)
        return 2
    except Exception:  # gptopt's own fault (or a library's under it): the traceback, to report and fix
        traceback.print_exc()
        print(f"gptopt {verb}: internal error (the traceback above); please report it", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ngptopt {verb}: stopped (Ctrl-C)", file=sys.stderr)
        return CTRL_C_EXIT


# The options that name a model to load: a local folder, or a Hugging Face Hub name. loadtest's --model is no
# path but the name its requests give the server (which may be a path on the server's machine).
MODEL_OPTIONS = ("model", "draft_model", "init_from")
NO_MODEL_PATHS = frozenset({"loadtest"})


def check_model_paths(verb: str, config: Any) -> None:
    """A model option meant as a local path (utils.paths.looks_local) that names nothing: refused now, before
    the command imports torch, in the loader's words (utils.paths.missing_model)."""
    if verb in NO_MODEL_PATHS:
        return
    names = {f.name for f in dataclasses.fields(config)}
    for name in MODEL_OPTIONS:
        value = getattr(config, name, None) if name in names else None
        if isinstance(value, str) and looks_local(value) and not os.path.exists(os.path.expanduser(value)):
            raise UserError(missing_model(value, f"--{name}"))


def output_flag(config: Any) -> str | None:
    """The option that names where a command writes (--output_dir, --output), if it has one."""
    names = {f.name for f in dataclasses.fields(config)}
    return next((f"--{n}" for n in ("output_dir", "output") if n in names), None)


# errno -> (the verb, what went wrong, the fix). Errors only a write meets say "write"; the output flag
# is named with them. A folder where a file was meant (or the reverse) may be an input or an output.
_FS_ERRORS = {
    errno.EACCES: ("write", "permission denied", "choose a folder you can write"),
    errno.EPERM: ("write", "permission denied", "choose a folder you can write"),
    errno.EROFS: ("write", "read-only file system", "choose a folder you can write"),
    errno.ENOSPC: ("write", "no space left on device", "free some space or choose another disk"),
    **({errno.EDQUOT: ("write", "disk quota exceeded", "free some space or choose another disk")}
       if hasattr(errno, "EDQUOT") else {}),  # not on Windows
    errno.EISDIR: ("use", "it is a folder, not a file", "check the path"),
    errno.ENOTDIR: ("use", "part of the path is a file, not a folder", "check the path"),
}


def os_error_line(e: OSError, flag: str | None) -> str | None:
    """One line for a file-system error: the path, what went wrong and the fix; None for other OSErrors
    (a network error, say), which keep their traceback."""
    if e.errno not in _FS_ERRORS and e.filename is None:
        return None
    verb, what, fix = _FS_ERRORS.get(e.errno, ("use", (e.strerror or str(e)).lower(), "check the path"))
    path = "" if e.filename is None else f" {e.filename}"
    if verb == "write" and e.filename is not None and os.path.exists(e.filename) \
            and not os.access(e.filename, os.R_OK):
        verb, fix = "read", "fix its permissions"  # an existing file we may not even read: an input
    return f"cannot {verb}{path}: {what}; {fix}" + (f" ({flag})" if flag and verb == "write" else "")
