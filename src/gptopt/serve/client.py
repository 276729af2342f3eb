"""What the HTTP side sees of an engine (EngineClient, a Protocol that Engine in process and EngineProcess both
satisfy: token ids out, output.py makes their text), the handle a client cancels with (Submitted), and the
admission policy's answers: QueueFull (429, with RetryAfter's seconds) and Draining (503).

    python -c "from gptopt.serve.client import RetryAfter; print(RetryAfter().seconds(4, 2))"
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gptopt.infer.sampling import SamplingParams
from gptopt.serve.blocklist import Blocklist

if TYPE_CHECKING:  # a type only: the engine itself never needs prometheus_client
    from gptopt.serve.metrics import ServeMetrics

from gptopt.serve.events import FinishReason, TokenSink


class RetryAfter:
    """Retry-After for a 429: the waiting requests per running place times a moving average of request latency."""

    def __init__(self) -> None:
        self.mean_latency = 1.0

    def observe(self, latency: float) -> None:
        """A completed request's latency, submit to last token."""
        self.mean_latency = 0.9 * self.mean_latency + 0.1 * latency

    def seconds(self, waiting: int, slots: int) -> int:
        """Whole seconds until a running place is likely free for one more request, 1 to 60."""
        return int(min(60, max(1, math.ceil((waiting + 1) / slots * self.mean_latency))))


class QueueFull(Exception):
    """The waiting queue is at max_queue; retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is at capacity; retry in {retry_after} s")
        self.retry_after = retry_after


class Draining(Exception):
    """The engine is shutting down and admits no new requests (HTTP 503)."""


class Submitted(Protocol):
    """What submit returns: the handle a client cancels its sequence with (Request, or the engine process's)."""

    def cancel(self, reason: FinishReason = "cancelled") -> None:
        """Have the engine drop the sequence: "cancelled", or why the front end ended it (a stop string's "stop",
        blocked content's "content_filter"), which the engine's metrics count it as."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """What the HTTP side (serve/app.py, routes.py, server.py) uses of an engine, and all it may use: Engine
    here, in this process, or engine_process.EngineProcess, the same engine in a child process.

    Only the client side: the engine's own thread, its model and its Generator stay behind it."""

    # what the routes check a request against
    @property
    def tokenizer(self) -> Any: ...
    @property
    def blocklist(self) -> Blocklist: ...
    @property
    def max_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def constrains(self) -> bool: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_queue(self) -> int: ...
    @property
    def capacity(self) -> int: ...

    # requests in, token events out (to the sink: output.TextSink makes their text), each sequence cancelled
    # through its handle
    def submit(self, prompt: list[int], params: SamplingParams, sink: TokenSink) -> Submitted: ...

    # the probes and /metrics
    @property
    def alive(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    def stalled(self, seconds: float) -> bool: ...
    def stats(self) -> dict[str, int]: ...
    @property
    def metrics(self) -> ServeMetrics: ...
    def render_metrics(self) -> bytes: ...

    # the server's lifespan
    def start(self) -> None: ...
    def begin_drain(self) -> None: ...
    def shutdown(self, timeout: float | None = None) -> None: ...
