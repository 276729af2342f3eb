"""What an engine hands its clients: Events (new text of one sequence, and at the end why it finished), and
the sinks that carry them, grouped so that each client event loop or pipe wakes once per engine iteration.

    python -c "from gptopt.serve.events import Event; print(Event(0, 'hi'))"

For asyncio clients, asyncio_sink(queue) puts each event into the queue on its event loop (deliver); a
ChannelSink sends them down a Channel (engine_process.py's pipe to the HTTP process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gptopt.infer.sampling import TokenLogprob

# Why a sequence ended. stop/length/content_filter are OpenAI's, and incomplete gptopt's (a constrained reply cut
# before its document was complete: decoding.Finish); they come with a result (COMPLETED), the others without:
# failed is the engine's end (its process died), error a failure of the request's own steps.
FinishReason = Literal["stop", "length", "content_filter", "incomplete", "cancelled", "timeout", "error", "failed"]
COMPLETED: tuple[FinishReason, ...] = ("stop", "length", "content_filter", "incomplete")


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


Sink = Callable[[Event], None]


class AsyncioSink:
    """Delivers events into an asyncio queue on its event loop (make it on that loop). The engine hands
    an iteration's events for one loop over in a single call (deliver), so the loop wakes once."""

    def __init__(self, queue: asyncio.Queue[Event], loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.queue, self.loop = queue, loop or asyncio.get_running_loop()

    def __call__(self, event: Event) -> None:
        deliver([(self, event)])


def asyncio_sink(queue: asyncio.Queue[Event], loop: asyncio.AbstractEventLoop | None = None) -> AsyncioSink:
    """A sink that delivers events into `queue` on its event loop (call from that loop)."""
    return AsyncioSink(queue, loop)


class Channel:
    """Where a ChannelSink's events go: send() takes an iteration's events for this channel in one call,
    as (key, event) pairs (engine_process.py's pipe to the HTTP process)."""

    def send(self, items: list[tuple[int, Event]]) -> None:
        raise NotImplementedError


class ChannelSink:
    """Delivers events into `channel` under `key` (which request they belong to), grouped per channel."""

    def __init__(self, channel: Channel, key: int) -> None:
        self.channel, self.key = channel, key

    def __call__(self, event: Event) -> None:
        deliver([(self, event)])


def _put_all(items: list[tuple[AsyncioSink, Event]]) -> None:
    for sink, event in items:
        sink.queue.put_nowait(event)


def deliver(outbox: list[tuple[Sink, Event]]) -> None:
    """Hand each event to its sink, in order: asyncio sinks grouped by event loop, one call_soon_threadsafe
    per loop (each is a write to the loop's wake-up pipe and a pass of the loop), channel sinks grouped
    by channel, one send each; other sinks called."""
    loops: dict[asyncio.AbstractEventLoop, list[tuple[AsyncioSink, Event]]] = {}
    channels: dict[Channel, list[tuple[int, Event]]] = {}
    for sink, event in outbox:
        if isinstance(sink, AsyncioSink):
            loops.setdefault(sink.loop, []).append((sink, event))
        elif isinstance(sink, ChannelSink):
            channels.setdefault(sink.channel, []).append((sink.key, event))
        else:
            sink(event)
    for channel, keyed in channels.items():
        channel.send(keyed)
    for loop, items in loops.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: its clients are gone, nothing to deliver to
            pass
