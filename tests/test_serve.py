"""The server, in-process on 127.0.0.1 port 0 with a tiny random model, through real HTTP clients.

    pytest -q tests/test_serve.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from gptopt.config import ServeConfig, preset  # noqa: E402
from gptopt.data.tokenizer import eot_id  # noqa: E402
from gptopt.infer import sampling  # noqa: E402
from gptopt.infer.generator import Generator, complete  # noqa: E402
from gptopt.infer.sampling import SamplingParams  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.runtime.device import resolve  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.blocklist import Blocklist, CheckTimeout, TextFilter, load_blocklist  # noqa: E402
from gptopt.serve.client import Draining, EngineClient  # noqa: E402
from gptopt.serve.guard import MAX_BODY_BYTES  # noqa: E402
from gptopt.serve.protocol import EXAMPLE_BODY, MAX_PROMPTS, MAX_STOP, MAX_STOP_CHARS  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402
from gptopt.utils.errors import UserError  # noqa: E402

PROMPT = "def parse_args(self, args=None):"
COMMANDS_DOC = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
# Rules no server may let freeze it: regular expressions that backtrack exponentially (their repeats
# bounded, as every rule's must be), and such text as a plain term (matched literally, so harmless).
HOSTILE_BLOCKLIST = ("re:(a|a){1,60}$\nre:(a{1,20}){1,20}$\nre:(x{1,20}x{1,20}){1,20}y\nre:(.{0,20}a){20}\n"
                     "(a+)+$\nforbidden\n")


@contextlib.contextmanager
def running(tokenizer: Any, decode_delay: float = 0.0, **overrides: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, app) of a live server with the debug model (the same weights every time)."""
    torch.manual_seed(0)
    model = GPT(preset("debug", vocab_size=tokenizer.get_vocab_size())).eval()
    app = create_app(ServeConfig(**{"model": "debug", "device": "cpu", **overrides}), model=model, tokenizer=tokenizer)
    if decode_delay:  # slow requests down so several overlap, as under real load
        gen, decode = app.state.engine.generator, app.state.engine.generator.decode

        def slow_decode(*args: Any) -> torch.Tensor:
            time.sleep(decode_delay)
            return decode(*args)

        gen.decode = slow_decode
    with serve_in_thread(app) as server:
        app.state.server = server
        yield f"http://127.0.0.1:{server.port}", app


@pytest.fixture(scope="module")
def server(debug_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    with running(debug_tokenizer, max_batch_size=4, chat_template="plain") as s:  # plain: the documented chat curl
        yield s


@pytest.fixture(scope="module")
def url(server: tuple[str, Any]) -> str:
    return server[0]


def completion(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, **body}, timeout=60)


def sse(response: httpx.Response) -> list[Any]:
    """The data frames of an SSE body, parsed; '[DONE]' stays a string."""
    frames = [line[6:] for line in response.content.decode("utf-8").split("\n\n") if line.startswith("data: ")]
    assert response.content.decode("utf-8").endswith("data: [DONE]\n\n")
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# -- endpoints ---------------------------------------------------------------------------------


