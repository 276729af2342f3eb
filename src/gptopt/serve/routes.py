"""The routes over one engine (Routes): the playbook's POST /generate, OpenAI-compatible /v1/completions and
/v1/chat/completions (chat_api.py), /v1/models, the probes, /metrics and the playground's files; the request
checks that need the model or its tokenizer, and the way into the engine and back (submit, collect).

    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "def", "max_tokens": 8}'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from gptopt.config import ServeConfig
from gptopt.infer import chat, constrain
from gptopt.infer.sampling import SamplingParams
from gptopt.utils.extras import require

require("fastapi", "serve", "gptopt serve")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402

from gptopt.serve.blocklist import CheckTimeout  # noqa: E402
from gptopt.serve.chat_api import DeltaChoices, message_choice  # noqa: E402
from gptopt.serve.client import Draining, EngineClient, QueueFull, Submitted  # noqa: E402
from gptopt.serve.events import COMPLETED, Event, asyncio_sink  # noqa: E402
from gptopt.serve.guard import MAX_BODY_BYTES, PAGE, api_key  # noqa: E402
from gptopt.serve.logprobs import ChatChoice, CompletionChoice, Vocab  # noqa: E402
from gptopt.serve.metrics import CONTENT_TYPE  # noqa: E402
from gptopt.serve.output import OutputProcessor  # noqa: E402
from gptopt.serve.protocol import (  # noqa: E402
    APIError,
    ChatRequest,
    CompletionRequest,
    ErrorBody,
    GenerateRequest,
    GenerateResponse,
    ResponseFormat,
    Sampling,
    prompt_list,
    stop_strings,
)
from gptopt.serve.sse import finish_error, next_event, sse, stall_error, stream_response, text_choice, watch_disconnect  # noqa: E402

log = logging.getLogger(__name__)

# Prompt checks at once, in their own pool so they never hold up tokenizing. Each ends within its
# time limit; enough threads that a burst of slow prompts does not queue the ordinary ones behind it.
BLOCKLIST_THREADS = 16
# A prompt up to this long is encoded on the event loop: that takes the loop about as long as the hand-off
# to a worker thread and back, so it costs less; a longer one goes to a thread, so one big prompt never stalls
# every stream (benchmarks/2026-12-05-serving-stack-ceiling.md, "The HTTP side").
INLINE_ENCODE_CHARS = 1024



STATUS_DOC = {
    400: "a bad request: the message names the field and the fix",
    401: "a missing or incorrect API key",
    404: "no model of that name",
    413: f"a body over {MAX_BODY_BYTES} bytes",
    429: "busy: retry after the Retry-After header's seconds",
    503: "shutting down: no new requests",
    504: "generation took longer than the server's --request_timeout",
}


def choice_seed(seed: int, index: int) -> int:
    """The seed of a request's sequence `index` (its choices in order, prompt by prompt: prompt i's j-th of n is
    i * n + j; with best_of, its candidates counted so), derived from the pair: the request's seed itself for the
    first, so a one-choice request draws what `gptopt generate --seed` draws; for each other, the top 63 bits of
    BLAKE2b of the two as 64-bit integers (torch's generators take seeds below 2**63). Seed + index, vLLM's rule,
    made choice j of seed s the first choice of seed s + j, so requests over a range of seeds drew the same
    samples again."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _error_doc(status: int) -> dict[str, Any]:
    return {"model": ErrorBody, "description": STATUS_DOC[status]}


def _responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: _error_doc(s) for s in statuses}




def _no_such_model(name: str, names: tuple[str, ...]) -> APIError:
    also = f" (also named {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""
    return APIError(404, f"the model {name!r} does not exist; this server has {names[0]!r}{also}",
                    param="model", code="model_not_found")


