"""`gptopt tune`: search the training settings for the fastest step on this machine, within a time
and a memory budget, and write the winner as a config `gptopt train` takes.

    gptopt tune                                    # tiny @ 256 on a CPU, gpt2 @ 1024 on a GPU; 10 minutes
    gptopt tune --preset gpt2 --seq_len 1024 --global_batch_tokens 524288 --time_budget 20m
    gptopt train --config tune_out/tune.toml       # train with the winner

Every candidate is a bench rung (bench/ladder.py): TrainConfig fields over the bench's base config,
trained by the step `gptopt train` runs under the TrainConfig that tune.toml then gives train. All start
from the same initial weights and train on the same batches, each step's whole global batch split into
micro-batches, so a candidate's loss after the timed steps is checked against the fp32 reference's
(gptopt's defaults) whatever its micro-batch. Cheap axes are settled first, measured eagerly (attention
and precision, the fused optimizer, data loading), then the micro-batch (grown until memory runs out,
with checkpointing only where it buys a faster one), then torch.compile modes, whose compiles cost the most.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from gptopt.bench.ladder import ALL, Bench, Rung, RungResult, StopHook, loss_matches, toml_options
from gptopt.config import BenchConfig, TrainConfig, TuneConfig
from gptopt.data import loader as data
from gptopt.outputs import lock_output
from gptopt.runtime import memory_check, process
from gptopt.runtime.device import cpu_has_fast_bf16, default_attention, environment, resolve
from gptopt.train.optim import fused_available
from gptopt.train.step import LOADER_FIELDS
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")

# a candidate's figures that the summary repeats for the winner, the reference and the baselines
PICK = ("name", "stage", "index", "status", "tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes", "loss")

# A candidate whose fastest timed step (two at least) is this much slower than the best's p90 step
# cannot win: step-to-step noise, even on a shared machine, stays inside that.
PRUNE_SLOWER = 1.25
# Below this share of the step spent fetching batches, better loading cannot win more than noise.
LOADER_MIN_WAIT = 0.02
# The first compile's cost before one is measured: a cold inductor cache's, with room to spare
# (benchmarks/2026-12-02-tuning.md, the cold cache); other modes cost this many times the default's.
COMPILE_PRIOR_S = {"cpu": 80.0, "cuda": 90.0, "mps": 90.0}
COMPILE_COST = {"default": 1.0, "reduce-overhead": 1.3, "max-autotune-no-cudagraphs": 3.0}
# On a CPU, below this share of its threads' time the process was not getting the cores (another
# process was using them): a slow step then says nothing about the candidate, so it is not pruned.
MIN_CPU_SHARE = 0.7
# Of the budget, kept for what the clock does not see: start-up (importing torch) and writing the report
# at the end.
RESERVE_S = 10.0


def amp_choices(plan_device: str) -> list[str]:
    """Autocast dtypes worth measuring on this device, the likely winner first (then fp32)."""
    if plan_device == "cuda":
        bf16_ok = torch.cuda.get_device_capability()[0] >= 8
        return (["bf16"] if bf16_ok else []) + ["fp16", "fp32"]
    if plan_device == "mps":
        return ["fp16", "fp32"]
    # fp16 autocast on a CPU is emulated and needs loss scaling: never the fast choice there
    return ["bf16", "fp32"] if cpu_has_fast_bf16() else ["fp32", "bf16"]


def loader_variants(device_type: str) -> list[dict[str, Any]]:
    """DataLoader settings to try besides the device default (data.default_loader_settings)."""
    none = dict(num_workers=0, pin_memory=False, prefetch_factor=None, persistent_workers=False)
    if device_type == "cuda":
        w = data.default_loader_settings("cuda")["num_workers"] or 1
        return [dict(num_workers=w, pin_memory=True, prefetch_factor=2, persistent_workers=True),
                dict(num_workers=w, pin_memory=True, prefetch_factor=4, persistent_workers=True),
                dict(none, pin_memory=True), none]
    # one worker at most: on a CPU every worker takes a core from the matmuls
    return [none, dict(num_workers=1, pin_memory=False, prefetch_factor=2, persistent_workers=True)]


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads."""
    return sum(psutil.Process().cpu_times()[:2])


