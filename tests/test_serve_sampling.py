"""OpenAI's sampling fields on /v1: logit_bias, presence and frequency penalties, best_of, response_format
(constrained decoding), and the fields this server refuses rather than ignores (tools, suffix).

    pytest -q tests/test_serve_sampling.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import PROMPT, assert_openai_error, completion, running, sse  # noqa: E402

from gptopt.infer.constrain import Grammars, grammar_for  # noqa: E402
from gptopt.infer.generator import Generator  # noqa: E402
from gptopt.infer.sampling import NO_TOKEN, SamplingParams  # noqa: E402
from gptopt.infer.scheduler import complete  # noqa: E402
from gptopt.runtime.device import resolve  # noqa: E402


@pytest.fixture(scope="module")
def server(debug_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    with running(debug_tokenizer, max_batch_size=8, chat_template="plain") as s:
        yield s


@pytest.fixture(scope="module")
def url(server: tuple[str, Any]) -> str:
    return server[0]


def direct(server: tuple[str, Any], tokenizer: Any, **params: Any) -> str:
    """The served model's greedy continuation of PROMPT computed here, with these SamplingParams."""
    gen = Generator(server[1].state.engine.generator.model, resolve("cpu"), max_batch_size=1)
    eot = tokenizer.token_to_id("<|endoftext|>")
    [(ids, _)] = complete(gen, [tokenizer.encode(PROMPT).ids], SamplingParams(temperature=0, stop_token_ids=(eot,),
                                                                                **params))
    return tokenizer.decode(ids)


def test_logit_bias_pins_a_token_and_equals_the_direct_computation(server: tuple[str, Any],
                                                                    debug_tokenizer: Any) -> None:
    url = server[0]
    token = debug_tokenizer.token_to_id("x") or 42
    r = completion(url, max_tokens=8, temperature=1.0, seed=1, logit_bias={str(token): 100})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == debug_tokenizer.decode([token] * 8)
    # A greedy reply with its favourite tokens pushed down: the same reply as the sampler computes it here.
    plain = debug_tokenizer.encode(completion(url, max_tokens=8, temperature=0).json()["choices"][0]["text"]).ids
    bias = {str(t): -100 for t in set(plain[:2])}
    r = completion(url, max_tokens=8, temperature=0, logit_bias=bias)
    expected = direct(server, debug_tokenizer, max_new_tokens=8, logit_bias=[(int(t), b) for t, b in bias.items()])
    assert r.json()["choices"][0]["text"] == expected


def test_presence_and_frequency_penalties_equal_the_direct_computation(server: tuple[str, Any],
                                                                       debug_tokenizer: Any) -> None:
    url = server[0]
    plain = completion(url, max_tokens=24, temperature=0).json()["choices"][0]["text"]
    for fields in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"presence_penalty": -1.5,
                                                                           "frequency_penalty": 0.5}):
        r = completion(url, max_tokens=24, temperature=0, **fields)
        assert r.json()["choices"][0]["text"] == direct(server, debug_tokenizer, max_new_tokens=24, **fields)
    assert completion(url, max_tokens=24, temperature=0, frequency_penalty=2.0).json()["choices"][0]["text"] != plain


def test_best_of_returns_the_candidates_with_the_highest_logprob_per_token(server: tuple[str, Any]) -> None:
    url = server[0]
    body = {"prompt": ["import os", "class A:"], "max_tokens": 6, "temperature": 1.0, "seed": 11}
    # n=3 draws the same three candidates per prompt as best_of=3 (the same seeds), with their logprobs.
    every = completion(url, n=3, logprobs=0, **body).json()

    def mean(choice: dict[str, Any]) -> float:
        lps = choice["logprobs"]["token_logprobs"]
        return sum(lps) / len(lps)

    candidates = [every["choices"][0:3], every["choices"][3:6]]
    assert len({c["text"] for c in candidates[0]}) > 1  # the choice matters
    r = completion(url, best_of=3, n=2, **body).json()
    expected = [c["text"] for group in candidates for c in sorted(group, key=mean, reverse=True)[:2]]
    assert [c["text"] for c in r["choices"]] == expected
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert all(c["logprobs"] is None for c in r["choices"])  # not asked for
    assert r["usage"] == every["usage"]  # every candidate generated counts, as OpenAI bills best_of


