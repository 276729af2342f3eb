"""The engine in a process of its own: the HTTP side and the model stop sharing one GIL.

    pytest -q tests/test_serve_process.py

`gptopt serve` builds its engine (engine.py: the model, the KV cache, the continuous-batching thread)
with startup.build_engine. By default it runs it in a child process (`EngineProcess`, this module: the
parent's side; engine_entry.py and engine_child.py: the child's), as vLLM's API server does, and talks
to it over two pipes: requests and cancels go in, each engine iteration's events (token ids: the HTTP side makes
their text, output.py) come back in one message. The HTTP process keeps the tokenizer, the request checks, the
detokenizing and the streams; the child keeps the model.

Why: the engine thread calls its kernels from Python and takes the GIL back after each one, so in one
process it waits whenever the event loop runs Python, and the event loop waits for it. Apart, neither
waits for the other (benchmarks/2026-12-04-serving-vs-transformers.md, "The engine in a process of its own").
`--no-engine_process` keeps everything in one process (and `create_app` with a model object always
does: tests and notebooks hand over a model in memory).

The child runs the engine loop on its main thread, the one that loaded the model and warmed it up
(Engine.run), and reads the parent's commands on another that does no torch work: a second thread
starting OpenMP regions gives the process a second pool of workers, and then every worker sleeps
between kernels instead of spinning (engine.Engine.run; benchmarks/2026-12-04-serving-vs-transformers.md,
"The engine on its process's main thread").

The child is started with "spawn": a forked child would inherit the parent's OpenMP and CUDA state,
which neither survives a fork. Its first code (engine_entry.run) ties its life to this process's, so a
server stopped at any stage of its start leaves no engine behind. It ignores SIGINT (Ctrl-C reaches the
whole process group) and drains when the parent tells it to, or on a SIGTERM of its own; it exits when
the parent's end of the pipe closes, and when its engine ends unasked (the parent then answers /health
with 503 "failed").
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from gptopt.config import ServeConfig
from gptopt.data.tokenizer import Tokenizer
from gptopt.infer.sampling import SamplingParams
from gptopt.serve import engine_entry
from gptopt.serve.blocklist import Blocklist, load_blocklist
from gptopt.serve.client import Draining, QueueFull, RetryAfter
from gptopt.serve.engine import Engine
from gptopt.serve.events import COMPLETED, FinishReason, TokenEvent, TokenSink, deliver
from gptopt.serve.metrics import ServeMetrics
from gptopt.utils.errors import UserError

log = logging.getLogger(__name__)

START_TIMEOUT = 3600.0  # seconds for the child to load and warm up (a cold compile of gpt2-xl's buckets is long)
METRICS_TIMEOUT = 5.0  # seconds /metrics waits for the child's figures


# -- the parent -------------------------------------------------------------------------------------


def _how_it_ended(code: int | None) -> str:
    """A process's exitcode in words: a negative one is the signal that killed it (-9: the kernel's
    out-of-memory killer, or kill -9)."""
    if code is None:
        return "closed its pipe but has not exited"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RemoteRequest:
    """What EngineProcess.submit returns: the handle a client cancels with, as engine.Request."""

    def __init__(self, engine: EngineProcess, key: int) -> None:
        self.engine, self.key = engine, key

    def cancel(self, reason: FinishReason = "cancelled") -> None:
        self.engine.cancel(self.key, reason)


class EngineProcess:
    """engine.EngineClient, the HTTP side's interface to an engine, for an engine running in a child process.

    The parent counts the sequences it has submitted and not yet seen finish, so 429 (QueueFull) and 503
    (Draining) are decided here at once, with the engine's rules; the child's count is never higher."""

    def __init__(self, cfg: ServeConfig, *, start_timeout: float = START_TIMEOUT,
                 setup: Callable[[Engine], None] | None = None) -> None:
        """Start the child and wait until its engine is warmed up (or raise what stopped it). setup: called
        with the engine in the child before it starts (a module-level function: it crosses by name)."""
        self.max_queue, self.request_timeout = cfg.max_queue, cfg.request_timeout
        self.blocklist: Blocklist = load_blocklist(cfg.blocklist)  # prompts and output are checked here
        self.metrics = ServeMetrics(engine=False)  # the HTTP side's; the engine's are the child's
        ctx = multiprocessing.get_context("spawn")
        commands, self._commands = ctx.Pipe(duplex=False)
        self._events, events = ctx.Pipe(duplex=False)
        on_main = threading.current_thread() is threading.main_thread()
        self._process = ctx.Process(target=engine_entry.run, args=(os.getpid(), on_main, cfg, commands, events, setup),
                                    name="gptopt-engine", daemon=True)
        self._process.start()
        # Whatever ends this process, the child goes first: registered after multiprocessing's own exit
        # hook (which would wait for a child that is still loading), so it runs before it.
        atexit.register(self._kill)
        commands.close()  # the child's ends: the parent keeps only its own, so EOF means the other side left
        events.close()
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._pending: list[bytes] = []  # pickled commands not yet written (_send)
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # the loop whose _flush is due
        self._sinks: dict[int, tuple[TokenSink, float]] = {}  # key -> (sink, submitted), until its last event
        self._keys = itertools.count()
        self._stats = {"running": 0, "waiting": 0}
        self._metrics_replies: dict[int, tuple[threading.Event, list[bytes]]] = {}
        self._draining = self._closed = False
        self._heard_at = self._submitted_at = time.monotonic()  # the child's last word; work's arrival at idle
        self._stop_requested = False  # by this process (a drain of the child's own SIGTERM is not)
        self._retry = RetryAfter()
        try:
            info = self._first_message(start_timeout)
        except BaseException:  # a start-up error, or Ctrl-C while the child loads: it must not linger
            self._kill()
            atexit.unregister(self._kill)
            self._commands.close()
            self._events.close()
            raise
        self.max_batch_size, self.max_len, self.vocab_size = info["max_batch_size"], info["max_len"], info["vocab_size"]
        self.constrains: bool = info["constrains"]
        self.tokenizer = Tokenizer.from_str(info["tokenizer"])  # the one the child loaded, whatever its source
        self._reader = threading.Thread(target=self._read, name="gptopt-engine-events", daemon=True)

    def _first_message(self, timeout: float) -> dict[str, Any]:
        """The child's "ready" and what it tells of the model; its exception if it failed to start."""
        try:
            msg = self._events.recv() if self._events.poll(timeout) else "timeout"
        except (EOFError, OSError):
            msg = "exited"
        if msg == "timeout":
            raise UserError(f"the engine process was not ready within {timeout:.0f} s")
        if msg == "exited":
            self._process.join(5)
            raise UserError(f"the engine process {_how_it_ended(self._process.exitcode)} before it was ready (out "
                             "of memory, if the kernel killed it; its own lines above say more)")
        if msg[0] == "failed":
            self._process.join(10)
            raise msg[1]
        return msg[1]

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    # -- engine.EngineClient ------------------------------------------------------------------------

    def start(self) -> None:
        self._reader.start()

    @property
    def capacity(self) -> int:
        return self.max_batch_size + self.max_queue

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    def retry_after(self) -> int:
        return self._retry.seconds(self._stats["waiting"], self.max_batch_size)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def alive(self) -> bool:
        return not self._closed and self._reader.is_alive() and self._process.is_alive()

    @property
    def failed(self) -> bool:
        """The engine process ended without this process asking it to: the server needs a restart."""
        return self._closed and not self._stop_requested

    def stalled(self, seconds: float) -> bool:
        """Requests are open and the child has said nothing (no events, no stats) for `seconds`, nor since the last
        request came: stuck in a step, or deadlocked, though its process lives."""
        with self._lock:
            busy = bool(self._sinks)
        return busy and time.monotonic() - max(self._heard_at, self._submitted_at) > seconds

    def submit(self, prompt: list[int], params: SamplingParams, sink: TokenSink) -> RemoteRequest:
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if self._closed or not self._process.is_alive():
                raise Draining(f"the engine process {_how_it_ended(self._process.exitcode)}; the server must be "
                               "restarted")
            if len(self._sinks) >= self.capacity:
                raise QueueFull(self.retry_after())
            key = next(self._keys)
            if not self._sinks:  # work arrives at an idle engine: its silence counts from now
                self._submitted_at = time.monotonic()
            self._sinks[key] = (sink, time.perf_counter())
        try:
            self._send(("submit", key, list(prompt), params))
        except BaseException:  # not sent: it must not hold a place
            with self._lock:
                self._sinks.pop(key, None)
            raise
        return RemoteRequest(self, key)

    def cancel(self, key: int, reason: FinishReason = "cancelled") -> None:
        """Have the child drop the sequence (Submitted.cancel). It stays counted until the child's last event
        for it: until then it holds the child's place."""
        if key in self._sinks:  # a finished one is not the child's concern any more
            self._send(("cancel", key, reason))

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on. Only a flag: uvicorn calls this from its signal handler,
        which may interrupt a send on the pipe; shutdown() drains the child."""
        self._draining = self._stop_requested = True

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain (in-flight requests finish, up to `timeout` s), then stop the child."""
        self.begin_drain()
        timeout = self.request_timeout if timeout is None else timeout
        self._send(("shutdown", timeout))
        if self._reader.is_alive():
            self._reader.join(timeout + 30)
        self._process.join(10)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s of its drain; killing it", timeout + 40)
            self._kill()
        self._close()
        atexit.unregister(self._kill)
        with self._send_lock:  # not under a send that passed its check just before
            self._commands.close()
        if not self._reader.is_alive():
            self._events.close()

    def render_metrics(self) -> bytes:
        """This process's metrics, then the engine's, asked of the child (blocks up to METRICS_TIMEOUT s);
        gptopt_engine_up says whether the child's are there (1) or it has ended or not answered in time (0)."""
        reply: list[bytes] = []
        if not self._closed:
            key, done = next(self._keys), threading.Event()
            self._metrics_replies[key] = (done, reply)
            try:
                self._send(("metrics", key))
                if not done.wait(METRICS_TIMEOUT):
                    log.warning("the engine process did not send its metrics within %.0f s; this scrape has "
                                "gptopt_engine_up 0 and none of its series", METRICS_TIMEOUT)
            finally:
                self._metrics_replies.pop(key, None)
        self.metrics.engine_up.set(1.0 if reply else 0.0)
        return self.metrics.render() + (reply[0] if reply else b"")

    # -- the pipes -----------------------------------------------------------------------------------

    def _send(self, msg: tuple[Any, ...]) -> None:
        """Send a command, pickled now (a message that cannot cross fails its caller). On an event loop the
        commands of one loop iteration (the requests that arrived together, their cancels) go down in one
        write at its end: a write per request costs the loop a system call and the child a wake-up each.
        Anywhere else it goes at once, with whatever the loop holds before it, so the order is kept."""
        data = bytes(ForkingPickler.dumps(msg))
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._send_lock:
            self._pending.append(data)
            if loop is not None and loop is self._flush_loop:  # its flush is already due
                return
            self._flush_loop = loop
        if loop is None:
            self._flush()
        else:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        with self._send_lock:
            pending, self._pending, self._flush_loop = self._pending, [], None
            if pending:
                with contextlib.suppress(OSError):  # the child is gone: _read ends its requests
                    self._commands.send_bytes(pending[0] if len(pending) == 1 else pickle.dumps(("batch", pending)))

    def _read(self) -> None:
        """The events thread: each message of the child's to the sinks it is for, until the child closes."""
        try:
            while True:
                try:
                    msg = self._events.recv()
                except (EOFError, OSError):
                    break
                self._heard_at = time.monotonic()  # the child is making progress
                if msg[0] == "events":
                    try:
                        self._dispatch(msg[1], msg[2])
                    except Exception:  # one bad delivery must not end every request's
                        log.exception("delivering the engine process's events failed")
                elif msg[0] == "metrics":
                    waiter = self._metrics_replies.get(msg[1])
                    if waiter is not None:
                        waiter[1].append(msg[2])
                        waiter[0].set()
                elif msg[0] == "draining":  # the child was told to stop (its own SIGTERM, or shutdown)
                    self._draining = True
                elif msg[0] == "closed":
                    break
        finally:  # however it ended, no request may wait for events that will never come
            self._close()

    def _dispatch(self, items: list[tuple[int, TokenEvent]], stats: dict[str, int]) -> None:
        outbox: list[tuple[TokenSink, TokenEvent]] = []
        with self._lock:
            now = time.perf_counter()
            for key, event in items:
                entry = self._sinks.get(key) if event.finish_reason is None else self._sinks.pop(key, None)
                if entry is None:
                    continue
                if event.finish_reason in COMPLETED:
                    self._retry.observe(now - entry[1])
                outbox.append((entry[0], event))
            self._stats = stats  # with the count: a finish seen here is a slot free there
        deliver(outbox)

    def _close(self) -> None:
        """No more events will come: every request still open ends now ('cancelled' when draining, else an
        error: the engine process died)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            left, self._sinks = self._sinks, {}
        for done, _ in list(self._metrics_replies.values()):  # a scrape waiting now gets this process's part
            done.set()
        if not self._stop_requested:
            self._process.join(5)  # its exitcode is None until it is reaped: the pipe closes first
        reason, error = ("cancelled", None) if self._draining else (
            "failed", f"the engine process {_how_it_ended(self._process.exitcode)}")
        deliver([(sink, TokenEvent([], reason, error=error)) for sink, _ in left.values()])
        if not self._stop_requested:
            log.error("the engine process %s; ended its %d open requests; restart the server",
                      _how_it_ended(self._process.exitcode), len(left))
