"""The GPU check's processes: each step in a process group of its own, stopped whole, its log's tail.

    pytest -q tests/test_gpu_check.py -k "hanging or stopped"

A step's torchrun ranks, compile workers and DataLoader workers join its group, so stopping the group
leaves nothing of the step running; a server's group is waited out, so the next server finds the device
memory free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpu_check_plan import ROOT


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _start(argv: list[str], log: Path, stdout: Path | None = None) -> subprocess.Popen[bytes]:
    """The step in a process group of its own (its torchrun ranks, compile workers and DataLoader
    workers join it), so it can be stopped whole; in this session, so whatever stops the runner's
    session stops it too."""
    group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with open(log, "ab") as err, open(stdout or os.devnull, "wb") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=out if stdout else err, stderr=err, **group)


def _stop(proc: subprocess.Popen[bytes], grace: tuple[float, float]) -> None:
    """Blocking: SIGINT to the leader (pytest then writes its report, gptopt what it has), SIGTERM and
    SIGKILL to the group, `grace` seconds apart; and the group's leftovers always."""
    for sig, wait in ((signal.SIGINT, grace[0]), (signal.SIGTERM, grace[1]), (signal.SIGKILL, 5)):
        if sig == signal.SIGINT:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
        else:
            _killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except Exception:  # not up yet: refused, reset, 503
        return None


def _group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a process that is not a zombie (a zombie holds no memory, and one
    whose parent is gone may wait long for init to reap it)."""
    try:
        stats = [f.read_text() for f in Path("/proc").glob("[0-9]*/stat")]
    except OSError:
        stats = []
    if not stats:  # no /proc: the group's existence, zombies included
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in stats:
        fields = stat.rsplit(")", 1)[-1].split()  # after the name, which may hold spaces: state, ppid, pgrp
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _gone(pgid: int, timeout: float = 10.0) -> None:
    """Wait until process group `pgid` has ended, so the next server finds its device memory free."""
    end = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.1)
