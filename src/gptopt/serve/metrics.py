"""Prometheus metrics of the server: latency histograms, load gauges, token and request counters, whether the
engine answered (gptopt_engine_up), the KV cache's usage and preemptions (as vLLM's vllm:kv_cache_usage_perc and
vllm:num_preemptions), and on CUDA the device memory (allocated, reserved, peak allocated), read at scrape time.

    curl -s http://127.0.0.1:8000/metrics | grep gptopt_

Each app gets its own CollectorRegistry: the global default registry would refuse a second app in
one process (tests build several), and /metrics should show this server's figures only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from gptopt.utils.extras import require

prometheus_client = require("prometheus_client", "serve", "gptopt serve")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector  # noqa: E402
from prometheus_client.core import CounterMetricFamily  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402

# Latency buckets from a tiny CPU model's token steps up to long generations on a busy GPU.
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
WAIT_BUCKETS = tuple(sorted(set(TOKEN_BUCKETS + REQUEST_BUCKETS)))  # a wait may be a step or a whole queue
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class ServeMetrics:
    """The server's metrics, in a private registry. Thread-safe: the engine thread observes them too."""

    def __init__(self, *, http: bool = True, engine: bool = True) -> None:
        """http: the requests counter the HTTP side keeps; engine: everything the engine observes, and the
        process's memory. A server whose engine runs in a process of its own (engine_process.py) keeps one
        part in each process; /metrics shows both."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = http
        if http:
            self.requests = Counter("gptopt_requests", "HTTP requests by route and status code",
                                    ["route", "status"], registry=r)
            # A scrape whose engine did not answer still says what the HTTP side knows, and this says that the
            # engine's series are missing: a 503 would lose the rest, and silence would look like an idle engine.
            self.engine_up = Gauge("gptopt_engine_up", "1: the engine is running and its series in this scrape are "
                                   "current; 0: it has ended, or (in a process of its own) did not answer within "
                                   "the scrape's wait, and its series are missing", registry=r)
        if not engine:  # the HTTP process of a server whose engine runs apart: its own memory, named apart
            ProcessCollector(namespace="gptopt_http", registry=r)
            return
        # process_resident_memory_bytes and friends (Linux): what `gptopt loadtest` samples to show
        # whether the server's memory grows over a run; the engine's process is the one that holds the model
        ProcessCollector(registry=r)
        self.ttft = Histogram("gptopt_time_to_first_token_seconds", "submit to first generated token (queue + prefill)",
                              buckets=WAIT_BUCKETS, registry=r)
        self.itl = Histogram("gptopt_inter_token_latency_seconds", "time between two tokens of one request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("gptopt_e2e_request_latency_seconds", "submit to last token of a request",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("gptopt_queue_time_seconds", "submit to admission into the running batch",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.running = Gauge("gptopt_requests_running", "requests running: admitted, holding KV-cache blocks",
                             registry=r)
        self.waiting = Gauge("gptopt_requests_waiting", "requests waiting to be admitted (preempted ones included)",
                             registry=r)
        self.prompt_tokens = Counter("gptopt_prompt_tokens", "prompt tokens of the requests admitted (prefilled, or "
                                     "taken from the prefix cache)", registry=r)
        # in tokens, as vLLM's vllm:prefix_cache_queries and vllm:prefix_cache_hits: hits / queries is the share of
        # prompt tokens whose prefill a cached prefix saved
        self.prefix_queries = Counter("gptopt_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("gptopt_prefix_cache_hits", "prompt tokens taken from the prefix cache, not "
                                   "prefilled", registry=r)
        # speculative decoding, as vLLM's vllm:spec_decode_num_draft_tokens and _num_accepted_tokens
        self.draft_tokens = Counter("gptopt_spec_decode_draft_tokens", "draft tokens the model verified "
                                    "(speculative decoding)", registry=r)
        self.accepted_tokens = Counter("gptopt_spec_decode_accepted_tokens", "draft tokens the model kept "
                                       "(speculative decoding)", registry=r)
        self.generated_tokens = Counter("gptopt_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("gptopt_finished_sequences", "generated sequences by finish reason",
                                ["reason"], registry=r)

    def bind_load(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the gauges from the engine at scrape time, so they can never drift from its state."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)

    def bind_engine_up(self, up: Callable[[], bool]) -> None:
        """gptopt_engine_up read from an engine in this process at scrape time (its series are always here)."""
        if self.http:
            self.engine_up.set_function(lambda: float(up()))

    def bind_kv_cache(self, usage: Callable[[], float], preemptions: Callable[[], int]) -> None:
        """The KV cache's usage (0 to 1: the share of the pool's blocks that requests hold) and the preemptions
        so far, read from the generator at scrape time, named as vLLM names them (vllm:kv_cache_usage_perc, a
        share despite its name, and vllm:num_preemptions)."""
        Gauge("gptopt_kv_cache_usage_perc", "share of the KV cache's blocks held by requests, 0 to 1 (cached "
              "prefixes no request holds are free to reuse and not counted)", registry=self.registry
              ).set_function(usage)
        self.registry.register(_CountRead("gptopt_num_preemptions", "requests preempted (their blocks freed when "
                                          "a decode step found none free; recomputed later)", preemptions))

    def bind_device_memory(self, device: torch.device) -> None:
        """On CUDA, gauges of the device's memory read from torch's caching allocator at scrape time:
        what `gptopt loadtest` samples beside the RSS (on a GPU the memory that runs out is the device's).
        Elsewhere nothing is added: a CPU server's memory is its RSS."""
        if device.type != "cuda":
            return
        r = self.registry
        # torch.cuda's functions are looked up at each scrape, not bound here (tests stand in for them)
        Gauge("gptopt_device_memory_allocated_bytes", "device memory held by tensors (torch.cuda.memory_allocated)",
              registry=r).set_function(lambda: torch.cuda.memory_allocated(device))
        Gauge("gptopt_device_memory_reserved_bytes", "device memory held by torch's caching allocator, "
              "allocated or cached (torch.cuda.memory_reserved)", registry=r
              ).set_function(lambda: torch.cuda.memory_reserved(device))
        Gauge("gptopt_device_memory_peak_allocated_bytes", "the most device memory tensors held since the server "
              "started, warm-up included (torch.cuda.max_memory_allocated)", registry=r
              ).set_function(lambda: torch.cuda.max_memory_allocated(device))

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class _CountRead(Collector):
    """A counter whose value is read at scrape time from what owns it (prometheus_client's Counter can only be
    incremented here, and the count lives in the engine)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, value=float(self.read()))
