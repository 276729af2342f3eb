"""The load tester against a live in-process server, a failing server and no server at all.

    pytest -q tests/test_loadtest.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from conftest import last_json_line

from gptopt import cli  # noqa: E402
from gptopt.commands.loadtest import MEMORY_METRICS, MemoryTrace, distribution, main, metric_values  # noqa: E402
from gptopt.config import LoadtestConfig, ServeConfig, preset  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402

STATS = {"mean", "p50", "p90", "p99"}


@pytest.fixture(scope="module")
def url(debug_tokenizer: Any) -> Iterator[str]:
    torch.manual_seed(0)
    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size())).eval()
    app = create_app(ServeConfig(model="debug", device="cpu", max_batch_size=4), model=model,
                     tokenizer=debug_tokenizer)
    with serve_in_thread(app) as server:
        yield f"http://127.0.0.1:{server.port}"


def test_closed_loop_reports_every_figure_and_no_errors(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = LoadtestConfig(url=url, requests=20, concurrency=4, prompt_tokens=8, max_tokens=8, json=True)
    assert main(cfg) == 0
    captured = capsys.readouterr()
    summary = last_json_line(captured.out)
    assert summary["errors"] == {} and summary["completed"] == 20
    assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
    assert 20 <= summary["output_tokens"] <= 20 * 8  # usage from the stream, at most max_tokens each
    for key in ("ttft_s", "tpot_s", "itl_s"):
        assert set(summary[key]) == STATS
        assert 0 < summary[key]["p50"] <= summary[key]["p99"] < 30, key
    assert summary["ttft_s"]["mean"] < summary["e2e_s"]["mean"]
    assert "requests" in captured.err  # the progress bar
    mem = summary["server_memory"]  # gptopt serve exports its RSS; the server runs in this process
    assert mem["samples"] >= 2 and mem["start_bytes"] > 2**20
    assert mem["peak_bytes"] >= max(mem["start_bytes"], mem["end_bytes"])
    assert mem["growth_after_warmup_bytes"] == mem["end_bytes"] - mem["after_warmup_bytes"]
    assert "server RSS" in captured.out
    assert summary["server_device_memory"] is None and "server GPU" not in captured.out  # a CPU server


def test_poisson_arrivals_complete(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(LoadtestConfig(url=url, requests=10, rate=50.0, prompt_tokens=4, max_tokens=4, json=True)) == 0
    summary = last_json_line(capsys.readouterr().out)
    assert summary["completed"] == 10 and summary["mode"] == "rate 50.0/s"


def test_server_errors_are_counted_by_status(capsys: pytest.CaptureFixture[str]) -> None:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    broken = FastAPI()
    calls = {"n": 0}

    @broken.post("/v1/completions")
    async def fail() -> JSONResponse:
        calls["n"] += 1
        status = 429 if calls["n"] % 4 == 0 else 500
        return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
                            status)

    with serve_in_thread(broken) as server:
        cfg = LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=8, concurrency=2, json=True)
        assert main(cfg) == 1
    summary = last_json_line(capsys.readouterr().out)
    assert summary["errors"] == {"500": 6, "429": 2} and summary["completed"] == 0
    assert summary["server_memory"] is None  # no /metrics there: nothing to report, no error either
    assert summary["server_device_memory"] is None
    assert summary["ttft_s"] == {k: None for k in STATS}


def test_an_unreachable_server_is_refused_before_the_load_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert cli.main(["loadtest", "--url", url, "--requests", "3", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err  # no table of dashes
    assert f"gptopt loadtest: error: --url {url}: cannot connect" in err and "gptopt serve" in err


def test_a_server_that_wants_a_key_is_refused_naming_api_key(debug_tokenizer: Any,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size())).eval()
    app = create_app(ServeConfig(model="debug", device="cpu", api_key="sk-right"), model=model,
                     tokenizer=debug_tokenizer)
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}"
        args = ["loadtest", "--url", url, "--requests", "2", "--prompt_tokens", "4", "--max_tokens", "2"]
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert "answered 401" in err and "pass --api_key KEY" in err
        assert cli.main([*args, "--api_key", "sk-wrong"]) == 2
        assert "it refused --api_key" in capsys.readouterr().err
        assert cli.main([*args, "--api_key", "sk-right"]) == 0


def test_distribution_percentiles() -> None:
    d = distribution([float(x) for x in range(1, 101)])
    assert d["mean"] == 50.5 and d["p50"] == 50.5
    assert d["p90"] == pytest.approx(90.1) and d["p99"] == pytest.approx(99.01)


def test_memory_growth_is_measured_after_the_warmup_tenth() -> None:
    trace = MemoryTrace([(0, 100.0), (5, 180.0), (10, 200.0), (60, 230.0), (100, 210.0)])
    mem = trace.summary(requests=100)
    assert mem == {"start_bytes": 100.0, "after_warmup_bytes": 200.0, "end_bytes": 210.0, "peak_bytes": 230.0,
                   "growth_after_warmup_bytes": 10.0, "samples": 5}
    assert MemoryTrace([(0, 100.0)]).summary(requests=10) is None  # one sample shows no growth


METRICS_TEXT = """# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 4.123e+08
# HELP gptopt_device_memory_allocated_bytes device memory held by tensors
# TYPE gptopt_device_memory_allocated_bytes gauge
gptopt_device_memory_allocated_bytes 1.073741824e+09
gptopt_device_memory_allocated_bytes_extra 7.0
gptopt_device_memory_reserved_bytes 2147483648.0
gptopt_device_memory_peak_allocated_bytes 3.0e+09 1700000000000
gptopt_requests_total{route="/v1/completions",status="200"} 5.0
gptopt_time_to_first_token_seconds_bucket{le="0.001"} 0.0
"""


def test_memory_figures_are_read_from_the_metrics_text() -> None:
    assert metric_values(METRICS_TEXT) == {
        "process_resident_memory_bytes": 4.123e8, "gptopt_device_memory_allocated_bytes": 2.0**30,
        "gptopt_device_memory_reserved_bytes": 2.0**31, "gptopt_device_memory_peak_allocated_bytes": 3e9}
    # a CPU server (or any other): RSS alone, and no device figures made up
    cpu = "\n".join(line for line in METRICS_TEXT.splitlines() if "device" not in line)
    assert metric_values(cpu) == {"process_resident_memory_bytes": 4.123e8}
    assert metric_values("") == {} and set(metric_values(METRICS_TEXT, ("gptopt_requests_total",))) == set()


def test_a_cuda_servers_device_memory_is_reported_beside_its_rss(
        debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A CPU server whose metrics are bound as on CUDA, to torch.cuda stand-ins: the server's gauges and
    # loadtest's reading of them, end to end. Allocated memory grows by 1 MiB per scrape.
    scrapes = {"n": 0}

    def allocated(device: torch.device) -> int:
        scrapes["n"] += 1
        return 2**30 + scrapes["n"] * 2**20

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2**31)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    torch.manual_seed(0)
    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size())).eval()
    app = create_app(ServeConfig(model="debug", device="cpu", max_batch_size=2), model=model, tokenizer=debug_tokenizer)
    app.state.metrics.bind_device_memory(torch.device("cuda", 0))
    with serve_in_thread(app) as server:
        cfg = LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=6, concurrency=2, prompt_tokens=4,
                             max_tokens=4, json=True)
        assert main(cfg) == 0
    captured = capsys.readouterr()
    summary = last_json_line(captured.out)
    gpu, rss = summary["server_device_memory"], summary["server_memory"]
    assert set(gpu) == {"start_bytes", "after_warmup_bytes", "end_bytes", "peak_bytes", "growth_after_warmup_bytes",
                        "samples", "peak_since_start_bytes", "reserved_start_bytes", "reserved_end_bytes"}
    assert gpu["samples"] == rss["samples"] == scrapes["n"] >= 2  # one scrape gives both figures
    assert gpu["start_bytes"] == 2**30 + 2**20 and gpu["end_bytes"] == 2**30 + scrapes["n"] * 2**20
    assert gpu["peak_bytes"] == gpu["end_bytes"] and gpu["peak_since_start_bytes"] == 3 * 2**30
    assert gpu["growth_after_warmup_bytes"] == gpu["end_bytes"] - gpu["after_warmup_bytes"]
    assert gpu["reserved_start_bytes"] == gpu["reserved_end_bytes"] == 2**31
    assert "server RSS" in captured.out and "server GPU   start 1025.0 MiB" in captured.out
    assert "(3072.0 since the server started); reserved 2048.0 -> 2048.0 MiB" in captured.out
    assert set(MEMORY_METRICS) == set(metric_values(app.state.metrics.render().decode()))  # the names agree


def _sse_server(frames: list[str], prefix: str = "data: ") -> Any:
    """A server whose /v1/completions streams `frames` (each one SSE data payload) and then closes."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    fake = FastAPI()

    @fake.post("/v1/completions")
    async def complete() -> StreamingResponse:
        async def body() -> Any:
            for f in frames:
                yield f"{prefix}{f}\n\n".encode()
        return StreamingResponse(body(), media_type="text/event-stream")

    return fake


