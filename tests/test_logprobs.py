"""Log-probabilities: the Generator's numbers against a direct forward, and /v1/completions' logprobs,
echo, limits and token-id prompts in OpenAI's shape, through a live in-thread server.

    pytest -q tests/test_logprobs.py
    pytest -q -m slow tests/test_logprobs.py   # lm-evaluation-harness's local-completions against it
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import (  # noqa: E402
    PROMPT,
    assert_openai_error,
    completion,
    end_of_text_after,
    first_stop,
    running,
    sse,
)

from gptopt.config import ServeConfig, preset  # noqa: E402
from gptopt.data.tokenizer import eot_id  # noqa: E402
from gptopt.infer.generator import Generator  # noqa: E402
from gptopt.infer.sampling import SamplingParams, TokenLogprob  # noqa: E402
from gptopt.infer.scheduler import complete  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.runtime.device import resolve  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.logprobs import CompletionLogprobs, Vocab, chat_content  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402

TOL = 1e-4  # the cached, batched forward against one plain forward: fp32 rounding only


@pytest.fixture(scope="module")
def server(debug_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    with running(debug_tokenizer, max_batch_size=4) as s:
        yield s


def direct_logprobs(model: GPT, ids: list[int]) -> torch.Tensor:
    """(T-1, V): log_softmax of the model's logits at each position, from one plain forward, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, :-1].float().log_softmax(-1)


def ids_of(vocab: Vocab, tokens: list[str]) -> list[int]:
    """Token strings back to ids: a byte-level BPE's token texts (bytes: forms included) are unique."""
    table = {vocab.text(i): i for i in range(vocab.tokenizer.get_vocab_size())}
    return [table[t] for t in tokens]


# -- the Generator ---------------------------------------------------------------------------------


def test_sampled_and_prompt_logprobs_equal_a_direct_forward(varied_model: GPT) -> None:
    gen = Generator(varied_model, resolve("cpu"), max_batch_size=2)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, top_k=None, logprobs=4, prompt_logprobs=2)
    (seq,), logits = gen.begin_many([prompt], params, chunk=3)  # three chunks: every position scored
    while seq.finish is None:
        (token,) = gen.sample_next(logits, [seq])
        seq.add(token)
        if seq.finish is None:
            logits = gen.decode_next([seq])
    lp = direct_logprobs(varied_model, seq.ids)
    assert len(seq.prompt_logprobs) == len(prompt) - 1 and len(seq.logprobs) == seq.n_new == 6
    for pos, e in enumerate(seq.prompt_logprobs + seq.logprobs):  # entry pos predicts ids[pos + 1]
        assert e.token == seq.ids[pos + 1]
        assert e.logprob == pytest.approx(lp[pos, e.token].item(), abs=TOL)
        top = lp[pos].topk(len(e.top))
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=TOL)
    assert all(len(e.top) == 2 for e in seq.prompt_logprobs) and all(len(e.top) == 4 for e in seq.logprobs)
    gen.end(seq)


def test_a_greedy_tokens_logprob_is_exactly_the_top_one(varied_model: GPT) -> None:
    gen = Generator(varied_model, resolve("cpu"), max_batch_size=2)
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0.9, seed=1)]
    logits = torch.randn(2, varied_model.config.vocab_size)
    logits[0, :2] = 9.0  # a tie: argmax takes one of the two
    tokens, entries = gen.sample_logprobs(logits, params, [[1], [1]], [None, gen.rng(1)])
    first = entries[0]
    assert first is not None and first.token == tokens[0] and first.logprob == first.top[0][1]
    assert entries[1] is None  # a row that did not ask gets nothing
    assert tokens == gen.sample(logits, params, [[1], [1]], [None, gen.rng(1)])  # the same draws


