"""The HTTP app (create_app): the engine, the guard in front of every route (guard.py), the routes (routes.py:
the playbook's POST /generate, OpenAI-compatible /v1/completions and /v1/chat/completions, health, metrics,
the playground), every error in OpenAI's body, and the OpenAPI document of what the server really sends.

    gptopt serve --model out/ --port 8000
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fib(n):", "max_tokens": 32, "stream": true}'

The `openai` Python client works unchanged against base_url=http://HOST:PORT/v1. Every request the
schema admits (protocol.py) gets a 2xx, or a 4xx with OpenAI's error body {"error": {"message", "type",
"param", "code"}}, checked before any model work; generation itself runs on the engine thread
(engine.py), by default in a process of its own (engine_process.py): the routes see either through
engine.EngineClient alone. server.py runs the app; streams are sse.py's.
Nothing a request sends runs unbounded on the event loop: tokenizing and the blocklist check run in
threads, the blocklist under a time limit. The body is read as JSON whatever its declared content
type (curl -d sends form-encoded). With --api_key every route but the probes /health and /ready and the
playground's page (GET /, static/), the docs and /metrics included, needs the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from gptopt.config import ServeConfig
from gptopt.utils.extras import require

require("fastapi", "serve", "gptopt serve")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.middleware.cors import CORSMiddleware  # noqa: E402
from fastapi.openapi.utils import get_openapi  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402

from gptopt.serve.client import EngineClient  # noqa: E402
from gptopt.serve.engine import settled_heap  # noqa: E402
from gptopt.serve.engine_process import EngineProcess  # noqa: E402
from gptopt.serve.guard import OPEN_ROUTES, Guard  # noqa: E402
from gptopt.serve.protocol import APIError, validation_error  # noqa: E402
from gptopt.serve.routes import STATUS_DOC, Routes  # noqa: E402
from gptopt.serve.startup import build_engine  # noqa: E402

log = logging.getLogger(__name__)



def create_app(cfg: ServeConfig, *, model: Any = None, tokenizer: Any = None) -> FastAPI:
    """The app for `cfg`. Without `model`, loads cfg.model (and its tokenizer) now, once; warms up."""
    engine = _engine(cfg, model, tokenizer)
    api = Routes(cfg, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with settled_heap():
            engine.start()
            yield
            await asyncio.to_thread(engine.shutdown, cfg.request_timeout)  # drain: finish in-flight requests
            api.checks.shutdown(wait=False)

    app = FastAPI(title="gptopt", version="1", lifespan=lifespan,
                  description="GPT-2-class text generation: the playbook's /generate and OpenAI /v1/completions "
                  "and /v1/chat/completions")
    app.state.engine, app.state.metrics, app.state.model_name = engine, engine.metrics, api.model_name
    # The last added is the outermost: CORS answers browsers' preflights (which carry no key) itself.
    app.add_middleware(Guard, metrics=engine.metrics, api_key=api.api_key)
    if cfg.cors_origin:
        app.add_middleware(CORSMiddleware, allow_origins=[cfg.cors_origin], allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    _add_error_handlers(app)
    api.add_routes(app)
    app.openapi = lambda: _openapi(app, guarded=api.api_key is not None,  # type: ignore[method-assign]
                                   max_tokens_limit=cfg.max_tokens_limit, max_logprobs=cfg.max_logprobs)
    return app


def _engine(cfg: ServeConfig, model: Any, tokenizer: Any) -> EngineClient:
    """The engine, warmed up and not started yet: in a process of its own (engine_process.py) when the
    model is loaded from cfg.model and cfg.engine_process asks for it, else in this process (which has set
    its switches where it started: server.main, or the test or notebook that made the model)."""
    if model is None and cfg.engine_process:
        return EngineProcess(cfg)
    return build_engine(cfg, model, tokenizer)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, in OpenAI's body."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(list(e.errors())).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), e.status_code, headers=e.headers)


def _openapi(app: FastAPI, *, guarded: bool, max_tokens_limit: int, max_logprobs: int) -> dict[str, Any]:
    """The schema of what the server does: 400 (never FastAPI's 422) with OpenAI's body, 401 and the
    bearer scheme where a key is needed, this server's max_tokens and logprobs limits."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        unauthorized = {"description": STATUS_DOC[401],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
        for path, operations in schema["paths"].items():
            for op in operations.values():
                op["responses"].pop("422", None)
                if guarded and path not in OPEN_ROUTES:
                    op["security"] = [{"bearer": []}]
                    op["responses"]["401"] = unauthorized
        if guarded:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for request, field, maximum in (("CompletionRequest", "max_tokens", max_tokens_limit),
                                        ("ChatRequest", "max_tokens", max_tokens_limit),
                                        ("ChatRequest", "max_completion_tokens", max_tokens_limit),
                                        ("CompletionRequest", "logprobs", max_logprobs),
                                        ("ChatRequest", "top_logprobs", max_logprobs)):
            limit = next(a for a in schemas[request]["properties"][field]["anyOf"] if a.get("type") == "integer")
            limit["maximum"] = maximum
        app.openapi_schema = schema
    return app.openapi_schema


