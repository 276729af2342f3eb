"""The front end's output processor (serve/output.py): the engine hands back token ids only, and the HTTP side makes
their text, ends a reply at a stop string or blocked content, and drops it in the engine at once.

    pytest -q tests/test_serve_output.py
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from conftest import wait_for

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import PROMPT, byte_token, completion, running  # noqa: E402

from gptopt.infer.generator import Generator  # noqa: E402
from gptopt.infer.sampling import SamplingParams, TokenLogprob  # noqa: E402
from gptopt.infer.scheduler import complete  # noqa: E402
from gptopt.runtime.device import resolve  # noqa: E402
from gptopt.serve.blocklist import Blocklist  # noqa: E402
from gptopt.serve.events import Event, TokenEvent  # noqa: E402
from gptopt.serve.output import TextSink  # noqa: E402


class Handle:
    """The engine's side of a sequence, as the processor sees it: what it was told to drop the sequence for."""

    def __init__(self) -> None:
        self.cancels: list[str] = []

    def cancel(self, reason: str = "cancelled") -> None:
        self.cancels.append(reason)


def text_sink(tokenizer: Any, *, stop: tuple[str, ...] = (), blocklist: Blocklist | None = None,
              **params: Any) -> tuple[TextSink, list[Event], Handle]:
    """A TextSink whose client is a list, attached to a Handle."""
    got: list[Event] = []
    sink = TextSink(tokenizer, blocklist or Blocklist(), SamplingParams(stop=stop, **params), got.append)
    handle = Handle()
    sink.attach(handle)
    return sink, got, handle


def first_completing(tokenizer: Any, ids: list[int], stop: str) -> int:
    """The index of the token whose text completes `stop`."""
    return next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))


def test_a_stop_string_within_one_steps_tokens_ends_the_reply_there_and_drops_it_in_the_engine(
        debug_tokenizer: Any) -> None:
    """Several tokens of one speculative step: the text stops before the stop string, usage counts the tokens up
    to the one that completed it, the engine is told to drop the sequence, and what it still sends is dropped."""
    ids = debug_tokenizer.encode("one two\n\nthree four five").ids
    k = first_completing(debug_tokenizer, ids, "\n\n")
    sink, got, handle = text_sink(debug_tokenizer, stop=("\n\n",))
    sink(TokenEvent(ids[:1], completion_tokens=1))
    sink(TokenEvent(ids[1:], completion_tokens=len(ids)))
    assert "".join(e.text for e in got) == "one two"
    assert (got[-1].finish_reason, got[-1].completion_tokens) == ("stop", k + 1)
    assert [e.finish_reason for e in got[:-1]] == [None] * (len(got) - 1)
    assert handle.cancels == ["stop"]
    n = len(got)
    sink(TokenEvent([ids[0]], completion_tokens=len(ids) + 1))
    sink(TokenEvent([], "stop", completion_tokens=len(ids) + 1))  # the engine's end of it
    assert len(got) == n


def test_the_budgets_last_token_comes_with_its_finish_in_one_event(debug_tokenizer: Any) -> None:
    ids = debug_tokenizer.encode("one two").ids
    sink, got, handle = text_sink(debug_tokenizer)
    for i, t in enumerate(ids):
        sink(TokenEvent([t], "length" if i == len(ids) - 1 else None, completion_tokens=i + 1))
    assert [e.text for e in got] == [debug_tokenizer.decode(ids[: i + 1])[len(debug_tokenizer.decode(ids[:i])):]
                                     for i in range(len(ids))]
    assert [e.finish_reason for e in got] == [None] * (len(ids) - 1) + ["length"]
    assert got[-1].completion_tokens == len(ids) and handle.cancels == []


def test_a_stop_token_id_ends_the_reply_with_the_text_held_back_for_a_stop_string(debug_tokenizer: Any) -> None:
    """" x" may begin the stop string " xyz", so it waits; the end-of-text that follows releases it, and usage
    counts the stop token id as the engine does."""
    ids = debug_tokenizer.encode("one x").ids
    sink, got, handle = text_sink(debug_tokenizer, stop=(" xyz",))
    sink(TokenEvent(ids, completion_tokens=len(ids)))
    assert "".join(e.text for e in got) == "one"
    sink(TokenEvent([], "stop", completion_tokens=len(ids) + 1))
    assert (got[-1].text, got[-1].finish_reason, got[-1].completion_tokens) == (" x", "stop", len(ids) + 1)
    assert handle.cancels == []  # the engine ended it itself


def test_a_stop_string_that_cuts_a_constrained_document_ends_it_incomplete(debug_tokenizer: Any) -> None:
    ids = debug_tokenizer.encode("{}").ids
    sink, got, handle = text_sink(debug_tokenizer, stop=("}",))
    for t in ids:
        sink(TokenEvent([t], completion_tokens=1, stop_reason="incomplete"))
    assert ("".join(e.text for e in got), got[-1].finish_reason) == ("{", "incomplete")
    assert handle.cancels == ["incomplete"]


