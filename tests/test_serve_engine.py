"""The serving engine under load, in the server's process: continuous batching, prefill in one forward and in
chunks, torch's thread counts per forward on a CPU, 429, disconnects, timeouts, the drain, a stall.

    pytest -q tests/test_serve_engine.py
"""

from __future__ import annotations

import dataclasses
import gc
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
    assert_openai_error,
    completion,
    running,
    stream_through_a_sigterm,
)

from gptopt.config import GPTConfig, ServeConfig, preset  # noqa: E402
from gptopt.infer.generator import BLOCK_SIZE, Generator  # noqa: E402
from gptopt.infer.sampling import SamplingParams  # noqa: E402
from gptopt.infer.scheduler import complete  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.runtime.device import resolve  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402

# -- the engine under load -------------------------------------------------------------------------


def test_continuous_batching_shares_decode_steps(debug_tokenizer: Any) -> None:
    n, max_tokens = 4, 24
    with running(debug_tokenizer, max_batch_size=n, decode_delay=0.005) as (url, app):
        engine = app.state.engine
        sizes: list[int] = []
        decode = engine.generator.decode

        def counted(slots: list[int], *args: Any) -> torch.Tensor:
            sizes.append(len(slots))
            return decode(slots, *args)

        engine.generator.decode = counted
        results: list[Any] = [None] * n

        def send(i: int) -> None:
            results[i] = completion(url, prompt=f"{PROMPT} {i}", max_tokens=max_tokens, temperature=0).json()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    tokens = [r["usage"]["completion_tokens"] for r in results]
    alone = sum(t - 1 for t in tokens)  # decode steps if each request ran by itself
    assert max(sizes) == n  # all four in one forward pass
    assert len(sizes) < 0.6 * alone, (len(sizes), tokens)


