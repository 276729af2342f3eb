"""The engine in a process of its own: the HTTP side and the model stop sharing one GIL.

    pytest -q tests/test_serve.py -k engine_process

`gptopt serve` builds its engine (engine.py: the model, the KV cache, the continuous-batching thread)
with `build_engine`. By default it runs it in a child process (`EngineProcess`), as vLLM's API
server does, and talks to it over two pipes: requests and cancels go in, each engine iteration's
events come back in one message. The HTTP process keeps the tokenizer, the request checks and the
streams; the child keeps the model.

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
which neither survives a fork. It ignores SIGINT (Ctrl-C reaches the whole process group) and drains
when the parent tells it to, or on a SIGTERM of its own; it exits when the parent's end of the pipe
closes, and when its engine ends unasked (the parent then answers /health with 503 "failed").
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
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from gptopt.config import ServeConfig
from gptopt.data.tokenizer import Tokenizer, eot_id
from gptopt.infer import generator_memory as infer_memory
from gptopt.infer import speculative
from gptopt.infer.constrain import Grammars
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference
from gptopt.infer.sampling import SamplingParams
from gptopt.runtime import memory_check as memory
from gptopt.runtime import process
from gptopt.runtime.device import resolve
from gptopt.serve.blocklist import Blocklist, load_blocklist
from gptopt.serve.client import Draining, QueueFull, RetryAfter
from gptopt.serve.engine import Engine, default_solo_threads, settled_heap
from gptopt.serve.events import COMPLETED, Channel, ChannelSink, Event, FinishReason, Sink, deliver
from gptopt.serve.metrics import ServeMetrics
from gptopt.utils.errors import UserError
from gptopt.utils.extras import has
from gptopt.utils.logs import setup_logging

log = logging.getLogger(__name__)

START_TIMEOUT = 3600.0  # seconds for the child to load and warm up (a cold compile of gpt2-xl's buckets is long)
METRICS_TIMEOUT = 5.0  # seconds /metrics waits for the child's figures


def build_engine(cfg: ServeConfig, model: Any = None, tokenizer: Any = None, *,
                 metrics: ServeMetrics | None = None) -> Engine:
    """The model (loaded now unless given) in a Generator, in a warmed-up engine that is not started yet."""
    plan = resolve(cfg.device, quiet=True)
    process.set_matmul_precision(plan)
    if cfg.compile:
        process.allow_recompiles()
    if model is None:
        model, tokenizer = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=plan, dtype=cfg.dtype,
                                              quantize=cfg.quantize)
    if tokenizer is None:
        raise UserError("create_app: a model was given without its tokenizer")
    metrics = metrics or ServeMetrics()
    dtype, context = model.transformer.wte.weight.dtype, model.config.block_size
    if cfg.max_len is not None and cfg.max_len > context:
        raise UserError(f"--max_len {cfg.max_len} exceeds the model's context of {context} tokens: its position "
                        f"embeddings (or rotary training) end there; use --max_len {context} or less")
    context = cfg.max_len or context
    slots = cfg.max_batch_size or infer_memory.auto_slots(model.config, context, plan.device, dtype=dtype)
    # the KV cache and the warm-up's forwards, checked before the cache is allocated (the weights are loaded)
    memory.require(infer_memory.inference_bytes(model.config, slots, context, dtype=dtype).without("weights"),
                   plan.device, f"--max_batch_size {slots} KV-cache slots of {context} tokens",
                   "lower --max_batch_size or --max_len, or use --dtype bf16")
    generator = Generator(model, plan, max_batch_size=slots, max_len=context, compile=cfg.compile,
                          cuda_graphs=cfg.cuda_graphs,
                          grammars=_grammars(tokenizer, model.config.vocab_size), prefix_cache=cfg.prefix_cache)
    engine = Engine(generator, tokenizer, max_queue=cfg.max_queue, request_timeout=cfg.request_timeout,
                    prefill_chunk=cfg.prefill_chunk, blocklist=load_blocklist(cfg.blocklist), metrics=metrics,
                    solo_threads=cfg.solo_threads or default_solo_threads(),
                    speculator=speculative.build(cfg, generator, tokenizer, plan),
                    speculate_max_batch=cfg.speculate_max_batch)
    try:
        engine.warmup()
    except RuntimeError as e:  # out of memory (torch.OutOfMemoryError is a RuntimeError) or a bad kernel
        raise UserError(f"the model does not run with these settings ({type(e).__name__}: {e}); "
                         "lower --max_batch_size, or use --dtype bf16 or --quantize int8-weight") from None
    metrics.bind_load(lambda: engine.stats()["running"], lambda: engine.stats()["waiting"])
    metrics.bind_device_memory(plan.device)  # CUDA only
    return engine


def _grammars(tokenizer: Tokenizer, vocab_size: int) -> Grammars | None:
    """response_format's grammars, or None where the model cannot be constrained (the server then answers
    such requests 400): a document ends with the end-of-text token, so the tokenizer needs one, and
    llguidance must read the tokenizer (it does not read every kind)."""
    eot = eot_id(tokenizer)
    if eot is None or not has("llguidance"):
        return None
    try:
        return Grammars(tokenizer, eot, vocab_size)
    except ValueError as e:
        log.warning("response_format cannot be served with this tokenizer (%s); such requests get a 400", e)
        return None


# -- the child --------------------------------------------------------------------------------------


class _Pipe(Channel):
    """The child's way back: each iteration's events, with the engine's load, in one message. Two threads
    send (the engine's and the one reading commands), so a lock keeps their messages whole."""

    def __init__(self, conn: Connection, engine: Engine | None = None) -> None:
        self.conn, self.engine, self.lock = conn, engine, threading.Lock()
        # key -> engine.Request, for cancels, until its last event; under its own lock, so a request that
        # ends at once cannot be recorded after its end
        self.requests: dict[int, Any] = {}
        self.requests_lock = threading.Lock()

    def submit(self, key: int, prompt: list[int], params: SamplingParams, index: int) -> None:
        assert self.engine is not None
        refused: Exception | None = None
        with self.requests_lock:
            try:
                self.requests[key] = self.engine.submit(prompt, params, ChannelSink(self, key), index=index)
            except Exception as e:  # the parent counts first: a drain of the child's own, or a bug
                refused = e
        if refused is not None:  # send() takes requests_lock: after it is released. Draining is a 503
            reason: FinishReason = "cancelled" if isinstance(refused, Draining) else "error"
            self.send([(key, Event(index, "", reason, error=f"{type(refused).__name__}: {refused}"))])

    def cancel(self, key: int) -> None:
        with self.requests_lock:
            req = self.requests.get(key)
        if req is not None:
            req.cancel()

    def send(self, items: list[tuple[int, Event]]) -> None:
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


def _child(cfg: ServeConfig, commands: Connection, events: Connection,
           setup: Callable[[Engine], None] | None) -> None:
    """The engine process: build and warm up the engine, say ready, then run it on this thread while
    another carries out the parent's commands, until it says shutdown (or its end of the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), name="gptopt-orphan-watch", daemon=True).start()
    setup_logging()  # a spawned process starts with logging unset; its lines look like the parent's
    pipe = _Pipe(events)
    try:
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
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
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


def _commands(engine: Engine, pipe: _Pipe, commands: Connection, terminated: threading.Event,
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


def _command(engine: Engine, pipe: _Pipe, msg: tuple[Any, ...], stopping: threading.Thread | None,
             stop: Callable[[float], threading.Thread]) -> threading.Thread | None:
    """Carry out one of the parent's commands; the drain's thread, once one is started."""
    try:
        kind = msg[0]
        if kind == "submit":
            pipe.submit(*msg[1:])
        elif kind == "cancel":
            pipe.cancel(msg[1])
        elif kind == "metrics":
            pipe.message(("metrics", msg[1], engine.render_metrics()))
        elif kind == "shutdown" and stopping is None:
            return stop(msg[1])
    except Exception:  # one bad command must not take the engine down
        log.exception("the engine process could not carry out %r", msg[0])
    return stopping


def _orphan_watch(parent: int) -> None:
    """Exit once the parent is gone: a parent killed outright (SIGKILL, or SIGTERM before it serves) runs
    no clean-up, and a child still loading would hold the model and its memory for minutes. Polled, not
    prctl's PDEATHSIG: that fires when the thread that started the child ends, which may be any thread."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _shut(engine: Engine, timeout: float, pipe: _Pipe) -> None:
    engine.shutdown(timeout)
    pipe.message(("closed",))


def _portable(e: BaseException) -> BaseException:
    """`e` if it crosses a pipe intact, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")


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

    def cancel(self) -> None:
        self.engine.cancel(self.key)


class EngineProcess:
    """engine.EngineClient, the HTTP side's interface to an engine, for an engine running in a child process.

    The parent counts the sequences it has submitted and not yet seen finish, so 429 (QueueFull) and 503
    (Draining) are decided here at once, with the engine's rules; the child's count is never higher."""

    def __init__(self, cfg: ServeConfig, *, start_timeout: float = START_TIMEOUT,
                 setup: Callable[[Engine], None] | None = None) -> None:
        """Start the child and wait until its engine is warmed up (or raise what stopped it). setup: called
        with the engine in the child before it starts (a module-level function: it crosses by name)."""
        self.max_queue, self.request_timeout = cfg.max_queue, cfg.request_timeout
        self.blocklist: Blocklist = load_blocklist(cfg.blocklist)  # prompts are checked here, output there
        self.metrics = ServeMetrics(engine=False)  # the HTTP side's; the engine's are the child's
        ctx = multiprocessing.get_context("spawn")
        commands, self._commands = ctx.Pipe(duplex=False)
        self._events, events = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_child, args=(cfg, commands, events, setup), name="gptopt-engine",
                                    daemon=True)
        self._process.start()
        # Whatever ends this process, the child goes first: registered after multiprocessing's own exit
        # hook (which would wait for a child that is still loading), so it runs before it.
        atexit.register(self._kill)
        commands.close()  # the child's ends: the parent keeps only its own, so EOF means the other side left
        events.close()
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._pending: list[bytes] = []  # pickled commands not yet written (_send)
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # the loop whose _flush is due
        self._sinks: dict[int, tuple[Sink, float, int]] = {}  # key -> (sink, submitted, index), until its last event
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

    def submit(self, prompt: list[int], params: SamplingParams, sink: Sink, *, index: int = 0) -> RemoteRequest:
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
            self._sinks[key] = (sink, time.perf_counter(), index)
        try:
            self._send(("submit", key, list(prompt), params, index))
        except BaseException:  # not sent: it must not hold a place
            with self._lock:
                self._sinks.pop(key, None)
            raise
        return RemoteRequest(self, key)

    def cancel(self, key: int) -> None:
        if key in self._sinks:  # a finished one is not the child's concern any more
            self._send(("cancel", key))

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
        """This process's metrics, then the engine's, asked of the child (blocks up to METRICS_TIMEOUT s)."""
        own = self.metrics.render()
        if self._closed:
            return own
        key, done, reply = next(self._keys), threading.Event(), []
        self._metrics_replies[key] = (done, reply)
        try:
            self._send(("metrics", key))
            if not done.wait(METRICS_TIMEOUT):
                log.warning("the engine process did not send its metrics within %.0f s", METRICS_TIMEOUT)
        finally:
            self._metrics_replies.pop(key, None)
        return own + (reply[0] if reply else b"")

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

    def _dispatch(self, items: list[tuple[int, Event]], stats: dict[str, int]) -> None:
        outbox: list[tuple[Sink, Event]] = []
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
        deliver([(sink, Event(index, "", reason, error=error)) for sink, _, index in left.values()])
        if not self._stop_requested:
            log.error("the engine process %s; ended its %d open requests; restart the server",
                      _how_it_ended(self._process.exitcode), len(left))