def test_generate_playbook_schema(url: str) -> None:
    r = httpx.post(f"{url}/generate", json={"prompt": PROMPT, "max_length": 24, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"generated_text", "inference_time"}
    assert body["generated_text"].startswith(PROMPT) and len(body["generated_text"]) > len(PROMPT)
    assert 0 < body["inference_time"] < 60


def test_generate_serves_the_least_max_length_its_schema_admits(url: str, debug_tokenizer: Any) -> None:
    # max_length counts the prompt, as in Hugging Face generate, which refuses one the prompt already fills
    schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]["GenerateRequest"]
    least = schema["properties"]["max_length"]["minimum"]
    assert len(debug_tokenizer.encode("x").ids) == 1
    r = httpx.post(f"{url}/generate", json={"prompt": "x", "max_length": least, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"].startswith("x")
    n = len(debug_tokenizer.encode(PROMPT).ids)
    err = assert_openai_error(httpx.post(f"{url}/generate", json={"prompt": PROMPT, "max_length": n}), 400)
    assert err["param"] == "max_length" and f"at least {n + 1}" in err["message"]


def as_floats(value: Any) -> Any:
    """The same JSON numbers written as floats (5 -> 5.0), booleans left alone."""
    if isinstance(value, list):
        return [as_floats(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def test_whole_numbers_written_as_floats_are_integers(url: str) -> None:
    # JSON has one kind of number: a client may write 5 as 5.0 (JavaScript's JSON.stringify never does,
    # Python's json.dumps of a float does), and JSON Schema's `integer` admits it.
    body = {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 5, "logprobs": 1, "top_k": 40, "seed": 3}
    r = completion(url, **{k: as_floats(v) for k, v in body.items()})
    assert r.status_code == 200, r.text
    texts = [(c["text"], c["finish_reason"]) for c in completion(url, **body).json()["choices"]]
    assert [(c["text"], c["finish_reason"]) for c in r.json()["choices"]] == texts and len(texts) == 4
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "max_completion_tokens": 4,
            "logprobs": True, "top_logprobs": 2, "seed": 1}
    replies = [httpx.post(f"{url}/v1/chat/completions", json=b, timeout=60)
               for b in (chat, {k: as_floats(v) for k, v in chat.items()})]
    assert replies[1].status_code == 200, replies[1].text
    assert replies[1].json()["choices"] == replies[0].json()["choices"]
    generated = [httpx.post(f"{url}/generate", json={"prompt": PROMPT, "max_length": length, "temperature": 0},
                            timeout=60) for length in (24, 24.0)]
    assert generated[1].status_code == 200 and generated[1].json()["generated_text"] == generated[0].json()[
        "generated_text"]
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x", "max_tokens": 1e1}', timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 10


def test_completion_fields_usage_and_greedy_determinism(url: str, debug_tokenizer: Any) -> None:
    r = completion(url, max_tokens=8, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "debug"
    assert abs(body["created"] - time.time()) < 60
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(debug_tokenizer.encode(PROMPT).ids)
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert completion(url, max_tokens=8, temperature=0).json()["choices"][0]["text"] == choice["text"]


def test_batched_greedy_completions_equal_the_generators(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    # The engine and `gptopt generate` share one end-of-sequence rule: the same tokens, ending for
    # the same reason (here the model's context, 64 tokens, when max_tokens is null).
    url, app = server
    prompts = [PROMPT, "import os", "x = [1, 2, 3]\n" * 3]
    r = completion(url, prompt=prompts, max_tokens=None, temperature=0).json()
    gen = Generator(app.state.engine.generator.model, resolve("cpu"), max_batch_size=len(prompts))
    eot = debug_tokenizer.token_to_id("<|endoftext|>")
    params = SamplingParams(max_new_tokens=1024, temperature=0, stop_token_ids=(eot,))
    expected = complete(gen, [debug_tokenizer.encode(p).ids for p in prompts], params)
    assert [(c["text"], c["finish_reason"]) for c in r["choices"]] == [
        (debug_tokenizer.decode(ids), reason) for ids, reason in expected]
    assert r["usage"]["completion_tokens"] == sum(len(ids) for ids, _ in expected)


def test_max_len_bounds_every_request_and_sizes_the_kv_cache(debug_tokenizer: Any) -> None:
    # --max_len: a long-context model served with shorter KV-cache slots; a request is held to it.
    with running(debug_tokenizer, max_batch_size=2, max_len=24) as (url, app):
        gen = app.state.engine.generator
        assert gen.max_len == 24 and gen.cache.k[0].shape[2] == 24 < gen.model.config.block_size
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 24
        n = len(debug_tokenizer.encode(PROMPT).ids)
        r = completion(url, max_tokens=None, temperature=0, stop=None).json()
        assert r["usage"]["completion_tokens"] <= 24 - n
        if r["choices"][0]["finish_reason"] == "length":  # no end-of-text met: the slot's length ended it
            assert r["usage"]["completion_tokens"] == 24 - n
        err = assert_openai_error(completion(url, max_tokens=25 - n), 400, "context_length_exceeded")
        assert "context of 24 tokens" in err["message"]
    with pytest.raises(UserError, match="--max_len 65 exceeds the model's context of 64 tokens"):
        create_app(ServeConfig(model="debug", device="cpu", max_len=65), model=GPT(preset("debug")),
                   tokenizer=debug_tokenizer)


def test_a_tokenizer_without_end_of_text_is_served_as_it_is() -> None:
    from tokenizers import Tokenizer, models

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    model = GPT(preset("debug")).eval()
    create_app(ServeConfig(model="debug", device="cpu", max_batch_size=1), model=model, tokenizer=words)
    assert words.get_vocab_size() == 3 and words.token_to_id("<|endoftext|>") is None  # no token added


def test_prompt_list_and_n_give_every_choice_and_seeds_reproduce(url: str) -> None:
    body = {"prompt": ["import os", "class A:"], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    first, again = completion(url, **body).json(), completion(url, **body).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert first["choices"] == again["choices"]  # same seed, same samples
    assert len({c["text"] for c in first["choices"]}) > 1  # each choice draws its own sample


def test_echo_prepends_the_prompt(url: str) -> None:
    text = completion(url, max_tokens=4, temperature=0, echo=True).json()["choices"][0]["text"]
    assert text.startswith(PROMPT)


def test_streaming_frames_done_usage_and_same_text_as_non_streaming(url: str) -> None:
    body = {"max_tokens": 20, "temperature": 1.0, "seed": 3}
    plain = completion(url, **body).json()
    r = completion(url, stream=True, stream_options={"include_usage": True}, **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse(r)  # decodes the whole body as strict UTF-8
    assert frames[-1] == "[DONE]"
    chunks, usage = frames[:-2], frames[-2]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    for c in chunks:
        assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"]
        assert "\ufffd" not in c["choices"][0]["text"] or "\ufffd" in plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == plain["choices"][0]["finish_reason"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]


def byte_token(tokenizer: Any, b: int) -> int:
    """The id of the single-byte token for byte b in a byte-level BPE (GPT-2's byte -> character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [x for x in range(256) if x not in printable]
    char = chr(b) if b in printable else chr(256 + others.index(b))
    return tokenizer.token_to_id(char)


def test_streaming_splits_text_only_between_whole_characters(debug_tokenizer: Any) -> None:
    script = [byte_token(debug_tokenizer, b) for b in "aé☕b".encode()]  # é and ☕ span 2 and 3 byte tokens
    with running(debug_tokenizer) as (url, app):
        gen = app.state.engine.generator
        gen.sample = lambda logits, params, histories, *_, **__: [script[len(h) - n_prompt] for h in histories]
        n_prompt = len(debug_tokenizer.encode(PROMPT).ids)
        frames = sse(completion(url, stream=True, max_tokens=len(script)))
    texts = [f["choices"][0]["text"] for f in frames[:-1]]
    assert [t for t in texts if t] == ["a", "é", "☕", "b"]
    assert frames[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_ends_the_text_before_it(url: str) -> None:
    full = completion(url, max_tokens=16, temperature=0).json()["choices"][0]["text"]
    stop = next((full[i : i + 2] for i in range(2, len(full) - 1) if full[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip("greedy text has no usable stop string")
    r = completion(url, max_tokens=16, temperature=0, stop=[stop, "@@never@@"]).json()
    assert r["choices"][0] == {**r["choices"][0], "text": full[: full.find(stop)], "finish_reason": "stop"}


def first_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """Where the earliest of `stops` starts in `text` (its length if none does), and which one it is."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found) if found else (len(text), None)


def test_an_lm_eval_batch_of_32_prompts_with_6_stop_strings_is_served(url: str) -> None:
    # lm-evaluation-harness's usual settings: --batch_size 32 sends 32 prompts in one request, and a
    # generation task's stop list comes with the end-of-text it adds.
    prompts = [f"x{i} = {i} * " for i in range(32)]
    body = {"prompt": prompts, "max_tokens": 12, "temperature": 1.0, "seed": 11}  # each choice its own seed
    plain = completion(url, **body).json()["choices"]
    full = [c["text"] for c in plain]
    stops: list[str] = []  # six printable ones, each the first found in some choice's text, past its start
    for text in full:
        for k in range(1, len(text) - 2):
            new, trial = text[k : k + 3], [*stops, text[k : k + 3]]
            if new.isascii() and new.isprintable() and new not in stops and all(
                    any(first_stop(t, trial)[1] == s for t in full) for s in trial):
                stops = trial
                break
        if len(stops) == 6:
            break
    assert len(stops) == 6, full
    r = completion(url, **body, stop=stops)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(32))
    for before, choice in zip(plain, choices, strict=True):
        cut, stop = first_stop(before["text"], stops)
        assert choice["text"] == before["text"][:cut]
        assert choice["finish_reason"] == ("stop" if stop else before["finish_reason"])


def test_models_health_ready_docs(url: str) -> None:
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "debug"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    assert httpx.get(f"{url}/docs").status_code == 200
    assert "/v1/completions" in httpx.get(f"{url}/openapi.json").json()["paths"]


def test_metrics_expose_histograms_gauges_and_counters(url: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    completion(url, max_tokens=4)
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("gptopt_time_to_first_token_seconds", "gptopt_inter_token_latency_seconds",
                 "gptopt_e2e_request_latency_seconds", "gptopt_queue_time_seconds"):
        assert families[name].type == "histogram"
        count = next(s.value for s in families[name].samples if s.name == f"{name}_count")
        assert count > 0, name
    assert families["gptopt_requests_running"].samples[0].value == 0
    assert families["gptopt_requests_waiting"].samples[0].value == 0
    assert families["gptopt_generation_tokens"].samples[0].value > 0
    assert families["gptopt_prompt_tokens"].samples[0].value > 0
    ok = [s for s in families["gptopt_requests"].samples
          if s.labels == {"route": "/v1/completions", "status": "200"} and s.name.endswith("_total")]
    assert ok and ok[0].value > 0
    assert not [name for name in families if name.startswith("gptopt_device_memory")]  # CUDA only


def requests_counted(url: str, route: str) -> dict[str, float]:
    """/metrics' request counter of one route, by status code."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    return {s.labels["status"]: s.value for s in families["gptopt_requests"].samples
            if s.name.endswith("_total") and s.labels["route"] == route}


def test_an_upload_the_client_abandons_is_counted_499_not_500(url: str) -> None:
    # A server error alert (rate of 5xx) must not fire because a client went away mid-upload.
    before = requests_counted(url, "/v1/completions")
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "def f(')
    wait_for(lambda: sum(requests_counted(url, "/v1/completions").values()) > sum(before.values()))
    after = requests_counted(url, "/v1/completions")
    assert {code: n - before.get(code, 0) for code, n in after.items() if n != before.get(code, 0)} == {"499": 1}


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


# -- bad input: 4xx with OpenAI's error body, never a 5xx ----------------------------------------


@pytest.mark.parametrize("body, status, code", [
    ({"prompt": ""}, 400, None),
    ({"prompt": []}, 400, None),
    ({"prompt": ["ok", ""]}, 400, None),
    ({"prompt": "word " * 200}, 400, "context_length_exceeded"),
    ({"prompt": "hello", "max_tokens": 64}, 400, "context_length_exceeded"),
    ({"prompt": "hello", "temperature": -0.5}, 400, None),
    ({"prompt": "hello", "top_p": 0}, 400, None),
    ({"prompt": "hello", "top_p": 1.5}, 400, None),
    ({"prompt": "hello", "n": 100}, 400, None),
    ({"prompt": "hello", "max_tokens": 5000}, 400, None),
    ({"prompt": "hello", "max_tokens": 0}, 400, None),
    ({"prompt": 5}, 400, None),
    ({"prompt": "hello", "max_tokens": "ten"}, 400, None),
    ({"prompt": "hello", "stream": "yes"}, 400, None),
    ({"prompt": "hello", "temperature": True}, 400, None),
    ({"prompt": "hello", "n": 1.5}, 400, None),
    ({"prompt": "hello", "max_tokens": True}, 400, None),
    ({"prompt": "hello", "n": "2"}, 400, None),
    ({"prompt": [1.5, 2]}, 400, None),
    ({"prompt": "hello", "stop": ["a"] * (MAX_STOP + 1)}, 400, None),
    ({"prompt": "hello", "stop": ["x" * MAX_STOP_CHARS] * 5}, 400, None),
    ({"prompt": "hello", "stop": [""]}, 400, None),
    ({"prompt": "hello", "logprobs": 21}, 400, None),
    ({"prompt": [1, 10**6]}, 400, "invalid_token_id"),
    ({"prompt": "hello", "model": "gpt-4"}, 404, "model_not_found"),
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, 400, None),
    ({}, 400, None),
])
def test_bad_completion_requests_get_4xx_openai_errors(url: str, body: dict[str, Any], status: int,
                                                       code: str | None) -> None:
    err = assert_openai_error(httpx.post(f"{url}/v1/completions", json=body, timeout=30), status, code)
    if status == 400 and code is None and body:
        assert err["param"] is not None


def test_a_prompt_is_read_as_the_tokenizer_reads_it_on_the_event_loop_or_off_it(url: str, debug_tokenizer: Any) -> None:
    """A short prompt is encoded on the event loop, a long one on a thread: both as the tokenizer does."""
    from gptopt.serve.routes import INLINE_ENCODE_CHARS

    line = "def f(x): return x\n"
    long, short = line * (INLINE_ENCODE_CHARS // len(line) + 1), line * 2
    assert len(long) > INLINE_ENCODE_CHARS >= len(short)
    for prompt in (long, short):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True}, timeout=30)
        n = len(debug_tokenizer.encode(prompt).ids)
        if r.status_code == 200:
            assert r.json()["usage"]["prompt_tokens"] == n and r.json()["choices"][0]["text"].startswith(prompt)
        else:  # longer than the debug model's context: the refusal counts its tokens
            assert f"the prompt is {n} tokens" in assert_openai_error(r, 400, "context_length_exceeded")["message"]


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"prompt": "x", "temperature": NaN}', b'{"prompt": '])
def test_malformed_json_gets_400(url: str, raw: bytes) -> None:
    r = httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "ok", "stop": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "ok", "model": "\\ud800"}'),
    ("/generate", b'{"prompt": "\\ud800"}'),
])
def test_lone_surrogates_get_400(url: str, path: str, raw: bytes) -> None:
    # Valid JSON, but no text: the tokenizer cannot take it (it was a 500).
    r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    err = assert_openai_error(r, 400, "invalid_unicode")
    assert "surrogate" in err["message"] and err["param"]


@pytest.mark.parametrize("body", [
    {"n": -1}, {"n": 0}, {"n": 9}, {"n": 1.5}, {"n": "2"}, {"best_of": 5}, {"best_of": -3}, {"logprobs": 0},
    {"logprobs": -1}, {"logprobs": True}, {"max_tokens": 10**30}, {"max_tokens": -5}, {"max_tokens": None},
    {"temperature": 1e-300}, {"temperature": 1e308}, {"top_p": 1e-300}, {"top_k": 10**30}, {"top_k": 0},
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 10}, {"seed": -1}, {"seed": 2**64}, {"seed": 2**63 - 1},
    {"stop": [["a"]]}, {"stop": {"a": 1}}, {"stop": ["x" * 300]}, {"stop": []}, {"stop": None}, {"stop": "\n"},
    {"prompt": [["nested"]]}, {"prompt": [1, 2]}, {"prompt": {"text": "x"}}, {"prompt": None},
    {"prompt": [10**30]}, {"prompt": [[1], []]}, {"prompt": [1, "a"]}, {"prompt": [0] * 64}, {"logprobs": 10**30},
    {"max_tokens": 0, "echo": True, "logprobs": 0, "stream": True}, {"logprobs": 20, "echo": True, "n": 8},
    {"prompt": "<|endoftext|>"}, {"prompt": "\x00\x01"}, {"prompt": "é" * 40}, {"prompt": "x", "echo": True, "n": 8},
    {"stream_options": {"include_usage": "yes"}}, {"stream_options": []}, {"stream": True, "n": 2, "echo": True},
    {"model": 5}, {"model": None}, {"suffix": "x", "user": "u", "presence_penalty": 2, "logit_bias": {"1": 5}},
])
def test_hostile_completion_fields_never_get_a_5xx(url: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "top_p": -Infinity}',
                                 b'{"prompt": "x", "repetition_penalty": NaN}',
                                 b'{"prompt": "x", "temperature": 1e999}',
                                 b'{"prompt": "x", "max_tokens": 1.5e0}', b'{"prompt": "x"} trailing', b"\xff\xfe",
                                 b'"just a string"', b"null", b""])
def test_non_numbers_and_non_objects_get_400(url: str, raw: bytes) -> None:
    generate_too = not any(name in raw for name in (b"top_p", b"repetition_penalty", b"max_tokens"))
    for path in ("/v1/completions", "/generate")[: 2 if generate_too else 1]:
        r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert_openai_error(r, 400)


@pytest.mark.parametrize("raw, why", [
    (b'{"prompt": "caf\xe9"}', "not UTF-8"), (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "cannot be read"), (b"", "empty"),
    (b"[1, 2]", "not an object"), (b'{"prompt": "x",}', "not valid JSON"),
])
def test_an_unreadable_body_is_told_why(url: str, raw: bytes, why: str) -> None:
    for path in ("/v1/completions", "/generate"):
        err = assert_openai_error(httpx.post(f"{url}{path}", content=raw, timeout=30), 400, "invalid_json")
        assert why in err["message"] and EXAMPLE_BODY in err["message"]


def test_a_body_that_is_not_json_is_told_so_whatever_its_content_type(url: str) -> None:
    for ctype in ("application/json", "application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(f"{url}/generate", content=b"prompt=hello", headers={"content-type": ctype})
        err = assert_openai_error(r, 400, "invalid_json")
        assert err["message"].startswith("the request body is not valid JSON") and '{"prompt"' in err["message"]
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                   headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert r.status_code == 200, r.text


def documented_curl_lines() -> list[str]:
    """The curl commands of the command reference's serve section, as written."""
    section = COMMANDS_DOC.read_text(encoding="utf-8").split("\n## serve", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("curl ")]


def test_the_documented_curl_examples_work_as_written(url: str) -> None:
    lines = documented_curl_lines()
    assert len(lines) >= 2
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    port = url.rsplit(":", 1)[1]
    for line in lines:
        argv = [a.replace("localhost:8000", f"127.0.0.1:{port}") for a in shlex.split(line)]
        out = subprocess.run(argv + ["--write-out", "\n%{http_code}", "--max-time", "60"], capture_output=True,
                             text=True, check=True, env={"GPTOPT_API_KEY": "", "PATH": "/usr/bin:/bin"}).stdout
        body, status = out.rsplit("\n", 1)
        assert status == "200", (line, body)
        if "stream" in line:
            assert body.rstrip().endswith("data: [DONE]"), body
        else:
            assert json.loads(body)


def test_a_request_that_can_never_fit_gets_400_not_429(debug_tokenizer: Any) -> None:
    # An OpenAI client retries a 429 by itself: one that could never succeed must not get one.
    with running(debug_tokenizer, max_batch_size=1, max_queue=1) as (url, _):
        err = assert_openai_error(completion(url, prompt=["a", "b", "c"], max_tokens=2), 400, "request_too_large")
        assert "3 sequences" in err["message"] and "2 (--max_batch_size 1 + --max_queue 1)" in err["message"]
        assert_openai_error(completion(url, prompt="a", n=3, max_tokens=2), 400, "request_too_large")
        r = completion(url, prompt=["a", "b"], max_tokens=2)  # exactly the capacity: served
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_openapi_documents_what_the_server_sends(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, api_key="k", max_tokens_limit=100) as (url, _):
        doc = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer k"}).json()
    paths, schemas = doc["paths"], doc["components"]["schemas"]
    assert "422" not in json.dumps(paths) and "HTTPValidationError" not in schemas
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        responses = paths[path]["post"]["responses"]
        for status in ("400", "401", "413", "429", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorBody"}, (path, status)
        assert paths[path]["post"]["security"] == [{"bearer": []}]
    assert "text/event-stream" in paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "security" not in paths["/health"]["get"] and "security" not in paths["/ready"]["get"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    request = schemas["CompletionRequest"]["properties"]
    text, listed, ids, id_lists = request["prompt"]["anyOf"]
    assert text["minLength"] == 1 and listed["minItems"] == 1 and listed["items"]["minLength"] == 1
    assert ids["items"] == {"type": "integer", "minimum": 0} and id_lists["items"]["minItems"] == 1
    assert next(a for a in request["max_tokens"]["anyOf"] if a["type"] == "integer")["maximum"] == 100
    assert next(a for a in request["logprobs"]["anyOf"] if a["type"] == "integer") == {
        "type": "integer", "minimum": 0, "maximum": 20}
    assert schemas["GenerateRequest"]["properties"]["prompt"]["minLength"] == 1


def test_openapi_without_a_key_has_no_security(url: str) -> None:
    doc = httpx.get(f"{url}/openapi.json").json()
    assert "securitySchemes" not in doc["components"] and "401" not in json.dumps(doc["paths"])


def test_oversized_body_gets_413(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}',
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": PROMPT, "max_length": 3},
                                  {"prompt": "word " * 200}, {"prompt": "x", "temperature": -1}])
def test_bad_generate_requests_get_400(url: str, body: dict[str, Any]) -> None:
    assert_openai_error(httpx.post(f"{url}/generate", json=body), 400)


def test_unknown_route_is_a_404_in_the_same_shape(url: str) -> None:
    assert_openai_error(httpx.get(f"{url}/v1/nothing"), 404)


# -- the engine under load -----------------------------------------------------------------------


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
    every core for a model above SMALL_MODEL_FLOPS, solo_threads for every step of one under it.
    Greedy tokens equal the eager one-at-a-time path's."""
    from gptopt.serve import engine as engine_module
    from gptopt.serve.engine import Engine

    if not small:
        monkeypatch.setattr(engine_module, "SMALL_MODEL_FLOPS", 0)

    short, long = [5, 17, 99], [8, 4, 200, 31]
    params = SamplingParams(temperature=0, max_new_tokens=12)
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


def stream_through_a_sigterm(url: str, app: Any) -> list[Any]:
    """The frames of a 30-token greedy stream whose server gets SIGTERM after the first (what uvicorn's
    signal handler calls); meanwhile a new request must get 503 draining."""
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        app.state.server.handle_exit(signal.SIGTERM, None)
        assert app.state.engine.draining
        with pytest.raises(Draining):  # at the engine: uvicorn may already be closing the listener
            app.state.engine.submit([1], SamplingParams(max_new_tokens=1), lambda event: None)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in [first, *rest[:-1]]]


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
    with pytest.raises(ValueError, match="lower --max_batch_size"):
        create_app(ServeConfig(model="debug", device="cpu"), model=model, tokenizer=debug_tokenizer)


def test_loads_a_training_output_dir_once_at_start_up(trained_out: Path) -> None:
    app = create_app(ServeConfig(model=str(trained_out), device="cpu", max_batch_size=2))
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == trained_out.name
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "import os", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# -- auth, CORS, blocklist -------------------------------------------------------------------------


def test_api_key_required_when_set(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, api_key="s3cret") as (url, _):
        assert_openai_error(completion(url, max_tokens=2), 401, "invalid_api_key")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer wrong"})
        assert_openai_error(r, 401)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{url}/ready").status_code == 200


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/nowhere"])
def test_api_key_guards_every_route_but_the_probes(debug_tokenizer: Any, path: str) -> None:
    with running(debug_tokenizer, api_key="s3cret") as (url, _):
        assert_openai_error(httpx.get(f"{url}{path}"), 401, "invalid_api_key")
        assert_openai_error(httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}), 401)
        r = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == (404 if path == "/nowhere" else 200)


def test_api_key_from_the_environment(debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTOPT_API_KEY", "from-env")
    with running(debug_tokenizer) as (url, _):
        assert_openai_error(httpx.post(f"{url}/generate", json={"prompt": "x"}), 401)
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert r.status_code == 200


def test_cors_only_for_the_given_origin(url: str, debug_tokenizer: Any) -> None:
    assert "access-control-allow-origin" not in httpx.get(f"{url}/health", headers={"Origin": "http://a.b"}).headers
    with running(debug_tokenizer, cors_origin="http://a.b") as (cors_url, _):
        r = httpx.options(f"{cors_url}/v1/completions", headers={
            "Origin": "http://a.b", "Access-Control-Request-Method": "POST"})
        assert r.headers["access-control-allow-origin"] == "http://a.b"


def test_blocklist_refuses_prompts_and_cuts_output(url: str, debug_tokenizer: Any, tmp_path: Path) -> None:
    sampled = {"max_tokens": 20, "temperature": 1.0, "seed": 1}
    full = completion(url, **sampled).json()["choices"][0]["text"]
    piece = next((full[i : i + 2] for i in range(4, len(full) - 1)
                  if full[i : i + 2].isprintable() and full[i : i + 2].strip() == full[i : i + 2]
                  and full[i] != "#" and full[i : i + 2].lower() not in PROMPT.lower()), None)
    assert piece is not None, full
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text(f"# comment\nforbidden\nre:secr[e3]t\n{piece}\n")
    with running(debug_tokenizer, blocklist=str(blocklist)) as (bl_url, _):
        assert_openai_error(completion(bl_url, prompt="a ForBidden word"), 400, "content_filter")
        assert_openai_error(completion(bl_url, prompt="my secr3t"), 400, "content_filter")
        choice = completion(bl_url, **sampled).json()["choices"][0]
        assert choice["finish_reason"] == "content_filter"
        assert choice["text"] == full[: full.lower().find(piece.lower())]
        frames = sse(completion(bl_url, stream=True, **sampled))
        assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == choice["text"]
        assert frames[-2]["choices"][0]["finish_reason"] == "content_filter"


def test_text_filter_holds_back_what_could_still_match() -> None:
    f = TextFilter(Blocklist(["bad"]))
    assert f.push("a b") == ("", False)  # "a b" could be the start of nothing, but holdback is 3
    assert f.push("a") == ("a", False)
    assert f.push("D!") == (" ", True)  # "baD" spans three pushes; the text stops before it
    g = TextFilter(Blocklist(patterns=["z{1,3}z"]))
    assert g.push("abc") == ("", False) and g.push("", final=True) == ("abc", False)


def filtered(rules: Blocklist, pieces: list[str]) -> tuple[str, bool]:
    """What a TextFilter releases of output arriving in `pieces`, the last one ending it; whether it cut it."""
    text_filter, released = TextFilter(rules), ""
    for i, piece in enumerate(pieces):
        out, cut = text_filter.push(piece, final=i == len(pieces) - 1)
        released += out
        if cut:
            return released, True
    return released, False


@pytest.mark.parametrize("rule, pieces, kept", [
    ("a{1,3}$", ["xa", "ay", "z"], "xaayz"), ("a{1,3}$", ["xa", "ay", "za"], "xaayz"),
    ("x\\Z", ["ax", "b"], "axb"), ("x\\Z", ["ax", "bx"], "axb"),
    ("(?m)^ok$", ["no\nok", "ay"], "no\nokay"), ("(?m)^ok$", ["no\nok", "\nmore"], "no\n"),
    ("\\bcat\\b", ["the cat", "s"], "the cats"), ("\\bcat\\b", ["the cat", " sat"], "the "),
    ("cat(?!s)", ["the cat", "s"], "the cats"), ("cat(?!s)", ["the cat", "!"], "the "),
])
def test_anchors_and_lookaheads_are_decided_by_the_text_that_follows(rule: str, pieces: list[str], kept: str) -> None:
    # `$` and `\Z` mean the end of the output, not of the text generated so far; `\b` and a lookahead
    # wait for the characters they look at.
    assert filtered(Blocklist(patterns=[rule]), pieces) == (kept, kept != "".join(pieces))


@pytest.mark.parametrize("rule, text, kept", [("x{12}", "ab" + "x" * 12 + "cd", "ab"),
                                              ("ab(?=c{12})", "xab" + "c" * 12 + "!", "x")])
def test_a_match_longer_than_its_rule_never_releases_its_start(rule: str, text: str, kept: str) -> None:
    # the rule's text is shorter than the text it matches (or reads): a character at a time, nothing of it
    assert filtered(Blocklist(patterns=[rule]), list(text)) == (kept, True)


def test_a_streamed_reply_never_shows_the_start_of_a_match_longer_than_its_rule(
        debug_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text("re:x{6}\n")
    script = [byte_token(debug_tokenizer, b) for b in b"ab" + b"x" * 6 + b"cd"]
    with running(debug_tokenizer, blocklist=str(path)) as (url, app):
        gen = app.state.engine.generator
        gen.sample = lambda logits, params, histories, *_, **__: [script[len(h) - n_prompt] for h in histories]
        n_prompt = len(debug_tokenizer.encode(PROMPT).ids)
        frames = sse(completion(url, stream=True, max_tokens=len(script)))
    assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == "ab"
    assert frames[-2]["choices"][0]["finish_reason"] == "content_filter"


def test_an_end_anchored_rule_cuts_only_outputs_that_end_in_a_match(url: str, debug_tokenizer: Any,
                                                                     tmp_path: Path) -> None:
    sampled = {"prompt": [PROMPT] * 4, "n": 8, "max_tokens": 10, "temperature": 1.0, "seed": 5}
    full = [(c["text"], c["finish_reason"]) for c in completion(url, **sampled).json()["choices"]]
    # a letter that ends some outputs and stands inside others
    ends = {t[-1] for t, _ in full if t and t[-1].isascii() and t[-1].isalpha()}
    assert ends, full
    letter = max(sorted(ends), key=lambda c: sum(c in t[:-1].lower() for t, _ in full))
    rule = f"{letter}{{1,3}}$"
    path = tmp_path / "blocklist.txt"
    path.write_text(f"re:{rule}\n")
    with running(debug_tokenizer, blocklist=str(path)) as (bl_url, _):
        got = [(c["text"], c["finish_reason"]) for c in completion(bl_url, **sampled).json()["choices"]]
    expected = []
    for text, reason in full:
        m = re.search(rule, text, re.IGNORECASE)
        expected.append((text[: m.start()], "content_filter") if m else (text, reason))
    assert got == expected
    assert any(letter in t.lower() and not re.search(rule, t, re.IGNORECASE) for t, _ in full)  # left whole


def test_blocklist_lines_are_plain_text_unless_prefixed_re(tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text("# a comment\n\n  a.c  \n(a+)+$\nre:secr[e3]t\nre: x\\d{2}\n", encoding="utf-8")
    blocklist = load_blocklist(str(path))
    assert blocklist.terms == ("a.c", "(a+)+$") and blocklist.sources == ("secr[e3]t", "x\\d{2}")
    found = {text: blocklist.find(text, timeout=5) for text in ["abc", "xA.Cx", "aaa(A+)+$", "my SECR3T", "x42", "x4"]}
    assert found == {"abc": None, "xA.Cx": 1, "aaa(A+)+$": 3, "my SECR3T": 3, "x42": 0, "x4": None}


@pytest.mark.parametrize("line, problem", [
    ("re:(unclosed", "not a valid regular expression"), ("re:a*", "matches the empty string"),
    ("re:", "matches the empty string"), ("re:secr(e)+t", "has no longest match"), ("re:x(?=.*y)", "no longest"),
    ("re:a{2000}", "may match 2000 characters"), ("re:\\p{L}x", "Python's re does not read"),
    ("x" * 1001, "the term is 1001 characters"),
])
def test_a_bad_blocklist_line_is_named(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text(f"fine\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"blocklist.txt:2: .*{problem}"):
        load_blocklist(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_blocklist(str(tmp_path / "missing.txt"))


def test_a_regex_past_its_time_limit_counts_as_a_match() -> None:
    slow = Blocklist(patterns=["(a|a){1,60}$"], timeout=0.2)  # exponential: 2**40 ways to fail on 40 a's and "!"
    assert slow.first_blocked(["fine", "b" * 40]) is None
    with pytest.raises(CheckTimeout, match="longer than 0.2 s"):
        slow.first_blocked(["fine", "a" * 40 + "!"])
    out = TextFilter(slow, timeout=0.2)  # generated text: cut where nothing was released yet
    assert out.push("bb") == ("", False) and out.push("a" * 40 + "!") == ("", True)


def test_a_pathological_prompt_costs_only_its_own_request(debug_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text(HOSTILE_BLOCKLIST, encoding="utf-8")
    with running(debug_tokenizer, blocklist=str(path)) as (url, app):
        blocklist = app.state.engine.blocklist
        blocklist.timeout = 3.0  # room for /health to answer while the check runs, on a busy machine
        check, started, done = blocklist.first_blocked, threading.Event(), threading.Event()

        def observed(texts: list[str]) -> int | None:
            started.set()
            try:
                return check(texts)
            finally:
                done.set()

        blocklist.first_blocked = observed
        result: dict[str, Any] = {}
        slow = threading.Thread(target=lambda: result.update(r=completion(url, prompt="a" * 40 + "!")))
        slow.start()
        assert started.wait(timeout=30)
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200 and not done.is_set()  # answered while the regex still ran
        slow.join(timeout=60)
        err = assert_openai_error(result["r"], 400, "content_filter")
        assert "within 3 s" in err["message"]
        assert completion(url, max_tokens=2).status_code == 200  # the server goes on


# -- clients ----------------------------------------------------------------------------------------


def test_openai_client_round_trip(url: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    assert [m.id for m in client.models.list()] == ["debug"]
    c = client.completions.create(model="debug", prompt=PROMPT, max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model="debug", prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="debug", prompt=PROMPT, max_tokens=6, temperature=-1)
    assert e.value.status_code == 400


@pytest.fixture(scope="module")
def hostile_server(debug_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("blocklist") / "hostile.txt"
    path.write_text(HOSTILE_BLOCKLIST, encoding="utf-8")
    with running(debug_tokenizer, max_batch_size=4, max_queue=4, blocklist=str(path),
                 chat_template="plain") as (url, _):
        yield url


REQUEST_LIMIT_S = 10  # guards against hangs only: every request here answers in well under a second


@pytest.mark.parametrize("examples", [100, pytest.param(2000, marks=pytest.mark.slow)])
def test_schemathesis_finds_no_server_errors(hostile_server: str, examples: int) -> None:
    # Every request the schema admits (and many it does not) gets a 2xx or a 4xx in OpenAI's shape,
    # in bounded time, from a server whose blocklist holds exponentially backtracking expressions.
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    url = hostile_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case: Any) -> None:
        response = case.call(base_url=url, timeout=REQUEST_LIMIT_S)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()


# -- start-up: refused before the model loads ------------------------------------------------------


def serve_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of `gptopt serve ARGV`, which must exit 2 before loading --model (it does not exist)."""
    from gptopt import cli

    capsys.readouterr()
    assert cli.main(["serve", "--model", "/nonexistent/model", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gptopt serve: error: "), err
    return err


def test_an_empty_api_key_is_refused(debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert "--api_key is empty; give a key or leave the option out" in serve_refused(["--api_key", ""], capsys)
    monkeypatch.setenv("GPTOPT_API_KEY", "")  # `export GPTOPT_API_KEY=$UNSET`
    assert "GPTOPT_API_KEY is set but empty" in serve_refused([], capsys)
    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size()))
    with pytest.raises(ValueError, match="GPTOPT_API_KEY is set but empty"):
        create_app(ServeConfig(model="debug", device="cpu"), model=model, tokenizer=debug_tokenizer)


def test_quantize_int4_on_a_cpu_is_refused_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    err = serve_refused(["--quantize", "int4-weight", "--port", "0"], capsys)
    assert "int4-weight needs an NVIDIA GPU of compute capability 8.0 or newer" in err and "this cpu" in err
    assert "drop --quantize here, or use --quantize int8-weight" in err


def test_a_port_in_use_or_a_foreign_host_is_refused_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = serve_refused(["--port", str(port)], capsys)
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port N" in err
    err = serve_refused(["--host", "192.0.2.1", "--port", "0"], capsys)  # TEST-NET-1: never this machine's
    assert "--host 192.0.2.1 is not an address of this machine" in err


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


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().split(")")[-1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def test_serve_announces_and_serves_the_port_it_bound(model_dir: Path) -> None:
    """...and Ctrl-C stops it with its engine process: nothing is left running."""
    import re
    import sys

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
        children = _children(proc.pid)
        assert children  # the engine's process
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    wait_for(lambda: not any(_alive(c) for c in children), timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


def test_the_model_is_also_named_by_the_model_argument_as_given(debug_tokenizer: Any) -> None:
    """vLLM's convention: clients send the path the server was started with, and it must work."""
    with running(debug_tokenizer, model="runs/tiny/") as (url, _):
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "runs/tiny/"]
        assert completion(url, model="runs/tiny/", max_tokens=2).json()["model"] == "runs/tiny/"  # echoed
        assert completion(url, max_tokens=2).json()["model"] == "tiny"
        assert httpx.get(f"{url}/v1/models/runs/tiny/").json()["id"] == "runs/tiny/"
        err = assert_openai_error(completion(url, model="runs/other"), 404, "model_not_found")
        assert "has 'tiny' (also named 'runs/tiny/')" in err["message"]


def test_head_probes_and_one_model_by_id(url: str) -> None:
    assert httpx.head(f"{url}/health").status_code == 200
    assert httpx.head(f"{url}/ready").status_code == 200
    model = httpx.get(f"{url}/v1/models/debug").json()
    assert model == httpx.get(f"{url}/v1/models").json()["data"][0]
    assert model["id"] == "debug" and model["object"] == "model"
    err = assert_openai_error(httpx.get(f"{url}/v1/models/gpt-4"), 404, "model_not_found")
    assert "'gpt-4' does not exist" in err["message"] and err["param"] == "model"


def end_of_text_after(gen: Generator, monkeypatch: pytest.MonkeyPatch, prompt_len: int, n: int, eot: int) -> None:
    """The engine's sampler picks end-of-text as the n-th new token (as a model that ends there would)."""
    real = sampling.pick

    def pick(logits: torch.Tensor, params: Any, histories: list[list[int]], generators: Any,
             *rest: Any) -> torch.Tensor:
        t = real(logits, params, histories, generators, *rest)
        at_end = torch.tensor([len(h) - prompt_len >= n - 1 for h in histories])
        return torch.where(at_end, torch.full_like(t, eot), t)

    monkeypatch.setattr(sampling, "pick", pick)  # every Generator's: the test's engine runs only `gen`


def test_a_reply_ended_by_end_of_text_loses_no_text_to_the_blocklist_holdback(
        debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The output filter holds back the last characters a rule could still match; a reply that the
    model ends (end-of-text, as nearly every chat reply does) must still get them."""
    eot = eot_id(debug_tokenizer)
    assert eot is not None
    plen = len(debug_tokenizer.encode(PROMPT).ids)
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text("qqqqqqqqqqqqqqqqqqqq\n")  # 20 characters: 19 held back
    texts = []
    for bl in (None, str(blocklist)):
        with running(debug_tokenizer, blocklist=bl) as (url, app):
            end_of_text_after(app.state.engine.generator, monkeypatch, plen, 8, eot)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 20, "temperature": 0},
                           timeout=60).json()["choices"][0]
            assert r["finish_reason"] == "stop"
            texts.append(r["text"])
    assert texts[0] and texts[1] == texts[0]


# -- the engine in a process of its own (gptopt serve's default) -----------------------------------


def slow_decode(engine: Any) -> None:
    """EngineProcess setup: 20 ms a decode step in the child, so requests stay open while a test acts."""
    decode = engine.generator.decode

    def slow(*args: Any) -> torch.Tensor:
        time.sleep(0.02)
        return decode(*args)

    engine.generator.decode = slow


@contextlib.contextmanager
def running_apart(model_dir: Path, setup: Any = None, **overrides: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, app) of a live server of model_dir whose engine runs in a child process."""
    from gptopt.serve import app as app_module
    from gptopt.serve.engine_process import EngineProcess

    cfg = ServeConfig(**{"model": str(model_dir), "device": "cpu", "max_batch_size": 2, **overrides})
    if setup is None:
        app = create_app(cfg)
    else:  # the same app, its engine process given the test's setup
        real = app_module.EngineProcess
        app_module.EngineProcess = lambda c: EngineProcess(c, setup=setup)  # type: ignore[assignment]
        try:
            app = create_app(cfg)
        finally:
            app_module.EngineProcess = real  # type: ignore[assignment]
    assert isinstance(app.state.engine, EngineProcess)
    with serve_in_thread(app) as server:
        app.state.server = server
        yield f"http://127.0.0.1:{server.port}", app


def _alive(pid: int | None) -> bool:
    try:
        assert pid is not None
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


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
        assert _alive(pid)
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
    assert not _alive(pid)


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
        wait_for(lambda: not _alive(app.state.engine.pid) and app.state.engine.failed, timeout=15)
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
        wait_for(lambda: not _alive(app.state.engine.pid), timeout=10)


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
        wait_for(lambda: not _alive(engine.pid), timeout=15)
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
    from gptopt.serve.engine_process import _Pipe

    model = GPT(preset("debug", vocab_size=debug_tokenizer.get_vocab_size())).eval()
    engine = Engine(Generator(model, resolve("cpu"), max_batch_size=1), debug_tokenizer)
    engine.begin_drain()
    inbox, outbox = multiprocessing.Pipe(duplex=False)
    pipe = _Pipe(outbox, engine)
    submit = threading.Thread(target=pipe.submit, args=(7, [1, 2, 3], SamplingParams(max_new_tokens=4), 0),
                              daemon=True)
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


def test_every_end_of_sequence_id_of_the_model_ends_a_completion_and_ignore_eos_goes_past_it(
        model_dir: Path, debug_tokenizer: Any, tmp_path: Path) -> None:
    """A Llama 3 or Qwen3 folder names end-of-sequence ids besides end-of-text (generation_config.json's
    eos_token_id list): completions and /generate stop at each, as transformers' generate does; ignore_eos
    (vLLM's) goes on to max_tokens."""
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    ids = debug_tokenizer.encode(PROMPT).ids
    from gptopt.infer.load import load_for_inference
    net, _ = load_for_inference(str(folder), tokenizer=None, plan=resolve("cpu"))
    greedy = complete(Generator(net, resolve("cpu"), max_batch_size=1), [ids],
                      SamplingParams(temperature=0, max_new_tokens=8))[0][0]
    k = next(i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])  # a token first seen at step k
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eot_id(debug_tokenizer), greedy[k]]}))
    app = create_app(ServeConfig(model=str(folder), device="cpu", engine_process=False, max_batch_size=2))
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}"
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        stopped = completion(url, **body).json()["choices"][0]
        assert stopped["finish_reason"] == "stop" and stopped["text"] == debug_tokenizer.decode(greedy[:k])
        past = completion(url, **body, ignore_eos=True).json()
        assert past["choices"][0]["finish_reason"] == "length" and past["usage"]["completion_tokens"] == 8
        generated = httpx.post(f"{url}/generate", json={"prompt": PROMPT, "max_length": len(ids) + 8,
                                                        "temperature": 0}).json()["generated_text"]
        assert generated == PROMPT + debug_tokenizer.decode(greedy[:k])


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