def engine_run(model: GPT, tokenizer: Any, prompts: list[list[int]], *, slots: int, chunk: int,
               max_tokens: int = 12, before: list[list[int]] = (), solo_threads: int | None = None,
               threads: list[tuple[str, int]] | None = None) -> tuple[list[list[int]], list[str]]:
    """Greedy tokens of each prompt through an Engine, and the forwards it ran in order ("prefill N"
    rows or "decode N" rows). `before` prompts are already decoding when `prompts` arrive. `threads`
    gets each forward (as in the list of forwards) with torch's thread count as it ran."""
    from gptopt.serve.engine import Engine

    gen = Generator(model, resolve("cpu"), max_batch_size=slots)
    engine, calls = Engine(gen, tokenizer, prefill_chunk=chunk, solo_threads=solo_threads), []
    extend, decode = gen.extend, gen.decode
    seen = [] if threads is None else threads

    def spy_extend(slots: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        calls.append(f"prefill {len(slots)}")
        seen.append((calls[-1], torch.get_num_threads()))
        return extend(slots, chunks, starts)

    def spy_decode(slots: list[int], *args: Any) -> torch.Tensor:
        calls.append(f"decode {len(slots)}")
        seen.append((calls[-1], torch.get_num_threads()))
        return decode(slots, *args)

    gen.extend, gen.decode = spy_extend, spy_decode
    tokens: dict[int, list[int]] = {}
    done = threading.Event()
    params = SamplingParams(temperature=0, max_new_tokens=max_tokens)
    reqs = []

    def sink(ev: Any) -> None:
        if ev.finish_reason is not None and len(reqs) == len(before) + len(prompts) and \
                all(r.seq is not None and r.seq.finish for r in reqs):
            done.set()

    for p in before:  # decoding already: admitted and one decode step run before the others arrive
        reqs.append(engine.submit(p, dataclasses.replace(params, max_new_tokens=10 * max_tokens), sink))
    if before:
        engine.start()
        while not any(c.startswith("decode") for c in calls):
            time.sleep(0.001)
    for p in prompts:  # without `before`, all queued before the engine starts: one burst
        reqs.append(engine.submit(p, params, sink))
    if not before:
        engine.start()
    assert done.wait(60)
    engine.shutdown(timeout=5)
    for r in reqs:
        tokens[id(r)] = r.seq.tokens
    return [tokens[id(r)] for r in reqs[len(before):]], calls


def test_a_burst_of_prompts_is_prefilled_in_one_forward_with_the_tokens_of_one_at_a_time(
        varied_model: GPT, debug_tokenizer: Any) -> None:
    """16 requests at once: every first token comes from one prefill forward, before any decode step, so
    the last request's first token does not wait for the other fifteen; greedy tokens as one at a time."""
    prompts = [[5 + i, 17, 99, 4, 200 + i][: 1 + i % 5] + [31] * (i % 3) for i in range(16)]
    alone = [complete(Generator(varied_model, resolve("cpu"), max_batch_size=1), [p],
                      SamplingParams(temperature=0, max_new_tokens=12))[0][0] for p in prompts]
    tokens, calls = engine_run(varied_model, debug_tokenizer, prompts, slots=16, chunk=512)
    assert calls[:2] == ["prefill 16", "decode 16"]
    assert tokens == alone


def test_an_engine_run_computes_on_the_calling_thread_until_shutdown(varied_model: GPT,
                                                                     debug_tokenizer: Any) -> None:
    """Engine.run: the loop on the caller's thread (the engine process's main thread, whose OpenMP pool is
    the only one), serving until shutdown from another thread returns it; an engine starts only once."""
    from gptopt.serve.engine import Engine

    gen = Generator(varied_model, resolve("cpu"), max_batch_size=2)
    engine = Engine(gen, debug_tokenizer)
    decode, forwards_on = gen.decode, set()

    def spy(*args: Any) -> torch.Tensor:
        forwards_on.add(threading.current_thread().name)
        return decode(*args)

    gen.decode = spy
    caller = threading.Thread(target=engine.run, name="the-caller")
    caller.start()
    wait_for(lambda: engine.alive)
    done = threading.Event()
    req = engine.submit([5, 17, 99], SamplingParams(temperature=0, max_new_tokens=6),
                        lambda ev: done.set() if ev.finish_reason is not None else None)
    assert done.wait(30)
    assert len(req.seq.tokens) == 6 and forwards_on == {"the-caller"}
    with pytest.raises(RuntimeError, match="started already"):
        engine.start()
    engine.shutdown(timeout=5)
    caller.join(timeout=5)
    assert not caller.is_alive()
    assert not engine.alive and not engine.failed  # asked to stop: not a failure


def _count_in_a_new_thread() -> int:
    """torch's thread count as a thread started now gets it (the process's default, not this thread's)."""
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    t.start()
    t.join()
    return got[0]


def _threads_of_a_two_request_run(model: GPT, tokenizer: Any) -> tuple[list[tuple[str, int]], int]:
    """With torch at 2 threads and solo_threads=1: a warm-up (after which the caller has every core back),
    then a request joining one already decoding. Each forward with its thread count, and the count a thread
    started after the run gets; torch's count is the caller's again after. Asserts the second request's
    greedy tokens are the one-at-a-time path's."""
    from gptopt.serve.engine import Engine

    first, second = [5, 17, 99], [8, 4, 200, 31]
    had = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        Engine(Generator(model, resolve("cpu"), max_batch_size=2), tokenizer, solo_threads=1).warmup()
        assert torch.get_num_threads() == 2  # the caller (a test, a notebook) gets every core back
        alone = complete(Generator(model, resolve("cpu"), max_batch_size=1), [second],
                         SamplingParams(temperature=0, max_new_tokens=12))[0][0]
        threads: list[tuple[str, int]] = []
        tokens, _ = engine_run(model, tokenizer, [second], slots=2, chunk=512, before=[first], solo_threads=1,
                               threads=threads)
        assert tokens == [alone]
        return threads, _count_in_a_new_thread()
    finally:
        torch.set_num_threads(had)


def _counts_by_kind(threads: list[tuple[str, int]]) -> dict[str, set[int]]:
    return {kind: {n for k, n in threads if k == kind} for kind, _ in threads}


def test_a_cpu_engine_decodes_one_request_on_its_solo_threads_and_the_rest_on_every_core(
        varied_model: GPT, debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve --solo_threads: a decode step of one request alone computes with that many torch threads; a
    prefill and a decode step of two requests with all the process had (2 here); after the warm-up and
    after shutdown the process has its count back for whatever else it runs. The greedy tokens are the
    one-at-a-time path's. (The debug model stands for one above SMALL_MODEL_FLOPS here.)"""
    from gptopt.serve import engine as engine_module

    monkeypatch.setattr(engine_module, "SMALL_MODEL_FLOPS", 0)
    threads, new_thread_count = _threads_of_a_two_request_run(varied_model, debug_tokenizer)
    assert _counts_by_kind(threads) == {"prefill 1": {2}, "decode 1": {1}, "decode 2": {2}}, threads
    assert threads[-1] == ("decode 1", 1)  # the engine thread ended on one; the process's default is back
    assert new_thread_count == 2


def test_a_cpu_engine_runs_every_forward_of_a_model_too_small_to_share_on_its_solo_threads(
        varied_model: GPT, debug_tokenizer: Any) -> None:
    """A model under SMALL_MODEL_FLOPS a token (the debug model) gains nothing from a second core, which the
    HTTP side needs: its prefills and decode steps of two requests run on solo_threads too, and a warm-up
    leaves its caller every core. The greedy tokens are the one-at-a-time path's."""
    from gptopt.models.flops import flops_per_token
    from gptopt.serve.engine import SMALL_MODEL_FLOPS

    assert flops_per_token(varied_model.config, 0, training=False) < SMALL_MODEL_FLOPS
    threads, _ = _threads_of_a_two_request_run(varied_model, debug_tokenizer)
    assert _counts_by_kind(threads) == {"prefill 1": {1}, "decode 1": {1}, "decode 2": {1}}, threads


@pytest.mark.parametrize("small", [False, True], ids=["a model above SMALL_MODEL_FLOPS", "one under it"])
def test_a_compiled_cpu_engine_never_recompiles_for_its_solo_threads(varied_model: GPT, debug_tokenizer: Any,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      small: bool) -> None:
    """A request left alone in slot 1 (slot 0's finished first) runs the compiled 2-row graph under the count
    it was compiled under, not solo_threads (dynamo guards on the count: that would recompile mid-serving):
    every core for a model above SMALL_MODEL_FLOPS, solo_threads for every step of one under it. The long
    request's keys reach past a KV block's end (BLOCK_SIZE), where a length inside a block once compiled the
    graph again. Greedy tokens equal the eager one-at-a-time path's."""
    from gptopt.serve import engine as engine_module
    from gptopt.serve.engine import Engine

    if not small:
        monkeypatch.setattr(engine_module, "SMALL_MODEL_FLOPS", 0)

    short, long = [5, 17, 99], [8, 4, 200, 31]
    params = SamplingParams(temperature=0, max_new_tokens=BLOCK_SIZE + 4)
    alone = [complete(Generator(varied_model, resolve("cpu"), max_batch_size=1), [p], params)[0][0]
             for p in (short, long)]
    had = torch.get_num_threads()
    torch.set_num_threads(2)
    torch._dynamo.reset()
    try:
        gen = Generator(varied_model, resolve("cpu"), max_batch_size=2, compile=True)
        engine = Engine(gen, debug_tokenizer, solo_threads=1)
        engine.warmup()
        done = threading.Event()
        reqs: list[Any] = []

        def sink(ev: Any) -> None:
            if ev.finish_reason is not None and len(reqs) == 2 and all(r.seq.finish for r in reqs):
                done.set()

        reqs.append(engine.submit(short, dataclasses.replace(params, max_new_tokens=3), sink))
        reqs.append(engine.submit(long, params, sink))
        graphs = dict(torch._dynamo.utils.counters["stats"])  # what the warm-up compiled
        engine.start()
        assert done.wait(120)
        engine.shutdown(timeout=5)
        assert dict(torch._dynamo.utils.counters["stats"]) == graphs  # nothing compiled while serving
        assert reqs[0].seq.tokens == alone[0][:3] and reqs[1].seq.tokens == alone[1]
    finally:
        torch.set_num_threads(had)
        torch._dynamo.reset()


def test_building_an_engine_leaves_torchs_process_switches_as_they_were(debug_tokenizer: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """TF32, dynamo's recompile limit and torch's thread count are set where a serving process starts
    (startup.set_process_switches; the engine's forwards switch threads around themselves only): building an
    engine, warm-up included, leaves them as the caller had them. The CPU stands for a device whose plan
    chooses TF32."""
    from gptopt.runtime.torch_private import recompile_limit
    from gptopt.serve import engine as engine_module
    from gptopt.serve import startup

    tf32 = dataclasses.replace(resolve("cpu"), tf32=True)
    monkeypatch.setattr(startup, "resolve", lambda *args, **kwargs: tf32)
    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size())).eval()
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    had_threads, had_precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    try:
        torch.set_num_threads(2)
        torch.set_float32_matmul_precision("highest")
        with torch._dynamo.config.patch(**{limit: 8}):
            cfg = ServeConfig(model="debug", device="cpu", max_batch_size=2, solo_threads=1)
            startup.build_engine(cfg, model, debug_tokenizer)  # its warm-up ran forwards on 1 and on 2 threads
            assert (torch.get_num_threads(), torch.get_float32_matmul_precision()) == (2, "highest")
            monkeypatch.setattr(engine_module.Engine, "warmup", lambda self: 0.0)  # no compiling needed here
            startup.build_engine(dataclasses.replace(cfg, compile=True), model, debug_tokenizer)
            assert (recompile_limit(), torch.get_float32_matmul_precision()) == (8, "highest")
            startup.set_process_switches(dataclasses.replace(cfg, compile=True))  # where serve's processes start
            assert (recompile_limit(), torch.get_float32_matmul_precision()) == (64, "high")
    finally:
        torch.set_num_threads(had_threads)
        torch.set_float32_matmul_precision(had_precision)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_decodes(
        varied_model: GPT, debug_tokenizer: Any) -> None:
    """A 40-token prompt at 8 tokens a forward: five prefills, each followed by a decode step of the
    request already running, which thus never waits for more than one chunk; the same greedy tokens."""
    long = [(7 * i) % 400 + 3 for i in range(40)]
    alone = complete(Generator(varied_model, resolve("cpu"), max_batch_size=1), [long],
                     SamplingParams(temperature=0, max_new_tokens=12))[0][0]
    (tokens,), calls = engine_run(varied_model, debug_tokenizer, [long], slots=2, chunk=8, before=[[42, 7]])
    prefills = [i for i, c in enumerate(calls) if c.startswith("prefill")][1:]  # after the running one's own
    assert len(prefills) == 5
    assert all(calls[i + 1] == "decode 1" for i in prefills[:-1])  # the running request's step after each chunk
    assert tokens == alone


def test_full_queue_gets_429_with_retry_after(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, max_batch_size=1, max_queue=1, decode_delay=0.02) as (url, app):
        engine = app.state.engine
        threads = [threading.Thread(target=completion, args=(url,), kwargs={"max_tokens": 20}) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: engine.stats() == {"running": 1, "waiting": 1})
        r = completion(url, max_tokens=20)
        assert_openai_error(r, 429, "rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1
        for t in threads:
            t.join()
        assert completion(url, max_tokens=2).status_code == 200  # capacity is back


def test_client_disconnect_frees_the_slot(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, max_batch_size=2, decode_delay=0.02) as (url, app):
        engine = app.state.engine
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
            assert engine.stats()["running"] == 1
        wait_for(lambda: engine.stats()["running"] == 0, timeout=5)  # streaming client gone
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 40}, timeout=0.3)
        wait_for(lambda: engine.stats()["running"] == 0, timeout=5)  # non-streaming client gone
        steps = engine.steps
        time.sleep(0.2)
        assert engine.steps == steps  # nothing is still decoding for the departed clients


