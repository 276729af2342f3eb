"""AdamW's best settings for a wall-time budget: a sweep of learning rate and step settings, each run's
horizon the number of its steps that fit the budget.

    python benchmarks/adamw_sweep.py --data_dir data/stdlib --out sweep [--budget_s 300]
        [--settings 16x256,8x256] [--lrs 1e-3,2e-3,3e-3,4e-3] [--warmups 100] [--step_ms 16x256=392,8x256=235]
        [--jobs 2] [-- extra train flags, e.g. --use_amp]

Time decides only each setting's horizon: its step time is measured first, one setting at a time with nothing
else running (or given with --step_ms), and a run of that setting has budget / step time steps, its cosine
decay ending there. Every other figure is a count of steps, so the runs themselves may share the machine
(--jobs, one thread each): the val loss a run ends at does not depend on how fast it went. The table is
sorted by final val loss (the whole val split at the end, every --eval_every steps on the way); the best
row is the tuned baseline of `gptopt bench --mode quality`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TIMING_STEPS = 25


def train(argv: list[str], log: Path, threads: int | None = None) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "gptopt", "train", *argv, "--overwrite", "--no-tensorboard", "--sample_tokens", "0",
           "--save_interval", "0"]
    with open(log, "w") as f:  # the run's output goes to its log as it comes, and outlives this script
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    text = log.read_text()
    if proc.returncode:
        raise SystemExit(f"train failed ({log}):\n{text[-2000:]}")
    return text


def step_ms(setting: str, args: argparse.Namespace, out: Path) -> float:
    b, t = setting.split("x")
    err = train(["--data_dir", args.data_dir, "--output_dir", str(out / f"time-{setting}"), "--batch_size", b,
                 "--seq_len", t, "--max_steps", str(TIMING_STEPS), "--eval_interval", "0", *args.extra],
                out / f"time-{setting}.log")
    m = re.search(r"median step ([\d.]+) ms", err)
    if not m:
        raise SystemExit(f"no step time in the timing run of {setting}")
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", default="data/stdlib")
    p.add_argument("--out", default="sweep")
    p.add_argument("--budget_s", type=float, default=300.0)
    p.add_argument("--settings", default="16x256,8x256", help="micro-batch x sequence length, comma-separated")
    p.add_argument("--lrs", default="1e-3,2e-3,3e-3,4e-3")
    p.add_argument("--warmups", default="100")
    p.add_argument("--step_ms", default="", help="SETTING=MS,...: step times measured before (skips the timing)")
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--eval_iters", type=int, default=8, help="val batches: 8 of 16 x 256 is tiny's whole stdlib split")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags every run takes (e.g. --use_amp)")
    args = p.parse_args()
    args.extra = [a for a in args.extra if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    given = dict(kv.split("=") for kv in args.step_ms.split(",") if kv)
    settings = args.settings.split(",")
    ms = {s: float(given[s]) if s in given else step_ms(s, args, out) for s in settings}
    grid = [(s, float(lr), int(w)) for s in settings for lr in args.lrs.split(",") for w in args.warmups.split(",")]

    def run(s: str, lr: float, warmup: int) -> dict:
        b, t = s.split("x")
        steps = int(args.budget_s * 1000 / ms[s])
        name = f"{s}-lr{lr:g}-w{warmup}"
        run_json = out / name / "run.json"  # a finished run is read again, not rerun
        if not (run_json.is_file() and json.loads(run_json.read_text())["summary"].get("step") == steps):
            train(["--data_dir", args.data_dir, "--output_dir", str(out / name), "--batch_size", b, "--seq_len", t,
                   "--learning_rate", str(lr), "--warmup_steps", str(warmup), "--max_steps", str(steps),
                   "--seed", str(args.seed), "--eval_interval", str(args.eval_every), "--eval_iters",
                   str(args.eval_iters), *args.extra], out / f"{name}.log", threads=1 if args.jobs > 1 else None)
        evals = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        curve = [(e["step"], e["val_loss"]) for e in evals if "val_loss" in e]
        return {"setting": s, "lr": lr, "warmup": warmup, "step_ms": ms[s], "steps": steps,
                "final_val_loss": curve[-1][1], "curve": curve}

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda g: run(*g), grid))
    rows.sort(key=lambda r: r["final_val_loss"])
    (out / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"| step setting | lr | warmup | step (ms) | steps in {args.budget_s:g} s | final val loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['lr']:g} | {r['warmup']} | {r['step_ms']:.0f} | {r['steps']} "
              f"| {r['final_val_loss']:.4f} |")


if __name__ == "__main__":
    main()