def test_the_memory_sampler_never_waits_for_a_clients_connection(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """At one client the server's /metrics is still read while a request streams: the sampler has a
    connection of its own, so neither waits for the other (a request's TTFT would count the wait)."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse

    from gptopt.commands import loadtest

    monkeypatch.setattr(loadtest, "MEMORY_INTERVAL_S", 0.05)
    scrapes = {"n": 0}
    fake = FastAPI()

    @fake.get("/metrics")
    async def metrics() -> PlainTextResponse:
        scrapes["n"] += 1
        return PlainTextResponse("process_resident_memory_bytes 1048576\n")

    @fake.post("/v1/completions")
    async def complete() -> StreamingResponse:
        async def body() -> Any:
            seen = scrapes["n"]
            yield f"data: {_chunk(text='a')}\n\n".encode()
            for _ in range(300):  # the stream stays open until a scrape comes in, 3 s at most
                if scrapes["n"] > seen:
                    break
                await asyncio.sleep(0.01)
            last = _chunk(text="b", finish_reason="length") if scrapes["n"] > seen else '{"error": "no scrape"}'
            yield f"data: {last}\n\ndata: [DONE]\n\n".encode()
        return StreamingResponse(body(), media_type="text/event-stream")

    with serve_in_thread(fake) as server:
        assert main(LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=2, concurrency=1, json=True)) == 0
    assert last_json_line(capsys.readouterr().out)["errors"] == {}


def _chunk(**choice: Any) -> str:
    import json

    return json.dumps({"id": "x", "object": "text_completion", "model": "m", "created": 0,
                       "choices": [{"index": 0, **choice}]})


# transformers serve --continuous-batching (5.x) as it streams a completion: a chunk per token, a finish
# chunk with empty text, a usage chunk with no choices, then it closes without [DONE]
HF_STREAM = [_chunk(text="ab"), _chunk(text="cd"), _chunk(text="ef"), _chunk(finish_reason="length", text=""),
             '{"id": "x", "object": "text_completion", "model": "m", "created": 0, "choices": [], '
             '"usage": {"completion_tokens": 3, "prompt_tokens": 10, "total_tokens": 13}}']


def test_a_stream_closed_after_every_choice_finished_counts_without_done(capsys: pytest.CaptureFixture[str]) -> None:
    with serve_in_thread(_sse_server(HF_STREAM)) as server:
        assert main(LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=4, concurrency=2, json=True)) == 0
    summary = last_json_line(capsys.readouterr().out)
    assert summary["errors"] == {} and summary["completed"] == 4
    assert summary["output_tokens"] == 12  # the usage chunk's count, though it has no choices
    assert summary["ttft_s"]["p50"] is not None and summary["tpot_s"]["p50"] is not None


@pytest.mark.parametrize("frames", [
    HF_STREAM[:3],  # closed mid-answer: no finish_reason came
    [],  # closed before a single chunk
    [*HF_STREAM[:3], '{"error": "Continuous batching failed for the request"}'],  # transformers' error frame
], ids=["cut-short", "empty", "error-frame"])
def test_a_stream_that_ends_before_its_finish_is_an_error(frames: list[str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with serve_in_thread(_sse_server(frames)) as server:
        assert main(LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=2, concurrency=2, json=True)) == 1
    assert last_json_line(capsys.readouterr().out)["errors"] == {"stream": 2}


def test_data_lines_without_the_optional_space_are_read(capsys: pytest.CaptureFixture[str]) -> None:
    frames = [_chunk(text="a"), _chunk(text="b", finish_reason="stop"), "[DONE]"]
    with serve_in_thread(_sse_server(frames, prefix="data:")) as server:  # SSE allows "data:" with no space
        assert main(LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=2, concurrency=1, json=True)) == 0
    summary = last_json_line(capsys.readouterr().out)
    assert summary["errors"] == {} and summary["output_tokens"] == 4  # no usage: one token per text chunk


def test_long_and_crlf_lines_are_read(capsys: pytest.CaptureFixture[str]) -> None:
    """A chunk far longer than a client's usual line buffer (logprobs of many tokens make one), and lines
    ended by CRLF (SSE allows it), are read as chunks, not counted as broken streams."""
    frames = [_chunk(text="x" * 1_500_000), _chunk(text="b", finish_reason="stop"), "[DONE]"]
    with serve_in_thread(_sse_server(frames)) as server:
        assert main(LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=2, concurrency=1, json=True)) == 0
    summary = last_json_line(capsys.readouterr().out)
    assert summary["errors"] == {} and summary["output_tokens"] == 4
    crlf = _sse_server([f"{_chunk(text='a')}\r\n\r\n"
                        f"data: {_chunk(text='b', finish_reason='stop')}\r\n\r\ndata: [DONE]\r"])
    with serve_in_thread(crlf) as server:
        assert main(LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=2, concurrency=1, json=True)) == 0
    summary = last_json_line(capsys.readouterr().out)
    assert summary["errors"] == {} and summary["output_tokens"] == 4


def test_a_line_beyond_the_read_buffer_is_a_stream_error_not_a_crash(capsys: pytest.CaptureFixture[str]) -> None:
    frames = [_chunk(text="x" * 3_000_000), _chunk(text="b", finish_reason="stop"), "[DONE]"]
    with serve_in_thread(_sse_server(frames)) as server:
        assert main(LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=2, concurrency=1, json=True)) == 1
    assert last_json_line(capsys.readouterr().out)["errors"] == {"stream": 2}


def test_the_api_key_is_sent_and_a_trailing_slash_is_harmless(capsys: pytest.CaptureFixture[str]) -> None:
    from fastapi import FastAPI, Header, HTTPException
    from fastapi.responses import StreamingResponse

    fake = FastAPI()

    @fake.post("/v1/completions")
    async def complete(authorization: str = Header("")) -> StreamingResponse:
        if authorization != "Bearer sk-test":
            raise HTTPException(401)

        async def body() -> Any:
            yield f"data: {_chunk(text='a', finish_reason='stop')}\n\ndata: [DONE]\n\n".encode()
        return StreamingResponse(body(), media_type="text/event-stream")

    with serve_in_thread(fake) as server:
        url = f"http://127.0.0.1:{server.port}/"
        assert main(LoadtestConfig(url=url, requests=2, concurrency=1, api_key="sk-test", json=True)) == 0
        assert last_json_line(capsys.readouterr().out)["errors"] == {}
        assert main(LoadtestConfig(url=url, requests=2, concurrency=1, json=True)) == 1
        out = capsys.readouterr().out
        assert last_json_line(out)["errors"] == {"401": 2} and "pass --api_key KEY" in out


def test_a_request_that_outlasts_the_timeout_is_a_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout bounds a whole request, a stream that goes quiet included: it ends as 'timeout' then."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    fake = FastAPI()

    @fake.post("/v1/completions")
    async def complete() -> StreamingResponse:
        async def body() -> Any:
            yield f"data: {_chunk(text='a')}\n\n".encode()
            await asyncio.sleep(30)  # never finishes within the client's timeout
        return StreamingResponse(body(), media_type="text/event-stream")

    with serve_in_thread(fake) as server:
        cfg = LoadtestConfig(url=f"http://127.0.0.1:{server.port}", requests=2, concurrency=2, timeout=0.5, json=True)
        assert main(cfg) == 1
    assert last_json_line(capsys.readouterr().out)["errors"] == {"timeout": 2}


def _prompt_server(prompts: list[str]) -> Any:
    """A server that records each request's prompt and answers it with one finished chunk."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    fake = FastAPI()

    @fake.post("/v1/completions")
    async def complete(request: dict[str, Any]) -> StreamingResponse:  # a dict: the JSON body
        prompts.append(request["prompt"])

        async def body() -> Any:
            yield f"data: {_chunk(text='a', finish_reason='length')}\n\ndata: [DONE]\n\n".encode()
        return StreamingResponse(body(), media_type="text/event-stream")

    return fake


def _sent_prompts(capsys: pytest.CaptureFixture[str], **options: Any) -> tuple[list[str], dict[str, Any]]:
    """The prompts one loadtest run sends (one client: in the order made), and its --json summary."""
    prompts: list[str] = []
    with serve_in_thread(_prompt_server(prompts)) as server:
        cfg = LoadtestConfig(url=f"http://127.0.0.1:{server.port}", concurrency=1, json=True, **options)
        assert main(cfg) == 0
    return prompts, last_json_line(capsys.readouterr().out)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
def test_with_a_tokenizer_every_prompt_is_exactly_prompt_tokens_of_it_and_no_special_token(
        n: int, train_data: Any, debug_tokenizer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from gptopt.data.tokenizer import eot_id

    path = str(train_data / "tokenizer.json")
    special = {i for i, t in debug_tokenizer.get_added_tokens_decoder().items() if t.special}
    assert eot_id(debug_tokenizer) in special
    for seed in (0, 1, 2):
        prompts, summary = _sent_prompts(capsys, requests=6, prompt_tokens=n, tokenizer=path, seed=seed)
        assert len(prompts) == 6 and len(set(prompts)) > 1  # random tokens: requests differ
        for prompt in prompts:
            ids = debug_tokenizer.encode(prompt).ids  # as gptopt serve encodes a prompt
            assert len(ids) == n and not special & set(ids), (seed, prompt)
        assert summary["prompt"] == {"kind": "tokens", "length": n, "shared_prefix": 0, "tokenizer": path}


@pytest.mark.parametrize("shared", [1, 40, 200])
def test_a_shared_prefix_is_the_same_tokens_at_the_start_of_every_prompt(
        shared: int, train_data: Any, debug_tokenizer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--shared_prefix: every prompt's tokens begin with the same ones (what a prefix cache matches), then its own
    --prompt_tokens; in words without a tokenizer."""
    path = str(train_data / "tokenizer.json")
    prompts, summary = _sent_prompts(capsys, requests=5, prompt_tokens=12, shared_prefix=shared, tokenizer=path)
    ids = [debug_tokenizer.encode(p).ids for p in prompts]
    assert all(len(i) == shared + 12 for i in ids) and len({tuple(i[:shared]) for i in ids}) == 1
    assert len({tuple(i[shared:]) for i in ids}) == 5
    assert summary["prompt"]["shared_prefix"] == shared
    words, _ = _sent_prompts(capsys, requests=3, prompt_tokens=4, shared_prefix=shared)
    assert len({" ".join(w.split()[:shared]) for w in words}) == 1 and all(len(w.split()) == shared + 4 for w in words)


def test_token_prompts_are_served_without_errors(url: str, train_data: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Random tokens decode to any text (control characters included): gptopt serve takes it as a prompt."""
    cfg = LoadtestConfig(url=url, requests=4, concurrency=2, prompt_tokens=24, max_tokens=4, json=True,
                         tokenizer=str(train_data / "tokenizer.json"))
    assert main(cfg) == 0
    out = capsys.readouterr().out
    assert last_json_line(out)["errors"] == {} and f"prompts      24 tokens of {train_data / 'tokenizer.json'}" in out


def test_token_prompts_follow_the_seed(train_data: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(train_data / "tokenizer.json")
    first, _ = _sent_prompts(capsys, requests=4, prompt_tokens=16, tokenizer=path, seed=7)
    again, _ = _sent_prompts(capsys, requests=4, prompt_tokens=16, tokenizer=path, seed=7)
    other, _ = _sent_prompts(capsys, requests=4, prompt_tokens=16, tokenizer=path, seed=8)
    assert first == again and set(first).isdisjoint(other)


@pytest.mark.parametrize("model", ["model_dir", "trained_out"])
def test_a_model_directory_gives_its_tokenizer_as_the_tokenizer_json_does(
        model: str, train_data: Any, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    """--tokenizer takes the served model's directory as serve's --model does, its tokenizer found as generate
    and serve find it: a model dir whose checkpoint records it, a training output dir (its latest checkpoint's)."""
    where = request.getfixturevalue(model)
    assert not (where / "tokenizer.json").exists()
    by_file, _ = _sent_prompts(capsys, requests=3, prompt_tokens=12, tokenizer=str(train_data / "tokenizer.json"))
    by_model, summary = _sent_prompts(capsys, requests=3, prompt_tokens=12, tokenizer=str(where))
    assert by_model == by_file and summary["prompt"]["tokenizer"] == str(where)


def test_without_a_tokenizer_prompts_are_words_of_the_fixed_text_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    prompts, summary = _sent_prompts(capsys, requests=3, prompt_tokens=5, seed=0)
    assert prompts == ["into one file tests prove", "prove behaviour numbers are measured", "over the lazy dog while"]
    assert summary["prompt"] == {"kind": "words", "length": 5, "shared_prefix": 0, "tokenizer": None}


@pytest.mark.parametrize("where, problem", [("missing.json", "no such file or folder"),
                                            ("empty_folder", "no tokenizer.json in this folder")])
def test_a_bad_tokenizer_is_refused_in_one_line_with_exit_2(where: str, problem: str, tmp_path: Any,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from gptopt import cli

    (tmp_path / "empty_folder").mkdir()
    prompts: list[str] = []
    with serve_in_thread(_prompt_server(prompts)) as server:
        rc = cli.main(["loadtest", "--url", f"http://127.0.0.1:{server.port}", "--requests", "2",
                       "--tokenizer", str(tmp_path / where)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and prompts == []  # refused before a request is sent
    assert len(err.splitlines()) == 1 and f"--tokenizer {tmp_path / where}: {problem}" in err


def test_the_help_says_prompt_tokens_are_words_without_a_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    from gptopt import cli

    with pytest.raises(SystemExit):
        cli.main(["loadtest", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--tokenizer" in out and "without it, this many words of a fixed text" in out and "approximately" in out
