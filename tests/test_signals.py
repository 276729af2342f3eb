"""Stop signals, one way for every command: a stop taken at the caller's boundary, a second Ctrl-C at once, the
handlers given back, children that leave stops to their parent, and long native calls that still take Ctrl-C at once.

    pytest -q tests/test_signals.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from gptopt.runtime import signals


@pytest.fixture(autouse=True)
def _python_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever ran before (conftest restores)


def test_the_first_stop_signal_is_noted_and_said_and_a_second_stops_at_once() -> None:
    said: list[int] = []
    stop = signals.StopRequest(said.append)
    with signals.handling(stop) as installed:
        assert installed and not stop
        os.kill(os.getpid(), signal.SIGTERM)  # handled before kill returns: the signal is this thread's
        assert stop and stop.signum == signal.SIGTERM and said == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert said == [signal.SIGTERM]  # the second one is not said: it stops


def test_the_handlers_before_the_block_come_back_however_it_ends() -> None:
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    with pytest.raises(RuntimeError), signals.handling(signals.StopRequest()):
        assert all(signal.getsignal(sig) is not before[sig] for sig in signals.STOP_SIGNALS)
        raise RuntimeError("the block failed")
    assert {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS} == before
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C is Python's own again
        os.kill(os.getpid(), signal.SIGINT)


def test_off_the_main_thread_nothing_is_set_and_the_block_still_runs() -> None:
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    seen: dict[str, object] = {}

    def worker() -> None:
        with signals.handling(signals.StopRequest()) as installed:
            seen["installed"] = installed
            seen["handlers"] = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"installed": False, "handlers": before}


def test_an_ignoring_child_outlives_the_stop_signals_its_parent_acts_on() -> None:
    code = ("import os, signal, time\nfrom gptopt.runtime import signals\nsignals.ignore()\n"
            "os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)\n"
            "print('still here')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "still here", done.stderr


def test_a_call_that_never_returns_to_python_still_takes_ctrl_c_at_once() -> None:
    """A call blocked in native code (here a wait no one ends) holds no Ctrl-C back: the caller gets
    KeyboardInterrupt while the call is still blocked, and the process need not wait for it."""
    release = threading.Event()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    threading.Timer(10.0, release.set).start()  # the call's end, should the interrupt never come: a failure, no hang
    with pytest.raises(KeyboardInterrupt):
        signals.interruptible(release.wait)
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
        signals.interruptible(release.wait)
    assert not release.is_set()  # the call was left, not finished
    end.cancel()
    release.set()


def test_interruptible_returns_the_value_and_raises_the_error_of_the_call() -> None:
    assert signals.interruptible(sum, [1, 2, 3]) == 6
    with pytest.raises(ValueError, match="boom"):
        signals.interruptible(lambda: (_ for _ in ()).throw(ValueError("boom")))
