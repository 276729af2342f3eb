"""/metrics: the Prometheus series of the HTTP side and of the engine. A test that asserts a counter gets a
server of its own: another test's requests on a shared one would move it.

    pytest -q tests/test_serve_metrics.py
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
from conftest import wait_for

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import completion, running  # noqa: E402


def families_of(url: str) -> dict[str, Any]:
    """/metrics' metric families by name."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def test_metrics_expose_histograms_gauges_and_counters(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, max_batch_size=2) as (url, _):
        usage = completion(url, max_tokens=4, temperature=0).json()["usage"]
        families = families_of(url)
    for name in ("gptopt_time_to_first_token_seconds", "gptopt_e2e_request_latency_seconds",
                 "gptopt_queue_time_seconds"):
        assert families[name].type == "histogram"
        assert next(s.value for s in families[name].samples if s.name == f"{name}_count") == 1, name  # one request
    itl = families["gptopt_inter_token_latency_seconds"]
    assert next(s.value for s in itl.samples if s.name.endswith("_count")) == usage["completion_tokens"] - 1
    assert families["gptopt_requests_running"].samples[0].value == 0
    assert families["gptopt_requests_waiting"].samples[0].value == 0
    assert families["gptopt_generation_tokens"].samples[0].value == usage["completion_tokens"]
    assert families["gptopt_prompt_tokens"].samples[0].value == usage["prompt_tokens"]
    ok = [s for s in families["gptopt_requests"].samples
          if s.labels == {"route": "/v1/completions", "status": "200"} and s.name.endswith("_total")]
    assert ok and ok[0].value == 1
    assert not [name for name in families if name.startswith("gptopt_device_memory")]  # CUDA only
    assert families["gptopt_engine_up"].samples[0].value == 1  # the engine runs in this process: its series are here


def requests_counted(url: str, route: str) -> dict[str, float]:
    """/metrics' request counter of one route, by status code."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    return {s.labels["status"]: s.value for s in families["gptopt_requests"].samples
            if s.name.endswith("_total") and s.labels["route"] == route}


def test_an_upload_the_client_abandons_is_counted_499_not_500(debug_tokenizer: Any) -> None:
    # A server error alert (rate of 5xx) must not fire because a client went away mid-upload.
    with running(debug_tokenizer, max_batch_size=1) as (url, _):
        assert requests_counted(url, "/v1/completions") == {}
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "def f(')
        wait_for(lambda: requests_counted(url, "/v1/completions") != {})
        assert requests_counted(url, "/v1/completions") == {"499": 1}


def test_device_memory_gauges_are_read_at_scrape_time_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gptopt.serve.metrics import ServeMetrics

    def scrape(metrics: ServeMetrics) -> dict[str, float]:
        return {f.name: f.samples[0].value for f in text_string_to_metric_families(metrics.render().decode())
                if f.name.startswith("gptopt_device_memory")}

    seen: list[torch.device] = []
    now = {"allocated": 100}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: seen.append(device) or now["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 200)
    cpu = ServeMetrics()
    cpu.bind_device_memory(torch.device("cpu"))
    assert scrape(cpu) == {} and not seen
    gpu = ServeMetrics()
    gpu.bind_device_memory(torch.device("cuda", 1))
    assert scrape(gpu) == {"gptopt_device_memory_allocated_bytes": 100, "gptopt_device_memory_reserved_bytes": 300,
                           "gptopt_device_memory_peak_allocated_bytes": 200}
    now["allocated"] = 150  # the figure of the moment, not the one at start-up
    assert scrape(gpu)["gptopt_device_memory_allocated_bytes"] == 150
    assert seen == [torch.device("cuda", 1)] * 2  # the server's own device


def test_kv_cache_usage_and_preemptions_are_the_generators_named_as_vllm_names_them(
        debug_tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """vllm:kv_cache_usage_perc and vllm:num_preemptions, with our prefix; and the start-up line says the pool the
    Generator was given: the debug model's 64-token context, two requests at once, blocks of 16."""
    import logging
    import re

    with caplog.at_level(logging.INFO, logger="gptopt.serve.startup"), \
            running(debug_tokenizer, max_batch_size=2) as (url, app):
        assert completion(url, max_tokens=4, temperature=0).status_code == 200
        families = families_of(url)
        generator = app.state.engine.generator
    line = re.search(r"KV cache: \d+\.\d\d GiB \((.+)\), ([\d,]+) tokens in ([\d,]+) blocks of 16; up to 2 requests "
                     r"at once, each up to 64 tokens", caplog.text)
    assert line, caplog.text
    tokens, blocks = (int(g.replace(",", "")) for g in line.groups()[1:])
    assert blocks == generator.num_blocks and tokens == 16 * blocks == 2 * 64  # two sequences of the context
    usage, preemptions = families["gptopt_kv_cache_usage_perc"], families["gptopt_num_preemptions"]
    assert usage.type == "gauge" and usage.samples[0].value == 0  # the request has ended: it holds no block
    assert preemptions.type == "counter" and preemptions.samples[0].name == "gptopt_num_preemptions_total"
    assert preemptions.samples[0].value == 0


def test_kv_cache_series_are_read_at_scrape_time() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gptopt.serve.metrics import ServeMetrics

    now = {"usage": 0.25, "preemptions": 3}
    metrics = ServeMetrics(http=False)
    metrics.bind_kv_cache(lambda: now["usage"], lambda: now["preemptions"])

    def scrape() -> tuple[float, float]:
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        return (families["gptopt_kv_cache_usage_perc"].samples[0].value,
                families["gptopt_num_preemptions"].samples[0].value)

    assert scrape() == (0.25, 3)
    now.update(usage=0.5, preemptions=4)  # the engine's figures of the moment, not those at start-up
    assert scrape() == (0.5, 4)
