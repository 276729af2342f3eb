"""Stop signals, handled one way by every command: SIGINT (Ctrl-C) and SIGTERM (kill, a scheduler, systemd).

    python -c "from gptopt.runtime import signals; help(signals)"

- exit_code: a command a signal stopped exits 128 + its number, as a shell reports one it killed (130, 143):
  train after its stop checkpoint, bench after the report of what it measured.
- StopRequest with handling: a stop taken at a boundary of the command's own (train: the end of a step). The
  first signal is noted and said at once; a second stops at once (KeyboardInterrupt). The handlers the process
  had come back when the block ends.
- install, ignore: handlers for the rest of the process. A child process its parent stops ignores the signals
  the parent acts on (DataLoader workers, serve's engine process and its Ctrl-C).
- Interrupt: a stop at once, as Ctrl-C stops (KeyboardInterrupt), for either signal: bench reports what it measured
  and exits 128 + the signal that came.
- interruptible: a long call in native code, which would hold Python's handlers back until it returns, run so
  that Ctrl-C is still taken at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, TypeVar

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Callable[[int, FrameType | None], Any] | int | None  # what signal.signal takes and returns


def exit_code(signum: int) -> int:
    """The exit status of a command that `signum` stopped: 128 + its number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


CTRL_C_EXIT = exit_code(signal.SIGINT)  # a command Ctrl-C stopped (bench: once its report of what it measured is out)


def name(signum: int) -> str:
    return signal.Signals(signum).name


def install(handler: Handler, signals: Sequence[int] = STOP_SIGNALS) -> dict[int, Handler]:
    """`handler` for each of `signals`; returns the handlers it replaced (restore() gives them back). Only the main
    thread may set handlers: on another (a test runner's worker, a notebook's thread) nothing is set and {} is
    returned, so the process keeps its own."""
    old: dict[int, Handler] = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in signals:
            old[sig] = signal.signal(sig, handler)
    return old


def restore(old: dict[int, Handler]) -> None:
    for sig, handler in old.items():
        if handler is not None:  # None: a handler set outside Python, which cannot be set back from here
            signal.signal(sig, handler)


def ignore(signals: Sequence[int] = STOP_SIGNALS) -> None:
    """For the rest of this process: a child whose parent stops it (a DataLoader worker: the main process saves at
    the step boundary, then shuts its workers down; serve's engine process and Ctrl-C: its server drains it)."""
    install(signal.SIG_IGN, signals)


@contextlib.contextmanager
def handling(handler: Handler, signals: Sequence[int] = STOP_SIGNALS) -> Iterator[bool]:
    """`handler` for `signals` within the block, the earlier handlers back after it however it ends; yields whether
    they were set (not off the main thread)."""
    old = install(handler, signals)
    try:
        yield bool(old)
    finally:
        restore(old)


class StopRequest:
    """The handler of a stop taken at a boundary of the caller's: the first stop signal is noted (`signum`) and said
    at once (`say`, given the signal's number), and the caller stops at its next boundary; a second one stops at once
    (KeyboardInterrupt), whatever the caller is doing.

        stop = StopRequest(say)
        with handling(stop):
            while not stop: ...  # one unit of work, then the boundary
    """

    def __init__(self, say: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self._say = say

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        if self._say is not None:
            self._say(signum)

    def __bool__(self) -> bool:
        return self.signum is not None


class Interrupt:
    """The handler of a command that stops at once on either stop signal as it does on Ctrl-C: it raises
    KeyboardInterrupt (which the command catches to report what it has done) and keeps the signal's number, so that
    the command's exit code says which came (exit_code)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        raise KeyboardInterrupt

    def exit_code(self, default: int = CTRL_C_EXIT) -> int:
        return exit_code(self.signum) if self.signum is not None else default


T = TypeVar("T")
INTERRUPT_POLL_S = 0.1  # how long Ctrl-C may wait in interruptible() when another thread receives the signal


def interruptible(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in a daemon thread, the caller waiting for it: a call that runs for seconds in native
    code (a tokenizer's encode_batch or BPE training in Rust) would hold the main thread, and with it Python's
    signal handlers, for all that time; waiting on a thread takes Ctrl-C at once (KeyboardInterrupt), and the
    process need not wait for the abandoned call to end."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller, with its traceback
            result["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="gptopt-interruptible")
    worker.start()
    # Joined in short waits: the kernel may deliver SIGINT to any thread (tqdm's monitor, torch's pool), and then
    # nothing wakes a main thread blocked in one long join to run Python's handler until the call ends.
    while worker.is_alive():
        worker.join(INTERRUPT_POLL_S)
    if "error" in result:
        raise result["error"]
    return result["value"]