def _check_completion(body: CompletionRequest, prompts: list[str | list[int]], names: tuple[str, ...],
                      max_tokens_limit: int, max_logprobs: int) -> None:
    """The request limits of /v1/completions that need no tokenizer (the schema checked the rest)."""
    if body.model is not None and body.model not in names:
        raise _no_such_model(body.model, names)
    if body.max_tokens is not None and body.max_tokens > max_tokens_limit:
        raise APIError(400, f"max_tokens may be at most {max_tokens_limit}", param="max_tokens")
    if body.logprobs is not None and body.logprobs > max_logprobs:
        raise APIError(400, f"logprobs may be at most {max_logprobs} (this server's --max_logprobs); ask for fewer",
                       param="logprobs")
    if body.max_tokens == 0 and not (body.echo and body.logprobs is not None):
        raise APIError(400, "max_tokens 0 scores the prompt only, which needs echo: true and logprobs (0 or more); "
                       "otherwise ask for at least 1 token", param="max_tokens")
    if body.suffix:
        raise APIError(400, "suffix is not supported: this server continues a prompt at its end only; send the "
                       "request without suffix", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of < body.n:
        raise APIError(400, f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of")
    if body.best_of is not None and body.best_of > body.n and body.stream:
        raise APIError(400, "best_of larger than n cannot be streamed: the best are known only once all are "
                       "generated; send stream: false, or best_of equal to n", param="best_of")


class Routes:
    """The routes over one engine: request checks that need the model or tokenizer, the way into the
    engine and back (submit, collect), and the handlers."""

    def __init__(self, cfg: ServeConfig, engine: EngineClient) -> None:
        self.cfg, self.engine, self.tokenizer = cfg, engine, engine.tokenizer
        self.context = engine.max_len
        self.model_name = cfg.model_name or Path(cfg.model.rstrip("/")).name or cfg.model
        # Also the --model argument exactly as given: vLLM's convention, so clients that send the path
        # the server was launched with work unchanged. The first is the id responses carry by default.
        self.model_names = tuple(dict.fromkeys([self.model_name, cfg.model]))
        self.api_key = api_key(cfg)
        self.started = int(time.time())
        self.checks = concurrent.futures.ThreadPoolExecutor(BLOCKLIST_THREADS, thread_name_prefix="gptopt-blocklist")
        # the chat template, resolved once: a bad --chat_template fails at start-up, not per request
        folders = chat.template_folders(cfg.model, cfg.tokenizer)
        # every end-of-sequence id of the model ends a completion, as in transformers' generate
        self.stop_ids = chat.end_token_ids(folders, self.tokenizer)
        # What the chat route answers without a template: in words, never the server's paths (its log has them).
        self.no_chat = chat.no_template(None if folders else ())
        try:
            self.chat = chat.load_template(cfg.chat_template, folders, self.tokenizer)
        except ValueError as e:
            if cfg.chat_template is not None:  # asked for: a bad one stops the start
                raise
            # The model's own, unasked: completions need no template, so the server starts and only the
            # chat route refuses, saying why.
            log.warning("the model's own chat template cannot be used, so /v1/chat/completions answers 400: %s", e)
            reason = str(e)
            for folder in folders:  # the reason reaches clients: the server's paths stay in its log
                reason = reason.replace(os.fspath(folder), "the model's folder")
            self.chat, self.no_chat = None, f"{reason} (the model's own template: start the server with " \
                                            "--chat_template FILE or plain)"
        self.chat_stop_ids = tuple(dict.fromkeys(
            (*self.stop_ids, *(self.chat.stop_token_ids(self.tokenizer) if self.chat is not None else ()))))
        self.vocab = Vocab(self.tokenizer)  # token texts and bytes for logprobs
        self.output = OutputProcessor(self.tokenizer, engine.blocklist)  # the engine's token ids -> text
        self._stall_said = False

    def add_routes(self, app: FastAPI) -> None:
        generation = _responses(400, 413, 429, 503, 504)
        app.post("/v1/completions", responses={**generation, 404: _error_doc(404), 200: {"content": {
            "text/event-stream": {"schema": {"type": "string", "description": "with stream: true"}}}}})(
                self.completions)
        app.post("/v1/chat/completions", responses={**generation, 404: _error_doc(404), 200: {"content": {
            "text/event-stream": {"schema": {"type": "string", "description": "with stream: true"}}}}})(
                self.chat_completions)
        app.post("/generate", response_model=GenerateResponse, responses=generation)(self.generate)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}", responses=_responses(404))(self.model)
        app.get("/health", responses={503: {"description": "the engine has failed: restart the server"}})(self.health)
        app.get("/ready", responses={503: {"description": "starting, draining, or the engine has failed"}})(self.ready)
        for probe, handler in (("/health", self.health), ("/ready", self.ready)):  # load balancers and curl -I
            app.head(probe, include_in_schema=False)(handler)
        app.get("/metrics", response_class=PlainTextResponse,
                responses={200: {"description": "Prometheus text format"}})(self.prometheus_metrics)
        for path, name in PAGE.items():
            app.get(path, include_in_schema=False)(_static(name))

    # -- checks ---------------------------------------------------------------------------------

    async def check_prompts(self, texts: list[str]) -> None:
        """400 content_filter if a prompt matches the blocklist, or if checking takes over its time limit.
        Off the event loop: a slow regular expression delays its own request, never /health."""
        blocklist = self.engine.blocklist
        if not blocklist:
            return
        check = asyncio.get_running_loop().run_in_executor(self.checks, blocklist.first_blocked, texts)
        try:  # the regex module's timeout counts CPU time; on a busy machine the wall-clock one ends it first
            blocked = await asyncio.wait_for(check, blocklist.timeout)
        except (CheckTimeout, asyncio.TimeoutError):
            raise APIError(400, f"the prompt could not be checked against the blocklist within "
                           f"{blocklist.timeout:g} s, so it is refused; send a shorter or plainer prompt",
                           param="prompt", code="content_filter") from None
        if blocked is not None:
            raise APIError(400, "the prompt contains blocked content", param="prompt", code="content_filter")

    def fit(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """max_tokens for this prompt, or 400 context_length_exceeded."""
        room = self.context - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server's context is {self.context} tokens",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            return min(room, self.cfg.max_tokens_limit)
        if max_tokens > room:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus {param}={max_tokens} exceeds this server's "
                           f"context of {self.context} tokens", param=param, code="context_length_exceeded")
        return max_tokens

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text; a long prompt off the event loop, a short one on it (its encoding costs the
        loop less than the hand-off to a worker thread and back). add_special_tokens: False for a prompt a
        chat template rendered with its own (chat.ChatTemplate.add_special_tokens)."""
        if sum(map(len, texts)) <= INLINE_ENCODE_CHARS:
            return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]
        return [e.ids for e in await asyncio.to_thread(self.tokenizer.encode_batch, texts,
                                                       add_special_tokens=add_special_tokens)]

    async def read_prompts(self, prompts: list[str | list[int]]) -> tuple[list[list[int]], list[str]]:
        """Each prompt's token ids and text (a prompt of ids: its decoded text, special tokens included),
        checked against the blocklist: 400 for an id outside the model's vocabulary."""
        given = [p for p in prompts if not isinstance(p, str)]
        vocab = self.engine.vocab_size
        for ids in given:
            if max(ids) >= vocab:
                raise APIError(400, f"prompt: token id {max(ids)} is outside this model's vocabulary (0..{vocab - 1}); "
                               "send ids of the served model's tokenizer", param="prompt", code="invalid_token_id")
        decoded = iter(await asyncio.to_thread(self.tokenizer.decode_batch, given, skip_special_tokens=False)
                       if given else [])
        texts = [p if isinstance(p, str) else next(decoded) for p in prompts]
        await self.check_prompts(texts)
        encoded = iter(await self.encode([p for p in prompts if isinstance(p, str)]) if len(given) < len(prompts)
                       else [])
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts], texts

    def check_capacity(self, sequences: int, copies: str = "n") -> None:
        """400 when a request needs more sequences at once than the engine ever holds: a 429 would have
        clients retry forever. copies: the field that multiplies the prompts (n, or best_of)."""
        if sequences > self.engine.capacity:
            raise APIError(400, f"this request needs {sequences} sequences at once (prompts x {copies}), more than "
                           f"this server ever holds: {self.engine.capacity} (--max_batch_size "
                           f"{self.engine.max_batch_size} + --max_queue {self.engine.max_queue}); send "
                           f"fewer prompts or a smaller {copies}", param=copies, code="request_too_large")

    # -- into the engine and back -----------------------------------------------------------------

    def logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """The request's logit_bias as (token id, bias) pairs: 400 for an id outside the model's vocabulary."""
        pairs = tuple((int(token), value) for token, value in (bias or {}).items())
        vocab = self.engine.vocab_size
        if outside := [t for t, _ in pairs if t >= vocab]:
            raise APIError(400, f"logit_bias: token id {outside[0]} is outside this model's vocabulary "
                           f"(0..{vocab - 1}); send ids of the served model's tokenizer", param="logit_bias",
                           code="invalid_token_id")
        return pairs

    async def grammar(self, response_format: ResponseFormat | None) -> str | None:
        """The grammar a response_format constrains the reply to (None: none); 400 naming what is wrong.
        Off the event loop: checking a schema compiles it."""
        if response_format is None or response_format.type == "text":
            return None
        if not self.engine.constrains:
            raise APIError(400, "this server cannot constrain replies to a response_format: the model's tokenizer "
                           "has no end-of-text token to end a document, or constrained decoding (llguidance, of "
                           "the serve extra) cannot read it or is not installed", param="response_format",
                           code="unsupported_parameter")
        try:
            return await asyncio.to_thread(constrain.grammar_for, response_format.model_dump(exclude_none=True))
        except ValueError as e:
            raise APIError(400, str(e), param="response_format", code="invalid_response_format") from None

    def sampling(self, body: Sampling, ids: list[list[int]], budgets: list[int],
                 stop: tuple[str, ...], stop_ids: tuple[int, ...], *, copies: int, grammar: str | None = None,
                 logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
        """`copies` sequences per prompt (n, or best_of) and their sampling, as the request asks. grammar:
        constrain.grammar_for's. logprobs: the top-k alternatives each new token's log-probability comes
        with (None: none computed); prompt_logprobs: the same for the prompt's tokens (echo)."""
        seqs, params = [], []
        bias = self.logit_bias(body.logit_bias)
        for i, (x, budget) in enumerate(zip(ids, budgets, strict=True)):
            for j in range(copies):
                seqs.append(x)
                params.append(SamplingParams(
                    max_new_tokens=budget, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                    repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, logit_bias=bias, grammar=grammar, stop=stop,
                    stop_token_ids=() if body.ignore_eos else stop_ids,
                    seed=None if body.seed is None else choice_seed(body.seed, i * copies + j),
                    logprobs=logprobs, prompt_logprobs=prompt_logprobs))
        return seqs, params

    def submit(self, prompts: list[list[int]],
               params: list[SamplingParams]) -> tuple[asyncio.Queue[Event], list[Submitted]]:
        """Every sequence into the engine, or none of them: 429 when it is busy, 503 when it is draining,
        400 when the request is larger than the engine ever holds (check_capacity). The queue gets each
        sequence's text (output.py makes it of the engine's token ids)."""
        self.check_capacity(len(prompts))
        queue: asyncio.Queue[Event] = asyncio.Queue()
        sink, reqs = asyncio_sink(queue), []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
                reqs.append(self.output.submit(self.engine, ids, p, sink, index=i))
        except (QueueFull, Draining) as e:
            for r in reqs:
                r.cancel()
            if isinstance(e, Draining):
                code = "engine_failed" if self.engine.failed else "draining"
                raise APIError(503, str(e), type="server_error", code=code) from None
            raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None
        return queue, reqs

    async def collect(self, request: Request, queue: asyncio.Queue[Event], reqs: list[Submitted]) -> list[Event]:
        """Wait for every sequence; the accumulated text (and log-probabilities, if asked) and the last
        event's reason, per sequence."""
        texts, results = [""] * len(reqs), [Event(i, "") for i in range(len(reqs))]
        logprobs: list[list[Any] | None] = [None] * len(reqs)
        prompt_logprobs: list[list[Any] | None] = [None] * len(reqs)
        watcher = asyncio.create_task(watch_disconnect(request, reqs))
        try:
            for _ in range(len(reqs)):  # one last event per sequence
                while True:
                    ev = await next_event(queue, self.engine, reqs, self.cfg.stall_timeout)
                    if ev.logprobs is not None:
                        logprobs[ev.index] = (logprobs[ev.index] or []) + ev.logprobs
                    if ev.prompt_logprobs is not None:
                        prompt_logprobs[ev.index] = ev.prompt_logprobs
                    if ev.finish_reason is not None:
                        break
                    texts[ev.index] += ev.text
                ev.text, results[ev.index] = texts[ev.index] + ev.text, ev
                ev.logprobs, ev.prompt_logprobs = logprobs[ev.index], prompt_logprobs[ev.index]
                if ev.finish_reason not in COMPLETED:
                    for r in reqs:
                        r.cancel()
                    if watcher.done():  # the client left; nginx's 499 keeps these apart in /metrics
                        raise APIError(499, "the client closed the request", code="client_closed_request")
                    raise finish_error(ev, self.cfg.request_timeout)
        finally:
            watcher.cancel()
            for r in reqs:  # no-op for finished requests; frees the others if we were cancelled
                r.cancel()
        return results

    # -- handlers -------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        prompts = prompt_list(body.prompt)
        stop = stop_strings(body.stop)
        _check_completion(body, prompts, self.model_names, self.cfg.max_tokens_limit, self.cfg.max_logprobs)
        copies = body.best_of or body.n  # best_of: every candidate is generated, the n best returned
        # before the prompts are read: refused, they cost nothing
        self.check_capacity(len(prompts) * copies, "best_of" if body.best_of else "n")
        grammar = await self.grammar(body.response_format)
        ids, texts = await self.read_prompts(prompts)
        budgets = [self.fit(x, body.max_tokens, "max_tokens") for x in ids]
        # Ranking candidates needs each token's log-probability, asked for or not.
        ranked = copies > body.n
        seqs, params = self.sampling(body, ids, budgets, stop, self.stop_ids, copies=copies, grammar=grammar,
                                     logprobs=0 if ranked and body.logprobs is None else body.logprobs,
                                     prompt_logprobs=body.logprobs if body.echo else None)
        queue, reqs = self.submit(seqs, params)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.model or self.model_name}  # the name the client used, as OpenAI's API echoes it
        echo = [texts[k // copies] if body.echo else "" for k in range(len(seqs))]
        choices = [CompletionChoice(self.vocab, x, texts[k // copies] if body.echo else None,
                                    body.logprobs is not None)
                   for k, x in enumerate(seqs)]
        prompt_tokens = sum(len(x) for x in ids)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return stream_response(sse(request, queue, reqs, head, choices, prompt_tokens, usage,
                                       self.cfg.request_timeout, self.engine, self.cfg.stall_timeout))
        results = await self.collect(request, queue, reqs)
        returned = _best(results, copies, body.n) if ranked else results

        def shaped() -> list[dict[str, Any]]:
            return [text_choice(i, echo[r.index] + r.text, r.finish_reason, choices[r.index].chunk(r)[1])
                    for i, r in enumerate(returned)]

        # Log-probabilities decode every token's text (a long echo, n choices): off the event loop.
        # Usage counts every candidate generated, as OpenAI bills best_of.
        return {**head, "choices": shaped() if body.logprobs is None else await asyncio.to_thread(shaped),
                "usage": _usage(prompt_tokens, results)}

    async def chat_completions(self, body: ChatRequest, request: Request) -> Any:
        """OpenAI's chat completions: the messages rendered with the chat template into one prompt, then
        what /v1/completions does with a prompt."""
        # max_completion_tokens is OpenAI's newer name for max_tokens: it wins where both are sent
        param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        if body.model is not None and body.model not in self.model_names:
            raise _no_such_model(body.model, self.model_names)
        if max_tokens is not None and max_tokens > self.cfg.max_tokens_limit:
            raise APIError(400, f"{param} may be at most {self.cfg.max_tokens_limit}", param=param)
        if body.top_logprobs is not None and body.top_logprobs > self.cfg.max_logprobs:
            raise APIError(400, f"top_logprobs may be at most {self.cfg.max_logprobs} (the server's --max_logprobs)",
                           param="top_logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for field, tools in (("tools", body.tools), ("functions", body.functions)):
            if tools:
                raise APIError(400, f"{field} is not supported: this server does not call functions; send the "
                               f"request without {field}", param=field, code="unsupported_parameter")
        if self.chat is None:
            raise APIError(400, self.no_chat, param="messages", code="no_chat_template")
        grammar = await self.grammar(body.response_format)
        try:
            messages = chat.check_messages([m.model_dump(exclude_none=True) for m in body.messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        await self.check_prompts([m["content"] for m in messages])
        try:  # a template is code: off the event loop
            prompt = await asyncio.to_thread(self.chat.render, messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="chat_template_error") from None
        (ids,) = await self.encode([prompt], self.chat.add_special_tokens)
        if not ids:
            raise APIError(400, f"{self.chat.kind} rendered these messages as no text",
                           param="messages", code="chat_template_error")
        stop = stop_strings(body.stop)
        seqs, params = self.sampling(body, [ids], [self.fit(ids, max_tokens, param)], stop + self.chat.stop,
                                     self.chat_stop_ids, copies=body.n, grammar=grammar,
                                     logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        choices = [ChatChoice(self.vocab, body.logprobs, p.stop_token_ids) for p in params]
        queue, reqs = self.submit(seqs, params)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.model or self.model_name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return stream_response(sse(request, queue, reqs, {**head, "object": "chat.completion.chunk"}, choices,
                                len(ids), usage, self.cfg.request_timeout, self.engine, self.cfg.stall_timeout,
                                shape=DeltaChoices()))
        results = await self.collect(request, queue, reqs)

        def shaped() -> list[dict[str, Any]]:
            return [message_choice(r.index, r.text, r.finish_reason, choices[r.index].chunk(r)[1]) for r in results]

        return {**head, "choices": await asyncio.to_thread(shaped) if body.logprobs else shaped(),
                "usage": _usage(len(ids), results)}

    async def generate(self, body: GenerateRequest, request: Request) -> GenerateResponse:
        t0 = time.perf_counter()
        await self.check_prompts([body.prompt])
        (ids,) = await self.encode([body.prompt])
        budget = self.fit(ids, None, "max_length")
        if body.max_length <= len(ids):
            raise APIError(400, f"max_length ({body.max_length}) must exceed the prompt's {len(ids)} tokens: it "
                           f"counts the prompt too, as in Hugging Face generate; send at least {len(ids) + 1}",
                           param="max_length")
        params = SamplingParams(max_new_tokens=min(budget, body.max_length - len(ids)),
                                temperature=body.temperature, top_k=None, top_p=1.0, repetition_penalty=1.0,
                                seed=None, stop=(), stop_token_ids=self.stop_ids)
        queue, reqs = self.submit([ids], [params])
        (result,) = await self.collect(request, queue, reqs)
        return GenerateResponse(generated_text=body.prompt + result.text, inference_time=time.perf_counter() - t0)

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "gptopt",
                "max_model_len": self.context, "chat": self.chat is not None}  # chat: whether the chat route works

    async def models(self) -> dict[str, Any]:
        """Every name of the one served model, its default id first."""
        return {"object": "list", "data": [self.model_card(name) for name in self.model_names]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """OpenAI's GET /v1/models/{model}: the served model's object, or 404 model_not_found."""
        if model_id not in self.model_names:
            raise _no_such_model(model_id, self.model_names)
        return self.model_card(model_id)

    async def health(self) -> JSONResponse:
        # liveness: the process answers, and its engine has neither died nor stalled (an orchestrator restarts it)
        if self.engine.failed:
            return JSONResponse({"status": "failed"}, 503)
        if self.stalled():
            return JSONResponse({"status": "stalled"}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(self) -> JSONResponse:
        if self.engine.draining or not self.engine.alive or self.stalled():
            status = ("failed" if self.engine.failed else "draining" if self.engine.draining
                      else "stalled" if self.engine.alive else "starting")
            return JSONResponse({"status": status}, 503)
        return JSONResponse({"status": "ready", **self.engine.stats()})

    def stalled(self) -> bool:
        """The engine has made no progress for --stall_timeout with requests waiting; said in the log once a stall."""
        stalled = self.engine.stalled(self.cfg.stall_timeout)
        if stalled and not self._stall_said:
            log.error("the engine is stalled: %s", stall_error(self.cfg.stall_timeout))
        self._stall_said = stalled
        return stalled

    async def prometheus_metrics(self) -> Response:
        # off the event loop: an engine in its own process is asked for its figures
        return Response(await asyncio.to_thread(self.engine.render_metrics), media_type=CONTENT_TYPE)




def _best(results: list[Event], copies: int, n: int) -> list[Event]:
    """best_of: of each prompt's `copies` candidates (consecutive in results), the n with the highest mean
    log-probability per token (the end-of-text that ended one counts: it is part of its likelihood), in
    that order; a candidate with no token ranks by 0."""

    def mean(r: Event) -> float:
        return sum(e.logprob for e in r.logprobs) / len(r.logprobs) if r.logprobs else 0.0

    return [r for k in range(0, len(results), copies)
            for r in sorted(results[k : k + copies], key=mean, reverse=True)[:n]]


def _usage(prompt_tokens: int, results: list[Event]) -> dict[str, int]:
    completion_tokens = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}




def _static(name: str) -> Any:
    """The handler of one playground file, read now: an install that lacks it fails at start-up. The
    policy lets the page load and fetch from this server only; no-cache: an upgrade shows at once."""
    content = (Path(__file__).with_name("static") / name).read_bytes()
    media = {"html": "text/html", "css": "text/css", "js": "text/javascript"}[name.rsplit(".", 1)[1]]
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
               "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                          "form-action 'none'; frame-ancestors 'none'"}

    async def page() -> Response:
        return Response(content, media_type=f"{media}; charset=utf-8", headers=headers)

    return page
