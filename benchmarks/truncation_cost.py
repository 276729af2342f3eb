"""What top-k and top-p rows cost against a plain sampled row: `pick` on 16 rows of random logits at temperature 1,
each setting's rows alike, the settings alternated round by round in one process; medians in ms and as a ratio to
the plain row of the same logits. The logits' spread (their standard deviation) sets how peaked a row is, and so
how wide its nucleus.

    python benchmarks/truncation_cost.py --vocab 49152 --spread 6 3
    python benchmarks/truncation_cost.py --baseline HEAD~1      # also the sampler of a git revision, interleaved

With --baseline, that revision's src/gptopt/infer/sampling.py is loaded as a second module beside this tree's
(the rest of the package is this tree's), and each of its settings is timed in the same rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gptopt.infer import sampling

SETTINGS = {"plain": {"top_k": None}, "top_k 50": {"top_k": 50}, "top_p 0.9": {"top_k": None, "top_p": 0.9},
            "top_p 0.5": {"top_k": None, "top_p": 0.5}, "top_k 50 + top_p 0.9": {"top_k": 50, "top_p": 0.9},
            "seeded plain": {"top_k": None, "seed": 0}, "seeded top_k 50": {"top_k": 50, "seed": 0}}


def at_revision(revision: str) -> ModuleType:
    """The sampler of a git revision, as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    try:
        text = subprocess.run(["git", "show", f"{revision}:src/gptopt/infer/sampling.py"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--baseline {revision}: git cannot show its sampler ({e.stderr.strip()}); give a "
                         "commit of this repository that has src/gptopt/infer/sampling.py") from None
    with tempfile.TemporaryDirectory() as tmp:  # the file is needed only while the module is executed
        path = Path(tmp) / "baseline_sampling.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("baseline_sampling", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["baseline_sampling"] = module
        spec.loader.exec_module(module)
    return module


def measure(logits: torch.Tensor, samplers: dict[str, ModuleType], rounds: int) -> dict[str, dict[str, float]]:
    """{sampler: {setting: median ms}}, every (sampler, setting) timed once a round, the order flipped each round."""
    B = len(logits)
    calls = {}
    for name, module in samplers.items():
        for setting, kwargs in SETTINGS.items():
            seed = kwargs.get("seed")
            params = [module.SamplingParams(temperature=1.0, **{k: v for k, v in kwargs.items() if k != "seed"})] * B

            def call(module: Any = module, params: list[Any] = params, seed: int | None = seed) -> None:
                gens = [None if seed is None else torch.Generator().manual_seed(seed + i) for i in range(B)]
                module.pick(logits, params, [[]] * B, gens)
            calls[(name, setting)] = call
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for key in calls:  # one unmeasured call each
        calls[key]()
    for r in range(rounds):
        for key in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            start = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - start)
    out: dict[str, dict[str, float]] = {name: {} for name in samplers}
    for (name, setting), t in times.items():
        out[name][setting] = round(statistics.median(t) * 1e3, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152, help="logits per row (SmolLM2's vocabulary)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--spread", type=float, nargs="+", default=[6.0, 3.0],
                        help="the logits' standard deviations: larger is more peaked, a narrower nucleus")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--baseline", help="a git revision whose sampler is timed beside this tree's")
    args = parser.parse_args()
    if args.vocab < 2 or args.rows < 1 or args.rounds < 1:
        parser.error("--vocab must be >= 2, --rows and --rounds >= 1")
    samplers = {"this tree": sampling}
    if args.baseline:
        samplers[args.baseline] = at_revision(args.baseline)
    for spread in args.spread:
        torch.manual_seed(0)
        logits = torch.randn(args.rows, args.vocab) * spread
        ms = measure(logits, samplers, args.rounds)
        largest = logits.softmax(dim=-1).amax(dim=-1)
        print(json.dumps({"vocab": args.vocab, "rows": args.rows, "spread": spread,
                          "largest_probability": [round(float(largest.min()), 4), round(float(largest.max()), 4)],
                          **{name: {s: {"ms": v, "x_plain": round(v / t["plain"], 2)} for s, v in t.items()}
                             for name, t in ms.items()}}))


if __name__ == "__main__":
    main()
