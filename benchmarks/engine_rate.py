"""The serving engine's own rate: closed-loop clients submitting straight to it, no HTTP, no streams.

    python benchmarks/engine_rate.py --model DIR [--clients 16] [--requests 256] [--max_tokens 32]
        [--prompt_tokens 60] [--max_batch_size 64] [--compile] [--solo_threads N] [--thread] [--dtype auto]

The engine is built as `gptopt serve` builds it (serve.startup: the process switches, then build_engine: the
same slots, warm-up and thread rule) and runs on this script's main thread, as in the engine process; --thread
runs it in a thread of its own, as `gptopt serve --no-engine_process` does. Each client sends a prompt of random
token ids, waits for its last token and sends the next, until --requests are done; greedy, with no stop
token, so every request makes exactly --max_tokens. What it prints is the ceiling that `gptopt
loadtest` figures of the same load are read against: tokens/s, decode steps and the sequences in each
(a compiled step computes its whole bucket of rows), and the time per prefill and decode forward.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from typing import Any

from gptopt.config import ServeConfig
from gptopt.infer.sampling import SamplingParams
from gptopt.serve.engine import Engine
from gptopt.serve.events import TokenEvent
from gptopt.serve.startup import build_engine, set_process_switches


def check(clients: int, requests: int) -> None:
    if not 1 <= clients <= requests:
        raise ValueError(f"clients must be in 1..requests ({requests}), got {clients}")


def rate(engine: Engine, *, clients: int, requests: int, max_tokens: int, prompt_tokens: int,
         in_thread: bool = False, seed: int = 0, timeout: float = 600.0) -> dict[str, Any]:
    """Run the closed loop on a built engine that has not started; what it measured. A run that has not
    finished within `timeout` seconds is stopped and reported with the requests done ("complete": false)."""
    check(clients, requests)
    if clients > engine.capacity:
        raise ValueError(f"clients must be at most the engine's {engine.capacity} places (max_batch_size + "
                         f"max_queue), got {clients}")
    gen, rng, lock = engine.generator, random.Random(seed), threading.Lock()
    finished, stopping = threading.Event(), threading.Event()
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    state = {"sent": 0, "done": 0, "tokens": 0, "errors": 0, "end": 0.0}
    spent = {"prefill": 0.0, "decode": 0.0}
    rows: list[int] = []

    def timed(name: str, f: Any) -> Any:
        def call(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args)
            finally:
                spent[name] += time.perf_counter() - t
                if name == "decode":
                    rows.append(len(args[0]))
        return call

    gen.prefill_step, gen.decode_next = timed("prefill", gen.prefill_step), timed("decode", gen.decode_next)

    def send() -> None:
        prompt = [rng.randrange(gen.vocab_size) for _ in range(prompt_tokens)]
        engine.submit(prompt, params, sink)

    def sink(ev: TokenEvent) -> None:  # on the engine's thread: the next request goes in at once
        if ev.finish_reason is None:
            return
        with lock:
            state["done"] += 1
            state["tokens"] += ev.completion_tokens
            state["errors"] += int(ev.finish_reason not in ("length", "stop"))
            more = state["sent"] < requests and not stopping.is_set()  # past the deadline: nothing new
            state["sent"] += int(more)
            if state["done"] == requests:
                state["end"] = time.perf_counter()
                finished.set()
        if more:
            send()

    state["sent"] = clients
    for _ in range(clients):
        send()
    def stop() -> None:
        finished.wait(timeout)
        with lock:  # a sink that sees this sends no more: a drain refuses them
            stopping.set()
        engine.shutdown(0)

    t0 = time.perf_counter()
    if in_thread:
        engine.start()
        stop()
    else:
        threading.Thread(target=stop, daemon=True).start()
        engine.run()
    wall = (state["end"] or time.perf_counter()) - t0  # to the last request's end, in either mode
    return {"tokens_per_s": state["tokens"] / wall, "tokens": state["tokens"], "requests_done": state["done"],
            "complete": finished.is_set(), "errors": state["errors"], "seconds": wall, "decode_steps": len(rows),
            "mean_decode_sequences": sum(rows) / max(1, len(rows)),
            "decode_ms": 1e3 * spent["decode"] / max(1, len(rows)),
            "prefill_s": spent["prefill"], "decode_s": spent["decode"], "engine_thread": "own" if in_thread else "main"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="what `gptopt serve --model` takes")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--prompt_tokens", type=int, default=60, help="prompt length in token ids; the default "
                    "comes near what loadtest's default prompt (words of a fixed text) tokenizes to")
    ap.add_argument("--max_batch_size", type=int, default=None, help="KV-cache slots; default: serve's")
    ap.add_argument("--compile", action="store_true", help="as `gptopt serve --compile`")
    ap.add_argument("--solo_threads", type=int, default=None, help="as `gptopt serve --solo_threads`")
    ap.add_argument("--thread", action="store_true", help="the engine in a thread of its own (--no-engine_process)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="as `gptopt serve --dtype`")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before an unfinished run is stopped")
    args = ap.parse_args(argv)
    try:
        check(args.clients, args.requests)  # before the model loads (and compiles, with --compile: slow)
        cfg = ServeConfig(model=args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                          max_batch_size=args.max_batch_size, solo_threads=args.solo_threads)
        set_process_switches(cfg)  # as serve's engine process does where it starts
        engine = build_engine(cfg)
        result = rate(engine, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens,
                      prompt_tokens=args.prompt_tokens, in_thread=args.thread, timeout=args.timeout)
    except (ValueError, FileNotFoundError) as e:
        print(f"engine_rate.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"args": vars(args), **result}, indent=1))
    if not result["complete"] or result["errors"]:
        print(f"engine_rate.py: {result['requests_done']} of {args.requests} requests done, {result['errors']} "
              "with an error: the figures are not the engine's rate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
