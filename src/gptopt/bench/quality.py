"""The recipe ladder: minutes of training to a target val loss, each recipe from the same weights on the
same data, over several seeds, with a significance stated.

    gptopt bench --mode quality                                  # tiny on the stdlib corpus, its default target
    gptopt bench --mode quality --recipes modern,no-muon,no-rope  # modern and what two of its changes buy
    gptopt bench --mode quality --target_loss 4.5 --seeds 5 --recipes adamw,muon,best

Every run is `gptopt train --target_loss L` in a process of its own (what a user runs). On tiny the step
settings are AdamW's tuned ones (TUNED_STEP: bf16 autocast, 16 sequences of 256 tokens a step); the training
ladder's best.toml replaces them when --output_dir holds one, and --batch_size / --seq_len override both. Seed s
gives every recipe the same batches (train draws them from --seed; the same initial weights where the recipes
share a model), so a recipe's difference is its own. A run's time to target is the wall time of its training
steps (evals and saves left out) up to the evaluation that found the val loss at or below the target; runs are
interleaved seed by seed so that a slow spell of the machine falls on every recipe alike. A recipe other than
AdamW stops at 1.5x AdamW's steps on its seed (GIVE_UP; when AdamW reached the target on that seed): no recipe's
step is cheaper than AdamW's, so by then it is at least 1.5x slower, out of the race.

The default target is the val loss the tuned AdamW reaches in about five minutes of a 2-core CPU, well into
training (docs/benchmarks.md, "Time to quality"): a loss worth having, against the best AdamW a user could tune.

Recipes (default: adamw and modern, which the 45-minute budget of a 2-core CPU holds; `all` runs every one):
  adamw     AdamW with GPT-2's block at the best learning rate and step settings of a sweep for that budget
            (benchmarks/adamw_sweep.py), the baseline of every figure
  muon      the baseline with --optimizer muon (Muon on the blocks' weight matrices, AdamW on the rest)
  modern    the speedrun records' block as --arch (rotary, QK-norm, ReLU^2, untied head, zero-initialised
            projections and head) with Muon for its matrices, at its own rates and horizon
  no-muon, no-rope, no-qk_norm, no-relu2, no-untied, no-zero_init
            modern without one of its changes: each one's time over modern's is what that change buys
  aligned   the baseline with --align_documents (windows start at document boundaries)
  schedule  the baseline's cosine decay ending where its runs reached the target (median steps)
  best      every change above that beat AdamW's time significantly (Welch, p < 0.01; with one seed,
            the mean), together (the decay ending where the fastest of them reached the target);
            AdamW again if none did

The report: minutes and tokens to target per recipe (mean and spread), the val loss and bits per byte each
recipe's runs ended with (at the target where reached, else at the step cap), Welch's t-test of the best
recipe against AdamW, val loss against training time for every run (quality.png),
quality_report.md, quality_results.json, and quality_best.toml for `gptopt train --config`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gptopt.bench.report import KIND, QUALITY_FILES
from gptopt.bench.setup import bench_preset
from gptopt.config import BenchConfig, TrainConfig
from gptopt.infer.measure import STOPPED
from gptopt.outputs import replacing
from gptopt.runtime.device import cpu_has_fast_bf16, environment, resolve
from gptopt.runtime.signals import CTRL_C_EXIT
from gptopt.utils.errors import UserError
from gptopt.utils.extras import has, require
from gptopt.utils.tables import fmt, text_table, to_json, toml_text

log = logging.getLogger("gptopt")

BASELINE = "adamw"
DEFAULT_RECIPES = ("adamw", "modern")

# AdamW at the best of a sweep of learning rate and step settings for the default target's budget (about five
# minutes of tiny on a CPU: benchmarks/adamw_sweep.py, docs/benchmarks.md "Time to quality"): the baseline's rates
# and horizon, and every recipe's step settings (the training ladder's best.toml or --batch_size / --seq_len
# replace them).
TUNED_STEP: dict[str, Any] = {"use_amp": True, "batch_size": 16, "seq_len": 256}
TUNED_ADAMW: dict[str, Any] = {"learning_rate": 4e-3, "warmup_steps": 100, "lr_decay_steps": 765}
# The speedrun records' block (modded-nanogpt, nanochat) as --arch fields over GPT-2's: rotary positions, a norm
# (the block's LayerNorm) on each head's queries and keys, squared-ReLU MLP, a head of its own, every block's
# output projections and the head starting at zero.
MODERN_ARCH: dict[str, Any] = {"positions": "rope", "qk_norm": True, "mlp": "relu2", "tie_embeddings": False,
                               "zero_init": True}
# Muon for the blocks' matrices (AdamW for embeddings, head, norms) at the rates and horizon tried for it on tiny
# (benchmarks/2026-12-06-time-to-quality.md)
MODERN_OPT: dict[str, Any] = {"optimizer": "muon", "muon_lr": 6e-3, "learning_rate": 8e-3, "warmup_steps": 10,
                              "lr_decay_steps": 300}


def _arch(fields: dict[str, Any]) -> str:
    return ",".join(f"{k}={str(v).lower()}" for k, v in fields.items())


# An ablation per large change: the modern recipe without it (what it buys is the ablation's time over modern's)
ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "no-muon": ("AdamW at the baseline's rates", {"optimizer": "adamw", "muon_lr": None, **{
        k: v for k, v in TUNED_ADAMW.items() if k != "lr_decay_steps"}}),
    "no-rope": ("learned positions", {"positions": "learned"}),
    "no-qk_norm": ("no norm on queries and keys", {"qk_norm": False}),
    "no-relu2": ("GPT-2's GELU MLP", {"mlp": "gelu"}),
    "no-untied": ("the head tied to the embedding (zero_init then leaves it GPT-2's)", {"tie_embeddings": True}),
    "no-zero_init": ("GPT-2's scaled normal init", {"zero_init": False}),
}


def _without(change: dict[str, Any]) -> dict[str, Any]:
    arch = {**MODERN_ARCH, **{k: v for k, v in change.items() if k in MODERN_ARCH}}
    opts = {**MODERN_OPT, **{k: v for k, v in change.items() if k not in MODERN_ARCH}}
    return {"arch": _arch(arch), **{k: v for k, v in opts.items() if v is not None}}


CHANGES: dict[str, tuple[str, dict[str, Any]]] = {  # the fixed recipes: what each changes, as train options
    "adamw": ("AdamW with GPT-2's block at the best rates of a sweep (lr 4e-3, warmup 100, cosine over 765 steps)",
              dict(TUNED_ADAMW)),
    # Muon's rates and warmup, measured for it on tiny (benchmarks/2026-12-04-time-to-quality.md)
    "muon": ("--optimizer muon on GPT-2's block: Muon 3e-3 on the blocks' weight matrices, AdamW 4e-3 on the rest "
             "(embeddings, tied head, biases, LayerNorm), warmup 10 steps; the baseline's horizon",
             {**TUNED_ADAMW, "optimizer": "muon", "muon_lr": 3e-3, "learning_rate": 4e-3, "warmup_steps": 10}),
    "modern": ("the speedrun block (rotary, QK-norm, ReLU^2, untied head, zero-initialised projections) with Muon "
               "for its matrices", {"arch": _arch(MODERN_ARCH), **MODERN_OPT}),
    **{name: (f"modern without one change: {what}", _without(change)) for name, (what, change) in ABLATIONS.items()},
    "aligned": ("--align_documents: every window starts at a document boundary",
                {**TUNED_ADAMW, "align_documents": True}),
}
DERIVED = {
    "schedule": "the baseline with its cosine decay ending at the median step where it reached the target",
    "best": "every change that beat AdamW's time significantly (Welch, p < 0.01), together",
}
# The embedded default: tiny on the stdlib corpus at the tuned step settings, to the val loss the tuned AdamW
# reaches in about five minutes on a CPU (docs/benchmarks.md, "Time to quality"); and every run's step cap.
DEFAULT_TARGET = {"tiny": 2.55}
DEFAULT_MAX_STEPS = 1000
GIVE_UP = 1.5  # a recipe's step cap: this many times AdamW's steps to the target on the same seed
EVAL_INTERVAL = 10  # steps between evaluations: the time to target is known to within that many steps
EVAL_ITERS = 8  # val batches per evaluation (tiny's whole stdlib val split), the same windows every time
SIGNIFICANCE = 0.01
PROGRESS_S = 2.0  # how often the bar reads a running run's evaluations


TRAIN_WARMUP: int = TrainConfig.__dataclass_fields__["warmup_steps"].default


def _schedule(steps: int, warmup: int = TRAIN_WARMUP) -> dict[str, Any]:
    """The decay ends at `steps`; the recipe's warmup stays (with AdamW a short one cost tiny steps:
    benchmarks/2026-12-04-time-to-quality.md, "Time to quality"), at most half the decay."""
    return {"lr_decay_steps": steps, **({"warmup_steps": max(1, steps // 2)} if warmup > steps // 2 else {})}


@dataclass
class Run:
    recipe: str
    seed: int
    flags: dict[str, Any]
    out: Path
    cap: int | None = None  # the step cap below max_steps (Ladder._cap), or None
    reached: bool = False
    time_s: float | None = None  # training time to target (steps only), first step included
    time_excl_compile_s: float | None = None
    tokens: int | None = None
    steps: int | None = None
    best_val_loss: float | None = None
    curve: list[tuple[float, float]] = field(default_factory=list)  # (training seconds, val loss) per evaluation
    end_bpb: float | None = None  # bits per byte of the run's last evaluation (where it stopped)
    config: dict[str, Any] | None = None  # the TrainConfig the run's process trained under (its run.json)
    error: str | None = None
    skipped: str | None = None  # why it was not measured (measure.STOPPED: the ladder was stopped first)


def recipes(spec: str) -> list[str]:
    names = list(DEFAULT_RECIPES) if spec.strip() == "default" else [*CHANGES, *DERIVED] if spec.strip() == "all" \
        else [p.strip() for p in spec.split(",") if p.strip()]
    known = [*CHANGES, *DERIVED]
    if not names:  # the baseline alone would run, compared with nothing
        raise UserError(f"--recipes {spec!r} names no recipe; choose from {', '.join(known)}, or default")
    bad = [n for n in names if n not in known]
    if bad:
        raise UserError(f"--recipes: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    if BASELINE not in names:
        names.insert(0, BASELINE)  # every figure is against it
    return [n for n in known if n in names]  # derived recipes after what they derive from


def train_argv(cfg: BenchConfig, run: Run, target: float, max_steps: int, best_toml: Path | None,
               sizes: dict[str, Any]) -> list[str]:
    argv = [sys.executable, "-m", "gptopt", "train"]
    if best_toml is not None:
        argv += ["--config", str(best_toml)]
    opts: dict[str, Any] = {
        "data_dir": cfg.data_dir, "output_dir": str(run.out), "seed": run.seed, "target_loss": target,
        "max_steps": max_steps, "eval_interval": EVAL_INTERVAL, "eval_iters": EVAL_ITERS, "sample_tokens": 0,
        "save_interval": 0, "save_total_limit": 1, "log_interval": EVAL_INTERVAL, "device": cfg.device,
        **({"preset": cfg.preset} if cfg.preset else {}), **sizes, **run.flags,
    }
    if run.cap is not None:  # stops sooner, on the schedule of the others (a warmup-only one stays so)
        if max_steps > opts.get("warmup_steps", TRAIN_WARMUP):
            opts.setdefault("lr_decay_steps", max_steps)
        opts["max_steps"] = run.cap
    for k, v in opts.items():
        if isinstance(v, bool):
            argv.append(f"--{k}" if v else f"--no-{k}")
        else:
            argv += [f"--{k}", str(v)]
    return [*argv, "--overwrite", "--no-tensorboard"]


def _latest_eval(metrics: Path) -> tuple[int, float] | None:
    """The (step, val loss) of a running run's latest evaluation, or None before its first."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:  # the line being written
            continue
        if "val_loss" in rec:
            return rec["step"], rec["val_loss"]
    return None


