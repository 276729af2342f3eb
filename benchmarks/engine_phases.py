"""Where `gptopt serve`'s threads spend their time under load, from py-spy's raw (collapsed) stacks.

    py-spy record -p ENGINE_PID -r 200 -f raw --threads --idle -d 12 -o stacks.txt   # while a loadtest runs
    python benchmarks/engine_phases.py stacks.txt

ENGINE_PID: the server's engine process, `pgrep -P SERVER_PID -f spawn_main` (the HTTP threads are
the server's own PID); with `gptopt serve --no-engine_process` both are the server's PID.

Each sample is charged to the first phase found walking its stack from the innermost frame out
(PHASES, in order); a thread's idle share is its samples waiting on a lock or the event loop's
selector. The engine thread's phases are what one iteration spends: the prefill and decode
forwards, sampling, detokenizing and stop strings, the blocklist, metrics and event delivery.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

# (phase, frame substrings): a frame matches a phase if it contains any of them
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("idle", ("Condition.wait", "EpollSelector.select", "select (selectors")),
    ("sampling", ("Generator.sample",)),
    ("detokenize and stop strings", ("StopChecker",)),
    ("blocklist", ("TextFilter",)),
    ("metrics", ("prometheus_client",)),
    ("event delivery", ("deliver (", "_deliver", "asyncio_sink", "call_soon_threadsafe", "_put_all")),
    # Generator._forward is in neither: the prefill and the eager decode share it, so the caller decides
    ("prefill forward", ("Generator.extend", "Generator.prefill (", "Generator.prefill_step", "Generator.begin")),
    ("decode forward", ("Generator.decode", "_decode_static")),
    ("other engine work", ("Engine._",)),
    ("HTTP and streaming", ("_sse", "starlette", "fastapi", "uvicorn", "h11", "httptools")),
]


def thread_name(frame: str) -> str:
    """py-spy's first frame, 'thread (TID): NAME' (or 'thread (TID)'), as the name alone."""
    name = frame.split(": ", 1)[1] if ": " in frame else frame
    return name.strip() or frame


def phase(frames: list[str]) -> str:
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


def table(counts: dict[str, collections.Counter[str]]) -> str:
    rows = []
    for thread, c in counts.items():
        total = sum(c.values())
        busy = total - c["idle"]
        if busy == 0:
            continue
        rows.append(f"{thread}: {total} samples, busy {busy / total:.1%}")
        rows += [f"  {name:<28} {n / busy:6.1%} of its busy time" for name, n in c.most_common() if name != "idle"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stacks", help="py-spy record -f raw output")
    args = ap.parse_args(argv)
    path = Path(args.stacks)
    if not path.is_file():
        print(f"engine_phases.py: {path}: no such file; record one with py-spy (see --help)", file=sys.stderr)
        return 2
    print(table(shares(path.read_text(errors="replace").splitlines())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
