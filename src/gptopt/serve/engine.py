"""Continuous batching: one thread owns the model, its KV cache and the scheduler; requests meet it through queues.

    pytest -q tests/test_serve_engine.py -k batching

Every iteration of the engine thread: drop cancelled and timed-out requests, hand the new ones to the scheduler
(infer/scheduler.py: admission by free slots and KV blocks, chunked prefill, preemption), run ONE prefill forward
over the admitted prompts and ONE decode step for all running requests together, hand each request's new token ids
to its client, and retire the finished ones, so their blocks are free again within one iteration. The engine makes
token ids only: the front end (output.py, on the HTTP process's event loop) makes their text, and drops a request
here (Request.cancel) when a stop string or the blocklist ends it. Requests join and
leave the batch at token granularity: a short request never waits for a long one to finish, and N requests share
each forward pass. The events of a prefill and of a decode step go out together after it: one wake-up of each
client event loop per forward, not one per token.

On a CPU a decode step of one request alone computes with `solo_threads` torch threads (serve's start-up,
startup.build_engine, decides them: by default every core but one; the engine only switches to them around its
own forwards, and gives its caller's thread its count back): its arithmetic is so small that the HTTP event
loop (which detokenizes) and local clients are as busy as the model, and the spare core keeps them from
preempting the decode's threads. A decode step of several requests, and every prefill, take every core: there
the model is the work, and a core fewer delays every client's next token and a new request's first (both measured:
benchmarks/2026-12-04-serving-vs-transformers.md, "A fourth comparison: a core left to the HTTP side").
A model too small for that (under SMALL_MODEL_FLOPS a token) runs every forward on `solo_threads`: its
steps gain next to nothing from another core, and the HTTP side, which caps such a server, needs it
(benchmarks/2026-12-05-serving-stack-ceiling.md).
The compiled CPU decode's 1-row graph and its graph of the other batch sizes keep the thread count they
were compiled under (dynamo guards on it: a step under another count would recompile), so the warm-up
compiles each under the count its steps run with.

Only this thread touches the model; other threads (the HTTP event loop) only submit, cancel and
read stats, under one lock. Token ids go back through a `sink` (events.py); the HTTP side sees the engine
through client.EngineClient alone.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gptopt.infer.decoding import Decoding
from gptopt.infer.generator import Generator, Stepper
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import PREFILL_CHUNK, Scheduler
from gptopt.models.flops import flops_per_token
from gptopt.serve.blocklist import Blocklist
from gptopt.serve.client import Draining, QueueFull, RetryAfter
from gptopt.serve.events import COMPLETED, FinishReason, TokenEvent, TokenSink, deliver
from gptopt.utils.errors import UserError

log = logging.getLogger(__name__)


# A forward's FLOPs per token (2 x parameters) under which a CPU engine runs every forward on solo_threads: a
# model this small gains from every core, and tiny and larger ones lose
# (benchmarks/2026-12-05-serving-stack-ceiling.md, "After: a model under 2 MFLOP a token runs every forward").
SMALL_MODEL_FLOPS = 2e6


_heap_lock = threading.Lock()
_heap_users = 0  # settled_heap()s open in this process: the collector gets the heap back when the last leaves


@contextlib.contextmanager
def settled_heap(*, give_back: bool = True) -> Iterator[None]:
    """While serving: what loading and the warm-up left in reference cycles collected first, and every
    survivor moved out of the collector's sight (gc.freeze), so no full collection walks it mid-request.
    On leaving, the last of this process's servers (tests and notebooks run several) hands the heap back
    to the collector; give_back=False keeps it frozen, for a process about to exit (unfrozen, its exit
    would pay one more full collection of the whole heap).

    A compiled warm-up leaves many cyclic objects behind: otherwise the engine process met them in its
    first full collection, a pause that every request in flight waited through
    (benchmarks/2026-12-04-serving-vs-transformers.md, "The start-up heap out of the collector's way")."""
    global _heap_users
    with _heap_lock:
        gc.collect()
        gc.freeze()
        _heap_users += 1
    try:
        yield
    finally:
        with _heap_lock:
            _heap_users -= 1
            if give_back and _heap_users == 0:
                gc.unfreeze()


@contextlib.contextmanager
def thread_count_kept() -> Iterator[None]:
    """The calling thread's torch thread count as it was when the block began, however the block ends: the engine
    switches it around its own forwards (Engine._use_threads), and its caller keeps its own."""
    had = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != had:
            torch.set_num_threads(had)


@dataclass(eq=False)
class Request:
    """One sequence to generate. The client side may call cancel(); the rest is the engine's."""

    prompt: list[int]
    params: SamplingParams
    sink: TokenSink
    timeout: float = 120.0
    submitted: float = field(default_factory=time.perf_counter)
    # Set from the client thread (a plain store is atomic): why the client side ended it, "cancelled" or what its
    # text ended it with (output.py: a stop string's "stop", blocked content's "content_filter").
    cancelled: FinishReason | None = None
    # engine state
    seq: Decoding | None = None  # its tokens, slot and end-of-sequence rule, from the scheduler's hand-off on
    admitted: float = 0.0
    last_token: float = 0.0
    engine: Engine | None = None
    logprobs_sent: int = 0  # seq.logprobs handed out in events so far
    prompt_logprobs_sent: bool = False

    def cancel(self, reason: FinishReason = "cancelled") -> None:
        """Ask the engine to drop this request, ended for `reason` (the first one given counts); its blocks are free
        after the engine's next iteration."""
        if self.cancelled is None:
            self.cancelled = reason
        if self.engine is not None:
            self.engine.wake()

    @property
    def completion_tokens(self) -> int:
        return 0 if self.seq is None else self.seq.generated


