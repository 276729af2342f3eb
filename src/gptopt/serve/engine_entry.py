"""The engine process's first code: before the imports that take it seconds (torch, the model's code), it ties its
life to its parent's, so that a server stopped while its engine still starts (importing, loading, warming up)
leaves no engine behind; then it runs engine_child.main.

    pytest -q tests/test_serve_process.py -k starting

Only the standard library is imported here: this module, the configuration and the pipes are all the child has
loaded when run() begins (a spawned child imports its target's module to unpickle it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any

from gptopt.runtime import signals

PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h): a signal for this process when its parent thread ends
ORPHAN_POLL_S = 1.0  # how often the watch looks for its parent


def run(parent: int, parent_thread_is_main: bool, *args: Any) -> None:
    """The child's target: tie it to its parent (the process `parent`), then serve (engine_child.main(*args)).
    parent_thread_is_main: the parent started it from its main thread, whose end is the parent's."""
    signals.ignore((signal.SIGINT,))  # Ctrl-C reaches the whole process group: the parent decides
    follow(parent, kernel=parent_thread_is_main)
    from gptopt.serve import engine_child

    engine_child.main(*args)


def follow(parent: int, *, kernel: bool) -> None:
    """End this process once `parent` is gone. A parent killed outright (SIGKILL, or SIGTERM before it serves) runs
    no clean-up, and a child still loading would hold the model and its memory for minutes.

    kernel: Linux kills this process itself when the parent's thread that started it ends (prctl's PDEATHSIG),
    even while this process holds the GIL in a long native call. That signal follows the thread, not the
    process, so it is asked for only when that thread is the parent's main one. Always, a thread polls the
    parent's id, which the parent passes: a parent that died before this code ran is found at once."""
    if kernel and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # gone already (while this process started, or before the kernel was asked)
        os._exit(1)
    threading.Thread(target=_orphan_watch, args=(parent,), name="gptopt-orphan-watch", daemon=True).start()


def _orphan_watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    os._exit(1)