def test_request_timeout_ends_with_504(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, max_batch_size=1, decode_delay=0.02, request_timeout=0.2) as (url, app):
        assert_openai_error(completion(url, max_tokens=40), 504, "timeout")
        wait_for(lambda: app.state.engine.stats()["running"] == 0, timeout=5)


def test_a_serving_process_keeps_its_start_up_heap_out_of_collections_and_gives_it_back(
        debug_tokenizer: Any) -> None:
    """While serving, what loading left is frozen (no full collection walks it mid-request); a server
    stopping while another still serves leaves it frozen, and after the last the collector has it again,
    so a process that goes on (tests, notebooks) leaks nothing."""
    from gptopt.serve.engine import settled_heap

    before = gc.get_freeze_count()
    with settled_heap():
        outer = gc.get_freeze_count()
        assert outer > 1000 and outer >= before
        with running(debug_tokenizer) as (url, _):
            assert completion(url, max_tokens=2).status_code == 200
            assert gc.get_freeze_count() >= outer
        assert gc.get_freeze_count() >= outer  # the server that stopped was not the last
    if before == 0:  # nothing else of this process froze its heap (the module's server has not started)
        assert gc.get_freeze_count() == 0
    else:
        assert gc.get_freeze_count() >= before


def test_drain_finishes_in_flight_requests_and_refuses_new_ones(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, max_batch_size=2, decode_delay=0.02) as (url, app):
        engine = app.state.engine
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(r=completion(url, max_tokens=30, temperature=0)))
        t.start()
        wait_for(lambda: engine.stats()["running"] == 1)
        engine.begin_drain()
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert httpx.get(f"{url}/health").status_code == 200
        assert_openai_error(completion(url, max_tokens=2), 503, "draining")
        t.join()
        assert result["r"].status_code == 200


