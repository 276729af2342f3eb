"""One writer per output: a verb holds an OS lock (flock) on its output for its whole life, from before
check_output to the end; a second writer is refused at once, naming the holder's pid.

    python -c "from gptopt.outputs.lock import lock_output; help(lock_output)"

Two runs into one folder would each pass check_output and then mix their files (checkpoints of one run under
the other's lineage, interleaved metrics).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock (lock_output)
    fcntl = None  # type: ignore[assignment]

from gptopt.outputs.check import _not_root_or_home, check_writable
from gptopt.outputs.staging import _HOST, LOCK_FILE, _path
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")

_held: dict[Path, list[int]] = {}  # lock file -> [fd, depth] of the locks this process holds (re-entrant)
_held_guard = threading.Lock()


def _drop_inherited() -> None:
    """In a forked child (a DataLoader worker): close the inherited lock descriptors. A flock belongs to
    the open file, which the child shares; kept, a worker that outlives a killed writer would go on
    holding the writer's lock."""
    for fd, _ in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited)


def _lock_path(target: Path, whole: bool) -> Path:
    # One place for every kind of writer, so that a train and a compress into one folder keep each other out:
    # beside the output (.NAME.gptopt-lock), as a whole publish needs (the folder itself is swapped by a rename,
    # and a lock inside would leave with the old one). An output written in place whose parent takes no new
    # file (--output_dir . in a read-only folder) locks inside instead; a whole publish could not be made there.
    parent = target.parent
    beside = parent / f".{target.name}{LOCK_FILE}"
    if whole or beside.exists() or not parent.is_dir() or os.access(parent, os.W_OK | os.X_OK):
        return beside
    return target / LOCK_FILE


def _missing(folder: Path) -> list[Path]:
    """folder and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not os.path.lexists(folder) and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


def _holder(fd: int) -> str:
    """Who holds the lock, from what the holder wrote into the file: "pid N" (on another host: "pid N on H")."""
    try:
        pid, _, host = os.pread(fd, 256, 0).decode("ascii", "replace").strip().partition(" ")
    except OSError:
        pid, host = "", ""
    if not pid.isdigit():  # the holder took the lock a moment ago and has not written its pid yet
        return "pid unknown"
    return f"pid {pid}" + (f" on {host}" if host and host != _HOST else "")


def _acquire(path: Path, *, wait: bool) -> tuple[int | None, list[Path]]:
    """An open descriptor of path holding its exclusive flock (None when another process holds it), and the
    folders made to hold it, deepest first. _NoLocks where the filesystem has no flock."""
    made: list[Path] = []
    while True:
        missing = _missing(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        made = missing or made
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:  # the last holder removed the folder it had made for its lock just now
            continue
        except PermissionError:  # another account's lock file, left by a killed run: flock takes a reader too
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None, made
        except BaseException as e:  # no flock here, or Ctrl-C while waiting
            os.close(fd)
            if isinstance(e, OSError) and e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                with contextlib.suppress(OSError):
                    os.unlink(path)  # a lock file that locks nothing is only litter
                _remove_empty(made)
                raise _NoLocks(e.strerror or str(e)) from None
            _remove_empty(made)
            raise
        # The last holder unlinks the file as it lets go; a lock taken on that unlinked file guards nothing,
        # so it counts only if the path still names the file locked.
        try:
            st, held = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                return fd, made
        except FileNotFoundError:
            pass
        os.close(fd)


class _NoLocks(Exception):
    """The filesystem keeps no flock."""


def _remove_empty(folders: Sequence[Path]) -> None:
    """The folders made for a lock, deepest first, while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


@contextlib.contextmanager
def lock_output(target: str | os.PathLike[str], *, flag: str = "--output_dir", whole: bool = False,
                wait: bool = False) -> Iterator[None]:
    """Hold the one-writer lock of the output target for the block.

    Take it before check_output, so that the checks and the writing happen under one lock. A second
    process writing the same output is refused at once (ValueError naming the holder's pid and the fix),
    or with wait=True waits for the first to finish (the default data, prepared on first use by whichever
    command needs it). whole: target is published as one directory or file (staged_dir, staged_file).

    An OS lock (flock) on a small file, LOCK_FILE: the kernel lets go of it when the process ends however
    it ends, so kill -9 leaves no stale lock, only the file, which the next writer reuses; the block's
    end removes it, and a folder made only to hold it. Forked children (DataLoader workers) close their
    copy (_drop_inherited). Re-entrant within a process. Local and NFS filesystems honour it; where there
    is no flock (Windows, a filesystem without locks) writers are not kept apart, and a warning says so.
    """
    dest = _path(target)
    _not_root_or_home(dest, flag)  # before a lock file is made there
    path = _lock_path(dest, whole)
    with _held_guard:
        nested = path in _held
        if nested:
            _held[path][1] += 1
    if nested:
        try:
            yield
        finally:
            with _held_guard:
                _held[path][1] -= 1
        return
    fd: int | None = -1  # -1: no lock to be had here (no flock on this platform or filesystem)
    made: list[Path] = []
    if fcntl is not None:
        check_writable(path.parent, flag, shown=dest)  # a file in the way, no permission: check_output's words
        try:
            fd, made = _acquire(path, wait=wait)
        except _NoLocks as e:
            log.warning(f"{flag} {dest}: the filesystem takes no lock ({e}); nothing keeps a second writer out of it")
    if fd == -1:
        yield
        return
    if fd is None:
        try:
            with open(path, "rb") as fh:
                who = _holder(fh.fileno())
        except OSError:  # it let go meanwhile
            who = "pid unknown"
        _remove_empty(made)
        raise UserError(f"{flag} {dest} is being written by another gptopt process ({who}); nothing was written: "
                         f"wait for it to finish, or choose another {flag}")
    try:
        with contextlib.suppress(OSError):  # read-only: another account's file (the lock holds all the same)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {_HOST}\n".encode(), 0)
        with _held_guard:
            _held[path] = [fd, 1]
        yield
    finally:
        with _held_guard:
            _held.pop(path, None)
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still locked: a writer that opened it meanwhile sees it gone and retries
        os.close(fd)
        _remove_empty(made)  # one that now holds anything stays
