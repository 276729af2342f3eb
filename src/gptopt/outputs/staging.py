"""Publishing an output whole: staged_dir (a directory), staged_file (a file), each written as a hidden
sibling, fsynced and renamed into place, so a crash leaves the old output or the complete new one, never half
of one; the mark a published folder carries (`.gptopt-output.json`: its kind and files); and the clean-up of
killed writers' staging leftovers.

    python -c "from gptopt.outputs.staging import staged_dir; help(staged_dir)"

Staging folders are tagged with their writer (host, boot and pid namespace, pid, start time) and a token; those of
a writer certainly dead are removed (or, for an interrupted replacement, restored) by the next write there.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("gptopt")

OWNER_FILE = ".gptopt-output.json"
LOCK_FILE = ".gptopt-lock"  # beside the output: .NAME.gptopt-lock (inside, where its parent takes no file)


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
# Who wrote a staging or aside folder: HOST-SPACE-PID-START. SPACE names this boot of the machine and this process's
# pid namespace (containers sharing a hostname and a volume have their own), START the process's start time, so
# a reused pid is told apart. Older versions wrote HOST-PID only.
_WRITER = r"(?P<host>[A-Za-z0-9_.]+)-(?:(?P<space>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)|(?P<old_pid>\d+))"
# .NAME.KIND-WRITER-TOKEN: tmp (being written), old (replaced, not yet deleted), trash (being deleted)
_STAGED = re.compile(rf"^\.(?P<name>.+)\.(?P<kind>tmp|old|trash)-{_WRITER}-[0-9a-f]{{8}}$")

_ASIDE = ".gptopt-old-"  # the folder an --overwrite moves the old entries into (aside.Aside)


def _path(target: str | os.PathLike[str]) -> Path:
    """Absolute and normalised: `--output_dir .` or `out/..` has no name to make a sibling of otherwise."""
    return Path(os.path.abspath(os.path.expanduser(target)))


def _start_time(pid: int) -> int | None:
    """When process pid started, in clock ticks since boot (/proc/PID/stat's 22nd field); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _space() -> str:
    """This boot of the machine and this process's pid namespace, as 8 hex digits ("00000000" where neither can be
    read): two writers of one space see each other's processes."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        with contextlib.suppress(OSError):
            parts.append(os.readlink(path) if path.endswith("/pid") else Path(path).read_text().strip())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8] if parts else "0" * 8


def _writer() -> str:
    pid = os.getpid()
    return f"{_HOST}-{_space()}-{pid}-{_start_time(pid) or 0}"


def _tag(kind: str) -> str:
    return f"{kind}-{_writer()}-{secrets.token_hex(4)}"


def _writer_gone(m: re.Match[str]) -> bool:
    """Whether the writer a _WRITER match names is certainly dead: of this host and this space (else its processes
    are not ours to see: never judged), with no live process of its pid and start time. Older names (host-pid):
    this host, no such pid."""
    if m["host"] != _HOST:
        return False
    if m["old_pid"] is not None:
        return not _alive(int(m["old_pid"]))
    if m["space"] != _space():
        return False
    pid, start = int(m["pid"]), int(m["start"])
    if not _alive(pid):
        return True
    now = _start_time(pid)
    return start != 0 and now is not None and now != start  # the pid was reused by another process


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
        if not m or not _writer_gone(m):
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
