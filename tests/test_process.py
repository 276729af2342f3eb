"""The process-wide switches a command sets where it starts, and interruptible long calls.

    pytest -q tests/test_process.py
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from gptopt.runtime import process
from gptopt.runtime.torch_private import recompile_limit


@pytest.fixture(autouse=True)
def _python_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever ran before (conftest restores)


def test_a_call_that_never_returns_to_python_still_takes_ctrl_c_at_once() -> None:
    """A call blocked in native code (here a wait no one ends) holds no Ctrl-C back: the caller gets
    KeyboardInterrupt while the call is still blocked, and the process need not wait for it."""
    release = threading.Event()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    threading.Timer(10.0, release.set).start()  # the call's end, should the interrupt never come: a failure, no hang
    with pytest.raises(KeyboardInterrupt):
        process.interruptible(release.wait)
    assert not release.is_set()  # the call was left, not finished
    release.set()


def test_ctrl_c_that_the_kernel_hands_to_another_thread_is_taken_at_once_too() -> None:
    """A process's SIGINT may land on any of its threads (tqdm's monitor, torch's pool): the blocked caller still
    gets KeyboardInterrupt while the call is blocked, not once it ends."""
    release = threading.Event()
    threading.Timer(0.2, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT)).start()
    end = threading.Timer(10.0, release.set)  # the call's end, should the interrupt wait for it
    end.start()
    with pytest.raises(KeyboardInterrupt):
        process.interruptible(release.wait)
    assert not release.is_set()  # the call was left, not finished
    end.cancel()
    release.set()


def test_interruptible_returns_the_value_and_raises_the_error_of_the_call() -> None:
    assert process.interruptible(sum, [1, 2, 3]) == 6
    with pytest.raises(ValueError, match="boom"):
        process.interruptible(lambda: (_ for _ in ()).throw(ValueError("boom")))


def test_allow_recompiles_raises_dynamos_limit_and_never_lowers_it() -> None:
    # dynamo's own patch, not monkeypatch: undoing a monkeypatch deletes the setting from torch's config module,
    # which then hides it from every later compile
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{name: 8}):
        process.allow_recompiles(64)
        assert recompile_limit() == 64
        process.allow_recompiles(16)  # a command that needs fewer leaves a larger limit as it is
        assert recompile_limit() == 64
    assert hasattr(torch._dynamo.config, name)
