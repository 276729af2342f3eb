"""Bad input to the server: every request gets a 2xx or a 4xx with OpenAI's error body, never a 5xx (schemathesis
over /openapi.json too), the OpenAPI document says what the server sends, and `gptopt serve` refuses bad
settings before it loads the model.

    pytest -q tests/test_serve_input.py
    pytest -q -m slow tests/test_serve_input.py   # schemathesis with 2,000 examples
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import (  # noqa: E402
    HOSTILE_BLOCKLIST,
    PROMPT,
    assert_openai_error,
    completion,
    running,
)

from gptopt.config import ServeConfig, preset  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.guard import MAX_BODY_BYTES  # noqa: E402
from gptopt.serve.protocol import EXAMPLE_BODY, MAX_PROMPTS, MAX_STOP, MAX_STOP_CHARS  # noqa: E402

COMMANDS_DOC = Path(__file__).resolve().parents[1] / "docs" / "commands.md"


# server, url: conftest.py's (a server of the debug model, plain chat template), one per module


# -- bad input: 4xx with OpenAI's error body, never a 5xx ------------------------------------------


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
    """The one error line of `gptopt serve ARGV`, which must exit 2 before loading --model (a folder that holds no
    model: loading it would be refused with another message)."""
    from gptopt import cli

    capsys.readouterr()
    no_model = str(Path(__file__).resolve().parent)
    assert cli.main(["serve", "--model", no_model, "--device", "cpu", *argv]) == 2
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
