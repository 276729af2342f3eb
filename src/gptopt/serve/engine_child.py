"""The engine process's side of engine_process.py: the child builds its engine, says ready, runs the engine loop on
its main thread, and carries out its parent's commands on another.

    pytest -q tests/test_serve_process.py

engine_entry.run, the child's first code, ties its life to its parent's, then runs main here. The engine runs on
the main thread, the one that loaded the model and warmed it up; the parent's commands are read on another that
does no torch work (why: engine_process.py). Each engine iteration's events, token ids and no text (the parent
makes it), go back to the parent in one message (EventPipe). The child drains when the parent tells it
to, or on a SIGTERM of its own, and exits when the parent's end of the pipe closes, and when its engine ends
unasked (the parent then answers /health with 503 "failed").
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from gptopt.config import ServeConfig
from gptopt.infer.sampling import SamplingParams
from gptopt.runtime import signals
from gptopt.serve.client import Draining
from gptopt.serve.engine import Engine, settled_heap
from gptopt.serve.events import Channel, ChannelSink, FinishReason, TokenEvent
from gptopt.serve.metrics import ServeMetrics
from gptopt.serve.startup import build_engine, set_process_switches
from gptopt.utils.logs import setup_logging

log = logging.getLogger(__name__)


class EventPipe(Channel):
    """The child's way back: each iteration's events, with the engine's load, in one message. Two threads
    send (the engine's and the one reading commands), so a lock keeps their messages whole."""

    def __init__(self, conn: Connection, engine: Engine | None = None) -> None:
        self.conn, self.engine, self.lock = conn, engine, threading.Lock()
        # key -> engine.Request, for cancels, until its last event; under its own lock, so a request that
        # ends at once cannot be recorded after its end
        self.requests: dict[int, Any] = {}
        self.requests_lock = threading.Lock()

    def submit(self, key: int, prompt: list[int], params: SamplingParams) -> None:
        assert self.engine is not None
        refused: Exception | None = None
        with self.requests_lock:
            try:
                self.requests[key] = self.engine.submit(prompt, params, ChannelSink(self, key))
            except Exception as e:  # the parent counts first: a drain of the child's own, or a bug
                refused = e
        if refused is not None:  # send() takes requests_lock: after it is released. Draining is a 503
            reason: FinishReason = "cancelled" if isinstance(refused, Draining) else "error"
            self.send([(key, TokenEvent([], reason, error=f"{type(refused).__name__}: {refused}"))])

    def cancel(self, key: int, reason: FinishReason) -> None:
        with self.requests_lock:
            req = self.requests.get(key)
        if req is not None:
            req.cancel(reason)

    def send(self, items: list[tuple[int, TokenEvent]]) -> None:
        with self.requests_lock:
            for key, event in items:
                if event.finish_reason is not None:
                    self.requests.pop(key, None)
        stats = self.engine.stats() if self.engine is not None else {"running": 0, "waiting": 0}
        self.message(("events", items, stats))

    def message(self, msg: tuple[Any, ...]) -> None:
        with self.lock:
            with contextlib.suppress(OSError):  # the parent is gone: nobody to tell
                self.conn.send(msg)


def main(cfg: ServeConfig, commands: Connection, events: Connection, setup: Callable[[Engine], None] | None) -> None:
    """The engine process (engine_entry.run has tied it to its parent): set its switches, build and warm up the
    engine, say ready, then run it on this thread while another carries out the parent's commands, until it says
    shutdown (or its end of the pipe closes)."""
    setup_logging()  # a spawned process starts with logging unset; its lines look like the parent's
    pipe = EventPipe(events)
    try:
        set_process_switches(cfg)  # this process's start
        engine = build_engine(cfg, metrics=ServeMetrics(http=False))  # the HTTP side counts requests
        if setup is not None:
            setup(engine)
    except BaseException as e:  # noqa: BLE001 - whatever it was, the parent reports it
        pipe.message(("failed", _portable(e)))
        return
    # Once serving, a SIGTERM of its own (systemd stops every process of a unit) drains it as the
    # parent's drain would, and tells the parent, which then refuses new requests. Before that, SIGTERM
    # ends it at once: there is nothing to drain.
    terminated = threading.Event()
    signals.install(lambda signum, frame: terminated.set(), (signal.SIGTERM,))
    pipe.engine = engine
    with settled_heap(give_back=False):
        pipe.message(("ready", {"max_batch_size": engine.max_batch_size, "max_len": engine.max_len,
                                "vocab_size": engine.vocab_size, "constrains": engine.constrains,
                                "tokenizer": engine.tokenizer.to_str()}))
        reader = threading.Thread(target=_commands, args=(engine, pipe, commands, terminated, cfg.request_timeout),
                                  name="gptopt-engine-commands", daemon=True)
        reader.start()
        # The engine runs on this thread, which loaded the model: the process's one OpenMP pool (Engine.run).
        engine.run()  # returns once stopped; an engine that ends unasked raises, and the child exits
        reader.join()


def _commands(engine: Engine, pipe: EventPipe, commands: Connection, terminated: threading.Event,
              drain_timeout: float) -> None:
    """The parent's commands, carried out until the drain it asked for is over or its end of the pipe
    closes. No torch work here: the engine's thread is the one that computes. If this thread fails, the
    engine stops too: a child that can no longer hear its parent must not look alive."""
    stopping: threading.Thread | None = None

    def stop(timeout: float) -> threading.Thread:
        pipe.message(("draining",))
        thread = threading.Thread(target=_shut, args=(engine, timeout, pipe), name="gptopt-engine-shutdown")
        thread.start()
        return thread

    try:
        while stopping is None or stopping.is_alive():
            if terminated.is_set() and stopping is None:
                stopping = stop(drain_timeout)
            try:
                if not commands.poll(0.1):
                    continue
                msg = commands.recv()
            except (EOFError, OSError):  # the parent is gone: end without waiting for anyone
                engine.shutdown(0)
                return
            batch = [pickle.loads(m) for m in msg[1]] if msg[0] == "batch" else [msg]  # EngineProcess._send
            for msg in batch:
                stopping = _command(engine, pipe, msg, stopping, stop)
    except BaseException:
        log.exception("the engine process stopped reading its commands; stopping its engine")
        engine.shutdown(0)
        raise


def _command(engine: Engine, pipe: EventPipe, msg: tuple[Any, ...], stopping: threading.Thread | None,
             stop: Callable[[float], threading.Thread]) -> threading.Thread | None:
    """Carry out one of the parent's commands; the drain's thread, once one is started."""
    try:
        kind = msg[0]
        if kind == "submit":
            pipe.submit(*msg[1:])
        elif kind == "cancel":
            pipe.cancel(msg[1], msg[2])
        elif kind == "metrics":
            pipe.message(("metrics", msg[1], engine.render_metrics()))
        elif kind == "shutdown" and stopping is None:
            return stop(msg[1])
    except Exception:  # one bad command must not take the engine down
        log.exception("the engine process could not carry out %r", msg[0])
    return stopping


def _shut(engine: Engine, timeout: float, pipe: EventPipe) -> None:
    engine.shutdown(timeout)
    pipe.message(("closed",))


def _portable(e: BaseException) -> BaseException:
    """`e` if it crosses a pipe intact, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")


