"""`gptopt serve` as a process: its engine in a child process of its own (the default), how that child starts,
serves, fails and stops with its server, and the socket the command listens on.

    pytest -q tests/test_serve_process.py
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import wait_for

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import (  # noqa: E402
    PROMPT,
    alive,
    assert_openai_error,
    child_pids,
    completion,
    running_apart,
    sse,
    stream_through_a_sigterm,
)

from gptopt.config import ServeConfig, preset  # noqa: E402
from gptopt.infer.generator import Generator  # noqa: E402
from gptopt.infer.sampling import SamplingParams  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.runtime.device import resolve  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.client import EngineClient  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402

# -- the command -----------------------------------------------------------------------------------


def test_the_served_connections_send_each_chunk_at_once() -> None:
    """The socket `gptopt serve` listens on gives its connections TCP_NODELAY, as uvicorn's own would: with
    Nagle's algorithm a streamed token waited for the client's delayed ACK (Linux's timer: 40 ms at least)."""
    import asyncio
    import socket

    from gptopt.serve.server import bind

    async def nodelay() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=bind("127.0.0.1", 0))
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()

    assert asyncio.run(nodelay()) != 0


def test_serve_announces_and_serves_the_port_it_bound(model_dir: Path) -> None:
    """...and Ctrl-C stops it with its engine process: nothing is left running."""
    import re

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    children: list[int] = []
    proc = subprocess.Popen([sys.executable, "-m", "gptopt", "serve", "--model", str(model_dir), "--device", "cpu",
                             "--port", "0", "--max_batch_size", "1"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:
            if m := re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "no 'serving on' line"
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/ready"), timeout=60)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == model_dir.name
        children = child_pids(proc.pid)
        assert children  # the engine's process
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    wait_for(lambda: not any(alive(c) for c in children), timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


STARTING = "the engine process is starting"


def never_ready(engine: Any) -> None:
    """EngineProcess setup: a start that goes on (a large model loading or warming up for minutes), said on stderr."""
    print(STARTING, file=sys.stderr, flush=True)
    time.sleep(600)


# `gptopt serve` whose engine process never gets ready (never_ready): argv[1] is this folder, argv[2] the model
SERVE_NEVER_READY = """
import sys
sys.path.insert(0, sys.argv[1])
from test_serve_process import never_ready
from gptopt import cli
from gptopt.serve import app, engine_process
app.EngineProcess = lambda cfg: engine_process.EngineProcess(cfg, setup=never_ready)
sys.exit(cli.main(["serve", "--model", sys.argv[2], "--device", "cpu", "--port", "0", "--max_batch_size", "1"]))
"""


def _engine_process_of(server: int) -> int | None:
    """The spawned child of `server` that runs its engine (not multiprocessing's resource tracker)."""
    for pid in child_pids(server):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


@pytest.mark.parametrize("stage", ["importing", "loading"])
def test_a_server_stopped_while_its_engine_is_starting_leaves_no_engine_behind(model_dir: Path, stage: str) -> None:
    """SIGTERM to `gptopt serve` while its engine process still starts, importing torch (it runs no code of ours yet)
    or loading and warming up: the engine process ends with the server, instead of finishing its start."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(tests.parent / "src")}
    proc = subprocess.Popen([sys.executable, "-c", SERVE_NEVER_READY, str(tests), str(model_dir)],
                            stderr=subprocess.PIPE, text=True, env=env)
    engine: int | None = None
    try:
        assert proc.stderr is not None
        if stage == "loading":
            assert any(STARTING in line for line in proc.stderr)  # read up to the setup's line
        wait_for(lambda: _engine_process_of(proc.pid) is not None, timeout=120)
        engine = _engine_process_of(proc.pid)
        left = child_pids(proc.pid)
        assert engine is not None and alive(engine)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        # the engine goes with its server (the kernel's parent-death signal, or its watch of the parent), not seconds
        # later; multiprocessing's resource tracker follows once it finds its pipe closed
        wait_for(lambda: not alive(engine), timeout=5)
        wait_for(lambda: not any(alive(pid) for pid in left), timeout=30)
    finally:
        proc.kill()
        proc.wait()
        if engine is not None and alive(engine):
            os.kill(engine, signal.SIGKILL)


# -- the engine in a process of its own (gptopt serve's default) -----------------------------------


def slow_decode(engine: Any) -> None:
    """EngineProcess setup: 20 ms a decode step in the child, so requests stay open while a test acts."""
    decode = engine.generator.decode

    def slow(*args: Any) -> torch.Tensor:
        time.sleep(0.02)
        return decode(*args)

    engine.generator.decode = slow


def test_an_engine_process_serves_what_an_engine_in_the_server_does(model_dir: Path) -> None:
    """Greedy text, streamed or not, usage and /metrics: the same as the in-process engine's, both seen by
    the routes as one EngineClient; the child ends with the server."""
    from prometheus_client.parser import text_string_to_metric_families

    body = {"prompt": [PROMPT, "import os"], "max_tokens": 12, "temperature": 0}
    app = create_app(ServeConfig(model=str(model_dir), device="cpu", max_batch_size=2, engine_process=False))
    assert isinstance(app.state.engine, EngineClient)  # engine.Engine, in this process
    with serve_in_thread(app) as server:
        expected = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body, timeout=60).json()
    with running_apart(model_dir) as (url, app):
        assert isinstance(app.state.engine, EngineClient)  # engine_process.EngineProcess
        pid = app.state.engine.pid
        assert alive(pid)
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in expected["choices"]]
        assert got["usage"] == expected["usage"]
        streamed = sse(httpx.post(f"{url}/v1/completions", json={**body, "prompt": PROMPT, "stream": True}, timeout=60))
        assert "".join(f["choices"][0]["text"] for f in streamed[:-1]) == expected["choices"][0]["text"]
        assert httpx.get(f"{url}/ready").json() == {"status": "ready", "running": 0, "waiting": 0}
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
        ok = [s for s in families["gptopt_requests"].samples if s.labels.get("status") == "200"]
        assert ok and ok[0].value >= 2  # the HTTP side's counter
        assert families["gptopt_generation_tokens"].samples[0].value == got["usage"]["completion_tokens"] + 12
        assert families["process_resident_memory_bytes"].samples[0].value > 0  # the engine's process
        assert families["gptopt_http_process_resident_memory_bytes"].samples[0].value > 0  # the HTTP side's
        assert families["gptopt_engine_up"].samples[0].value == 1  # the engine's series are here
        # the child's KV cache, read in the child at scrape time: no request holds a block now
        assert families["gptopt_kv_cache_usage_perc"].samples[0].value == 0
        assert families["gptopt_num_preemptions"].samples[0].value == 0
    assert not alive(pid)


def metrics_stall_once(engine: Any) -> None:
    """EngineProcess setup: the engine's first metrics take 3 s (a stuck step, or a busy process), later ones none."""
    real, calls = engine.render_metrics, []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(3)
        return real()

    engine.render_metrics = render


def test_metrics_of_an_engine_that_does_not_answer_say_so_and_keep_the_http_sides(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape whose engine process does not answer in time still answers with the HTTP side's series, with
    gptopt_engine_up 0 and none of the engine's: a scraper tells a stalled engine from an idle one."""
    from prometheus_client.parser import text_string_to_metric_families

    from gptopt.serve import engine_process

    def scrape(url: str) -> dict[str, Any]:
        return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)}

    monkeypatch.setattr(engine_process, "METRICS_TIMEOUT", 0.5)
    with running_apart(model_dir, metrics_stall_once) as (url, _):
        stalled = scrape(url)
        assert stalled["gptopt_engine_up"].samples[0].value == 0
        assert "gptopt_requests" in stalled and "gptopt_generation_tokens" not in stalled
        wait_for(lambda: scrape(url)["gptopt_engine_up"].samples[0].value == 1, timeout=30)
        assert "gptopt_generation_tokens" in scrape(url)


def test_a_stop_string_ends_the_reply_in_the_http_process_and_frees_the_engine_processs_request(
        model_dir: Path) -> None:
    """The child sends token ids only; the HTTP side finds the stop string, ends the reply, and has the child drop
    the request: it decodes far fewer tokens than its budget, and its metrics count it as stopped."""
    from prometheus_client.parser import text_string_to_metric_families

    max_tokens = 40  # with the prompt, within the model's 64 tokens
    with running_apart(model_dir, slow_decode) as (url, app):
        full = completion(url, max_tokens=max_tokens, temperature=0, ignore_eos=True).json()
        text = full["choices"][0]["text"]
        assert full["usage"]["completion_tokens"] == max_tokens
        stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
        r = completion(url, max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=[stop]).json()
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (text[: text.find(stop)], "stop")
        wait_for(lambda: app.state.engine.stats() == {"running": 0, "waiting": 0})
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
        assert families["gptopt_generation_tokens"].samples[0].value < 2 * max_tokens - 1
        finished = {s.labels["reason"]: s.value for s in families["gptopt_finished_sequences"].samples
                    if s.name.endswith("_total")}
        assert finished == {"length": 1, "stop": 1}


def forwards_on_the_main_thread_only(engine: Any) -> None:
    """EngineProcess setup: a prefill or decode forward off the child's main thread fails its requests."""
    gen = engine.generator

    def checked(f: Any) -> Any:
        def call(*args: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(f"{f.__name__} on thread {threading.current_thread().name}")
            return f(*args)
        return call

    gen.prefill_step, gen.decode = checked(gen.prefill_step), checked(gen.decode)


def engine_exits_on_decode(engine: Any) -> None:
    """EngineProcess setup: the engine's loop itself ends at the first decode step (not one request's error)."""
    def leave(*args: Any) -> torch.Tensor:
        raise SystemExit(3)

    engine.generator.decode = leave


def commands_fail(engine: Any) -> None:
    """EngineProcess setup: the child's command reader fails on the first request it is handed."""
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise SystemExit(4)  # not an Exception: past the reader's per-command guard

    engine.submit = fail


def test_an_engine_process_computes_on_its_main_thread(model_dir: Path) -> None:
    """The child's engine runs on the thread that loaded the model: a second thread starting OpenMP
    regions made every CPU kernel wait for its workers to wake (Engine.run)."""
    with running_apart(model_dir, forwards_on_the_main_thread_only) as (url, _):
        r = completion(url, max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 1  # a decode step ran


@pytest.mark.parametrize("setup", [engine_exits_on_decode, commands_fail], ids=["engine", "command-reader"])
def test_an_engine_process_whose_engine_or_command_reader_ends_exits_and_fails_the_probes(
        model_dir: Path, setup: Any) -> None:
    """The child's loop ending on its own, or its command reader failing (it can no longer hear its
    parent), ends the child: the request gets a 5xx, the probes say a restart is due, nothing hangs, and
    the server does not look alive with no engine."""
    with running_apart(model_dir, setup) as (url, app):
        assert completion(url, max_tokens=8).status_code >= 500
        wait_for(lambda: not alive(app.state.engine.pid) and app.state.engine.failed, timeout=15)
        for probe in ("health", "ready"):
            response = httpx.get(f"{url}/{probe}")
            assert (response.status_code, response.json()["status"]) == (503, "failed")


def test_an_engine_process_refuses_beyond_capacity_and_frees_a_departed_clients_slot(model_dir: Path) -> None:
    with running_apart(model_dir, slow_decode, max_batch_size=1, max_queue=0) as (url, app):
        engine = app.state.engine
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"{url}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()  # held: a closed line iterator closes the stream, and the client is gone
            next(line for line in lines if line.startswith("data: "))
            refused = completion(url, max_tokens=2)
            assert_openai_error(refused, 429, "rate_limit_exceeded")
            assert int(refused.headers["retry-after"]) >= 1
        wait_for(lambda: engine.stats()["running"] == 0, timeout=5)  # the child dropped the departed stream
        assert completion(url, max_tokens=2).status_code == 200


def test_an_engine_process_that_dies_ends_its_requests_with_an_error_and_logs_the_signal(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with running_apart(model_dir, slow_decode) as (url, app), caplog.at_level("ERROR", logger="gptopt"):
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(r=completion(url, max_tokens=40)))
        t.start()
        wait_for(lambda: app.state.engine.stats()["running"] == 1)
        os.kill(app.state.engine.pid, signal.SIGKILL)  # as the kernel's out-of-memory killer would
        t.join(timeout=30)
        # a stable code: the engine failed (a 503, as a restart is what helps)
        assert "killed by signal 9" in assert_openai_error(result["r"], 503, "engine_failed")["message"]
        wait_for(lambda: "restart the server" in caplog.text, timeout=10)
        assert "the engine process was killed by signal 9 (SIGKILL); ended its 1 open requests" in caplog.text
        for probe in ("health", "ready"):  # an orchestrator's liveness probe restarts it
            r = httpx.get(f"{url}/{probe}")
            assert (r.status_code, r.json()["status"]) == (503, "failed")
        # a new request is told what the log says: how the engine ended
        message = assert_openai_error(completion(url, max_tokens=2), 503, "engine_failed")["message"]
        assert "the engine process was killed by signal 9 (SIGKILL)" in message


def test_sigterm_lets_the_open_stream_finish_through_the_engine_process(model_dir: Path) -> None:
    with running_apart(model_dir, slow_decode, max_batch_size=1) as (url, app):
        frames = stream_through_a_sigterm(url, app)
        assert frames[-1]["choices"][0]["finish_reason"] == "length"  # all 30 tokens, none lost to the drain
        app.state.server.thread.join(timeout=30)
        assert not app.state.server.thread.is_alive()
        wait_for(lambda: not alive(app.state.engine.pid), timeout=10)


def test_a_sigterm_of_the_engine_process_alone_drains_it_and_fails_the_probes(model_dir: Path) -> None:
    """systemd stops every process of a unit: the engine's own SIGTERM finishes the open stream, the
    server refuses new requests, and once the engine is gone the probes say so (a restart is due)."""
    with running_apart(model_dir, slow_decode, max_batch_size=1) as (url, app):
        engine = app.state.engine
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"{url}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(engine.pid, signal.SIGTERM)
            wait_for(lambda: engine.draining, timeout=10)
            assert_openai_error(completion(url, max_tokens=2), 503, "draining")
            rest = [line for line in lines if line.startswith("data: ")]
        frames = [json.loads(f[6:]) for f in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]" and frames[-1]["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: engine.failed, timeout=15)
        for probe in ("health", "ready"):
            response = httpx.get(f"{url}/{probe}")
            assert (response.status_code, response.json()["status"]) == (503, "failed")


def test_a_sigterm_of_an_idle_engine_process_stops_it(model_dir: Path) -> None:
    """With nothing to serve the engine waits; a SIGTERM of its process still ends it at once."""
    with running_apart(model_dir) as (url, app):
        engine = app.state.engine
        os.kill(engine.pid, signal.SIGTERM)
        wait_for(lambda: engine.failed, timeout=15)
        wait_for(lambda: not alive(engine.pid), timeout=15)
        assert_openai_error(completion(url, max_tokens=2), 503)


def test_requests_that_arrive_together_reach_an_engine_process_in_one_write_and_in_order(model_dir: Path) -> None:
    """The commands of one event-loop iteration go to the child in one write (a write each cost the loop a
    system call and the child a wake-up per request), in their order: a request cancelled in the iteration
    that submitted it ends cancelled, and the others are answered in full."""
    import asyncio

    from gptopt.serve.engine_process import EngineProcess
    from gptopt.serve.events import asyncio_sink

    engine = EngineProcess(ServeConfig(model=str(model_dir), device="cpu", max_batch_size=4))
    engine.start()
    writes: list[bytes] = []
    send_bytes = engine._commands.send_bytes
    engine._commands.send_bytes = lambda data: (writes.append(data), send_bytes(data))[1]  # type: ignore[method-assign]

    async def three_requests_one_cancelled() -> tuple[list[str | None], list[int], int]:
        queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in range(3)]
        reqs = [engine.submit([1, 2, 3 + i], SamplingParams(temperature=0, max_new_tokens=6), asyncio_sink(q))
                for i, q in enumerate(queues)]
        reqs[1].cancel()
        ends = []
        for q in queues:
            while (event := await q.get()).finish_reason is None:
                pass
            ends.append(event)
        return [e.finish_reason for e in ends], [e.completion_tokens for e in ends], len(writes)

    try:
        reasons, tokens, n_writes = asyncio.run(asyncio.wait_for(three_requests_one_cancelled(), 60))
    finally:
        engine.shutdown(5)
    assert reasons == ["length", "cancelled", "length"]
    assert (tokens[0], tokens[2]) == (6, 6)
    assert n_writes == 1


def test_an_engine_process_told_to_stop_on_its_own_refuses_what_still_arrives(debug_tokenizer: Any) -> None:
    """A SIGTERM of the engine's process alone (systemd stops every process of a unit) drains it; a
    request already on its way gets an error event back, and the child goes on serving the others."""
    import multiprocessing

    from gptopt.serve.engine import Engine
    from gptopt.serve.engine_child import EventPipe

    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size())).eval()
    engine = Engine(Generator(model, resolve("cpu"), max_batch_size=1), debug_tokenizer)
    engine.begin_drain()
    inbox, outbox = multiprocessing.Pipe(duplex=False)
    pipe = EventPipe(outbox, engine)
    submit = threading.Thread(target=pipe.submit, args=(7, [1, 2, 3], SamplingParams(max_new_tokens=4)), daemon=True)
    submit.start()
    submit.join(10)
    assert not submit.is_alive()  # answered, not stuck on its own lock
    assert inbox.poll(10)
    kind, items, stats = inbox.recv()
    (key, event), = items
    # "cancelled": the server's 503, as for any request it refuses while draining
    assert (kind, key, event.finish_reason) == ("events", 7, "cancelled") and "Draining" in (event.error or "")
    assert stats == {"running": 0, "waiting": 0} and not pipe.requests


def test_an_engine_process_that_cannot_start_says_why(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="int4-weight needs an NVIDIA GPU"):  # the child's error, raised here
        create_app(ServeConfig(model=str(model_dir), device="cpu", quantize="int4-weight"))
