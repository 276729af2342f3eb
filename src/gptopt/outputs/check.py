"""The one check every writing verb makes before any work (check_output), and `replacing`, the check and
the aside together for a verb that writes its output as it goes.

    python -c "from gptopt.outputs.check import check_output; help(check_output)"

check_output validates an output before any work: not a file, writable, and either new, or holding no entry
the verb would write, or (with --overwrite) marked by gptopt as this kind of output and holding nothing gptopt
did not write. Nothing else is ever replaced.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from gptopt.outputs.aside import Aside, recover
from gptopt.outputs.staging import OWNER_FILE, _ours, _path, clean_stale, mark, marked_kind
from gptopt.utils.errors import UserError


def some(names: Iterable[str], most: int = 4) -> str:
    """The first few names, for a message: "a, b, c, d, ..."."""
    names = list(names)
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def check_writable(path: Path, flag: str, shown: Path | str | None = None) -> None:
    """Refuse (ValueError naming flag and the fix) when path, or the nearest folder above it that exists,
    cannot take a new folder: a file there, no permission, or a folder that cannot be created after all
    (permission bits do not tell everything: as root, /proc and read-only mounts pass them)."""
    shown = path if shown is None else shown
    probe = Path(path)
    while not probe.exists():  # the nearest existing ancestor is where the first mkdir happens
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.is_file():
        raise UserError(f"{flag} {shown}: {probe} is a file, not a folder; choose another {flag}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {shown}: cannot write in {probe} (permission denied); choose a folder you can "
                         f"write with {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gptopt-probe-", dir=probe))
    except OSError as e:
        raise UserError(f"{flag} {shown}: cannot create a folder there ({e.strerror or e}); nothing was written: "
                         f"choose a folder you can write with {flag}") from None


def check_output(target: Path, *, kind: str, overwrite: bool, ours: Sequence[str] = (),
                 flag: str = "--output_dir", whole: bool = False,
                 contents: Mapping[str, Sequence[str]] | None = None) -> list[Path]:
    """Validate an output location before any work; returns gptopt's entries there that will be replaced.

    ours: glob patterns of the entries this verb writes into target (a training run: "ckpt-*",
    "metrics.jsonl", ...); entries listed in target's mark count as ours too. whole: the verb
    publishes target as one directory (staged_dir(replace=True)), so target must hold nothing else.
    contents: for folders among ours, the globs of the paths (relative to that folder) the verb writes
    inside them: a file there that matches none is the user's, and --overwrite will not delete it.
    Refused, with the fix named: target is a file, cannot be written, or is the filesystem root or the
    home folder; target holds another kind of gptopt output (each kind gets a folder of its own); an
    entry the verb would write exists and --overwrite is not given; --overwrite on a folder gptopt did
    not mark as `kind`, or one that holds (whole: anywhere; else: inside gptopt's folders) a file gptopt
    did not write.
    """
    target = _path(target)
    if target.is_file() or (target.is_symlink() and not target.exists()):
        raise UserError(f"{flag} {target} is a file; give the path of a folder")
    _not_root_or_home(target, flag)
    check_writable(target, flag)
    if whole and target.exists():  # staged beside target and renamed in its parent: that must take writes too
        check_writable(target.parent, flag, shown=target)
    if not target.is_dir():
        return []
    recover(target, ours)
    clean_stale(target)
    found = marked_kind(target)
    if found is not None and found != kind:
        raise UserError(f"{flag} {target} holds gptopt {found} output; nothing was written: give this output a "
                         f"folder of its own with {flag}")
    mine, theirs = _ours(target, ours)
    if not mine and not (whole and theirs):
        return []  # new, or the user's files only: the verb writes beside them and touches none of them
    # What --overwrite would refuse is said now, not advised first and refused after.
    if found != kind:
        what = (f"not marked as gptopt's ({OWNER_FILE} is damaged)" if (target / OWNER_FILE).exists()
                else f"not marked as gptopt's ({OWNER_FILE} missing)")
        held = "exists and is not empty" if whole else f"already holds {some(p.name for p in mine)}"
        raise UserError(f"{flag} {target} {held} and is {what}; nothing was written, and --overwrite will not "
                         f"replace it either: gptopt only replaces what it wrote itself; move them out, or choose "
                         f"another {flag}")
    foreign = theirs if whole else _foreign_inside(mine, contents or {})
    if foreign:
        names = some(str(p.relative_to(target)) for p in foreign)
        raise UserError(f"{flag} {target} holds files gptopt did not write ({names}); nothing was written, and "
                         f"--overwrite will not replace it: move them out, or choose another {flag}")
    if not overwrite:
        if whole:
            raise UserError(f"{flag} {target} holds an earlier output of this command; nothing was written: pass "
                             f"--overwrite to replace it (kept until the new output is complete), or choose another "
                             f"{flag}")
        names = some(p.name for p in mine)
        raise UserError(f"{flag} {target} already holds output ({names}); nothing was written: pass --overwrite "
                         f"to replace it (kept until the new output is complete), or choose another {flag}")
    return mine


def _not_root_or_home(target: Path, flag: str) -> None:
    if target == Path(target.anchor) or target == _path(Path.home()):
        what = "the filesystem root" if target == Path(target.anchor) else "your home folder"
        raise UserError(f"{flag} {target} is {what}; give the output a folder of its own, e.g. "
                         f"{flag} {target / 'gptopt_out'}")


def _foreign_inside(entries: Sequence[Path], contents: Mapping[str, Sequence[str]]) -> list[Path]:
    """Files inside gptopt's folders that match none of the paths gptopt writes there."""
    foreign: list[Path] = []
    for entry in entries:
        if not entry.is_dir() or entry.is_symlink():
            continue
        globs = next((g for pattern, g in contents.items() if fnmatch.fnmatchcase(entry.name, pattern)), None)
        if globs is None:
            continue
        for path in sorted(entry.rglob("*")):
            if path.is_dir() and not path.is_symlink():
                continue
            rel = path.relative_to(entry).as_posix()
            if not any(fnmatch.fnmatchcase(rel, g) for g in globs):
                foreign.append(path)
    return foreign


@contextlib.contextmanager
def replacing(out: Path, *, kind: str, ours: Sequence[str], old: Sequence[Path] | None = None,
              list_files: bool = True) -> Iterator[None]:
    """Write an output into out as a run goes, beside the user's own files (bench, tune, profile).

    gptopt's old entries (old: check_output's answer, made before the run; worked out again when None)
    stay aside until the block ends and come back if it fails; out is then marked as kind, listing the
    entries of ours it now holds (list_files=False: none, for a folder two modes share by file name)."""
    out = _path(out)
    if old is None:
        old = check_output(out, kind=kind, overwrite=True, ours=ours)
    out.mkdir(parents=True, exist_ok=True)

    def mark_ours() -> None:
        mark(out, kind, files=[name for name in ours if (out / name).exists()] if list_files else None)

    with Aside(out, old, ours):
        try:
            yield
        except BaseException:
            # A first run that failed part-way: what it wrote is still gptopt's, so a rerun with
            # --overwrite may replace it (unmarked, it would be refused as the user's).
            if not old:
                with contextlib.suppress(OSError):  # never hide the error that ended the run
                    mark_ours()
            raise
        mark_ours()