def read_run(run: Run) -> None:
    """The run's run.json "config" and "target", and its metrics.jsonl evaluations."""
    info = json.loads((run.out / "run.json").read_text())
    run.config = info["config"]
    target = info.get("target") or {}
    run.reached = bool(target.get("reached"))
    run.time_s, run.time_excl_compile_s = target.get("time_to_target_s"), target.get("time_to_target_excl_compile_s")
    run.tokens, run.steps, run.best_val_loss = target.get("tokens_to_target"), target.get("steps_to_target"), \
        target.get("best_val_loss")
    for line in (run.out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec and "train_s" in rec:
            run.curve.append((rec["train_s"], rec["val_loss"]))
            run.end_bpb = rec.get("val_bpb", run.end_bpb)


class Ladder:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir).expanduser()
        self.names = recipes(cfg.recipes)
        self.seeds = [cfg.seed + i for i in range(cfg.seeds)]
        self.plan = resolve(cfg.device, quiet=True)
        self.preset = bench_preset(cfg, self.plan)
        self.cfg = dataclasses.replace(cfg, preset=self.preset)  # every run trains the preset the report names
        if cfg.target_loss is None and self.preset not in DEFAULT_TARGET:
            raise UserError(f"--mode quality has no default target for {self.preset}: pass --target_loss")
        self.target = cfg.target_loss if cfg.target_loss is not None else DEFAULT_TARGET[self.preset]
        self.max_steps = cfg.max_steps or DEFAULT_MAX_STEPS
        toml = self.out / "best.toml"  # the training ladder's fastest step settings, if it ran here
        self.best_toml = toml if toml.is_file() else None
        # the step settings every run takes, kept by quality_best.toml with the recipe: the tuned ones where the
        # default target was tuned (no best.toml here), the flags' micro-batch and length over them
        tuned = TUNED_STEP if self.best_toml is None and self.preset in DEFAULT_TARGET else {}
        self.step_source = str(self.best_toml) if self.best_toml else "the tuned AdamW's" if tuned else \
            "train's defaults"
        self.sizes = {**tuned, **{k: v for k, v in (("batch_size", cfg.batch_size), ("seq_len", cfg.seq_len)) if v}}
        self.runs: list[Run] = []
        self.flags: dict[str, dict[str, Any]] = {n: f for n, (_, f) in CHANGES.items()}
        self.notes: dict[str, str] = {}
        self.stopped = False  # Ctrl-C ended the ladder early

    # -- running ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        fixed = [n for n in self.names if n in CHANGES]
        derived = [n for n in self.names if n in DERIVED]
        total = len(self.seeds) * len(self.names)
        not_run: set[str] = set()  # derived recipes with nothing to run (their note says why)
        with tqdm(total=total, desc="quality ladder", unit="run", dynamic_ncols=True) as bar:
            try:
                self._phase(fixed, bar)
                for name in derived:  # each needs what ran before it
                    flags = self._derive(name)
                    if flags is None:
                        not_run.add(name)
                        bar.update(len(self.seeds))
                        continue
                    self.flags[name] = flags
                    self._phase([name], bar)
            except KeyboardInterrupt:  # what was measured is reported; the rest say why they have no figures
                self.stopped = True
                done = {(r.recipe, r.seed) for r in self.runs}
                self.runs += [Run(n, s, self.flags.get(n, {}), self.out / "runs" / f"{n}-seed{s}", skipped=STOPPED)
                              for n in self.names if n not in not_run for s in self.seeds if (n, s) not in done]
        return self.summary()

    def _phase(self, names: list[str], bar: tqdm) -> None:
        for seed in self.seeds:  # interleaved: seed by seed, every recipe in turn
            for name in names:
                run = Run(name, seed, self.flags[name], self.out / "runs" / f"{name}-seed{seed}", self._cap(name, seed))
                bar.set_postfix_str(f"{name}, seed {seed}")
                self._train(run, bar)
                self.runs.append(run)
                bar.update(1)

    def _cap(self, name: str, seed: int) -> int | None:
        """The run's step cap below max_steps: GIVE_UP times AdamW's steps on this seed, if AdamW reached the target."""
        base = next((r.steps for r in self.runs if r.recipe == BASELINE and r.seed == seed and r.reached), None)
        cap = math.ceil(GIVE_UP * base) if base and name != BASELINE else None
        return cap if cap is not None and cap < self.max_steps else None

    def _train(self, run: Run, bar: tqdm | None = None) -> None:
        argv = train_argv(self.cfg, run, self.target, self.max_steps, self.best_toml, self.sizes)
        run.out.parent.mkdir(parents=True, exist_ok=True)
        log_path = run.out.parent / f"{run.out.name}.log"
        with open(log_path, "wb") as f:
            f.write((shlex.join(argv) + "\n").encode())
            f.flush()
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:  # a run takes minutes: its step and latest val loss show on the ladder's bar meanwhile
                while proc.poll() is None:
                    time.sleep(PROGRESS_S)
                    if bar is not None and (latest := _latest_eval(run.out / "metrics.jsonl")):
                        bar.set_postfix_str(f"{run.recipe}, seed {run.seed}: step {latest[0]}, "
                                            f"val loss {latest[1]:.3f} (target {self.target})")
            except BaseException:  # Ctrl-C reached the child too: a moment to stop, as subprocess.run gives it
                try:
                    proc.wait(timeout=0.25)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            run.error = f"gptopt train exited with {proc.returncode}: {tail[0]} (log: {log_path})"
            log.warning(f"{run.recipe}, seed {run.seed}: {run.error}")
            return
        read_run(run)
        cap = f" in {run.cap} steps ({GIVE_UP}x AdamW's)" if run.cap else ""
        log.info(f"{run.recipe}, seed {run.seed}: " + (f"target reached at step {run.steps} in {run.time_s:.1f} s"
                                                       if run.reached else "target not reached" + cap))

    def _derive(self, name: str) -> dict[str, Any] | None:
        if name == "schedule":
            steps = self._median_steps(BASELINE)
            if steps is None:
                self.notes[name] = "not run: AdamW did not reach the target in every seed"
                return None
            return {**self.flags[BASELINE], **_schedule(steps)}
        # best: the changes that beat AdamW's time significantly, together. A mean ahead by noise is left
        # out: a schedule ahead of AdamW by noise alone once ended Muon's decay early and cost it steps.
        if self._times(BASELINE) is None:
            self.notes[name] = "not run: AdamW did not reach the target in every seed"
            return None
        winners = [n for n in self.names if n not in (BASELINE, "best") and self._beats(n)]
        if not winners:
            self.notes[name] = "not run: no change beat AdamW's time significantly; the best recipe is AdamW"
            return None
        flags: dict[str, Any] = dict(self.flags[BASELINE])  # the baseline's rates where no winner sets its own
        for n in winners:
            if n != "schedule":  # its decay is set again below, after the others' warmups
                flags.update(self.flags[n])
        if "schedule" in winners:  # the decay ends where the fastest winner reached the target
            fastest = min(winners, key=lambda n: statistics.mean(self._times(n) or [math.inf]))
            steps = self._median_steps(fastest)
            if steps is not None:
                flags.update(_schedule(steps, flags.get("warmup_steps", TRAIN_WARMUP)))
        self.notes[name] = "+".join(winners)
        return flags

    def _beats(self, name: str) -> bool:
        """Faster than AdamW on the mean, and significantly so (Welch); with one seed, where there is no
        test, the mean alone."""
        times, base = self._times(name), self._times(BASELINE)
        if times is None or base is None or statistics.mean(times) >= statistics.mean(base):
            return False
        test = self._welch(name)
        return test is None or test["significant"]

    def _of(self, name: str) -> list[Run]:
        return [r for r in self.runs if r.recipe == name]

    def _times(self, name: str) -> list[float] | None:
        """Seconds to target of every seed, or None when a run did not reach it."""
        runs = self._of(name)
        if not runs or not all(r.reached and r.time_s is not None for r in runs):
            return None
        return [r.time_s for r in runs if r.time_s is not None]

    def _median_steps(self, name: str) -> int | None:
        runs = self._of(name)
        if not runs or not all(r.reached and r.steps for r in runs):
            return None
        return round(statistics.median(r.steps for r in runs if r.steps))

    # -- report -------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        rows = []
        base = self._times(BASELINE)
        for name in [n for n in self.names if self._of(n)]:
            runs, times = self._of(name), self._times(name)
            row: dict[str, Any] = {
                "recipe": name, "what": CHANGES[name][0] if name in CHANGES else DERIVED[name],
                "flags": self.flags.get(name, {}), "runs": len(runs), "reached": sum(r.reached for r in runs),
                "minutes_mean": statistics.mean(times) / 60 if times else None,
                "minutes_sd": statistics.stdev(times) / 60 if times and len(times) > 1 else None,
                "tokens_mean": statistics.mean(r.tokens for r in runs if r.tokens) if times else None,
                "steps_mean": statistics.mean(r.steps for r in runs if r.steps) if times else None,
                "vs_adamw": statistics.mean(times) / statistics.mean(base) if times and base else None,
                # the quality each run ended with: at the target where reached, else at its step cap
                "end_val_loss_mean": _mean([r.curve[-1][1] for r in runs if r.curve]),
                "end_bpb_mean": _mean([r.end_bpb for r in runs if r.end_bpb is not None]),
                "note": "; ".join(n for n in (self.notes.get(name, ""), self._unmeasured(runs)) if n),
            }
            rows.append(row)
        for name, note in self.notes.items():
            if not self._of(name):
                rows.append({"recipe": name, "what": DERIVED.get(name, ""), "flags": {}, "runs": 0, "reached": 0,
                             "minutes_mean": None, "minutes_sd": None, "tokens_mean": None, "steps_mean": None,
                             "vs_adamw": None, "end_val_loss_mean": None, "end_bpb_mean": None, "note": note})
        # the best recipe beats AdamW's mean time; none that does leaves AdamW (no TOML, no test to state)
        ranked = [r for r in rows if r["vs_adamw"] is not None and r["recipe"] != BASELINE and r["vs_adamw"] < 1]
        best = min(ranked, key=lambda r: r["vs_adamw"]) if ranked else None
        test = self._welch(best["recipe"]) if best else None
        return {
            "mode": "quality", "stopped": self.stopped, "preset": self.preset, "data_dir": self.cfg.data_dir,
            "target_loss": self.target,
            "max_steps": self.max_steps, "sizes": self.sizes,
            "eval_interval": EVAL_INTERVAL, "eval_iters": EVAL_ITERS,
            "seeds": self.seeds, "step_settings": self.step_source + "".join(
                f", --{k}" if v is True else f", --{k} {v}" for k, v in self.sizes.items()),
            "environment": environment(self.plan), "native_bf16": cpu_has_fast_bf16(),
            "recipes": rows, "best": best["recipe"] if best else None, "welch": test,
            "runs": [{"recipe": r.recipe, "seed": r.seed, "flags": r.flags, "step_cap": r.cap, "reached": r.reached,
                      "time_to_target_s": r.time_s, "time_to_target_excl_compile_s": r.time_excl_compile_s,
                      "tokens_to_target": r.tokens, "steps_to_target": r.steps, "best_val_loss": r.best_val_loss,
                      "end_bpb": r.end_bpb,
                      "curve": r.curve, "error": r.error, "skipped": r.skipped, "output_dir": str(r.out),
                      "config": r.config}
                     for r in self.runs],
        }

    @staticmethod
    def _unmeasured(runs: list[Run]) -> str:
        n = sum(r.skipped is not None for r in runs)
        return f"{n} of its {len(runs)} runs not measured (bench was stopped): no time to compare" if n else ""

    def _welch(self, name: str) -> dict[str, Any] | None:
        a, b = self._times(name), self._times(BASELINE)
        if not a or not b or len(a) < 2 or len(b) < 2:
            return None
        stats = require("scipy.stats", "stats", "bench --mode quality's significance test")
        res = stats.ttest_ind(a, b, equal_var=False)
        p = float(res.pvalue)
        return {"recipe": name, "against": BASELINE, "t": float(res.statistic), "p_value": p,
                "significant": bool(p < SIGNIFICANCE and statistics.mean(a) < statistics.mean(b)),
                "level": SIGNIFICANCE}


