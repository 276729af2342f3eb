"""OpenAI's completion stream (server-sent events): one chunk per text delta, each choice's finish, usage, then
[DONE]; a client that goes away cancels its requests.

    curl -sN 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "x", "stream": true}'
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from gptopt.utils.extras import require

require("fastapi", "serve", "gptopt serve")
from fastapi import Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from gptopt.serve.client import EngineClient, Submitted  # noqa: E402
from gptopt.serve.events import COMPLETED, Event  # noqa: E402
from gptopt.serve.logprobs import ChatChoice, CompletionChoice  # noqa: E402
from gptopt.serve.protocol import (  # noqa: E402
    APIError,
)

log = logging.getLogger(__name__)

async def watch_disconnect(request: Request, requests: list[Submitted]) -> None:
    """Cancel the engine requests when the client goes away, so their slots free up at once."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for r in requests:
                r.cancel()
            return


def finish_error(ev: Event, timeout: float) -> APIError:
    if ev.finish_reason == "timeout":
        return APIError(504, f"generation took longer than the server's {timeout:g} s limit",
                        type="timeout_error", code="timeout")
    if ev.finish_reason == "cancelled":
        return APIError(503, "the server stopped before the request finished", type="server_error")
    if ev.finish_reason == "failed":
        return APIError(503, f"{ev.error}: restart the server", type="server_error", code="engine_failed")
    return APIError(500, f"generation failed: {ev.error}", type="server_error")


def stall_error(seconds: float) -> APIError:
    """What a request waiting on a stalled engine is told (and the log says)."""
    return APIError(503, f"the engine made no progress for {seconds:g} s with requests waiting (stuck in a step, "
                    "or deadlocked): restart the server", type="server_error", code="engine_stalled")


async def next_event(queue: asyncio.Queue[Event], engine: EngineClient, reqs: list[Submitted],
                     stall: float) -> Event:
    """The next event for these requests. An engine that makes no progress for `stall` seconds with work waiting
    is reported, so that no client waits without end: the requests cancelled, a log line, APIError 503
    engine_stalled."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), stall)
        except asyncio.TimeoutError:
            if engine.stalled(stall):
                for r in reqs:
                    r.cancel()
                log.error("ended a request: %s", stall_error(stall))
                raise stall_error(stall) from None




def stream_response(frames: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def text_choice(index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


async def sse(request: Request, queue: asyncio.Queue[Event], reqs: list[Submitted], head: dict[str, Any],
               choices: Sequence[CompletionChoice | ChatChoice], prompt_tokens: int, usage: bool, timeout: float,
               engine: EngineClient, stall: float,
               shape: Callable[[int, str, str | None, Any], dict[str, Any]] = text_choice) -> AsyncIterator[bytes]:
    """OpenAI's completion stream: one chunk per text delta, per-choice finish, usage, then [DONE].
    choices[i].chunk(event) gives an event's text and logprobs object; shape(index, text, finish_reason,
    logprobs) makes the chunk's choice of them: a completion's text, a chat's delta."""

    def frame(obj: Any) -> bytes:  # ensure_ascii=False: deltas are whole characters, sent as UTF-8
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    def chunk(ev: Event, reason: str | None) -> bytes:
        extra = {"usage": None} if usage else {}
        text, logprobs = choices[ev.index].chunk(ev)
        return frame({**head, "choices": [shape(ev.index, text, reason, logprobs)], **extra})

    watcher = asyncio.create_task(watch_disconnect(request, reqs))
    try:
        completion_tokens, open_ = 0, len(reqs)
        for i, c in enumerate(choices):
            if c.echo and c.logprobs is None:
                yield chunk(Event(i, c.echo), None)
        failed = False
        while open_ and not failed:
            # What has arrived goes out in one write: the engine delivers an iteration's events together.
            try:
                events, out = [await next_event(queue, engine, reqs, stall)], []
            except APIError as e:  # a stalled engine: the stream ends with its error
                yield frame(e.body())
                failed = True
                break
            while not queue.empty():
                events.append(queue.get_nowait())
            for ev in events:
                if ev.finish_reason is None:
                    out.append(chunk(ev, None))
                    continue
                open_ -= 1
                completion_tokens += ev.completion_tokens
                if ev.finish_reason not in COMPLETED:
                    out.append(frame(finish_error(ev, timeout).body()))
                    failed = True
                    break
                out.append(chunk(ev, ev.finish_reason))
            yield b"".join(out)
        if usage and not failed:
            yield frame({**head, "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}})
        yield b"data: [DONE]\n\n"
    finally:
        watcher.cancel()
        for r in reqs:
            r.cancel()