def test_requests_without_logprobs_take_the_plain_sampling_path(varied_model: GPT,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gen = Generator(varied_model, resolve("cpu"), max_batch_size=1)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("log-probabilities computed for a request that did not ask")

    monkeypatch.setattr(Generator, "sample_logprobs", fail)
    monkeypatch.setattr(Generator, "_score_prompts", fail)
    (seq,), logits = gen.begin_many([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0))
    seq.add(gen.sample_next(logits, [seq])[0])
    assert seq.logprobs == [] and seq.prompt_logprobs == []


# -- the chat shape --------------------------------------------------------------------------------


def test_chat_content_entries_name_each_token_with_its_bytes(debug_tokenizer: Any) -> None:
    vocab = Vocab(debug_tokenizer)
    ids = debug_tokenizer.encode("naïve 🙂 ok").ids
    entries = [TokenLogprob(token=t, logprob=-0.5, top=((t, -0.5), (ids[0], -1.25))) for t in ids]
    content = chat_content(vocab, entries)
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8") == "naïve 🙂 ok"
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"} and c["logprob"] == -0.5
        try:  # whole characters: the token is their text; else OpenAI's bytes: form
            assert c["token"] == bytes(c["bytes"]).decode("utf-8")
        except UnicodeDecodeError:
            assert c["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in c["bytes"])
        assert [a["logprob"] for a in c["top_logprobs"]] == [-0.5, -1.25]
        assert c["top_logprobs"][0]["bytes"] == c["bytes"]
    assert any(c["token"].startswith("bytes:") for c in content)  # the emoji spans tokens


# -- /v1/completions -------------------------------------------------------------------------------


def test_completion_logprobs_equal_a_direct_forward(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    url, app = server
    r = completion(url, max_tokens=8, temperature=1.0, seed=5, logprobs=3)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    vocab = Vocab(debug_tokenizer)
    prompt = debug_tokenizer.encode(PROMPT).ids
    new = ids_of(vocab, lp["tokens"])
    assert len(new) == r.json()["usage"]["completion_tokens"]
    assert debug_tokenizer.decode(new) == choice["text"]
    direct = direct_logprobs(app.state.engine.generator.model, prompt + new)
    for i, (t, got, top) in enumerate(zip(new, lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        row = direct[len(prompt) - 1 + i]
        assert got == pytest.approx(row[t].item(), abs=TOL)
        values = list(top.values())
        assert values == sorted(values, reverse=True) and lp["tokens"][i] in top and 3 <= len(top) <= 4
        best = row.topk(3)
        assert [top[vocab.text(x)] for x in best.indices.tolist()] == pytest.approx(best.values.tolist(), abs=TOL)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and all(o <= len(choice["text"]) for o in offsets)
    for tok, off in zip(lp["tokens"], offsets, strict=True):
        if not tok.startswith("bytes:"):  # whole characters: the text holds them there
            assert choice["text"].startswith(tok, off)


def test_echo_gives_the_prompts_logprobs_first_null(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    url, app = server
    r = completion(url, max_tokens=3, temperature=0, logprobs=2, echo=True).json()
    (choice,) = r["choices"]
    lp, prompt = choice["logprobs"], debug_tokenizer.encode(PROMPT).ids
    assert choice["text"].startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(prompt) + r["usage"]["completion_tokens"]
    assert "".join(lp["tokens"][: len(prompt)]) == PROMPT and lp["text_offset"][len(prompt)] == len(PROMPT)
    ids = ids_of(Vocab(debug_tokenizer), lp["tokens"])
    assert ids[: len(prompt)] == prompt
    direct = direct_logprobs(app.state.engine.generator.model, ids)
    assert lp["token_logprobs"][1:] == pytest.approx([direct[i - 1, t].item() for i, t in enumerate(ids) if i],
                                                     abs=TOL)
    # greedy: each new token is the most likely, as lm-eval's is_greedy reads it
    for got, top in zip(lp["token_logprobs"][len(prompt):], lp["top_logprobs"][len(prompt):], strict=True):
        assert got == max(top.values())


def test_chunked_prefill_gives_the_same_echo_logprobs(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    body = {"prompt": [PROMPT, "import os\nimport sys\n"], "max_tokens": 2, "temperature": 0, "logprobs": 1,
            "echo": True}
    whole = completion(server[0], **body).json()["choices"]
    with running(debug_tokenizer, max_batch_size=4, prefill_chunk=3) as (url, _):
        chunked = completion(url, **body).json()["choices"]
    for a, b in zip(whole, chunked, strict=True):
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=TOL)


def assert_same_logprobs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two legacy logprobs objects of one text: the same tokens, offsets and alternatives, the same numbers up to
    float rounding (a request that reuses a cached prompt prefix reads keys and values that a forward of another
    shape computed)."""
    assert set(a) == set(b) and a["tokens"] == b["tokens"] and a.get("text_offset") == b.get("text_offset")

    def close(x: float | None, y: float | None) -> bool:
        return x == y if x is None or y is None else abs(x - y) <= 1e-5

    assert all(close(x, y) for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True))
    for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert set(x) == set(y) and all(close(x[t], y[t]) for t in x)


def test_streaming_carries_the_same_logprobs(server: tuple[str, Any]) -> None:
    url = server[0]
    body = {"max_tokens": 10, "temperature": 0.8, "seed": 11, "logprobs": 2, "echo": True, "n": 2}
    whole = completion(url, **body).json()["choices"]
    frames = [f for f in sse(completion(url, stream=True, **body)) if f != "[DONE]"]
    for c in whole:
        chunks = [ch for f in frames for ch in f["choices"] if ch["index"] == c["index"]]
        assert "".join(ch["text"] for ch in chunks) == c["text"]
        streamed = {k: [x for ch in chunks if ch["logprobs"] for x in ch["logprobs"][k]] for k in c["logprobs"]}
        assert_same_logprobs(streamed, c["logprobs"])
        for ch in chunks:  # each chunk carries its own text's tokens
            if ch["logprobs"] and ch["text"]:
                assert ch["logprobs"]["tokens"]


def test_logprobs_beyond_the_limit_get_400(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    err = assert_openai_error(completion(server[0], logprobs=21), 400)
    assert err["param"] == "logprobs" and "20" in err["message"] and "--max_logprobs" in err["message"]
    assert completion(server[0], logprobs=20, max_tokens=1).status_code == 200
    with running(debug_tokenizer, max_batch_size=1, max_logprobs=0) as (url, _):
        assert_openai_error(completion(url, logprobs=1), 400)
        assert completion(url, logprobs=0, max_tokens=2).json()["choices"][0]["logprobs"]["top_logprobs"][0]


def test_token_id_prompts_score_like_text(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    url = server[0]
    ids = debug_tokenizer.encode(PROMPT).ids
    as_text = completion(url, max_tokens=4, temperature=0, logprobs=1, echo=True).json()
    as_ids = completion(url, prompt=ids, max_tokens=4, temperature=0, logprobs=1, echo=True).json()
    assert as_ids["choices"][0]["text"] == as_text["choices"][0]["text"]
    assert_same_logprobs(as_ids["choices"][0]["logprobs"], as_text["choices"][0]["logprobs"])
    assert as_ids["usage"] == as_text["usage"]
    listed = completion(url, prompt=[ids, ids[:3]], max_tokens=2, temperature=0).json()
    assert [c["index"] for c in listed["choices"]] == [0, 1]
    err = assert_openai_error(completion(url, prompt=[1, 99999]), 400, "invalid_token_id")
    assert "99999" in err["message"] and err["param"] == "prompt"
    assert_openai_error(completion(url, prompt=[[1], []]), 400)
    assert_openai_error(completion(url, prompt=[1, -2]), 400)


def test_max_tokens_zero_with_echo_scores_the_prompt_only(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    url = server[0]
    ids = debug_tokenizer.encode(PROMPT).ids
    for stream in (False, True):
        r = completion(url, max_tokens=0, echo=True, logprobs=0, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            (choice,) = [c for f in sse(r) if f != "[DONE]" for c in f["choices"] if c["text"]]
        else:
            (choice,) = r.json()["choices"]
            assert r.json()["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
        assert choice["text"] == PROMPT and len(choice["logprobs"]["tokens"]) == len(ids)
    assert_openai_error(completion(url, max_tokens=0, echo=True), 400)  # without logprobs: nothing to return
    assert_openai_error(completion(url, max_tokens=0, logprobs=1), 400)


def test_without_logprobs_the_answer_is_unchanged(server: tuple[str, Any]) -> None:
    plain = completion(server[0], max_tokens=6, temperature=0).json()["choices"][0]
    scored = completion(server[0], max_tokens=6, temperature=0, logprobs=2).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == scored["text"]


def test_the_openai_client_reads_logprobs_and_token_id_prompts(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x")
    ids = debug_tokenizer.encode(PROMPT).ids
    c = client.completions.create(model="debug", prompt=ids, max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + c.usage.completion_tokens
    assert lp.text_offset[len(ids)] == len(PROMPT) and c.choices[0].text.startswith(PROMPT)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])


def imitate_lm_eval_loglikelihood(url: str, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions model sends for one loglikelihood request
    (tokenized_requests=True) and how its parse_logprobs reads the answer (lm_eval 0.4.13)."""
    body = {"model": "debug", "prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    ctxlen = len(context)
    (choice,) = sorted(out["choices"], key=lambda c: c["index"])
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=False))
    return sum(token_logprobs), is_greedy


def test_the_fields_lm_eval_reads_score_a_continuation(server: tuple[str, Any], debug_tokenizer: Any) -> None:
    url, app = server
    context, continuation = debug_tokenizer.encode("def f(x):\n    return").ids, debug_tokenizer.encode(" x").ids
    total, _ = imitate_lm_eval_loglikelihood(url, context, continuation)
    ids = context + continuation
    direct = direct_logprobs(app.state.engine.generator.model, ids)
    assert total == pytest.approx(sum(direct[i - 1, ids[i]].item() for i in range(len(context), len(ids))), abs=TOL)
    # the model's own greedy continuation is greedy by lm-eval's reading
    greedy = completion(url, prompt=context, max_tokens=3, temperature=0, logprobs=1).json()["choices"][0]
    own = ids_of(Vocab(debug_tokenizer), greedy["logprobs"]["tokens"])
    assert imitate_lm_eval_loglikelihood(url, context, own)[1]


def hf_tokenizer(train_data: Path, folder: Path) -> Path:
    """The served tokenizer as a Hugging Face folder: lm-eval tokenizes the requests with it, and its
    eos_token is the end-of-text lm-eval adds to a generation task's stop strings."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_file=str(train_data / "tokenizer.json"),
                            eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_lm_eval_local_completions_scores_a_task_through_the_server(debug_tokenizer: Any, train_data: Path,
                                                                    tmp_path: Path) -> None:
    lm_eval = pytest.importorskip("lm_eval", reason="needs the lmeval extra: pip install -e '.[lmeval]'")
    pytest.importorskip("transformers")
    from lm_eval.tasks import TaskManager

    hf = hf_tokenizer(train_data, tmp_path / "tokenizer")
    # target_delimiter '': the choices carry their own leading space, so the scored continuation is exactly it
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"q": "def add(a, b):\n    return", "choices": [" a + b", " a - b"], "gold": 0},
            {"q": "import", "choices": [" os", " sys"], "gold": 1},
            {"q": "for i in", "choices": [" range(3):", " None"], "gold": 0}]
    (tasks / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "tiny.yaml").write_text(
        "task: gptopt_tiny\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tasks / 'tiny.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ntarget_delimiter: ''\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
    with running(debug_tokenizer, max_batch_size=4) as (url, app):
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=debug,base_url={url}/v1/completions,tokenizer={hf},tokenizer_backend=huggingface,"
                       "tokenized_requests=True,num_concurrent=1,max_retries=1",
            tasks=["gptopt_tiny"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
        model = app.state.engine.generator.model
    # Each choice's log-likelihood as lm-eval read it from our logprobs, against a direct forward, and
    # the accuracy it computed from them.
    right = 0
    for sample in sorted(results["samples"]["gptopt_tiny"], key=lambda s: s["doc_id"]):
        row = rows[sample["doc_id"]]
        scores = []
        for choice, resp in zip(row["choices"], sample["resps"], strict=True):
            context = debug_tokenizer.encode(row["q"]).ids
            whole = debug_tokenizer.encode(row["q"] + choice).ids
            direct = direct_logprobs(model, whole)
            expected = sum(direct[i - 1, whole[i]].item() for i in range(len(context), len(whole)))
            assert resp[0][0] == pytest.approx(expected, abs=TOL)
            scores.append(expected)
        right += max(range(len(scores)), key=scores.__getitem__) == row["gold"]
    assert results["results"]["gptopt_tiny"]["acc,none"] == pytest.approx(right / len(rows))


HUMANEVAL_UNTIL = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # lm-eval's humaneval.yaml


def scripted_model(tokenizer: Any, text: str) -> GPT:
    """The debug preset whose greedy text is `text`'s tokens, position by position and over again,
    whatever the prompt: each position's embedding is a script token's, far larger than any prompt
    token's, and the output layer shares the token embeddings. (A randomly initialised model repeats
    one token and never writes a stop string.)"""
    torch.manual_seed(0)
    model = GPT(preset("debug", vocab_size=tokenizer.get_vocab_size())).eval()
    script = tokenizer.encode(text).ids
    with torch.no_grad():
        wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
        for pos in range(wpe.shape[0]):
            wpe[pos] = 100 * wte[script[pos % len(script)]]
    return model


@pytest.mark.slow
def test_lm_eval_runs_a_generation_task_with_its_usual_batch_and_stop_list(debug_tokenizer: Any, train_data: Path,
                                                                            tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # --batch_size 32 sends 32 prompts in one request; humaneval's 5 stop strings come with the
    # end-of-text lm-eval adds: 6.
    lm_eval = pytest.importorskip("lm_eval", reason="needs the lmeval extra: pip install -e '.[lmeval]'")
    pytest.importorskip("transformers")
    from lm_eval.tasks import TaskManager

    hf = hf_tokenizer(train_data, tmp_path / "tokenizer")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    prompts = [f"def f{i}(x):\n    return x" + " + 1" * (i % 8) for i in range(40)]  # 8 lengths, 8 script offsets
    # target "": lm-eval's exact_match counts the replies a stop string cut to nothing
    (tasks / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in prompts))
    (tasks / "gen.yaml").write_text(
        "task: gptopt_tiny_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: target\n"
        f"generation_kwargs:\n  until: {json.dumps(HUMANEVAL_UNTIL)}\n  max_gen_toks: 12\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    model = scripted_model(debug_tokenizer, " x\n# a\nif b:\ndef c():\nclass D:\nprint(e)\n")
    app = create_app(ServeConfig(model="debug", device="cpu", max_batch_size=4), model=model, tokenizer=debug_tokenizer)
    # each request's stop strings, one entry per sequence, by the client its sequences' text goes to
    engine, batches = app.state.engine, {}
    submit = engine.submit

    def recording_submit(prompt: list[int], params: SamplingParams, sink: Any) -> Any:
        batches.setdefault(id(sink.client), (sink.client, []))[1].append(params.stop)  # kept: its id stays unique
        return submit(prompt, params, sink)

    monkeypatch.setattr(engine, "submit", recording_submit)
    with serve_in_thread(app) as server:
        results = lm_eval.simple_evaluate(
            model="local-completions", batch_size=32,
            model_args=f"model=debug,base_url=http://127.0.0.1:{server.port}/v1/completions,tokenizer={hf},"
                       "tokenizer_backend=huggingface,tokenized_requests=True,max_length=64,max_retries=1",
            tasks=["gptopt_tiny_gen"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
    assert sorted(len(stops) for _, stops in batches.values()) == [8, 32]
    assert {s for _, stops in batches.values() for s in stops} == {(*HUMANEVAL_UNTIL, "<|endoftext|>")}
    # Each reply is the served model's greedy text, computed here directly, cut before its first stop string.
    gen = Generator(engine.generator.model, resolve("cpu"), max_batch_size=8)
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(eot_id(debug_tokenizer),))
    full = [debug_tokenizer.decode(ids) for ids, _ in
            complete(gen, [debug_tokenizer.encode(p).ids for p in prompts], params)]
    expected = [text[: first_stop(text, list(HUMANEVAL_UNTIL))[0]] for text in full]
    samples = sorted(results["samples"]["gptopt_tiny_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == expected
    assert sum(e != f for e, f in zip(expected, full, strict=True)) >= len(prompts) // 2  # the stops did cut
    assert results["results"]["gptopt_tiny_gen"]["exact_match,none"] == pytest.approx(expected.count("") / len(prompts))


def test_end_of_text_keeps_its_logprob_so_lm_evals_slice_stays_aligned(debug_tokenizer: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval's local-completions sends echo, logprobs 1, max_tokens 1 and reads token_logprobs[ctxlen:-1]:
    it assumes the one generated token is in the list. Were end-of-text left out, the slice would drop
    the continuation's last token from the score, silently. The chat route leaves it out of the content."""
    eot = eot_id(debug_tokenizer)
    assert eot is not None
    ids = debug_tokenizer.encode("def f(x):\n    return x").ids
    with running(debug_tokenizer, max_batch_size=2, chat_template="plain") as (url, app):
        end_of_text_after(app.state.engine.generator, monkeypatch, len(ids), 1, eot)
        body = {"prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        choice = r["choices"][0]
        lp = choice["logprobs"]
        assert choice["finish_reason"] == "stop" and len(lp["token_logprobs"]) == len(ids) + 1
        assert r["usage"]["completion_tokens"] == 1  # the end-of-text the model generated, as its logprobs list
        assert lp["text_offset"][-1] == len(choice["text"])  # after the text: end-of-text shows none
        monkeypatch.undo()
        chat_ids = debug_tokenizer.encode("User: hi\nAssistant:").ids
        end_of_text_after(app.state.engine.generator, monkeypatch, len(chat_ids), 3, eot)
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True}).json()["choices"][0]
        assert reply["finish_reason"] == "stop" and len(reply["logprobs"]["content"]) == 2


def test_text_offsets_count_a_byte_no_token_completes_as_its_replacement_character(debug_tokenizer: Any) -> None:
    """A lone UTF-8 continuation byte decodes to U+FFFD for good: the tokens after it start one character later;
    the bytes of a character split over tokens all point at its start."""
    by_byte = {b: debug_tokenizer.token_to_id(c) for b, c in bytes_to_unicode().items()}  # its one-byte tokens
    lone, space, euro = by_byte[0xAA], by_byte[0x20], [by_byte[b] for b in "€".encode()]
    fmt = CompletionLogprobs(Vocab(debug_tokenizer))
    ids = [lone, space, *euro, space]
    text = debug_tokenizer.decode(ids)
    assert text == "\ufffd € "
    offsets = fmt.add(ids, [None] * len(ids), shown=len(text))["text_offset"]
    assert offsets == [0, 1, 2, 2, 2, 3]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
