"""The ASGI middleware in front of every route (Guard): the API key, 413 for a body over MAX_BODY_BYTES, JSON
whatever the declared content type, and the request counter by route and status; and the key itself (api_key).

    python -c "from gptopt.serve.guard import OPEN_ROUTES; print(OPEN_ROUTES)"
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from gptopt.config import ServeConfig
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

require("fastapi", "serve", "gptopt serve")
from fastapi.responses import JSONResponse  # noqa: E402

from gptopt.serve.chat_api import CHAT_EXAMPLE_BODY  # noqa: E402
from gptopt.serve.metrics import ServeMetrics  # noqa: E402
from gptopt.serve.protocol import (  # noqa: E402
    EXAMPLE_BODY,
    APIError,
    json_problem,
)

log = logging.getLogger(__name__)

# The request limit checked here, before a handler reads the body (the schema's are in protocol.py).
MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt that fits a GPT-2 context
# The playground (static/): a page and its two files, served without the key so that a browser can open
# it and ask for the key; every request the page makes is an API request, which needs it.
PAGE = {"/": "index.html", "/static/playground.css": "playground.css", "/static/playground.js": "playground.js"}
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/health", "/ready",
          "/metrics", *PAGE)  # metric labels
OPEN_ROUTES = ("/health", "/ready", *PAGE)  # probes and the playground: answered without the API key
JSON_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")  # the routes that take a body: a JSON object


def api_key(cfg: ServeConfig) -> str | None:
    """The key requests must send: --api_key, else $GPTOPT_API_KEY, else None (no authentication).
    An empty one is refused: it is what an unset shell variable (--api_key "$KEY") gives, and serving
    without a key because of it would open the server silently."""
    if cfg.api_key is not None:
        if not cfg.api_key.strip():
            raise UserError("--api_key is empty; give a key or leave the option out")
        return cfg.api_key
    key = os.environ.get("GPTOPT_API_KEY")
    if key is not None and not key.strip():
        raise UserError("GPTOPT_API_KEY is set but empty; set it to a key, or unset it to serve without one")
    return key




class Guard:
    """ASGI middleware in front of every route: the API key, 413 for bodies over MAX_BODY_BYTES, JSON
    whatever the declared content type, and the request counter by route and status.

    The key is checked here, before the body is read, so no route can be added without it (the docs
    and /metrics included). The body is read here (at most the limit) and replayed, so no handler ever
    sees a bigger one; its content type is set to JSON, the only body this API takes, so that
    `curl -d` (form-encoded) works and a body that is not JSON is told exactly that."""

    def __init__(self, app: Any, metrics: ServeMetrics, api_key: str | None) -> None:
        self.app, self.metrics = app, metrics
        self.api_key = api_key.encode() if api_key is not None else None

    def authorized(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None or scope["path"] in OPEN_ROUTES:
            return True
        given = headers.get(b"authorization", b"")
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(token, self.api_key)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else (
            "/v1/models/{id}" if scope["path"].startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        headers = dict(scope["headers"])
        try:
            if not self.authorized(scope, headers):
                err = APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")
                return await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, counted_send)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = bytearray()
                length = headers.get(b"content-length", b"0")
                too_big = not length.isdigit() or int(length) > MAX_BODY_BYTES
                while not too_big:  # a chunked body has no length: count what arrives
                    message = await receive()
                    if message["type"] == "http.disconnect":  # the client left mid-body: no server error
                        status["code"] = 499  # nginx's "client closed request", as collect() counts a departure
                        return
                    body += message.get("body", b"")
                    too_big = len(body) > MAX_BODY_BYTES
                    if not message.get("more_body"):
                        break
                if too_big:
                    err = APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
                    return await JSONResponse(err.body(), 413)(scope, receive, counted_send)
                if route in JSON_ROUTES:
                    example = CHAT_EXAMPLE_BODY if route == "/v1/chat/completions" else EXAMPLE_BODY
                    if problem := json_problem(bytes(body), example):
                        err = APIError(400, problem, code="invalid_json")
                        return await JSONResponse(err.body(), 400)(scope, receive, counted_send)
                    scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                             + [(b"content-type", b"application/json")]}
                receive = replay_body(bytes(body), receive)
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.requests.labels(route, str(status["code"])).inc()


def replay_body(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, which streaming watches for

    return replay
