"""Publishing a directory: written whole into a hidden sibling, made durable, then renamed into place.

Every directory gptopt hands to a user (checkpoints, model directories, Hugging Face and ONNX exports,
compressed models, prepared data) goes through staged_dir, so a crash at any point leaves either the
old directory or the complete new one, never half of one, and no temporary directory behind.

    python -c "from gptopt.fsutil import staged_dir; help(staged_dir)"
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["fsync_dir", "replace_dir", "staged_dir"]


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


def _sibling(target: Path, tag: str) -> Path:
    # Hidden (listings of checkpoints skip dot names) and unique per process and call.
    return target.with_name(f".{target.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory src to dst, replacing an old dst only after src is complete."""
    if dst.exists():
        old = _sibling(dst, "old")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    fsync_dir(dst.parent)


@contextlib.contextmanager
def staged_dir(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """An empty temporary sibling of target to write into; published as target when the block ends.

    replace=True swaps out an existing target (the old one stays until the new is complete); with
    replace=False only a missing or empty target is taken, and a target that something else filled
    meanwhile makes the publish fail (rename(2) refuses a non-empty directory) with nothing replaced.
    An exception inside the block removes the temporary directory and leaves target as it was.

    The temporary directory is made with mkdir, not tempfile.mkdtemp: mkdtemp's 0700 mode would stay
    on the published directory and lock out every other account (the one that serves a model, say),
    where mkdir gives what the user's umask says, as any directory the user makes; files get open()'s.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _sibling(target, "tmp")
        try:
            tmp.mkdir()
            break
        except FileExistsError:  # a leftover of a killed run with the same pid and token: draw again
            continue
    try:
        yield tmp
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