def test_sigterm_lets_the_open_stream_finish(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, max_batch_size=1, decode_delay=0.02) as (url, app):
        frames = stream_through_a_sigterm(url, app)
        assert frames[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        app.state.server.thread.join(timeout=30)
        assert not app.state.server.thread.is_alive() and not app.state.engine.alive


def test_a_model_that_does_not_fit_fails_at_start_up(debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gptopt.serve import engine as engine_module

    def oom(self: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(engine_module.Engine, "warmup", oom)
    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size()))
    with pytest.raises(ValueError, match="lower --kv_cache_memory, --max_batch_size or --prefill_chunk"):
        create_app(ServeConfig(model="debug", device="cpu"), model=model, tokenizer=debug_tokenizer)


def test_loads_a_training_output_dir_once_at_start_up(trained_out: Path) -> None:
    app = create_app(ServeConfig(model=str(trained_out), device="cpu", max_batch_size=2))
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == trained_out.name
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "import os", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_a_stalled_engine_is_reported_and_its_waiting_requests_end_with_a_503(
        debug_tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An engine stuck in a step (a hung kernel, a deadlock) with work waiting: after --stall_timeout, /health and
    /ready answer 503 "stalled", the waiting request ends with 503 engine_stalled, and the log says so."""
    release = threading.Event()
    with running(debug_tokenizer, max_batch_size=2, stall_timeout=0.5) as (url, app), \
            caplog.at_level("ERROR", logger="gptopt"):
        gen, decode = app.state.engine.generator, app.state.engine.generator.decode

        def stuck(*args: Any) -> torch.Tensor:
            release.wait()
            return decode(*args)

        gen.decode = stuck
        try:
            r = completion(url, max_tokens=5, temperature=0)
            assert "no progress for 0.5 s" in assert_openai_error(r, 503, "engine_stalled")["message"]
            for probe in ("health", "ready"):
                response = httpx.get(f"{url}/{probe}")
                assert (response.status_code, response.json()["status"]) == (503, "stalled")
            assert "stalled" in caplog.text or "no progress" in caplog.text
        finally:
            release.set()
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=10)  # going again: healthy


def test_the_warm_up_runs_what_serving_runs_never_a_prefill_of_the_whole_context(
        debug_tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A long-context model warms up with one prefill chunk and a decode step of each batch shape, each logged: its
    start-up does not grow with the context."""
    from gptopt.serve.engine import Engine

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32768, vocab_size=512)).eval()
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=4, kv_blocks=2048 + 8)
    widths: list[int] = []
    extend, prefill = gen.extend, gen.prefill

    def spy_extend(slots: list[int], chunks: list[list[int]], *args: Any, **kw: Any) -> torch.Tensor:
        widths.append(sum(len(c) for c in chunks))
        return extend(slots, chunks, *args, **kw)

    def spy_prefill(slot: int, tokens: list[int], **kw: Any) -> torch.Tensor:
        widths.append(len(tokens))
        return prefill(slot, tokens, **kw)

    gen.extend, gen.prefill = spy_extend, spy_prefill  # type: ignore[method-assign]
    with caplog.at_level("INFO", logger="gptopt.serve.engine"):
        Engine(gen, debug_tokenizer, prefill_chunk=256).warmup()
    assert max(widths) == 256
    assert "warm-up: a prefill of 256 tokens" in caplog.text and "warm-up: a decode step of 4 rows" in caplog.text
    gen.pool.check_idle()