_wall = time.perf_counter


# A candidate's identity: the Hugging Face model or not, host memory reuse, and its resolved TrainConfig's values
Key = tuple[bool, bool, tuple[Any, ...]]


class Tuner:
    """The search. `clock` is injectable so tests can run out of time without waiting for it."""

    def __init__(self, cfg: TuneConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock = cfg, clock
        self.start = clock()
        budget = cfg.time_budget_s
        self.deadline = self.start + budget - min(RESERVE_S, 0.05 * budget)
        bench_cfg = BenchConfig(preset=cfg.preset, seq_len=cfg.seq_len, device=cfg.device, data_dir=cfg.data_dir,
                                seed=cfg.seed, loss_tolerance=cfg.loss_tolerance, output_dir=cfg.output_dir)
        self.bench = Bench(bench_cfg, steps=cfg.steps, warmup=cfg.warmup)
        self.device_type = self.bench.plan.device.type
        T = self.bench.seq_len
        tokens = cfg.global_batch_tokens or (64 if self.device_type == "cuda" else 16) * T
        if tokens % T:
            raise UserError(f"--global_batch_tokens {tokens} is not a multiple of the sequence length {T}: "
                             f"use {max(1, round(tokens / T)) * T}")
        self.global_batch = tokens // T  # sequences per optimizer step
        self.sizes = [d for d in range(1, self.global_batch + 1) if self.global_batch % d == 0]
        self.memory_limit = self._memory_limit()
        self.entries: list[tuple[str, RungResult]] = []
        self.measured: dict[Key, tuple[Rung, RungResult]] = {}
        self.reference: RungResult | None = None
        self.best: tuple[Rung, RungResult] | None = None
        self.best_cost = 0.0  # wall seconds the best eager candidate took to measure
        self.costs: dict[Key, float] = {}
        self.compile_costs: list[float] = []
        self.bench_all: RungResult | None = None

    def _memory_limit(self) -> int:
        device = self.bench.plan.device
        if self.device_type == "cuda":
            return int(self.cfg.memory_budget * (memory_check.capacity_bytes(device) or 0))
        # what this process can hold: what is free now (RAM, cgroup, ulimit -v) plus its own (others keep theirs)
        free = memory_check.available_bytes(device)[0]
        return int(self.cfg.memory_budget * (free + psutil.Process().memory_info().rss))

    # -- measuring one candidate -------------------------------------------------------------

    def _at(self, rung: Rung, b: int, name: str | None = None) -> Rung:
        a = self.global_batch // b
        return rung.but(name or f"micro-batch {b}", f"micro-batch {b} x accumulation {a}", batch_size=b,
                        gradient_accumulation_steps=a)

    def _key(self, rung: Rung) -> Key:
        """The settings alone, as they run: two candidates whose TrainConfigs resolve alike are one."""
        return rung.hf, rung.reuse_memory, dataclasses.astuple(self.bench.config(rung))

    def _larger(self, b: int) -> int | None:
        return next((d for d in self.sizes if d >= 2 * b), None)  # doubling, where the global batch allows

    def _smaller(self, b: int) -> int | None:
        return next((d for d in reversed(self.sizes) if d <= b // 2), None)

    def _estimate(self, rung: Rung) -> float:
        """Seconds a candidate will take. An eager one changes one setting of the best, so it costs about
        what the best did (a slower one is pruned after two timed steps, and the deadline ends any one)."""
        cfg = self.bench.config(rung)
        if not cfg.compile:
            return self.best_cost
        first = (self.compile_costs[0] if self.compile_costs
                 else COMPILE_PRIOR_S.get(self.device_type, 90.0) + self.best_cost)
        return first * COMPILE_COST.get(cfg.compile_mode, 3.0)

    def _stop_hook(self, prune: bool, deadline: bool, share: list[float]) -> StopHook:
        """Ends a candidate at the deadline, or once it cannot win; appends to `share` the CPU share of
        the timed steps so far (CPU devices: the process's CPU time over its threads' wall time)."""
        n = self.cfg.warmup + self.cfg.steps
        threads, mark = torch.get_num_threads(), [0.0, 0.0]

        def stop(i: int, times: list[float]) -> tuple[str, str] | None:
            if self.device_type == "cpu" and i >= self.cfg.warmup:
                cpu, wall = _cpu_seconds(), _wall()
                if i == self.cfg.warmup:
                    mark[:] = cpu, wall
                else:
                    share.append((cpu - mark[0]) / max(1e-9, (wall - mark[1]) * threads))
            if deadline and self.clock() > self.deadline:
                return "over budget", f"the time budget ran out after {i} of {n} steps"
            if share and share[-1] < MIN_CPU_SHARE:
                return None  # the machine is busy, not necessarily the candidate slow
            if prune and self.best is not None and len(times) >= 2:
                ratio = min(times) / self.best[1].step_time_p90_s
                if ratio > PRUNE_SLOWER:
                    return "pruned", (f"cannot win: its fastest of {len(times)} timed steps took {ratio:.2f}x "
                                      f"the best's p90 step")
            return None

        return stop

    def _record(self, stage: str, rung: Rung, status: str, note: str) -> RungResult:
        """A candidate that is not run: it still gets a row, with the reason (once: the budget only shrinks)."""
        res = self.bench.result(rung, self.bench.config(rung), status=status, note=note)
        self.measured[self._key(rung)] = rung, res
        self.entries.append((stage, res))
        self._log(stage, res)
        return res

    def measure(self, stage: str, rung: Rung, *, forced: bool = False, again: bool = False,
                prunable: bool = True) -> RungResult:
        """Run one candidate (unless its settings were measured already, or the budget cannot cover it),
        check its memory and its loss, record it, and keep it if it is the fastest valid one so far.
        again: measure settings a second time (the confirmation round). prunable: False runs it to the
        end even when its first steps look slow."""
        key = self._key(rung)
        if key in self.measured and not again:
            return self.measured[key][1]
        left = self.deadline - self.clock()
        est = self.costs[key] if again else self._estimate(rung)
        if not forced and est > left:
            if again:  # the first measurement stands; no row for what was not run
                return self.measured[key][1]
            return self._record(stage, rung, "over budget",
                                f"needs about {est:.0f} s; {max(0.0, left):.0f} s of the budget left")
        t0 = self.clock()
        # the reference and the baseline run to the end: everything else is judged against them
        share: list[float] = []
        hook = self._stop_hook(prune=prunable and not (forced or rung.hf or again), deadline=not (forced or rung.hf),
                               share=share)
        res = self.bench.run_rung(rung, stop=hook)
        cost = self.clock() - t0
        if share and share[-1] < MIN_CPU_SHARE:  # the last share covers all but the last timed step
            res.note = (res.note + "; " if res.note else "") + (
                f"measured on a busy machine: this process had {share[-1]:.0%} of its {torch.get_num_threads()} "
                "threads' time")
        compiled = self.bench.config(rung).compile
        if compiled and not again:
            self.compile_costs.append(cost)
        self._check(res)
        if not again:
            self.measured[key], self.costs[key] = (rung, res), cost
        self.entries.append((stage, res))
        if res.status == "ok" and (res.loss_ok or forced) and not rung.hf and (
                self.best is None or res.tokens_per_s > self.best[1].tokens_per_s):
            self.best = (rung, res)
            if not compiled:
                self.best_cost = cost
        self._log(stage, res)
        return res

    def _check(self, res: RungResult) -> None:
        peak = res.reserved_mem_bytes  # CUDA: what the caching allocator holds; CPU: the process's peak RSS
        if res.status == "ok" and peak is not None and peak > self.memory_limit:
            res.status = "oom"
            res.note = (f"peak memory {peak / 2**20:,.0f} MiB is over the memory budget "
                        f"({self.cfg.memory_budget:.0%}: {self.memory_limit / 2**20:,.0f} MiB)")
        ref = self.reference
        if res.status != "ok" or ref is None:
            return
        res.speedup_vs_baseline = res.tokens_per_s / ref.tokens_per_s
        res.loss_ok = loss_matches(res.loss, ref.loss, self.cfg.loss_tolerance)
        if not res.loss_ok:
            res.status = "rejected"
            res.note = (f"loss {res.loss:.4f} departs from the fp32 reference's {ref.loss:.4f} by "
                        f"{abs(res.loss - ref.loss) / abs(ref.loss):.1%} (tolerance {self.cfg.loss_tolerance:.0%})")

    def _log(self, stage: str, res: RungResult) -> None:
        speed = f"{res.tokens_per_s:,.0f} tokens/s" if res.tokens_per_s else "-"
        log.info(f"tune {self.clock() - self.start:5.0f}s/{self.cfg.time_budget_s:.0f}s  {stage:<13} "
                 f"{res.name:<34} {speed:>16}  {res.status}" + (f": {res.note}" if res.note else ""))

    # -- the search, cheap axes first ----------------------------------------------------------

    def run(self) -> dict[str, Any]:
        axes = self.cfg.axis_set
        cuda = self.device_type == "cuda"
        if cuda:  # allocations past the budget raise out-of-memory like a full device would
            torch.cuda.set_per_process_memory_fraction(self.cfg.memory_budget, self.bench.plan.device)
        try:
            self._reference()
            self._baseline()
            if axes & {"attention", "amp"}:
                self._precision_and_attention(axes)
            if "fused" in axes:
                self._fused()
            if "loader" in axes:
                self._loader()
            if "loss" in axes:
                self._loss()
            hit_oom = self._micro_batch() if "batch" in axes else None
            if "checkpointing" in axes:
                self._checkpointing(hit_oom, "batch" in axes)
            if "compile" in axes:
                self._compile()
            self._confirm()
        finally:
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, self.bench.plan.device)
        self.bench.settle_peak([r for _, r in self.entries])  # every candidate's MFU against one peak
        return self.summary()

    def _reference(self) -> None:
        """gptopt train's defaults on this device, at the tune's global batch: the fp32 reference every
        loss is checked against, and the first baseline. Halved (with more accumulation) until it fits."""
        defaults = TrainConfig()
        attention = default_attention(self.device_type)
        b = max(d for d in self.sizes if d <= defaults.batch_size)
        # train's defaults as they resolve here (bench.config): the device's attention and DataLoader settings
        base = Rung("defaults", f"gptopt train's defaults here: fp32, {attention} attention, fused AdamW, default "
                    "DataLoader", {"fused_optimizer": defaults.fused_optimizer and fused_available(self.device_type)},
                    reuse_memory=True)
        while True:
            res = self.measure("reference", self._at(base, b, "defaults"), forced=True)
            if res.status == "ok":
                res.loss_ok, res.speedup_vs_baseline = True, 1.0
                self.reference = res
                return
            smaller = self._smaller(b)
            if res.status != "oom" or smaller is None:
                raise RuntimeError(f"the fp32 reference (gptopt's defaults) did not run: {res.note}; "
                                   "try a smaller --preset, --seq_len or --global_batch_tokens")
            b = smaller

    def _baseline(self) -> None:
        """The Hugging Face model as the naive script trains it, for the report's gain; not a candidate."""
        assert self.best is not None
        ref_rung = self.best[0]
        naive = ref_rung.but("hf", "Hugging Face GPT2LMHeadModel, eager attention, fp32, for-each AdamW: the naive "
                             "script's model", attention="eager", fused_optimizer=False)
        hf = dataclasses.replace(naive, hf=True, reuse_memory=False)
        b: int | None = self.bench.config(hf).batch_size
        while b is not None:
            res = self.measure("baseline", self._at(hf, b, "hf"))
            if res.status != "oom":
                return
            b = self._smaller(b)

    def _precision_and_attention(self, axes: set[str]) -> None:
        """Measured together: which attention kernel is faster depends on the dtype (SDPA's CPU kernels)."""
        assert self.best is not None
        base = self.best[0]
        current = self.bench.config(base).attention
        other = "eager" if current == "sdpa" else "sdpa"
        attentions = [current, other] if "attention" in axes else [current]
        for dtype in amp_choices(self.device_type) if "amp" in axes else ["fp32"]:
            for attention in attentions:
                amp = dtype != "fp32"
                self.measure("precision", base.but(f"{attention} {dtype}", f"{attention} attention, {dtype}",
                                                   attention=attention, use_amp=amp,
                                                   amp_dtype=dtype if amp else "auto"))

    def _fused(self) -> None:
        assert self.best is not None
        rung = self.best[0]
        fused = self.bench.config(rung).fused_optimizer
        if not fused_available(self.device_type) and not fused:
            return
        self.measure("optimizer", rung.but("AdamW " + ("for-each" if fused else "fused"),
                                           "the other AdamW implementation", fused_optimizer=not fused))

    def _loss(self) -> None:
        """The other loss: the chunked one frees the logits' memory (a larger micro-batch may fit after it), the
        full one has the fewer kernels."""
        assert self.best is not None
        rung = self.best[0]
        other = "full" if self.bench.config(rung).loss == "chunked" else "chunked"
        self.measure("loss", rung.but(f"{other} loss", f"the {other} loss", loss=other))

    def _loader(self) -> None:
        assert self.best is not None
        rung, res = self.best
        cfg = self.bench.config(rung)
        current = {k: getattr(cfg, k) for k in LOADER_FIELDS}
        for v in [v for v in loader_variants(self.device_type) if v != current]:
            name = (f"loader {v['num_workers']} workers" + (" pinned" if v["pin_memory"] else "")
                    + (f" prefetch {v['prefetch_factor']}" if v["prefetch_factor"] else ""))
            cand = rung.but(name, f"DataLoader {v}", **v)
            wait = res.data_wait_frac
            if wait is not None and wait < LOADER_MIN_WAIT:
                self._record("loader", cand, "pruned", f"cannot win: the best candidate waits for batches {wait:.1%} "
                             "of its step, all that better loading could save")
            else:
                self.measure("loader", cand)

    def _micro_batch(self) -> int | None:
        """Grow the micro-batch by doubling (accumulation keeps the global batch) while it fits and gets
        faster; back off when it does not. Returns the first size that ran out of memory, if any."""
        assert self.best is not None
        rung, prev = self.best
        b0 = self.bench.config(rung).batch_size
        b = self._larger(b0)
        grew = False
        while b is not None:
            res = self.measure("micro-batch", self._at(rung, b))
            if res.status == "oom":
                return b
            if res.status != "ok" or res.tokens_per_s <= prev.tokens_per_s:
                nxt = self._larger(b)
                if nxt is not None and res.status in ("ok", "pruned"):
                    self._record("micro-batch", self._at(rung, nxt), "pruned",
                                 f"cannot win: micro-batch {b} was already slower than {prev.batch_size}")
                break
            prev, b, grew = res, self._larger(b), True
        if not grew:
            # nothing larger fits or helps: a smaller micro-batch can still win where the larger's
            # activations (the logits above all) overflow the caches
            prev, b = self.best[1], self._smaller(b0)
            while b is not None:
                res = self.measure("micro-batch", self._at(rung, b))
                if res.status != "ok" or res.tokens_per_s <= prev.tokens_per_s:
                    break
                prev, b = res, self._smaller(b)
        return None

    def _checkpointing(self, hit_oom: int | None, searched: bool) -> None:
        """Recomputing activations only pays where it lets a larger micro-batch fit that is faster."""
        assert self.best is not None
        rung = self.best[0]
        recomputing = rung.but("checkpointing", "activation checkpointing", gradient_checkpointing=True)
        if hit_oom is None:
            b0 = self.bench.config(rung).batch_size
            why = ("micro-batch {b} is the whole global batch" if b0 == self.global_batch else
                   "larger micro-batches fit without it" if searched else "the micro-batch was not searched")
            self._record("checkpointing", recomputing, "pruned",
                         f"cannot win: {why.format(b=b0)}; recomputing activations only adds time")
            return
        prev, b = self.best[1], hit_oom
        while b is not None:
            res = self.measure("checkpointing", self._at(recomputing, b, f"checkpointing, micro-batch {b}"))
            if res.status != "ok" or res.tokens_per_s <= prev.tokens_per_s:
                break
            prev, b = res, self._larger(b)

    def _compile(self) -> None:
        """Compile modes on the best eager settings, and bench's `all` rung, which the winner must match."""
        assert self.best is not None and self.reference is not None
        eager_best = self.best[0]
        compiled = eager_best.but("compile default", "torch.compile, default mode, on the best eager settings",
                                  compile=True)
        self.measure("compile", compiled)
        # never pruned: its first compiled steps can be slow for reasons of their own (allocator, page
        # faults), and the winner is judged against it, so it must be measured in full
        self.bench_all = self.measure("compile", self._bench_all(), prunable=False)  # maybe the first's settings
        base = self.best[0] if self.bench.config(self.best[0]).compile else compiled
        modes = ["max-autotune-no-cudagraphs"] + (["reduce-overhead"] if self.device_type == "cuda" else [])
        for mode in modes:
            self.measure("compile", base.but(f"compile {mode}", f"torch.compile mode {mode}", compile_mode=mode))

    def _bench_all(self) -> Rung:
        """`gptopt bench`'s `all` rung at the reference's micro-batch: compile + the policy's autocast +
        fused AdamW + the default DataLoader + the device's default attention (the reference's, train's)."""
        return self.measured_rung(self.reference).but(
            "bench 'all' rung", "gptopt bench's `all` rung: compile + autocast + fused AdamW + default DataLoader + "
            "the device's attention", **ALL)

    def _confirm(self) -> None:
        """The two fastest valid candidates once more, back to back: on a shared machine one run in a
        quiet (or busy) moment must not decide the winner. Their second figures rank them."""
        ranked = sorted((r.tokens_per_s, i) for i, (_, r) in enumerate(self.entries) if self.valid(r))
        for _, i in ranked[::-1][:2] if len(ranked) >= 2 else []:
            first = self.entries[i][1]
            rung = self.measured_rung(first)
            again = self.measure("confirm", rung.but(f"{first.name} (again)", f"{first.what}, measured again"),
                                 again=True)
            if again is not first:
                first.note = (first.note + "; " if first.note else "") + f"measured again as #{len(self.entries)}"

    def summary(self) -> dict[str, Any]:
        """Everything the report, tune_results.json and `--json` show; `train_config`: what tune.toml holds."""
        assert self.reference is not None
        bench, cfg = self.bench, self.cfg
        candidates = [{"index": i, "stage": stage, **dataclasses.asdict(r)}
                      for i, (stage, r) in enumerate(self.entries, 1)]
        pairs = list(zip(candidates, (r for _, r in self.entries), strict=True))
        latest: dict[str, dict[str, Any]] = {}  # settings measured twice (the confirmation) rank by the second figure
        for c, r in pairs:
            if self.valid(r):
                latest[json.dumps(c["config"], sort_keys=True)] = c

        def last(res: Any) -> dict[str, Any] | None:
            c = next((c for c, r in pairs if r is res), None)
            return latest.get(json.dumps(c["config"], sort_keys=True), c) if c else None

        win = max(latest.values(), key=lambda c: c["tokens_per_s"])  # the reference is always valid
        ref = last(self.reference)
        hf = next((c for c, r in pairs if c["hf"] and r.tokens_per_s and r.status in ("ok", "rejected")), None)
        hf_note = next((c["note"] for c in candidates if c["hf"]), "not measured")
        bench_all = last(self.bench_all) if self.bench_all is not None and self.valid(self.bench_all) else None
        # the winner's TrainConfig as it was measured: its run (model, data, seed) and step settings
        opts = toml_options(win["config"])
        return {
            "preset": bench.preset, "seq_len": bench.seq_len, "global_batch": self.global_batch,
            "global_batch_tokens": self.global_batch * bench.seq_len, "steps": cfg.steps, "warmup": cfg.warmup,
            "axes": sorted(cfg.axis_set), "time_budget_s": cfg.time_budget_s, "elapsed_s": self.clock() - self.start,
            "memory_budget": cfg.memory_budget, "memory_limit_bytes": self.memory_limit,
            "memory_column": "peak_mem_bytes" if self.device_type == "cuda" else "reserved_mem_bytes",
            "loss_tolerance": cfg.loss_tolerance, "model": bench.model_config.to_dict(), "params": bench.params,
            "flops_per_token": bench.fpt, "peak_flops": bench.peak, "peak_source": bench.peak_source,
            "device_policy": bench.plan.reason, "environment": environment(bench.plan),
            "best": {**{k: win[k] for k in PICK}, "config": win["config"]},
            "defaults": {k: ref[k] for k in PICK},
            "hf": {k: hf[k] for k in PICK} if hf else None, "hf_note": hf["note"] if hf else hf_note,
            "bench_all": {k: bench_all[k] for k in PICK} if bench_all else None,
            "gain_vs_defaults": win["tokens_per_s"] / ref["tokens_per_s"],
            "gain_vs_hf": win["tokens_per_s"] / hf["tokens_per_s"] if hf else None,
            "train_config": opts, "candidates": candidates,
        }

    @staticmethod
    def valid(r: RungResult) -> bool:
        """May win: measured to the end, loss matching, and not the Hugging Face baseline."""
        return r.status == "ok" and bool(r.loss_ok) and not r.hf

    def measured_rung(self, res: RungResult | None) -> Rung:
        return next(rung for rung, r in self.measured.values() if r is res)


def main(cfg: TuneConfig) -> int:
    out = Path(cfg.output_dir).expanduser()
    with lock_output(out):  # one writer in the folder, from its checks to the report
        return _tune(cfg, out)


def _tune(cfg: TuneConfig, out: Path) -> int:
    from gptopt.commands.tune_report import check_output_dir, table, write_all
    from gptopt.utils.tables import to_json

    check_output_dir(out, cfg.overwrite)  # before the tuner builds or measures anything
    process.set_matmul_precision(resolve(cfg.device, quiet=True))  # the process's switches, where it starts
    tuner = Tuner(cfg)
    log.info(f"tune: {tuner.bench.preset} at {tuner.bench.seq_len} tokens, global batch {tuner.global_batch} sequences "
             f"({tuner.global_batch * tuner.bench.seq_len:,} tokens); {cfg.warmup} warm-up + {cfg.steps} timed steps "
             f"per candidate; budget {cfg.time_budget}, memory {cfg.memory_budget:.0%}")
    try:
        summary = tuner.run()
    except RuntimeError as e:  # the reference itself did not run: nothing to judge candidates against
        print(f"gptopt tune: {e}", file=sys.stderr)
        return 1
    write_all(summary, out)
    print(table(summary))
    best = summary["best"]
    print(f"\nwinner #{best['index']} {best['name']}: {best['tokens_per_s']:,.0f} tokens/s, "
          f"{summary['gain_vs_defaults']:.2f}x gptopt's defaults"
          + (f", {summary['gain_vs_hf']:.2f}x the Hugging Face baseline" if summary["gain_vs_hf"] else "")
          + f"; {summary['elapsed_s']:.0f} s of {summary['time_budget_s']:.0f} s")
    print(f"train with it: gptopt train --config {out / 'tune.toml'}; report: {out / 'tune_report.md'}")
    if cfg.json:
        print(to_json(summary))
    return 0
