"""Where `gptopt serve`'s threads spend their time under load, from py-spy's raw (collapsed) stacks.

    py-spy record -p ENGINE_PID -r 200 -f raw --threads --idle -d 12 -o stacks.txt   # while a loadtest runs
    python benchmarks/engine_phases.py stacks.txt

ENGINE_PID: the server's engine process, `pgrep -P SERVER_PID -f spawn_main` (the HTTP threads are
the server's own PID); with `gptopt serve --no-engine_process` both are the server's PID.

Each sample is charged to the first phase found walking its stack from the innermost frame out
(PHASES, in order); a thread's idle share is its samples waiting on a lock or the event loop's
selector. The engine thread's phases are what one iteration spends: the prefill and decode
forwards, sampling, detokenizing and stop strings, the blocklist, metrics and event delivery; the HTTP
process's: the hand-off from the engine (the events pipe, each event loop's share), tokenizing, the SSE
frames, the HTTP stack (uvicorn, starlette, fastapi) and the event loop itself.

With --tokens (the output tokens the loadtest received while py-spy recorded) and --rate (py-spy's -r),
each phase is also given as CPU microseconds per output token, to set one process's stages beside
another's or before beside after. Record without --idle for that: py-spy then samples a thread only
while it runs, so a sample is CPU time.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

# (phase, frame substrings): a frame matches a phase if it contains any of them
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("idle", ("Condition.wait", "EpollSelector.select", "select (selectors")),
    ("sampling", ("Generator.sample", "gptopt/infer/sampling.py")),
    ("detokenize and stop strings", ("StopChecker",)),
    ("blocklist", ("TextFilter",)),
    ("metrics", ("prometheus_client",)),
    ("event delivery", ("deliver (", "_deliver", "asyncio_sink", "call_soon_threadsafe", "_put_all",
                        "_Pipe.", "EngineProcess._read", "EngineProcess._dispatch", "EngineProcess._send",
                        "EngineProcess._flush", "EngineProcess.submit", "_command (", "_commands (")),
    ("tokenize", ("Routes.encode", "Routes.read_prompts")),
    # Generator._forward is in neither: the prefill and the eager decode share it, so the caller decides
    ("prefill forward", ("Generator.extend", "Generator.prefill (", "Generator.prefill_step", "Generator.begin")),
    ("decode forward", ("Generator.decode", "_decode_static")),
    ("other engine work", ("Engine._",)),
    ("SSE frames", ("gptopt/serve/sse.py",)),
    ("HTTP stack", ("starlette", "fastapi", "uvicorn", "h11", "httptools", "gptopt/serve/app.py",
                    "gptopt/serve/guard.py")),
    ("event loop", ("asyncio/", "uvloop")),
]


def thread_name(frame: str) -> str:
    """py-spy's first frame, 'thread (TID): NAME' (or 'thread (TID)'), as the name alone."""
    name = frame.split(": ", 1)[1] if ": " in frame else frame
    return name.strip() or frame


# A thread blocked in C (a pipe's read, a pool worker's queue, a sleep) can be sampled as running: a stack
# whose innermost frame is one of these is waiting, whatever py-spy thought (the idle phase's frames wait
# wherever they are).
BLOCKED: tuple[str, ...] = ("Connection._recv (", "_worker (concurrent/futures/thread.py", "_orphan_watch (")


def phase(frames: list[str]) -> str:
    if frames and any(k in frames[-1] for k in BLOCKED):
        return "idle"
    for f in reversed(frames):
        for name, keys in PHASES:
            if any(k in f for k in keys):
                return name
    return "other"


def shares(lines: list[str]) -> dict[str, collections.Counter[str]]:
    """Samples per thread and phase, from py-spy raw lines 'thread (TID): NAME;frame;...;frame COUNT'."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        out[thread_name(frames[0])][phase(frames[1:])] += int(count)
    return out


def table(counts: dict[str, collections.Counter[str]], per_token: float | None = None) -> str:
    """Each thread's busy share by phase; per_token: seconds a sample stands for, over the output tokens
    (then each phase's CPU microseconds per token too, and the process's total)."""
    rows = []
    everything = 0
    for thread, c in counts.items():
        total = sum(c.values())
        busy = total - c["idle"]
        if busy == 0:
            continue
        everything += busy
        rows.append(f"{thread}: {total} samples, busy {busy / total:.1%}")
        for name, n in c.most_common():
            if name != "idle":
                cost = "" if per_token is None else f"  {n * per_token * 1e6:8.1f} us a token"
                rows.append(f"  {name:<28} {n / busy:6.1%} of its busy time{cost}")
    if per_token is not None:
        rows.append(f"all threads: {everything * per_token * 1e6:.1f} us of CPU a token")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stacks", help="py-spy record -f raw output")
    ap.add_argument("--tokens", type=int, help="output tokens received while py-spy recorded: adds each "
                    "phase's CPU microseconds per token")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's sampling rate, its -r (default 100)")
    args = ap.parse_args(argv)
    path = Path(args.stacks)
    if not path.is_file():
        print(f"engine_phases.py: {path}: no such file; record one with py-spy (see --help)", file=sys.stderr)
        return 2
    if args.tokens is not None and (args.tokens < 1 or args.rate <= 0):
        print("engine_phases.py: --tokens and --rate must be positive", file=sys.stderr)
        return 2
    per_token = None if args.tokens is None else 1 / args.rate / args.tokens
    print(table(shares(path.read_text(errors="replace").splitlines()), per_token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