class Engine:
    """Continuous batching around a Generator and its Scheduler; see the module docstring. An EngineClient."""

    def __init__(self, generator: Generator, tokenizer: Any, *, max_queue: int = 64,
                 request_timeout: float = 120.0, prefill_chunk: int = PREFILL_CHUNK,
                 blocklist: Blocklist | None = None, metrics: Any = None, threads: int | None = None,
                 solo_threads: int | None = None, speculator: Stepper | None = None,
                 speculate_max_batch: int = 4) -> None:
        """threads, solo_threads: on a CPU, torch's threads of a prefill or a decode step of several requests (every
        core: torch's count when the engine is made, unless given), and of a one-request decode step; without
        solo_threads the engine leaves torch's count alone. Whoever starts the server decides both (startup.py);
        the engine sets them around its own forwards only. speculator: speculative decoding
        (infer.speculative.Speculator), for decode steps of at most `speculate_max_batch` requests: a larger batch
        already keeps the arithmetic busy, and decodes plainly."""
        if solo_threads is not None and solo_threads < 1:
            raise UserError(f"solo_threads must be >= 1, got {solo_threads}")
        self.generator = generator
        # torch's threads on a CPU: every core, and a one-request decode step's; None leaves torch's count
        # alone (GPUs, or not asked)
        self._all_threads = threads or torch.get_num_threads()
        self._solo_threads = solo_threads if generator.device.type == "cpu" else None
        # One count for every forward of such a model (not one per size): a compiled CPU decode runs all its
        # batched sizes through one graph of symbolic rows, which keeps the count it was compiled under.
        self._small_model = flops_per_token(generator.model.config, 0, training=False) < SMALL_MODEL_FLOPS
        if self._solo_threads is not None and self._solo_threads > self._all_threads:
            log.warning("--solo_threads %d is more than torch's %d threads (the cores, or OMP_NUM_THREADS): "
                        "a one-request step on more threads than cores only contends with itself",
                        self._solo_threads, self._all_threads)
        self.prefill_chunk = prefill_chunk
        self.speculator = speculator
        self.scheduler = Scheduler(generator, prefill_chunk=prefill_chunk, stepper=speculator,
                                   speculate_max_batch=speculate_max_batch,
                                   on_forward=lambda rows: self._use_threads(rows=rows))
        self.tokenizer = tokenizer  # the front end's (EngineClient): this engine's thread makes no text
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.blocklist = blocklist or Blocklist()
        self.metrics = metrics  # serve.metrics.ServeMetrics or None
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()  # submitted, not yet the scheduler's
        self._held: dict[int, Request] = {}  # engine thread only: the scheduler's requests, by id(seq)
        self._outbox: list[tuple[TokenSink, TokenEvent]] = []  # this iteration's events, delivered at its end
        self._n_running = 0  # mirror of len(_held), read under the lock by stats()
        self._n_queued = 0  # mirror of the scheduler's waiting sequences (preempted ones included)
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None  # start()'s, or the thread that called run()
        self._started = False
        self._done = threading.Event()  # the loop has ended
        self._retry = RetryAfter()
        self._progress_at = self._submitted_at = time.monotonic()  # an iteration's start; work's arrival at idle
        self.steps = 0  # decode steps run, for tests and logs

    # -- client side (any thread) -----------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, sink: TokenSink) -> Request:
        """Queue a request, whose TokenEvents go to `sink`; raises QueueFull beyond max_queue waiting, Draining when
        shutting down."""
        req = Request(prompt=list(prompt), params=params, sink=sink, timeout=self.request_timeout)
        req.engine = self
        with self._cv:
            if self._draining or self._stop or self._done.is_set():
                raise Draining("the server is shutting down")
            if self._n_running + len(self._waiting) >= self.capacity:
                raise QueueFull(self.retry_after())
            if not self._busy():  # work arrives at an idle engine: its silence counts from now
                self._submitted_at = time.monotonic()
            self._waiting.append(req)
            self._cv.notify()
        return req

    def _busy(self) -> bool:
        """Requests waiting or running (under the lock: _n_running mirrors the engine thread's requests)."""
        return bool(self._waiting or self._n_running)

    def stalled(self, seconds: float) -> bool:
        """Requests are waiting and no iteration has begun for `seconds`, nor since the first of them came: the
        engine thread is stuck in a step, or deadlocked."""
        with self._cv:
            busy = self._busy()
        return busy and time.monotonic() - max(self._progress_at, self._submitted_at) > seconds

    @property
    def capacity(self) -> int:
        """Sequences the engine holds at once: max_batch_size run, beyond them max_queue may wait."""
        return self.generator.max_batch_size + self.max_queue

    def retry_after(self) -> int:
        """Seconds until a request is likely done: queue depth times the mean latency per running request."""
        return self._retry.seconds(len(self._waiting) + self._n_queued, self.generator.max_batch_size)

    def stats(self) -> dict[str, int]:
        """Requests running (admitted: holding a slot and KV blocks) and waiting (submitted or preempted)."""
        with self._cv:
            return {"running": self._n_running - self._n_queued, "waiting": len(self._waiting) + self._n_queued}

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (their blocks were needed by older ones), each recomputed later."""
        return self.scheduler.preemptions

    def kv_usage(self) -> float:
        """The share of KV blocks running sequences hold, 0..1."""
        return self.generator.kv_usage()

    @property
    def max_batch_size(self) -> int:
        return self.generator.max_batch_size

    @property
    def max_len(self) -> int:
        """The longest sequence, prompt and completion together: the model's context."""
        return self.generator.max_len

    @property
    def vocab_size(self) -> int:
        return self.generator.vocab_size

    @property
    def constrains(self) -> bool:
        """Whether requests may carry a grammar (response_format): the Generator has the tokenizer's."""
        return self.generator.grammars is not None

    def render_metrics(self) -> bytes:
        """/metrics' text: the Prometheus metrics, empty for an engine made without them."""
        return b"" if self.metrics is None else self.metrics.render()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def alive(self) -> bool:
        return self._started and not self._done.is_set()

    @property
    def failed(self) -> bool:
        """The engine ended without being asked to: it serves nothing more, and the server needs a restart."""
        return self._done.is_set() and not self._stop

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- lifecycle --------------------------------------------------------------------------

    def warmup(self) -> float:
        """Before serving, what serving runs: the largest prefill forward (one chunk) and a decode step of every
        batch shape the decode runs (each compiled bucket's graph, or its CUDA graph, is built now), each logged:
        the first requests are not slow, and a configuration whose forwards do not fit fails at start-up, not on a
        user. Seconds taken."""
        g, t0 = self.generator, time.perf_counter()
        # the caller's thread (a test, a notebook, the engine process's main thread) gets its count back
        with torch.inference_mode(), thread_count_kept():
            chunk = max(1, min(self.prefill_chunk, g.max_len - 1))
            log.info("warm-up: a prefill of %d tokens", chunk)
            self._use_threads(rows=0)
            slot = g.alloc()
            try:
                g.prefill(slot, [0] * chunk)
            finally:
                g.free(slot)
            # reduce-overhead's CUDA graphs: a shape's first calls warm up, a later one records its graph
            repeats = 3 if g.compiled and g.device.type == "cuda" else 1
            # no batch larger than the pool's blocks ever runs: a running request holds one at least
            shapes = [b for b in g.buckets if b <= g.num_blocks] if g.bucketed else [min(g.max_batch_size,
                                                                                       g.num_blocks)]
            try:
                for i, rows in enumerate(shapes):
                    log.info("warm-up: a decode step of %d rows (%d of %d)", rows, i + 1, len(shapes))
                    slots = [g.alloc() for _ in range(rows)]
                    try:
                        self._use_threads(rows=0)
                        g.extend(slots, [[0]] * rows, [0] * rows)
                        self._use_threads(rows=rows)
                        for _ in range(repeats):
                            g.decode(slots, [0] * rows, [1] * rows)
                    finally:
                        for s in slots:
                            g.free(s)
            finally:
                g.forget_prefixes()  # the warm-up's prompts are no request's
        seconds = time.perf_counter() - t0
        if g.bucketed:
            log.info("%s the decode for batches of %s in %.1f s",
                     "compiled" if g.compiled else "recorded CUDA graphs of", ", ".join(map(str, g.buckets)), seconds)
        return seconds

    def _use_threads(self, *, rows: int) -> None:
        """torch's thread count for the next forward on a CPU: solo_threads for a decode step of one row
        (for every forward of a model under SMALL_MODEL_FLOPS), every core for more rows or a prefill
        (rows=0). Set only on a change: a run of steps of one kind pays for no switch."""
        if self._solo_threads is not None:
            n = self._solo_threads if rows == 1 or self._small_model else self._all_threads
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)

    def start(self) -> None:
        """Run the loop in a thread of its own ("gptopt-engine")."""
        self._claim()
        self._thread = threading.Thread(target=self._run, name="gptopt-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until shutdown (called from another thread) stops it.

        On a CPU the thread that loaded the model should run it, as the engine process's main thread does:
        libgomp keeps a pool of OpenMP workers for each thread that starts parallel regions, and once two
        threads' pools hold more threads than there are cores, every worker stops spin-waiting and sleeps
        between regions (libgomp's rule: 100 spins, not 300,000), so each of the step's parallel kernels
        pays a wake-up through the kernel, and a decode step on a second thread is much slower than on the
        thread that loaded the model (benchmarks/2026-12-04-serving-vs-transformers.md, "The engine on its
        process's main thread")."""
        self._claim()
        self._thread = threading.current_thread()
        self._run()

    def _claim(self) -> None:
        with self._cv:
            if self._started:
                raise RuntimeError("the engine was started already")
            self._started = True

    def _run(self) -> None:
        try:
            with thread_count_kept():  # whatever this thread runs next has its count as it was
                self._loop()
        finally:
            self._done.set()

    def begin_drain(self) -> None:
        """Stop admitting new requests; those already submitted run to the end."""
        with self._cv:
            self._draining = True
            self._cv.notify()

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain (finish in-flight requests, up to `timeout` s), then stop the loop.

        Requests still unfinished at the deadline end with finish_reason 'cancelled'; called from the
        loop's own thread (a sink), there is no waiting: the requests in flight end so at once."""
        self.begin_drain()
        deadline = time.monotonic() + (self.request_timeout if timeout is None else timeout)
        own = self._thread is threading.current_thread()  # from a sink on the loop's thread: no drain to wait for
        with self._cv:
            while (self._n_running or self._waiting) and self.alive and not own:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.05))
            self._stop = True
            self._cv.notify()
        if self._started and not own:
            self._done.wait(timeout=10)

    # -- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    try:
                        if not self._iterate():
                            break
                    except Exception as e:  # a bug in one step must not leave clients waiting forever
                        log.exception("engine iteration failed; ending the running requests")
                        for r in list(self._held.values()):
                            self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                    finally:
                        self._deliver()
        finally:  # whatever ended the loop, no client may wait forever
            with self._cv:
                left = list(self._held.values()) + list(self._waiting)
                self._waiting.clear()
            for req in left:
                self._finish(req, "cancelled")
            self._deliver()

    def _iterate(self) -> bool:
        with self._cv:
            while not (self._waiting or self._held or self._stop):
                # Timed: a signal's Python handler (the engine process's SIGTERM drain) runs on the main
                # thread, and one the kernel hands to another thread does not interrupt this wait.
                self._cv.wait(0.5)
            self._progress_at = time.monotonic()  # an iteration begins: the engine is not stuck
            if self._stop:
                return False
            now = time.perf_counter()
            new = list(self._waiting)
            self._waiting.clear()
            self._n_running += len(new)
        for r in new:
            self._hand_over(r)
        for r in [r for r in self._held.values() if r.cancelled or now - r.submitted > r.timeout]:
            self._finish(r, r.cancelled or "timeout")
        self._admit()
        if self.scheduler.running:
            self._prefill()
            self._deliver()  # the first tokens go out now, not after the decode step
            self._decode()
        with self._cv:
            self._n_queued = len(self.scheduler.waiting)
        return True

    def _deliver(self) -> None:
        outbox, self._outbox = self._outbox, []
        deliver(outbox)

    def _hand_over(self, req: Request) -> None:
        """A submitted request to the scheduler, as a sequence of its own (refused here if its prompt is bad)."""
        try:
            req.seq = self.generator.new(req.prompt, req.params)
        except Exception as e:  # one bad request must not take the server down
            log.exception("admission failed")
            with self._cv:
                self._n_running -= 1
                self._cv.notify_all()
            self._finish(req, "error", error=f"{type(e).__name__}: {e}")
            return
        self._held[id(req.seq)] = req
        self.scheduler.add(req.seq)

    def _admit(self) -> None:
        """The scheduler's waiting sequences into the batch, as slots and blocks allow."""
        for seq in self.scheduler.admit():
            req = self._held[id(seq)]
            if seq.preemptions:
                continue
            req.admitted = time.perf_counter()
            if self.metrics is not None:
                self.metrics.queue_time.observe(req.admitted - req.submitted)
                self.metrics.prompt_tokens.inc(len(req.prompt))

    def _prefill(self) -> None:
        """One prefill forward: the next chunk of the admitted prompts, oldest first. Those whose prompt is
        complete take their first token and decode from now on."""
        try:
            done = self.scheduler.prefill()
        except Exception as e:  # e.g. out of memory: these requests fail, the server goes on
            log.exception("prefill failed")
            for seq in [s for s in self.scheduler.running if not s.prefilled]:
                self._finish(self._held[id(seq)], "error", error=f"{type(e).__name__}: {e}")
            return
        for seq, token in done:
            if self.metrics is not None and self.generator.prefix_cache and not seq.preemptions:
                self.metrics.prefix_queries.inc(seq.prompt_len)
                self.metrics.prefix_hits.inc(seq.reused)
            req = self._held[id(seq)]
            if token is None:  # max_new_tokens 0: the prompt's logprobs only
                self._finish(req, "length")
            else:
                self._accept(req, [token])

    def _decode(self) -> None:
        spec = self.speculator
        before = (spec.proposed, spec.accepted) if spec is not None else (0, 0)
        try:
            made = self.scheduler.decode()
        except Exception as e:
            log.exception("decode step failed")
            for seq in [s for s in self.scheduler.running if s.prefilled]:
                self._finish(self._held[id(seq)], "error", error=f"{type(e).__name__}: {e}")
            return
        if not made:
            return
        if spec is not None and self.metrics is not None:
            self.metrics.draft_tokens.inc(spec.proposed - before[0])
            self.metrics.accepted_tokens.inc(spec.accepted - before[1])
        self.steps += 1
        for seq, tokens in made:
            self._accept(self._held[id(seq)], tokens)

    def _accept(self, req: Request, tokens: list[int]) -> None:
        """Record one forward's sampled tokens of a request (several after a speculative step; those after one that
        ends it are not its) and send them in one event, its last if it is done."""
        seq = req.seq
        assert seq is not None
        before, reason = len(seq.ids), None
        for token in tokens:
            now = time.perf_counter()
            if self.metrics is not None:
                self.metrics.generated_tokens.inc()
                if seq.n_new:
                    self.metrics.itl.observe(now - req.last_token)
                else:
                    self.metrics.ttft.observe(now - req.submitted)
            req.last_token = now
            reason = seq.add(token)
            if reason is not None:
                break
        # the tokens it kept (not a stop token id, nor one its grammar refused) are its text; a stop string in them
        # ends it as stop_reason says, asked of its grammar only where it has stop strings
        ev = TokenEvent(seq.ids[before:], stop_reason=seq.stop_reason if seq.params.stop else "stop")
        if reason is not None:
            return self._finish(req, reason, ev)
        ev.completion_tokens = req.completion_tokens
        self._outbox.append((req.sink, self._logprobs(req, ev)))

    @staticmethod
    def _logprobs(req: Request, ev: TokenEvent) -> TokenEvent:
        """The event with the log-probabilities not yet sent, for a request that asks for them."""
        seq = req.seq
        if seq is None or (seq.params.logprobs is None and seq.params.prompt_logprobs is None):
            return ev
        ev.logprobs, req.logprobs_sent = seq.logprobs[req.logprobs_sent :], len(seq.logprobs)
        if not req.prompt_logprobs_sent and seq.params.prompt_logprobs is not None:
            ev.prompt_logprobs, req.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        return ev

    def _finish(self, req: Request, reason: FinishReason, ev: TokenEvent | None = None, *,
                error: str | None = None) -> None:
        """Free the request's slot and blocks (if the scheduler has it) and send its last event (`ev`, with its last
        tokens)."""
        if req.seq is not None and self._held.pop(id(req.seq), None) is not None:
            self.scheduler.finish(req.seq)
            with self._cv:
                self._n_running -= 1
                self._cv.notify_all()  # shutdown() waits for the engine to empty
        latency = time.perf_counter() - req.submitted
        if self.metrics is not None:
            self.metrics.finished.labels(reason).inc()
            if reason in COMPLETED:
                self.metrics.e2e.observe(latency)
        if reason in COMPLETED:
            self._retry.observe(latency)
        ev = ev or TokenEvent([])
        ev.finish_reason, ev.completion_tokens, ev.error = reason, req.completion_tokens, error
        self._outbox.append((req.sink, self._logprobs(req, ev)))
