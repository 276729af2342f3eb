"""What the serve tests share: a live in-process server of the debug model (running) or of a model folder with its
engine in a process of its own (running_apart), requests and their checks, and processes' states. Apart from
conftest.py because it needs the serve extra (fastapi, httpx): a module imports it after its importorskips.

    pytest -q tests/test_serve*.py
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from gptopt.config import ServeConfig, preset
from gptopt.infer import sampling
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.models.gpt import GPT
from gptopt.serve.app import create_app
from gptopt.serve.client import Draining
from gptopt.serve.server import serve_in_thread

PROMPT = "def parse_args(self, args=None):"
# Rules no server may let freeze it: regular expressions that backtrack exponentially (their repeats
# bounded, as every rule's must be), and such text as a plain term (matched literally, so harmless).
HOSTILE_BLOCKLIST = ("re:(a|a){1,60}$\nre:(a{1,20}){1,20}$\nre:(x{1,20}x{1,20}){1,20}y\nre:(.{0,20}a){20}\n"
                     "(a+)+$\nforbidden\n")
# Two forwards of different shapes (a prompt prefilled whole or after a cached prefix, rows batched apart)
# round differently in their last bits on some CPUs: their log-probabilities agree to this.
LOGPROB_TOL = 1e-4


@contextlib.contextmanager
def running(tokenizer: Any, decode_delay: float = 0.0, **overrides: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, app) of a live server with the debug model (the same weights every time)."""
    torch.manual_seed(0)
    model = GPT(preset("debug", vocab_size=tokenizer.get_vocab_size())).eval()
    app = create_app(ServeConfig(**{"model": "debug", "device": "cpu", **overrides}), model=model, tokenizer=tokenizer)
    if decode_delay:  # slow requests down so several overlap, as under real load
        gen, decode = app.state.engine.generator, app.state.engine.generator.decode

        def slow_decode(*args: Any) -> torch.Tensor:
            time.sleep(decode_delay)
            return decode(*args)

        gen.decode = slow_decode
    with serve_in_thread(app) as server:
        app.state.server = server
        yield f"http://127.0.0.1:{server.port}", app


def completion(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, **body}, timeout=60)


def sse(response: httpx.Response) -> list[Any]:
    """The data frames of an SSE body, parsed; '[DONE]' stays a string."""
    frames = [line[6:] for line in response.content.decode("utf-8").split("\n\n") if line.startswith("data: ")]
    assert response.content.decode("utf-8").endswith("data: [DONE]\n\n")
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err



def byte_token(tokenizer: Any, b: int) -> int:
    """The id of the single-byte token for byte b in a byte-level BPE (GPT-2's byte -> character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [x for x in range(256) if x not in printable]
    char = chr(b) if b in printable else chr(256 + others.index(b))
    return tokenizer.token_to_id(char)


def first_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """Where the earliest of `stops` starts in `text` (its length if none does), and which one it is."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found) if found else (len(text), None)


def end_of_text_after(gen: Generator, monkeypatch: pytest.MonkeyPatch, prompt_len: int, n: int, eot: int) -> None:
    """The engine's sampler picks end-of-text as the n-th new token (as a model that ends there would)."""
    real = sampling.pick

    def pick(logits: torch.Tensor, params: Any, histories: list[list[int]], generators: Any,
             *rest: Any) -> torch.Tensor:
        t = real(logits, params, histories, generators, *rest)
        at_end = torch.tensor([len(h) - prompt_len >= n - 1 for h in histories])
        return torch.where(at_end, torch.full_like(t, eot), t)

    monkeypatch.setattr(sampling, "pick", pick)  # every Generator's: the test's engine runs only `gen`


def stream_through_a_sigterm(url: str, app: Any) -> list[Any]:
    """The frames of a 30-token greedy stream whose server gets SIGTERM after the first (what uvicorn's
    signal handler calls); meanwhile a new request must get 503 draining."""
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        app.state.server.handle_exit(signal.SIGTERM, None)
        assert app.state.engine.draining
        with pytest.raises(Draining):  # at the engine: uvicorn may already be closing the listener
            app.state.engine.submit([1], SamplingParams(max_new_tokens=1), lambda event: None)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in [first, *rest[:-1]]]


@contextlib.contextmanager
def running_apart(model_dir: Path, setup: Any = None, **overrides: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, app) of a live server of model_dir whose engine runs in a child process."""
    from gptopt.serve import app as app_module
    from gptopt.serve.engine_process import EngineProcess

    cfg = ServeConfig(**{"model": str(model_dir), "device": "cpu", "max_batch_size": 2, **overrides})
    if setup is None:
        app = create_app(cfg)
    else:  # the same app, its engine process given the test's setup
        real = app_module.EngineProcess
        app_module.EngineProcess = lambda c: EngineProcess(c, setup=setup)  # type: ignore[assignment]
        try:
            app = create_app(cfg)
        finally:
            app_module.EngineProcess = real  # type: ignore[assignment]
    assert isinstance(app.state.engine, EngineProcess)
    with serve_in_thread(app) as server:
        app.state.server = server
        yield f"http://127.0.0.1:{server.port}", app


def alive(pid: int | None) -> bool:
    try:
        assert pid is not None
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().split(")")[-1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def same_up_to_rounding(a: Any, b: Any, tol: float = LOGPROB_TOL) -> bool:
    """Two JSON answers are the same but for float rounding: the same keys, lists, strings and integers, and
    floats within `tol` of each other (for the numbers of two forwards of different shapes, LOGPROB_TOL)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=0, abs_tol=tol)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_up_to_rounding(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            same_up_to_rounding(x, y, tol) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