def test_each_choice_of_a_seeded_request_draws_from_a_seed_of_its_own_that_no_other_request_shares(url: str) -> None:
    """Choice j of seed s draws from a seed derived from the pair (s, j), never s + j: requests over a range of seeds
    give as many different samples as they have choices (vLLM's seed + index made choice 1 of seed s the first of
    seed s + 1). The same prompt, seed and choice give the same sample again, alone or batched beside others."""
    from gptopt.serve.routes import choice_seed

    pairs = [(s, j) for s in range(64) for j in range(8)]
    seeds = {choice_seed(s, j) for s, j in pairs}
    assert len(seeds) == len(pairs) and all(0 <= x < 2**63 for x in seeds)  # no two pairs share a stream
    assert all(choice_seed(s, j) != choice_seed(s + j, 0) for s, j in pairs if j)
    assert choice_seed(5, 0) == 5 and choice_seed(2**63 - 1, 7) < 2**63  # the first choice keeps the seed itself
    body = {"max_tokens": 8, "temperature": 1.0}
    swept = [c["text"] for seed in range(6) for c in completion(url, prompt="import os", n=2, seed=seed,
                                                                **body).json()["choices"]]
    assert len(set(swept)) == len(swept) == 12
    batched = completion(url, prompt=["import os", "class A:"], n=2, seed=3, **body).json()["choices"]
    assert [c["text"] for c in batched[:2]] == swept[6:8]  # prompt 0's choices 0 and 1 of seed 3, beside prompt 1's


@pytest.mark.parametrize(("body", "param"), [
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"prompt": ["a"] * 10, "best_of": 8}, "best_of"),  # 80 sequences, beyond the server's 8 slots + 64 queued
    ({"suffix": "\n    return x"}, "suffix"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"one": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
])
def test_sampling_fields_out_of_range_or_unsupported_get_400_naming_the_field(url: str, body: dict[str, Any],
                                                                              param: str) -> None:
    err = assert_openai_error(completion(url, max_tokens=2, **body), 400)
    assert err["param"] is not None and err["param"].startswith(param), err


def test_chat_refuses_tools_and_takes_the_sampling_fields(url: str) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for field, value in (("tools", [tool]), ("functions", [tool["function"]])):
        r = httpx.post(f"{url}/v1/chat/completions", json={**base, field: value}, timeout=60)
        err = assert_openai_error(r, 400, "unsupported_parameter")
        assert err["param"] == field and field in err["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**base, "tools": [], "temperature": 0, "logit_bias": {"5": 100},
                                                       "presence_penalty": 1.0, "frequency_penalty": 1.0}, timeout=60)
    assert r.status_code == 200, r.text


def test_each_row_of_one_batched_step_gets_only_its_own_bias_and_penalty(debug_model: Any) -> None:
    gen = Generator(debug_model, resolve("cpu"), max_batch_size=3)
    logits = torch.zeros(3, 8)
    logits[:, 2] = 1.0
    params = [SamplingParams(temperature=0, logit_bias=[(5, 3.0)]), SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=2.0)]
    assert gen.sample(logits, params, [[2], [2], [2]], [None] * 3, prompt_lens=[0, 0, 0]) == [5, 2, 0]


