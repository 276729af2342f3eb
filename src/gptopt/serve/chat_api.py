"""/v1/chat/completions' side of the API: OpenAI's chat.completion objects over the engine's results.

    curl -s 127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

The request model is protocol.py's ChatRequest; the route itself is in app.py beside /v1/completions,
whose machinery it shares (checks, submit, collect, the SSE stream); templates and message checks are
gptopt.infer.chat's.
"""

from __future__ import annotations

from typing import Any

CHAT_EXAMPLE_BODY = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'


def message_choice(index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a chat.completion; logprobs: {"content": [...]} when the request asked."""
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": reason}


class DeltaChoices:
    """The choices of chat.completion.chunk frames: a choice's first delta carries the role (with the
    content so far, "" included), later ones the new content; the last has the finish_reason and any
    text that came with it. One per stream: it remembers which choices have started."""

    def __init__(self) -> None:
        self.started: set[int] = set()

    def __call__(self, index: int, text: str, reason: str | None,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if index not in self.started:
            self.started.add(index)
            delta = {"role": "assistant", "content": text}
        elif text:
            delta = {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
