"""Replacing gptopt's old entries of an output only once the new ones stand: Aside (an output written as
a run goes: a training run, a bench, a profile), staged_files (files published into a folder the user shares:
prepare), recover (what a killed --overwrite had moved aside comes back).

    python -c "from gptopt.outputs.aside import Aside; help(Aside)"
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from gptopt.outputs.staging import (
    _ASIDE,
    _WRITER,
    OWNER_FILE,
    _finish_tree,
    _ours,
    _path,
    _staging_dir,
    _tag,
    _writer_gone,
    fsync_dir,
    mark,
    marked_kind,
    remove,
)

log = logging.getLogger("gptopt")

# ----------------------------------------------------------------------------------------------
# Replacing an output that a verb writes into as it goes (a training run, a bench, a profile).



class Aside:
    """Move gptopt's old entries of target aside; give them back if the new output fails.

        with Aside(target, check_output(target, kind=..., overwrite=True, ours=OURS), OURS) as aside:
            ... write the new output ...
            aside.commit()   # once the new output can stand in for the old (optional: a clean exit commits)

    An exception before commit() deletes what the new output wrote (entries matching ours) and puts the
    old entries back. A killed process leaves the aside folder; recover() restores it the next time.
    The user's own entries are never moved.
    """

    def __init__(self, target: Path, entries: Sequence[Path], ours: Sequence[str]) -> None:
        self.target = _path(target)
        self.entries = list(entries)
        self.ours = tuple(ours)
        self.folder: Path | None = None

    def __enter__(self) -> Aside:
        if self.entries:
            self.folder = self.target / f"{_ASIDE}{_tag('old')}"
            self.folder.mkdir()
            kind = marked_kind(self.target)
            if kind:  # the restore needs to know what was gptopt's
                mark(self.folder, kind)
            for path in self.entries:
                os.replace(path, self.folder / path.name)
            fsync_dir(self.target)
        return self

    def commit(self) -> None:
        """The new output stands: the old one goes."""
        if self.folder is not None:
            remove(self.folder)
            self.folder = None

    def rollback(self) -> None:
        """The new output failed without an exception (a non-zero exit): the old one comes back."""
        if self.folder is not None:
            _restore(self.target, self.folder, self.ours)
            self.folder = None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.rollback()


def _restore(target: Path, folder: Path, ours: Sequence[str]) -> None:
    mine, _ = _ours(target, ours)
    for path in mine:
        if (folder / path.name).exists() or any(fnmatch.fnmatchcase(path.name, g) for g in ours):
            remove(path)
    for path in folder.iterdir():
        if path.name != OWNER_FILE:
            os.replace(path, target / path.name)
    remove(folder)
    fsync_dir(target)
    log.warning(f"{target}: the new output failed; the earlier one is back in place")


def recover(target: Path, ours: Sequence[str] = ()) -> None:
    """Give back an old output that a killed --overwrite had moved aside (its process is gone)."""
    target = _path(target)
    try:
        asides = [p for p in target.iterdir() if p.name.startswith(_ASIDE)]
    except OSError:
        return
    for folder in asides:
        m = re.match(rf"^old-{_WRITER}-[0-9a-f]{{8}}$", folder.name[len(_ASIDE):])
        if m and _writer_gone(m):
            _restore(target, folder, ours)


@contextlib.contextmanager
def staged_files(target: Path, *, kind: str, replace: Sequence[Path] = (), ours: Sequence[str] = (),
                 last: str | None = None) -> Iterator[Path]:
    """An empty hidden sibling of the folder target to write files into; when the block ends they are
    moved into target beside whatever else is there (the user's files stay), `last` after all the others.

    For a verb whose output shares a folder with the user's files (prepare: nanoGPT keeps input.txt and
    prepare.py beside the shards), where staged_dir's whole-directory swap would take those files with it.
    replace: gptopt's old entries (check_output's answer); they are set aside (Aside) until every new file
    is in, and put back if that fails. target is then marked as kind, listing the new files. The sibling
    is removed in every case; a killed run's is removed by the next write there (clean_stale).
    """
    target = _path(target)
    tmp = _staging_dir(target)
    try:
        yield tmp
        _finish_tree(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        if last in names:
            names.remove(last)
            names.append(last)
        target.mkdir(exist_ok=True)
        moved: list[Path] = []
        try:
            with Aside(target, replace, ours):
                for name in names:
                    os.replace(tmp / name, target / name)
                    moved.append(target / name)
                mark(target, kind, files=names)
                fsync_dir(target)
        except BaseException:
            if not replace:  # nothing was set aside, so Aside has nothing to restore: take back what came in
                for path in moved:
                    remove(path)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
