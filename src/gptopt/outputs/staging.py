"""Writing a user's disk safely: staged publishing, ownership marks, and output checks.

Every directory gptopt hands to a user (checkpoints, model directories, Hugging Face and ONNX exports,
compressed models, prepared data) goes through staged_dir, so a crash at any point leaves either the
old directory or the complete new one, never half of one, and no temporary directory behind.

The rules every writing verb follows (docs/design.md, "Nothing a user owns is lost"):
- check_output validates an output before any work: not a file, writable, and either new, or
  holding no entry the verb would write, or (with --overwrite) marked by gptopt as this kind of
  output and holding nothing gptopt did not write. Nothing else is ever replaced.
- mark / marked_kind: the `.gptopt-output.json` a verb leaves in what it wrote (its kind and files).
- Aside: --overwrite moves the old output aside, restores it if the new one fails before commit(),
  and deletes it only once the new one has something to put in its place.
- Staging and aside folders are tagged host-pid-token; those of a dead process on this host are
  removed (or, for an interrupted replacement, restored) by the next write there.
- lock_output: one writer per output. A verb holds an OS lock on its output for its whole life, from
  before check_output to the end; a second writer is refused at once, naming the holder's pid.

    python -c "from gptopt.outputs.staging import staged_dir; help(staged_dir)"
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock (lock_output)
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "OWNER_FILE", "Aside", "check_output", "check_writable", "clean_stale", "fsync_dir",
           "lock_output", "mark", "marked_kind", "recover", "remove", "replace_dir", "replacing", "some", "staged_dir",
           "staged_file", "staged_files", "write_text_atomic"]

log = logging.getLogger("gptopt")

OWNER_FILE = ".gptopt-output.json"
LOCK_FILE = ".gptopt-lock"  # inside an output written in place; beside one published whole: .NAME.gptopt-lock


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform (Windows); the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    try:  # Linux says it without changing it: no window in which another thread creates with a wrong mask
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _finish_tree(root: Path) -> None:
    """Give every file the mode open() gives under the umask, then fsync files and folders, deepest first.

    Some writers narrow it: safetensors' save_file leaves 0600, which would lock other accounts out.
    """
    file_mode = 0o666 & ~_umask()
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            os.chmod(path, file_mode)
            with open(path, "rb") as fh:  # fsync on a read-only descriptor flushes the file all the same
                os.fsync(fh.fileno())
        fsync_dir(Path(dirpath))


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
# .NAME.KIND-HOST-PID-TOKEN: tmp (being written), old (replaced, not yet deleted), trash (being deleted)
_STAGED = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|trash)-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _path(target: str | os.PathLike[str]) -> Path:
    """Absolute and normalised: `--output_dir .` or `out/..` has no name to make a sibling of otherwise."""
    return Path(os.path.abspath(os.path.expanduser(target)))


def _tag(kind: str) -> str:
    return f"{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def _sibling(target: Path, kind: str) -> Path:
    # Hidden (listings of checkpoints skip dot names) and unique per host, process and call.
    return target.with_name(f".{target.name}.{_tag(kind)}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another account's live process
        return True
    return True


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Delete a file or folder of gptopt's own: renamed to a trash name first, so an interrupted delete is
    recognisably garbage (clean_stale) and never mistaken for the thing it was."""
    if not os.path.lexists(path):
        return
    trash = path.with_name(f".{path.name.lstrip('.')}.{_tag('trash')}")
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    _delete(trash)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a small file (a pointer, a mark) so that a reader sees the old text or the new, never a torn one
    (staged_file)."""
    with staged_file(Path(path)) as tmp:
        tmp.write_text(text)


def clean_stale(directory: Path) -> list[Path]:
    """Remove the staging leftovers of dead gptopt processes on this host in directory (kill -9,
    power loss); a replacement interrupted between its two renames gets its old directory back.
    Returns what was removed or restored. Live processes' and other hosts' entries are never touched."""
    directory = Path(directory)
    done: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return done
    for path in entries:
        m = _STAGED.match(path.name)
        if not m or m["host"] != _HOST or _alive(int(m["pid"])):
            continue
        target = directory / m["name"]
        if m["kind"] == "old" and not target.exists():
            os.replace(path, target)  # the new one never arrived: the old one is still the output
            log.warning(f"restored {target}, which an interrupted write had moved aside")
        else:
            _delete(path)
        done.append(path)
    return done


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory src to dst, replacing an old dst only after src is complete."""
    if dst.exists():
        old = _sibling(dst, "old")
        os.replace(dst, old)
        os.replace(src, dst)
        remove(old)
    else:
        os.replace(src, dst)
    fsync_dir(dst.parent)


