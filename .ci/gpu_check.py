#!/usr/bin/env python3
"""Every GPU path of gptopt, run and measured in one call: the plan, the runner and the record.

    bash .ci/gpu_check.sh DIR                       # the GPU machine: install, then every step
    python3 .ci/gpu_check.py run DIR --only bench   # again, some steps only (after a fix)
    python3 .ci/gpu_check.py dry-run DIR            # any machine: the plan, and DIR/results.json of it
    python3 .ci/gpu_check.py record DIR             # results.json -> the rows of docs/gpu-results.md

Standard library only: the runner starts before gptopt is installed (its first step installs it),
and every step is a separate process, so one that crashes, hangs or runs out of memory costs only
its own time limit. A GPU machine is lent rarely and briefly, so the run never stops early: a
failed step keeps the tail of its log, the next step starts, and results.json plus summary.txt
are rewritten after every step (a run cut off from outside still leaves what it had).

The plan is one list of steps in one place; the same steps run on a CPU with the debug preset
(`run DIR --target cpu`, what tests/test_gpu_check.py does) so that a typo in a command is found
here, not on the GPU. Steps that start together (`group`) only check that a path works: nothing
timed runs beside anything else.

The check is this file (the command line) and its siblings, each one concern, found because this folder
is sys.path[0]: gpu_check_plan.py (the sizes and the steps), gpu_check_figures.py (each step's figures,
read from its outputs), gpu_check_runner.py (the runner) over gpu_check_procs.py (a process group per
step), and gpu_check_record.py (summary.txt, and `record`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gpu_check_plan
from gpu_check_plan import BUDGET_S, CPU_LIMIT_S, ROOT, SIZES, Ctx, phases
from gpu_check_record import record, unfit_folder
from gpu_check_runner import Runner, _say


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    for verb, what in (("run", "run the steps"), ("dry-run", "print the plan and write DIR/results.json of it")):
        p = sub.add_parser(verb, help=what)
        p.add_argument("dir", type=Path, help="where logs, outputs, results.json and summary.txt go")
        p.add_argument("--target", choices=SIZES, default="gpu",
                       help="gpu: the real sizes; cpu: the debug preset, to rehearse every command (default: gpu)")
        p.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
        p.add_argument("--skip", default="", help="comma-separated steps to leave out")
        p.add_argument("--budget", type=int, default=None, help=f"seconds for the whole run (default: {BUDGET_S} on "
                       "a GPU; on a CPU the steps' limits)")
        p.add_argument("--report", type=Path, default=None, help="also keep results.json, summary.txt and logs.txt "
                       "(each step's log tail) here: three small files, for a machine that returns only a few")
    p = sub.add_parser("record", help="add DIR/results.json's rows to docs/gpu-results.md")
    p.add_argument("dir", type=Path)
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "gpu-results.md")
    args = ap.parse_args(argv)

    if args.verb == "record":
        for line in record(args.dir, args.doc):
            print(line)
        return 0
    wheels = Path(os.environ.get("GPTOPT_WHEELS", ROOT / ".whl"))
    ctx = Ctx(out=args.dir.resolve(), target=args.target, sizes=SIZES[args.target],
              wheels=tuple(sorted(str(w) for w in wheels.glob("*.whl"))) if wheels.is_dir() else ())
    steps = gpu_check_plan.plan(ctx)  # through its module: a test puts a plan of its own there
    order = [s.name for s in steps]
    names = set(order)
    only, skip = ({n for n in x.split(",") if n} for x in (args.only, args.skip))
    if unknown := (only | skip) - names:
        ap.error(f"unknown step(s) {', '.join(sorted(unknown))}; the steps: {', '.join(s.name for s in steps)}")
    if only and args.target == "gpu":
        # a rerun on a fresh machine (a lease's machine goes back when idle) needs gptopt and the data again
        only |= {"install"} | ({"prepare"} if not (ctx.out / "data" / "meta.json").is_file() else set())
    if "serve" in only:  # the Hugging Face folder its peer serves, made from this call's checkpoint
        only |= {"serve_export"}
    steps = [s for s in steps if (s.name in only if only else s.default) and s.name not in skip
             and (args.target == "gpu" or s.cpu or s.name in only)]
    for folder, flag in ((ctx.out, "DIR"), (args.report, "--report")):
        if folder is not None and (problem := unfit_folder(folder)):
            ap.error(f"{flag} {folder}: {problem}")
    ctx.out.mkdir(parents=True, exist_ok=True)
    budget_s = args.budget or (BUDGET_S if args.target == "gpu" else CPU_LIMIT_S * len(phases(steps)))
    runner = Runner(ctx, steps, budget_s, order, report=args.report.resolve() if args.report else None)
    if args.verb == "dry-run":
        for phase in phases(steps):
            for step in phase:
                others = ", ".join(s.name for s in phase if s is not step)
                together = f" [starts with: {others}]" if others else ""
                _say(f"{step.name:<17} {runner.results[step.name]['limit_s']:>4}s  {step.what}{together}")
                r = runner.results[step.name]
                for line in filter(None, [r.get("decode"), r["command"], *r.get("loadtests", []), r.get("peer"),
                                          *r.get("peer_loadtests", [])]):
                    _say(f"{'':<17}        $ {line}")
        _say(f"planned: {runner.header['planned_s']}s of a {budget_s}s budget, {len(steps)} steps -> "
             f"{ctx.out / 'results.json'}")
        runner.save()
        return 0
    doc = runner.run()
    if "cut_off" in doc:
        _say(f"cut off ({doc['cut_off']}) after {doc['seconds']}s; results: {ctx.out / 'results.json'}")
        return 130
    bad = [name for name, r in runner.results.items() if r["status"] != "ok"]  # this run's steps
    _say(f"done in {doc['seconds']}s: {len(runner.results) - len(bad)} ok"
         + (f", not ok: {', '.join(bad)}" if bad else ""))
    _say(f"results: {ctx.out / 'results.json'}, {ctx.out / 'summary.txt'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