# A run's config entries that are not its recipe: where that one process wrote, and its licence to replace
# what was there. The file names no output folder, so a train from it never writes into the ladder's runs.
NOT_RECIPE = ("output_dir", "overwrite", "resume")
ALWAYS = ("preset", "data_dir", "seed", "target_loss", "max_steps")  # written even where train's default


def best_toml(summary: dict[str, Any]) -> str | None:
    """quality_best.toml: the winning recipe's run of the first seed as its `gptopt train` process ran it (the
    config in its run.json: the training ladder's best.toml, the sizes, the recipe, the step cap and the
    evaluations), so that `gptopt train --config quality_best.toml` is that run again."""
    best = next((r for r in summary["recipes"] if r["recipe"] == summary["best"]), None)
    run = next((r for r in summary["runs"] if r["recipe"] == summary["best"] and r["config"]), None)
    if best is None or run is None:
        return None
    defaults = dataclasses.asdict(TrainConfig())
    opts = {k: v for k, v in run["config"].items()
            if k not in NOT_RECIPE and (k in ALWAYS or v != defaults.get(k))}
    return toml_text(opts, (f"# written by `gptopt bench --mode quality`: recipe '{best['recipe']}', "
                            f"{best['vs_adamw']:.2f}x AdamW's time to val loss {summary['target_loss']}",
                            f"# its run with seed {run['seed']} as that `gptopt train` ran it "
                            "(flags override any of it)",
                            "# gptopt train --config quality_best.toml"))


