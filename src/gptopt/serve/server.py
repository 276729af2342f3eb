"""The server runner: `gptopt serve` binds its address, builds the app (app.py), serves it with uvicorn
until SIGTERM or SIGINT, and drains the engine before it exits.

    gptopt serve --model out/ --port 8000

Everything that can be refused is refused before the model loads: the API key, the chat template, the
address (bind). On a stop signal the engine first stops admitting (so /ready turns 503), then uvicorn
finishes the open requests. serve_in_thread runs an app the same way in a background thread (tests,
notebooks).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from gptopt.config import ServeConfig
from gptopt.infer import chat
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

for _module in ("fastapi", "uvicorn"):
    require(_module, "serve", "gptopt serve")
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.client import EngineClient  # noqa: E402
from gptopt.serve.guard import api_key  # noqa: E402
from gptopt.serve.startup import set_process_switches  # noqa: E402

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM/SIGINT, first stops the engine admitting (so /ready turns 503), then lets
    uvicorn finish the open requests (up to timeout_graceful_shutdown) before the engine stops."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        engine: EngineClient | None = getattr(getattr(self.config.app, "state", None), "engine", None)
        if engine is not None:
            engine.begin_drain()
        super().handle_exit(sig, frame)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[DrainingServer]:
    """Run `app` on a real uvicorn server in a background thread (tests, notebooks); `.port` is bound."""
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=30))
    thread = threading.Thread(target=server.run, name="gptopt-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    server.port = server.servers[0].sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    server.thread = thread  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound now as uvicorn would bind it, so that a port in use or a host that is
    not this machine's fails with one line before the model loads (uvicorn itself logs and exits 1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP,
    # and without it each small streamed chunk waited for the client's delayed ACK
    # (benchmarks/2026-12-04-serving-vs-transformers.md, "Streamed tokens held by Nagle's algorithm").
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use (another server?); stop it, or choose "
                             "another with --port N (--port 0 picks a free one)") from None
        if e.errno == errno.EACCES:
            raise UserError(f"port {port} on {host} needs privileges to listen on; choose one from 1024 up with "
                             "--port N") from None
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host {host} is not an address of this machine; use 127.0.0.1 (this machine only) "
                             "or 0.0.0.0 (every interface)") from None
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --host or "
                         "--port") from None
    return sock


def main(cfg: ServeConfig) -> int:
    """`gptopt serve`: load the model once, warm up, serve until SIGTERM/SIGINT, drain, exit 0."""
    api_key(cfg)  # before any work
    if cfg.chat_template is not None:  # a bad one: before loading (the model's own may fail later, as a warning)
        chat.load_template(cfg.chat_template, chat.template_folders(cfg.model, cfg.tokenizer))
    sock = bind(cfg.host, cfg.port)  # before the model loads, and before "serving on" is said
    try:
        if not cfg.engine_process:  # the engine runs here; else its process sets them where it starts
            set_process_switches(cfg)
        app = create_app(cfg)
    except BaseException:
        sock.close()
        raise
    engine: EngineClient = app.state.engine
    port = sock.getsockname()[1]  # --port 0: the one picked
    log.info("serving %s on http://%s:%d (batch %d, queue %d); OpenAI base_url http://%s:%d/v1",
             app.state.model_name, cfg.host, port, engine.max_batch_size, cfg.max_queue, cfg.host, port)
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=port, log_level="info",
                                           timeout_graceful_shutdown=int(cfg.request_timeout) + 1))
    server.run(sockets=[sock])
    return 0 if server.started else 1
