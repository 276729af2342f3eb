"""The server's routes, in-process on 127.0.0.1 port 0 with a tiny random model, through real HTTP clients:
/generate, /v1/completions' fields, streaming, stop strings, the models and the probes, the OpenAI client.

    pytest -q tests/test_serve.py

The other serve tests: test_serve_input (bad input, refusals at start-up), test_serve_engine (the engine under
load), test_serve_guard (the API key, CORS, the blocklist), test_serve_process (the engine in a process of its
own), test_serve_metrics, test_serve_sampling, test_logprobs, test_chat, test_prefix_cache, test_speculative.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import (  # noqa: E402
    PROMPT,
    assert_openai_error,
    byte_token,
    completion,
    first_stop,
    running,
    same_up_to_rounding,
    sse,
)

from gptopt.config import ServeConfig, preset  # noqa: E402
from gptopt.data.tokenizer import eot_id  # noqa: E402
from gptopt.infer.generator import Generator  # noqa: E402
from gptopt.infer.sampling import SamplingParams  # noqa: E402
from gptopt.infer.scheduler import complete  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.runtime.device import resolve  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402
from gptopt.utils.errors import UserError  # noqa: E402

# server, url: conftest.py's (a server of the debug model, plain chat template), one per module


# -- endpoints -------------------------------------------------------------------------------------


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
    # the second reuses the first's prompt from the prefix cache: a forward of another shape, whose
    # log-probabilities may differ in their last bits
    assert same_up_to_rounding(replies[1].json()["choices"], replies[0].json()["choices"])
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
    # --max_len: a long-context model served for shorter requests; a request is held to it, a block table spans
    # it, and the default pool holds --max_batch_size sequences of it (2 x 2 blocks of 16 for 24 tokens).
    with running(debug_tokenizer, max_batch_size=2, max_len=24) as (url, app):
        gen = app.state.engine.generator
        assert gen.max_len == 24 and gen.tables.shape[1] * gen.block_size < gen.model.config.block_size
        assert gen.num_blocks == 2 * 2
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 24
        n = len(debug_tokenizer.encode(PROMPT).ids)
        r = completion(url, max_tokens=None, temperature=0, stop=None).json()
        assert r["usage"]["completion_tokens"] <= 24 - n
        if r["choices"][0]["finish_reason"] == "length":  # no end-of-text met: max_len ended it
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


# -- clients ---------------------------------------------------------------------------------------


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