def _mean(xs: list[float]) -> float | None:
    return statistics.mean(xs) if xs else None


def _2dp(v: float | None) -> str:  # minutes in the table, seconds per run
    return "-" if v is None else f"{v:.2f}"


def table(summary: dict[str, Any]) -> str:
    head = ["recipe", "reached", "minutes (mean ± sd)", "steps", "tokens", "vs adamw", "end val loss", "bits/byte",
            "note"]
    body = [[r["recipe"], f"{r['reached']}/{r['runs']}",
             "-" if r["minutes_mean"] is None else f"{r['minutes_mean']:.2f} ± {_2dp(r['minutes_sd'])}",
             fmt(r["steps_mean"], "int"), fmt(r["tokens_mean"], "int"), fmt(r["vs_adamw"], "x"),
             fmt(r.get("end_val_loss_mean"), "loss"), fmt(r.get("end_bpb_mean"), "bpb"), r["note"]]
            for r in summary["recipes"]]
    return text_table(head, body)


def markdown(summary: dict[str, Any], plots: list[str], toml: str | None) -> str:
    env = summary["environment"]
    w = summary["welch"]
    md = [f"# gptopt bench --mode quality: {summary['preset']} to val loss {summary['target_loss']}", "",
          f"- machine: {env.get('device_name', env.get('cpu', '?'))} ({env.get('device', '')}"
          f"{'' if env.get('device') != 'cpu' else ', native bf16: ' + ('yes' if summary['native_bf16'] else 'no')}); "
          f"torch {env.get('torch', '?')}",
          f"- data: {summary['data_dir']}; seeds {', '.join(map(str, summary['seeds']))}; step settings: "
          f"{summary['step_settings']}",
          f"- each run: `gptopt train --target_loss {summary['target_loss']} --max_steps {summary['max_steps']} "
          f"--eval_interval {summary['eval_interval']} --eval_iters {summary['eval_iters']}` plus the recipe's "
          f"options, every other recipe stopping at {GIVE_UP}x AdamW's steps on its seed; time to target = the "
          "training steps' wall time (evals and saves left out)", "",
          "```", table(summary), "```", ""]
    if w:
        verdict = "significant" if w["significant"] else "not significant"
        md.append(f"Best recipe: **{w['recipe']}**; Welch's t-test against AdamW over the seeds' times: "
                  f"t = {w['t']:.2f}, p = {w['p_value']:.3g} ({verdict} at {w['level']}).")
    elif summary["best"]:
        md.append(f"Best recipe: **{summary['best']}** (too few seeds reached the target for a t-test).")
    elif summary.get("stopped"):
        md.append("Stopped (Ctrl-C) before every run was measured: a recipe with runs not measured is not compared.")
    elif any(r["recipe"] == BASELINE and r["reached"] == r["runs"] > 0 for r in summary["recipes"]):
        md.append("No recipe beat AdamW's mean time to the target: the best recipe is AdamW, train's default.")
    else:
        md.append("AdamW did not reach the target in every seed: no comparison (a higher --target_loss or more "
                  "--max_steps).")
    if toml:
        md += ["", "Train with it: `gptopt train --config quality_best.toml`", "", "```toml", toml.rstrip(), "```"]
    md += ["", "## Every run", "", "| recipe | seed | reached | seconds to target | steps | tokens | best val loss |",
           "|---|---:|---|---:|---:|---:|---:|"]
    for r in summary["runs"]:
        no = "no" + (f": {r['error']}" if r["error"] else f" in {r['step_cap']} steps ({GIVE_UP}x AdamW's)"
                     if r.get("step_cap") else "")
        no = f"skipped: {r['skipped']}" if r.get("skipped") else no
        md.append(f"| {r['recipe']} | {r['seed']} | {'yes' if r['reached'] else no} "
                  f"| {_2dp(r['time_to_target_s'])} "
                  f"| {fmt(r['steps_to_target'], 'int')} | {fmt(r['tokens_to_target'], 'int')} "
                  f"| {fmt(r['best_val_loss'], 'loss')} |")
    if plots:
        md += ["", "## Val loss against training time", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(md) + "\n"


def plot(summary: dict[str, Any], out: Path) -> list[str]:
    if not has("matplotlib"):
        log.info("quality.png skipped: pip install 'gptopt[plot]'")
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors: dict[str, Any] = {}
    for r in summary["runs"]:
        if not r["curve"]:
            continue
        xs, ys = zip(*r["curve"], strict=True)
        color = colors.setdefault(r["recipe"], f"C{len(colors)}")
        ax.plot([x / 60 for x in xs], ys, color=color, alpha=0.8, lw=1.2,
                label=r["recipe"] if r["seed"] == summary["seeds"][0] else None)
    ax.axhline(summary["target_loss"], color="k", ls="--", lw=0.8, label=f"target {summary['target_loss']}")
    ax.set_xlabel("training minutes (steps only)")
    ax.set_ylabel("val loss")
    ax.set_title(f"{summary['preset']}: val loss against training time, {len(summary['seeds'])} seeds per recipe")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=110)
    plt.close(fig)
    return ["quality.png"]


def main(cfg: BenchConfig) -> int:
    ladder = Ladder(cfg)
    if len(ladder.seeds) > 1:
        require("scipy.stats", "stats", "bench --mode quality's significance test")  # before minutes of training
    log.info(f"quality ladder: {ladder.preset} to val loss {ladder.target}, recipes {', '.join(ladder.names)}, "
             f"seeds {', '.join(map(str, ladder.seeds))}, at most {ladder.max_steps} steps a run")
    summary = ladder.run()
    out = ladder.out
    toml = best_toml(summary)
    with replacing(out, kind=KIND, ours=QUALITY_FILES, list_files=False):
        plots = plot(summary, out)
        (out / "quality_results.json").write_text(to_json(summary) + "\n")
        if toml:
            (out / "quality_best.toml").write_text(toml)
        (out / "quality_report.md").write_text(markdown(summary, plots, toml))
    print(table(summary))
    print(f"\nreport: {out / 'quality_report.md'}")
    if cfg.json:
        print(to_json(summary))
    if ladder.stopped:
        log.warning("bench --mode quality was stopped: the report holds the runs measured before it")
        return CTRL_C_EXIT
    return 0 if any(r.reached for r in ladder.runs if r.recipe == BASELINE) else 1
