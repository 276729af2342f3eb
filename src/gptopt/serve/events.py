"""What an engine hands the front end and what a client receives, and the sinks that carry them, grouped so that
each client event loop or pipe wakes once per engine iteration.

    python -c "from gptopt.serve.events import TokenEvent; print(TokenEvent([42]))"

The engine sends TokenEvents: each forward's new token ids of a sequence, and at the end why it finished. The
front end's output processor (output.py) turns them into Events, the text its client streams. For asyncio
clients, asyncio_sink(queue) puts each event into the queue on its event loop (deliver), and any LoopSink
takes its events on its loop; a ChannelSink sends them down a Channel (engine_process.py's pipe to the HTTP
process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gptopt.infer.sampling import TokenLogprob

# Why a sequence ended. stop/length/content_filter are OpenAI's, and incomplete gptopt's (a constrained reply cut
# before its document was complete: decoding.Finish); they come with a result (COMPLETED), the others without:
# failed is the engine's end (its process died), error a failure of the request's own steps.
FinishReason = Literal["stop", "length", "content_filter", "incomplete", "cancelled", "timeout", "error", "failed"]
COMPLETED: tuple[FinishReason, ...] = ("stop", "length", "content_filter", "incomplete")


@dataclass
class TokenEvent:
    """What the engine hands the front end after a forward, for one sequence: its new token ids, and at the end why
    it finished (output.py makes the text of them)."""

    token_ids: list[int]  # the tokens it took in this forward (several after a speculative step), all of them text
    # Set on its last event: "length" comes with the budget's last token, the last of token_ids; "stop" and
    # "incomplete" after them (a stop token id, or a token its grammar refused: neither is text).
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0  # generated so far, a stop token id that ended it included (usage counts it)
    error: str | None = None
    # How a stop string found in these tokens ends it: "incomplete" where that cuts a constrained document short
    # (Decoding.stop_reason). A constrained sequence takes one token a forward, so this holds for each of them.
    stop_reason: FinishReason = "stop"
    # As Event's, for the tokens of this event: the front end hands them on with the text they belong to.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Event:
    """What a client receives: new text of one sequence, and at the end why it finished."""

    index: int  # which sequence of the client's request (OpenAI's choice index)
    text: str  # complete UTF-8 characters only; "" when the new token's text is held back
    finish_reason: FinishReason | None = None  # set on the last event of the sequence
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    # Only for requests whose params ask for them: the new tokens' entries since the previous event (a
    # token whose text is held back goes with the next event), and, on the sequence's first event, the
    # prompt's (one per prompt token after the first).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


Sink = Callable[[Event], None]  # a client's
TokenSink = Callable[[TokenEvent], None]  # the engine's events: the front end's (output.py), or a pipe's


class LoopSink:
    """A sink that takes its events on an asyncio event loop: the engine hands an iteration's events for one loop
    over in a single call (deliver), so the loop wakes once. With no loop (None) it takes them where they are
    delivered."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop

    def take(self, event: Any) -> None:
        """One event, on the sink's loop."""
        raise NotImplementedError

    def __call__(self, event: Any) -> None:
        if self.loop is None:
            self.take(event)
        else:
            deliver([(self, event)])


class AsyncioSink(LoopSink):
    """Delivers events into an asyncio queue on its event loop (make it on that loop)."""

    def __init__(self, queue: asyncio.Queue[Any], loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(loop or asyncio.get_running_loop())
        self.queue = queue

    def take(self, event: Any) -> None:
        self.queue.put_nowait(event)


def asyncio_sink(queue: asyncio.Queue[Any], loop: asyncio.AbstractEventLoop | None = None) -> AsyncioSink:
    """A sink that delivers events into `queue` on its event loop (call from that loop)."""
    return AsyncioSink(queue, loop)


class Channel:
    """Where a ChannelSink's events go: send() takes an iteration's events for this channel in one call,
    as (key, event) pairs (engine_process.py's pipe to the HTTP process)."""

    def send(self, items: list[tuple[int, TokenEvent]]) -> None:
        raise NotImplementedError


class ChannelSink:
    """Delivers events into `channel` under `key` (which request they belong to), grouped per channel."""

    def __init__(self, channel: Channel, key: int) -> None:
        self.channel, self.key = channel, key

    def __call__(self, event: TokenEvent) -> None:
        deliver([(self, event)])


def _take_all(items: list[tuple[LoopSink, Any]]) -> None:
    for sink, event in items:
        sink.take(event)


def deliver(outbox: list[tuple[Callable[[Any], None], Any]]) -> None:
    """Hand each event to its sink, in order: loop sinks grouped by event loop, one call_soon_threadsafe
    per loop (each is a write to the loop's wake-up pipe and a pass of the loop), channel sinks grouped
    by channel, one send each; other sinks called."""
    loops: dict[asyncio.AbstractEventLoop, list[tuple[LoopSink, Any]]] = {}
    channels: dict[Channel, list[tuple[int, TokenEvent]]] = {}
    for sink, event in outbox:
        if isinstance(sink, LoopSink) and sink.loop is not None:
            loops.setdefault(sink.loop, []).append((sink, event))
        elif isinstance(sink, ChannelSink):
            channels.setdefault(sink.channel, []).append((sink.key, event))
        else:
            sink(event)
    for channel, keyed in channels.items():
        channel.send(keyed)
    for loop, items in loops.items():
        try:
            loop.call_soon_threadsafe(_take_all, items)
        except RuntimeError:  # the loop is closed: its clients are gone, nothing to deliver to
            pass
