"""The front end's side of every sequence (vLLM's output processor): the engine's token ids -> the text its client
streams, ended at a stop string or at blocked content.

    pytest -q tests/test_serve_output.py

The engine only makes token ids (events.TokenEvent). The HTTP process turns them into text here, whether its
engine runs in a child process (engine_process.py) or in a thread of its own: the routes submit every sequence
through OutputProcessor.submit, whose TextSink takes the engine's events on the event loop that streams them. It
runs the incremental detokenizer and the stop strings (infer.stop.StopChecker), then the blocklist's filter of
the output (blocklist.TextFilter), and hands its client the Events of what is safe to show, each new token's
text as it completes. When a stop string or the filter ends a sequence, its client has its last event at once,
and the engine is told to drop it (its handle's cancel, with that reason): its blocks are free within an
iteration, and whatever the engine still sends for it is dropped here. Its usage counts the tokens up to the one
that completed the stop string, as it would have had the engine stopped there itself.
"""

from __future__ import annotations

from typing import Any

from gptopt.infer.sampling import SamplingParams, TokenLogprob
from gptopt.infer.stop import StopChecker
from gptopt.serve.blocklist import Blocklist, TextFilter
from gptopt.serve.client import EngineClient, Submitted
from gptopt.serve.events import COMPLETED, Event, FinishReason, LoopSink, Sink, TokenEvent


class OutputProcessor:
    """Makes the TextSink of each sequence a client submits: the tokenizer and the blocklist they share."""

    def __init__(self, tokenizer: Any, blocklist: Blocklist) -> None:
        self.tokenizer, self.blocklist = tokenizer, blocklist

    def submit(self, engine: EngineClient, prompt: list[int], params: SamplingParams, client: Sink, *,
               index: int = 0) -> Submitted:
        """Submit one sequence to `engine`; its client receives the Events of its text (as sequence `index` of
        its request). What the engine raises (QueueFull, Draining) reaches the caller."""
        sink = TextSink(self.tokenizer, self.blocklist, params, client, index=index, prompt_tokens=len(prompt))
        request = engine.submit(prompt, params, sink)
        sink.attach(request)
        return request


class TextSink(LoopSink):
    """One sequence's TokenEvents -> its client's Events, on the client's event loop (where it is delivered,
    for a client that is not an asyncio sink)."""

    def __init__(self, tokenizer: Any, blocklist: Blocklist, params: SamplingParams, client: Sink, *,
                 index: int = 0, prompt_tokens: int = 0) -> None:
        super().__init__(client.loop if isinstance(client, LoopSink) else None)
        self.client, self.index, self.prompt_tokens = client, index, prompt_tokens
        # an asyncio client's events go straight into it: this runs on its loop
        self._hand = client.take if isinstance(client, LoopSink) else client
        self.checker = StopChecker(tokenizer, params.stop)
        self.filter = TextFilter(blocklist) if blocklist else None
        # Log-probabilities go with the text of their tokens: held while that text is, as the tokens' are.
        self.scored = params.logprobs is not None or params.prompt_logprobs is not None
        self.wants_prompt = params.prompt_logprobs is not None
        self.logprobs: list[TokenLogprob] = []  # received, not yet handed on
        self.prompt_logprobs: list[TokenLogprob] | None = None  # received, not yet handed on
        self.generated = 0  # completion tokens of the events taken so far
        self.done = False  # its client has had its last event
        self.request: Submitted | None = None  # the engine's handle, once submitted
        self.ended: FinishReason | None = None  # ended here before the engine had

    def attach(self, request: Submitted) -> None:
        """The engine's handle of this sequence; one that ended before it came is dropped now."""
        self.request = request
        if self.ended is not None:
            request.cancel(self.ended)

    def take(self, event: TokenEvent) -> None:
        for ev in self.process(event):
            self._hand(ev)

    def process(self, event: TokenEvent) -> list[Event]:
        """The client's Events of one engine event: one per token whose text is ready (as each token's text
        completes), and the last one when the sequence ends, in the engine or here."""
        if self.done:  # ended here: the engine's events until it has dropped the sequence
            return []
        self.logprobs += event.logprobs or []
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        reason = event.finish_reason
        if reason is not None and reason not in COMPLETED:  # cancelled, timed out, failed: no more text
            return [self._event("", reason, event.completion_tokens, event.error)]
        out: list[Event] = []
        n = len(event.token_ids)
        for i, token in enumerate(event.token_ids):
            # the budget's last token ends it with its text; a stop token id ends it after the text, below
            ev = self._step(token, reason if i == n - 1 and reason == "length" else None, self.generated + i + 1,
                            event.stop_reason)
            if ev is not None:
                out.append(ev)
                if ev.finish_reason is not None:  # a stop string, or blocked content
                    if reason is None:  # the engine goes on: it drops the sequence now
                        self.ended = ev.finish_reason
                        if self.request is not None:
                            self.request.cancel(ev.finish_reason)
                    return out
        self.generated = event.completion_tokens
        if reason is not None and (reason != "length" or not n):  # a stop token id, a grammar's end, no token
            ev = self._step(None, reason, event.completion_tokens, event.stop_reason)
            if ev is not None:
                out.append(ev)
        return out

    def _step(self, token: int | None, reason: FinishReason | None, generated: int,
              stop_reason: FinishReason) -> Event | None:
        """One token's text (None: the engine ended the sequence after its text), the held-back rest once it ends;
        the Event to send, if any."""
        # A stop token id has no text of its own, but what the checker holds back (a possible stop string's
        # start, a split character) and the filter's holdback end the reply.
        text = "" if token is None else self.checker.add(token)
        if self.checker.stopped:
            reason = stop_reason
        if reason is not None:
            text += self.checker.finish()  # "" after a stop string
        if self.filter is not None:
            text, matched = self.filter.push(text, final=reason is not None)
            if matched:
                reason = "content_filter"
        if reason is not None:
            return self._event(text, reason, generated)
        return self._event(text, None, generated) if text else None

    def _event(self, text: str, reason: FinishReason | None, generated: int, error: str | None = None) -> Event:
        ev = Event(self.index, text, reason, self.prompt_tokens, generated, error)
        self.done = reason is not None
        if self.scored:
            ev.logprobs, self.logprobs = self.logprobs, []
        if self.wants_prompt and self.prompt_logprobs is not None:
            ev.prompt_logprobs, self.prompt_logprobs, self.wants_prompt = list(self.prompt_logprobs), None, False
        return ev