def _staging_dir(target: Path) -> Path:
    """A new empty hidden sibling of target (its parent made, dead writers' leftovers there removed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target.parent)
    while True:
        tmp = _sibling(target, "tmp")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:  # a leftover of a killed run with the same pid and token: draw again
            continue


@contextlib.contextmanager
def staged_dir(target: Path, *, replace: bool = False, kind: str | None = None) -> Iterator[Path]:
    """An empty temporary sibling of target to write into; published as target when the block ends.

    replace=True swaps out an existing target (the old one stays until the new is complete); with
    replace=False only a missing or empty target is taken, and a target that something else filled
    meanwhile makes the publish fail (rename(2) refuses a non-empty directory) with nothing replaced.
    An exception inside the block removes the temporary directory and leaves target as it was.

    The temporary directory is made with mkdir, not tempfile.mkdtemp: mkdtemp's 0700 mode would stay
    on the published directory and lock out every other account (the one that serves a model, say),
    where mkdir gives what the user's umask says, as any directory the user makes; files get open()'s.

    kind: mark the published directory as this kind of gptopt output (mark), listing its files, so
    that a later --overwrite may replace it and nothing else.
    """
    target = _path(target)
    tmp = _staging_dir(target)
    try:
        yield tmp
        if kind is not None:
            mark(tmp, kind, files=[p.name for p in tmp.iterdir()])
        _finish_tree(tmp)
        if replace:
            replace_dir(tmp, target)
        else:
            try:
                os.rename(tmp, target)
            except OSError as e:
                raise FileExistsError(f"{target} exists and is not empty; nothing was replaced") from e
            fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when published


# ----------------------------------------------------------------------------------------------
# Ownership: what gptopt wrote, and the one check every writing verb makes before any work.


def mark(directory: Path, kind: str, files: Iterable[str] | None = None) -> None:
    """Record that gptopt wrote directory as `kind` (e.g. "export-hf", "train-run"), and which of its
    entries are gptopt's when it shares the folder with the user's files."""
    from gptopt import __version__  # the package root: no cycle

    body: dict[str, Any] = {"written_by": "gptopt", "kind": kind, "version": __version__}
    if files is not None:
        body["files"] = sorted(set(files) - {OWNER_FILE})
    write_text_atomic(Path(directory) / OWNER_FILE, json.dumps(body, indent=2) + "\n")


def _marker(directory: Path) -> dict[str, Any] | None:
    try:
        body = json.loads((Path(directory) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and body.get("written_by") == "gptopt" else None


def marked_kind(directory: Path) -> str | None:
    """The kind gptopt marked directory with, or None when gptopt did not mark it."""
    body = _marker(directory)
    kind = body.get("kind") if body else None
    return kind if isinstance(kind, str) else None


def _ours(directory: Path, ours: Sequence[str]) -> tuple[list[Path], list[Path]]:
    """(gptopt's entries, the user's entries) of directory: gptopt's match a glob of `ours` or are listed
    in the mark; the mark itself and gptopt's staging names count as neither."""
    body = _marker(directory) or {}
    listed = set(body.get("files") or []) if isinstance(body.get("files"), list) else set()
    mine: list[Path] = []
    theirs: list[Path] = []
    for path in sorted(Path(directory).iterdir()):
        name = path.name
        if name == OWNER_FILE or name.endswith(LOCK_FILE) or _STAGED.match(name) or name.startswith(_ASIDE):
            continue
        if name in listed or any(fnmatch.fnmatchcase(name, g) for g in ours):
            mine.append(path)
        else:
            theirs.append(path)
    return mine, theirs


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
        raise ValueError(f"{flag} {shown}: {probe} is a file, not a folder; choose another {flag}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {shown}: cannot write in {probe} (permission denied); choose a folder you can "
                         f"write with {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gptopt-probe-", dir=probe))
    except OSError as e:
        raise ValueError(f"{flag} {shown}: cannot create a folder there ({e.strerror or e}); nothing was written: "
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
        raise ValueError(f"{flag} {target} is a file; give the path of a folder")
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
        raise ValueError(f"{flag} {target} holds gptopt {found} output; nothing was written: give this output a "
                         f"folder of its own with {flag}")
    mine, theirs = _ours(target, ours)
    if not mine and not (whole and theirs):
        return []  # new, or the user's files only: the verb writes beside them and touches none of them
    # What --overwrite would refuse is said now, not advised first and refused after.
    if found != kind:
        what = (f"not marked as gptopt's ({OWNER_FILE} is damaged)" if (target / OWNER_FILE).exists()
                else f"not marked as gptopt's ({OWNER_FILE} missing)")
        held = "exists and is not empty" if whole else f"already holds {some(p.name for p in mine)}"
        raise ValueError(f"{flag} {target} {held} and is {what}; nothing was written, and --overwrite will not "
                         f"replace it either: gptopt only replaces what it wrote itself; move them out, or choose "
                         f"another {flag}")
    foreign = theirs if whole else _foreign_inside(mine, contents or {})
    if foreign:
        names = some(str(p.relative_to(target)) for p in foreign)
        raise ValueError(f"{flag} {target} holds files gptopt did not write ({names}); nothing was written, and "
                         f"--overwrite will not replace it: move them out, or choose another {flag}")
    if not overwrite:
        if whole:
            raise ValueError(f"{flag} {target} holds an earlier output of this command; nothing was written: pass "
                             f"--overwrite to replace it (kept until the new output is complete), or choose another "
                             f"{flag}")
        names = some(p.name for p in mine)
        raise ValueError(f"{flag} {target} already holds output ({names}); nothing was written: pass --overwrite "
                         f"to replace it (kept until the new output is complete), or choose another {flag}")
    return mine


# ----------------------------------------------------------------------------------------------
# One writer per output: two runs into one folder would each pass the checks above and then mix their
# files (checkpoints of one run under the other's lineage, interleaved metrics).

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
    # Written in place (train, bench, prepare, ...): inside the folder, whose parent need not be writable
    # (--output_dir . in a home folder). Published whole (staged_dir, staged_file): beside it, as the
    # staging is; the folder itself is swapped by a rename, and a lock inside would leave with the old one.
    return target.parent / f".{target.name}{LOCK_FILE}" if whole else target / LOCK_FILE


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
        raise ValueError(f"{flag} {dest} is being written by another gptopt process ({who}); nothing was written: "
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


def _not_root_or_home(target: Path, flag: str) -> None:
    if target == Path(target.anchor) or target == _path(Path.home()):
        what = "the filesystem root" if target == Path(target.anchor) else "your home folder"
        raise ValueError(f"{flag} {target} is {what}; give the output a folder of its own, e.g. "
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


# ----------------------------------------------------------------------------------------------
# Replacing an output that a verb writes into as it goes (a training run, a bench, a profile).

_ASIDE = ".gptopt-old-"


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
        m = re.match(r"^old-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[0-9a-f]{8}$", folder.name[len(_ASIDE):])
        if m and m["host"] == _HOST and not _alive(int(m["pid"])):
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


@contextlib.contextmanager
def staged_file(target: Path) -> Iterator[Path]:
    """A hidden sibling path of the file target to write; it replaces target when the block ends (os.replace:
    readers see the old file or the new one, never half), and is deleted if the block fails, so a failed run
    leaves an existing target as it was. A killed run's sibling is removed by the next write there."""
    target = _path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target.parent)
    tmp = _sibling(target, "tmp")
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)