def test_blocked_content_ends_the_reply_before_it_and_drops_it_in_the_engine(debug_tokenizer: Any) -> None:
    ids = debug_tokenizer.encode("one two three four").ids
    sink, got, handle = text_sink(debug_tokenizer, blocklist=Blocklist(["three"]))
    for i, t in enumerate(ids):
        sink(TokenEvent([t], completion_tokens=i + 1))
    assert "".join(e.text for e in got) == "one two "
    assert got[-1].finish_reason == "content_filter" and handle.cancels == ["content_filter"]


def test_an_engines_error_or_cancel_ends_the_reply_without_its_held_back_text(debug_tokenizer: Any) -> None:
    sink, got, handle = text_sink(debug_tokenizer, stop=(" xyz",))
    sink(TokenEvent(debug_tokenizer.encode("one x").ids, completion_tokens=2))
    sink(TokenEvent([], "error", completion_tokens=2, error="RuntimeError: boom"))
    assert (got[-1].text, got[-1].finish_reason, got[-1].error) == ("", "error", "RuntimeError: boom")
    assert handle.cancels == []


def test_a_tokens_logprob_goes_with_the_text_it_completes(debug_tokenizer: Any) -> None:
    """'é' is two byte tokens: the first has no text of its own, so its entry waits for the second's event."""
    first, second = byte_token(debug_tokenizer, 0xC3), byte_token(debug_tokenizer, 0xA9)
    entries = [TokenLogprob(first, -1.0, ()), TokenLogprob(second, -2.0, ())]
    sink, got, _ = text_sink(debug_tokenizer, logprobs=0)
    sink(TokenEvent([first], completion_tokens=1, logprobs=entries[:1]))
    assert got == []
    sink(TokenEvent([second], "length", completion_tokens=2, logprobs=entries[1:]))
    assert [(e.text, e.logprobs) for e in got] == [("é", entries)]


# -- through a server ------------------------------------------------------------------------------


class DecodesOffTheEngineThread:
    """A tokenizer that refuses to make text on the engine's thread, and counts what it makes elsewhere."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self.decoded = tokenizer, 0

    def decode(self, *args: Any, **kwargs: Any) -> str:
        if threading.current_thread().name == "gptopt-engine":
            raise RuntimeError("the engine's thread decoded text")
        self.decoded += 1
        return self._tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_the_engine_thread_makes_token_ids_only_and_the_front_end_their_text(debug_tokenizer: Any) -> None:
    """The engine's events carry token ids and no text; a reply streamed, with a stop string and log-probabilities,
    is the same text as the model's tokens decoded, none of it made on the engine's thread."""
    tokenizer = DecodesOffTheEngineThread(debug_tokenizer)
    with running(tokenizer) as (url, app):
        full = completion(url, max_tokens=16, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
        stop = next((full[i : i + 2] for i in range(2, len(full) - 1) if full[i : i + 2].strip()), None)
        assert stop is not None, full
        r = completion(url, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop], logprobs=1)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (full[: full.find(stop)], "stop")
        engine, events, done = app.state.engine, [], threading.Event()

        def sink(ev: Any) -> None:
            events.append(ev)
            if ev.finish_reason is not None:
                done.set()

        req = engine.submit(debug_tokenizer.encode(PROMPT).ids, SamplingParams(temperature=0, max_new_tokens=8), sink)
        assert done.wait(30)
    assert all(isinstance(e, TokenEvent) and not hasattr(e, "text") for e in events)
    assert [t for e in events for t in e.token_ids] == req.seq.tokens and events[-1].finish_reason == "length"
    assert tokenizer.decoded > 0


def test_a_stop_string_frees_the_request_in_the_engine_within_a_step_or_two(debug_tokenizer: Any) -> None:
    """The engine cannot see a stop string, so the front end drops the request there: its slot and blocks are free
    long before its max_tokens, usage counts the tokens up to the one that completed the stop string, and the
    engine's metrics count it as stopped, not cancelled."""
    max_tokens = 40  # with the prompt, within the debug model's 64 tokens
    with running(debug_tokenizer, decode_delay=0.01) as (url, app):
        engine = app.state.engine
        prompt = debug_tokenizer.encode(PROMPT).ids
        gen = Generator(engine.generator.model, resolve("cpu"), max_batch_size=1)
        ((tokens, _),) = complete(gen, [prompt], SamplingParams(temperature=0, max_new_tokens=max_tokens))
        full = debug_tokenizer.decode(tokens)
        stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if full[i : i + 3].strip())
        k = first_completing(debug_tokenizer, tokens, stop)
        steps = engine.steps
        r = completion(url, max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=[stop]).json()
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (full[: full.find(stop)], "stop")
        assert r["usage"]["completion_tokens"] == k + 1
        wait_for(lambda: engine.stats() == {"running": 0, "waiting": 0})
        assert engine.steps - steps < max_tokens - 1  # it did not decode to its budget
        engine.scheduler.check_idle()  # every slot and block free
        finished = {s.labels["reason"]: s.value for s in engine.metrics.finished.collect()[0].samples
                    if s.name.endswith("_total")}
        assert finished.get("stop") == 1 and not finished.get("cancelled")