# -- response_format: constrained decoding --------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n", "tags"],
          "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def test_a_json_schema_reply_validates_and_equals_the_direct_computation(server: tuple[str, Any],
                                                                          debug_tokenizer: Any) -> None:
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    url, app = server
    body = {"prompt": "x", "max_tokens": 50, "temperature": 0, "response_format": SCHEMA_FORMAT}
    r = completion(url, **body).json()
    text = r["choices"][0]["text"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r["choices"][0]["finish_reason"] == "stop"
    # The same constrained greedy decoding, computed here with the server's model and tokenizer.
    model = app.state.engine.generator.model
    eot = debug_tokenizer.token_to_id("<|endoftext|>")
    gen = Generator(model, resolve("cpu"), max_batch_size=1,
                    grammars=Grammars(debug_tokenizer, eot, model.config.vocab_size))
    [(ids, _)] = complete(gen, [debug_tokenizer.encode("x").ids], SamplingParams(
        temperature=0, max_new_tokens=50, stop_token_ids=(eot,), grammar=grammar_for(SCHEMA_FORMAT)))
    assert text == debug_tokenizer.decode(ids)
    # Streamed, and sampled in a batch beside unconstrained requests: every reply is still a valid document.
    frames = sse(completion(url, **{**body, "stream": True}))
    assert "".join(f["choices"][0]["text"] for f in frames[:-1] if f["choices"]) == text
    sampled = completion(url, **{**body, "prompt": ["x", "def f(", "import os"], "temperature": 1.0, "seed": 3,
                                 "n": 2}).json()
    for choice in sampled["choices"]:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_a_stop_string_that_cuts_a_constrained_reply_short_ends_it_incomplete_not_stop(url: str,
                                                                                        debug_tokenizer: Any) -> None:
    """A reply that breaks its schema never says "stop": cut by a stop string before its document is complete (here
    at its first character), it ends "incomplete"; unconstrained, the same stop string ends it "stop"."""
    pytest.importorskip("llguidance")
    brace = debug_tokenizer.token_to_id("{")
    # both replies begin with "{": the object's first character, and the unconstrained one's through its bias
    body = {"prompt": "x", "max_tokens": 30, "temperature": 0, "stop": ["{"], "logit_bias": {str(brace): 100}}
    cut = completion(url, **body, response_format={"type": "json_object"}).json()["choices"][0]
    assert (cut["finish_reason"], cut["text"]) == ("incomplete", "")
    plain = completion(url, **body).json()["choices"][0]
    assert (plain["finish_reason"], plain["text"]) == ("stop", "")


def test_a_row_its_grammar_leaves_no_token_ends_incomplete_and_never_takes_a_forbidden_token(
        debug_model: Any) -> None:
    gen = Generator(debug_model, resolve("cpu"), max_batch_size=2)
    seq, logits = gen.begin([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5))
    allowed = torch.zeros(2, logits.shape[-1], dtype=torch.bool)
    allowed[1, 7] = True  # the other row may take token 7 only
    tokens = gen.sample(torch.stack([logits, logits]), [seq.params] * 2, [seq.ids] * 2, [None, None], allowed=allowed)
    assert tokens == [NO_TOKEN, 7]
    assert seq.add(tokens[0]) == "incomplete" and seq.tokens == []
    gen.end(seq)


def test_chat_with_json_object_replies_with_a_json_object(url: str) -> None:
    pytest.importorskip("llguidance")
    stopped = False
    for seed in range(4):
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "an object"}], "max_tokens": 30, "temperature": 1.0,
            "seed": seed, "response_format": {"type": "json_object"}}, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]
        if reply["finish_reason"] == "stop":
            assert isinstance(json.loads(reply["message"]["content"]), dict)
            stopped = True
        else:  # out of tokens mid-string (a random model's strings run long): cut short, as OpenAI's are
            assert reply["finish_reason"] == "length" and reply["message"]["content"].startswith("{")
    assert stopped


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"not": {"type": "string"}}}},
    {"type": "yaml"},
])
def test_a_response_format_that_cannot_be_served_gets_400(url: str, response_format: dict[str, Any]) -> None:
    pytest.importorskip("llguidance")
    err = assert_openai_error(completion(url, max_tokens=4, response_format=response_format), 400)
    assert err["param"] is not None and err["param"].startswith("response_format"), err


def test_a_tokenizer_constrained_decoding_cannot_read_serves_all_but_response_format() -> None:
    pytest.importorskip("llguidance")
    from tokenizers import Tokenizer, models

    from gptopt.config import ServeConfig, preset
    from gptopt.models.gpt import GPT
    from gptopt.serve.app import create_app
    from gptopt.serve.server import serve_in_thread

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    app = create_app(ServeConfig(model="debug", device="cpu", max_batch_size=1), model=GPT(preset("debug")).eval(),
                     tokenizer=words)
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}"
        assert completion(url, prompt="a", max_tokens=2).status_code == 200
        err = assert_openai_error(completion(url, prompt="a", max_tokens=2, response_format={"type": "json_object"}),
                                  400, "unsupported_parameter")
        assert err["param"] == "response_format"
