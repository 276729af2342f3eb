"""The training ladder: each playbook optimisation measured on this machine against the naive baseline.

    gptopt bench                                  # tiny @ 256 on a CPU, gpt2 @ 1024 on a GPU
    gptopt bench --preset gpt2 --rungs default,ckpt,batch_sweep --json

Every rung starts from the same weights and trains on the same batches, so its loss after the timed
steps can be compared with the baseline's: a rung that is faster at computing something else fails.
A rung is TrainConfig fields over the bench's base config (Rung.overrides); it trains with the step
`gptopt train` runs (step.TrainStep) under that TrainConfig, which its best.toml gives train field by field:
AdamW with decay on matrices only, gradient clipping, the warmup schedule. A rung whose config, once the
device policy has resolved it, is an earlier rung's is not measured again.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from gptopt.bench.setup import Setup
from gptopt.config import BenchConfig, GPTConfig, TrainConfig
from gptopt.data import loader as data
from gptopt.infer.measure import STOPPED
from gptopt.models.flops import at_least, flops_per_token, mfu
from gptopt.models.gpt import GPT
from gptopt.runtime import memory_check
from gptopt.runtime.compile import compile_model
from gptopt.runtime.device import (
    DevicePlan,
    default_attention,
    environment,
    fp8_unavailable,
    peak_flops,
    reuse_host_memory,
    sdpa_backend_unavailable,
)
from gptopt.runtime.memory_check import is_oom
from gptopt.runtime.monitor import Monitor, format_summary
from gptopt.runtime.signals import CTRL_C_EXIT
from gptopt.runtime.torch_private import reset_dynamo
from gptopt.train import step_memory
from gptopt.train.step import LOADER_FIELDS, TrainStep, loader_options
from gptopt.train.wrap import to_float8
from gptopt.utils.errors import UserError
from gptopt.utils.extras import has
from gptopt.utils.tables import to_json

log = logging.getLogger("gptopt")


# A rung's settings are TrainConfig fields over the bench's base config (Bench.base: the bench's model, data,
# length, micro-batch and seed, train's defaults for the rest). The naive script's: fp32 (train's default),
# the SDPA kernel, the for-each AdamW, batches read in the training process, unpinned.
NAIVE: dict[str, Any] = {"attention": "sdpa", "fused_optimizer": False, "num_workers": 0, "pin_memory": False}
# `all` is train's defaults (fused AdamW, the device's attention kernel and DataLoader settings) with autocast
# and torch.compile: `gptopt train --use_amp --compile`.
ALL: dict[str, Any] = {"use_amp": True, "compile": True}


@dataclass(frozen=True)
class Rung:
    """One setting of the ladder (or a tune candidate): its TrainConfig is the bench's base with the overrides
    (Bench.config). Two switches are the bench's alone, since `gptopt train` has no option for them: the Hugging
    Face model in place of gptopt's (the naive script's), and host memory reuse, which train always does on CPUs
    (off in the naive rungs, so `all` shows what it buys)."""

    name: str
    what: str  # the one change this rung makes, for the report
    overrides: Mapping[str, Any] = field(default_factory=dict)  # TrainConfig field -> value
    hf: bool = False
    reuse_memory: bool = False  # on CPUs, freed host memory kept for the next tensor, as `gptopt train` runs

    def but(self, name: str, what: str, **overrides: Any) -> Rung:
        """This rung under another name, with more overrides (over its own)."""
        return dataclasses.replace(self, name=name, what=what, overrides={**self.overrides, **overrides})


LADDER: list[Rung] = [
    Rung("hf", "Hugging Face GPT2LMHeadModel, eager attention, fp32: the naive script", {**NAIVE, "attention": "eager"},
         hf=True),
    Rung("eager", "gptopt's model, eager attention, fp32", {**NAIVE, "attention": "eager"}),
    Rung("sdpa", "+ scaled_dot_product_attention (flash / memory-efficient kernels)", NAIVE),
    Rung("amp", "+ autocast mixed precision", {**NAIVE, "use_amp": True}),
    Rung("compile", "+ torch.compile, fp32", {**NAIVE, "compile": True}),
    Rung("compile_amp", "torch.compile + autocast", {**NAIVE, "compile": True, "use_amp": True}),
    Rung("all", "compile + autocast + fused AdamW + tuned DataLoader + the device's attention + host memory reuse",
         ALL, reuse_memory=True),
]
OPTIONAL: list[Rung] = [
    Rung("ckpt", "'all' + activation checkpointing (memory against time)", {**ALL, "gradient_checkpointing": True},
         reuse_memory=True),
    Rung("cudnn_attention", "'all' with SDPA's cuDNN kernel only (CUDA, compute capability 8.0+, cuDNN 9)",
         {**ALL, "attention": "sdpa", "sdpa_backend": "cudnn"}, reuse_memory=True),
    Rung("fp8", "'all' with float8 matmuls in the blocks (torchao; GPUs of compute capability 8.9+)",
         {**ALL, "fp8": True}, reuse_memory=True),
    Rung("chunked_loss", "'all' with the chunked loss (the full logits never exist)", {**ALL, "loss": "chunked"},
         reuse_memory=True),
    Rung("reduce_overhead", "'all' with compile mode reduce-overhead (CUDA graphs)",
         {**ALL, "compile_mode": "reduce-overhead"}, reuse_memory=True),
    Rung("max_autotune", "'all' with compile mode max-autotune", {**ALL, "compile_mode": "max-autotune"},
         reuse_memory=True),
]
SWEEP = "batch_sweep"  # expands to 'all' at doubling micro-batches until one does not fit


def select_rungs(spec: str) -> list[Rung]:
    by_name = {r.name: r for r in LADDER + OPTIONAL}
    valid = ", ".join(dict.fromkeys([*by_name, SWEEP, "default", "all"]))  # "all" is a rung and a set
    names: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == "default":
            names += [r.name for r in LADDER]
        elif part == "all":
            names += [r.name for r in LADDER + OPTIONAL] + [SWEEP]
        elif part in by_name or part == SWEEP:
            names.append(part)
        else:
            raise UserError(f"unknown rung {part!r}; valid rungs: {valid}")
    if not names:  # nothing to measure: refused before a report with no rungs is written
        raise UserError(f"--rungs {spec!r} names no rung; valid rungs: {valid} (`--rungs list` says what each does)")
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return [by_name[n] if n in by_name else Rung(SWEEP, "batch sweep") for n in seen]


class HFLoss(nn.Module):
    """The naive script's step: HF logits, then cross-entropy against the same targets gptopt uses."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.model = hf_model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


@dataclass
class RungResult:
    name: str
    what: str
    status: str = "ok"  # ok | oom | skipped | failed | identical (to the rung `same_as`: not measured again)
    note: str = ""
    same_as: str | None = None  # the earlier rung whose effective settings this rung's are
    hf: bool = False  # the Hugging Face model (Rung.hf): a baseline, never the recommendation
    config: dict[str, Any] = field(default_factory=dict)  # the TrainConfig it trained under, field by field
    batch_size: int = 0
    compile_s: float | None = None  # the first (warm-up) step: compile, autotune, caches
    step_time_s: float | None = None  # median
    step_time_p10_s: float | None = None
    step_time_p90_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_mem_bytes: int | None = None
    reserved_mem_bytes: int | None = None
    data_wait_frac: float | None = None  # share of the timed steps spent fetching and copying batches
    loss: float | None = None
    loss_ok: bool | None = None
    losses: list[float] = field(default_factory=list)  # every step's, warm-up included
    grad_norms: list[float] = field(default_factory=list)  # every step's, before clipping
    speedup_vs_baseline: float | None = None
    speedup_vs_previous: float | None = None


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def loss_matches(loss: float, reference: float, tolerance: float) -> bool:
    """Whether a loss after the same steps on the same batches is the reference's, within a relative tolerance."""
    return abs(loss - reference) <= tolerance * abs(reference)


# Asked before each step after the first: (step index, timed step times so far) -> None to go on, or
# (status, note) to end the rung there (tune ends candidates that cannot win or run past the budget).
StopHook = Callable[[int, list[float]], "tuple[str, str] | None"]


class Bench:
    def __init__(self, cfg: BenchConfig, *, steps: int | None = None, warmup: int | None = None) -> None:
        self.cfg = cfg
        # tune measures more candidates, each for fewer steps than BenchConfig allows
        self.steps = cfg.steps if steps is None else steps
        self.warmup = cfg.warmup if warmup is None else warmup
        setup = Setup.from_config(cfg)
        self.plan, self.preset, self.data = setup.plan, setup.preset, setup.data
        self.model_config, self.seq_len = setup.model_config, setup.seq_len
        self.batch_size = cfg.batch_size or 16
        self.fpt = flops_per_token(self.model_config, self.seq_len)
        torch.manual_seed(cfg.seed)  # then the model, as `gptopt train` builds it: the same initial weights
        init = GPT(self.model_config)
        self.params = init.num_params()
        self.init_state = {k: v.clone() for k, v in init.state_dict().items()}
        self.peak, self.peak_source = peak_flops(self.plan)
        # every rung's TrainConfig starts here; train's defaults fill the rest (learning rate, warmup, schedule,
        # weight decay, betas, gradient clipping), so best.toml trains what the rung measured
        self.base = TrainConfig(preset=self.preset, data_dir=cfg.data_dir, seq_len=self.seq_len,
                                batch_size=self.batch_size, seed=cfg.seed, device=cfg.device)
        self.results: list[RungResult] = []
        self.stopped = False  # Ctrl-C ended the ladder early
        self._effective: dict[str, dict[str, Any]] = {}  # rung name -> its effective settings (self.effective)
        self.monitor: dict[str, Any] = {}

    # -- one rung --------------------------------------------------------------------------

    def config(self, rung: Rung, batch_size: int | None = None) -> TrainConfig:
        """The TrainConfig a rung trains under: the base with the rung's overrides (and a sweep's micro-batch),
        its attention kernel, autocast and DataLoader settings as this device resolves them (autocast that the
        policy leaves at fp32 is off), so the config, and best.toml written from it, names what ran."""
        # what TrainConfig derives (min_lr, muon_lr) is derived again, from the rung's learning rate and optimizer
        derived = {"min_lr": None, "muon_lr": None}
        cfg = dataclasses.replace(self.base, **{**derived, **rung.overrides,
                                                **({"batch_size": batch_size} if batch_size else {})})
        plan = self._plan(cfg)
        amp = plan.amp_name
        cfg = dataclasses.replace(cfg, attention=self._attention(cfg.attention, plan.amp_dtype), use_amp=amp != "fp32",
                                  amp_dtype="auto" if amp == "fp32" else amp, **loader_options(cfg, plan.device.type))
        loss, _ = step_memory.pick_loss(
            cfg.loss, lambda loss: self.memory_estimate(dataclasses.replace(cfg, loss=loss)), plan.device,
            f"{cfg.batch_size} x {self.seq_len}")
        return dataclasses.replace(cfg, loss=loss)

    def _model_config(self, cfg: TrainConfig) -> GPTConfig:
        """The model a rung's (resolved) TrainConfig trains: the bench's shape with its runtime switches."""
        return dataclasses.replace(self.model_config, attention=cfg.attention, loss=cfg.loss,
                                   gradient_checkpointing=cfg.gradient_checkpointing)

    def _attention(self, choice: str, amp_dtype: torch.dtype | None) -> str:
        if choice != "auto":
            return choice
        # Not the faster of the fp32 `eager` and `sdpa` rungs: that ranking does not carry over to
        # compiled autocast steps (on CPUs SDPA wins in eager fp32 and loses compiled in bf16).
        default = default_attention(self.plan.device.type, amp_dtype)
        other = "sdpa" if default == "eager" else "eager"
        status = {r.name: r.status for r in self.results}
        return other if status.get(default, "ok") != "ok" and status.get(other) == "ok" else default

    def _build(self, rung: Rung, cfg: TrainConfig) -> nn.Module:
        model = GPT(self._model_config(cfg))
        model.load_state_dict(self.init_state)
        if rung.hf:
            from gptopt.models.hf import to_hf_model

            return HFLoss(to_hf_model(model).train()).to(self.plan.device)
        model.to(self.plan.device)
        if cfg.fp8:
            to_float8(model)
        return model

    def _plan(self, cfg: TrainConfig) -> DevicePlan:
        """The device plan a rung trains under: fp32, the policy's autocast dtype, or the dtype it names."""
        if not cfg.use_amp:
            return dataclasses.replace(self.plan, amp_dtype=None, use_grad_scaler=False)
        if cfg.amp_dtype == "auto":
            return self.plan
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp_dtype]
        # fp16 needs loss scaling on CUDA; bf16 has fp32's exponent range and does not
        return dataclasses.replace(self.plan, amp_dtype=dtype,
                                   use_grad_scaler=cfg.amp_dtype == "fp16" and self.plan.device.type == "cuda")

    def result(self, rung: Rung, cfg: TrainConfig, **fields: Any) -> RungResult:
        """A rung's row, before any figure: what it is and the config it trains under."""
        return RungResult(**{"name": rung.name, "what": rung.what, "hf": rung.hf, "batch_size": cfg.batch_size,
                             "config": dataclasses.asdict(cfg), **fields})

    def effective(self, rung: Rung, batch_size: int | None = None) -> dict[str, Any]:
        """What a rung runs once the device policy has resolved it: its config, the model, and host memory
        reuse, which counts only on CPUs."""
        return {**dataclasses.asdict(self.config(rung, batch_size)), "hf": rung.hf,
                "reuse_memory": rung.reuse_memory and self.plan.device.type == "cpu"}

    def memory_estimate(self, cfg: TrainConfig) -> memory_check.Estimate:
        """The peak memory of a rung's step, as step_memory.train_step_bytes counts it."""
        return step_memory.train_step_bytes(self._model_config(cfg), cfg.batch_size, self.seq_len,
                                       amp_dtype=self._plan(cfg).amp_dtype,
                                       accumulation=cfg.gradient_accumulation_steps)

    def identical_to(self, rung: Rung) -> RungResult | None:
        """The earlier measured rung this one would repeat, if any."""
        mine = self.effective(rung)
        return next((r for r in self.results if r.status != "identical" and r.name in self._effective
                     and self._effective[r.name] == mine), None)

    def run_rung(self, rung: Rung, batch_size: int | None = None, *, stop: StopHook | None = None) -> RungResult:
        cfg, plan = self.cfg, self.plan
        tcfg = self.config(rung, batch_size)
        B, accum = tcfg.batch_size, tcfg.gradient_accumulation_steps
        res = self.result(rung, tcfg, name=rung.name if batch_size is None else f"{rung.name}_b{B}")
        if rung.hf and not has("transformers"):
            res.status, res.note = "skipped", "needs the 'hf' extra: pip install 'gptopt[hf]'"
            return res
        rplan = self._plan(tcfg)
        why = (fp8_unavailable(plan.device) if tcfg.fp8 else None) or sdpa_backend_unavailable(
            tcfg.sdpa_backend, plan.device, rplan.amp_dtype)
        if why:
            res.status, res.note = "skipped", why
            return res
        short = memory_check.shortfall(self.memory_estimate(tcfg), plan.device)
        if short is not None:  # reported before anything is allocated: a CPU would otherwise be OOM-killed
            res.status, res.note = "oom", f"out of memory at micro-batch {B} (estimated, not run): it {short}"
            log.warning(f"rung {res.name}: {res.note}")
            return res
        model = train_step = None
        reused = rung.reuse_memory and plan.device.type == "cpu" and reuse_host_memory()
        try:
            model = self._build(rung, tcfg)
            step_model = compile_model(model, mode=tcfg.compile_mode) if tcfg.compile else model
            # train's step under the rung's TrainConfig: the HF baseline too (its config turns the fused kernel off)
            train_step = TrainStep(step_model, model, rplan, tcfg)
            # Each step's whole batch (B x accum sequences) is one item, split into micro-batches here:
            # every way of splitting it trains on the same sequences, so losses compare across micro-batches.
            ds = data.BatchDataset(self.data, "train", B * accum, self.seq_len, cfg.seed)
            batches = iter(data.make_loader(ds, 0, **loader_options(tcfg, plan.device.type)))
            times, waits = [], []
            rss0 = psutil.Process().memory_info().rss
            rss_peak = rss0
            if plan.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(plan.device)
            n_steps = self.warmup + self.steps
            for i in range(n_steps):
                verdict = stop(i, times) if stop is not None and i > 0 else None
                if verdict is not None:
                    res.status, res.note = verdict
                    break
                plan.synchronize()
                t0 = time.perf_counter()
                x, y = next(batches)
                x, y = x.to(plan.device, non_blocking=True), y.to(plan.device, non_blocking=True)
                wait = time.perf_counter() - t0
                out = train_step(i, lambda m, x=x, y=y: (x[m * B:(m + 1) * B], y[m * B:(m + 1) * B]))
                plan.synchronize()
                dt = time.perf_counter() - t0
                res.losses.append(out.loss)
                res.grad_norms.append(out.grad_norm)
                rss_peak = max(rss_peak, psutil.Process().memory_info().rss)
                if i == 0:
                    res.compile_s = dt
                elif i >= self.warmup:
                    times.append(dt)
                    waits.append(wait)
            res.step_times_s = times
            if times:  # a rung its stop hook ended still shows how fast it was going
                res.step_time_s = statistics.median(times)
                res.step_time_p10_s, res.step_time_p90_s = _percentile(times, 0.1), _percentile(times, 0.9)
                res.tokens_per_s = B * accum * self.seq_len / res.step_time_s
                res.tflops = res.tokens_per_s * self.fpt / 1e12
                # one ceiling for every rung (the policy dtype's), so the MFU column ranks like tokens/s
                res.mfu = mfu(res.tokens_per_s, self.fpt, self.peak)
                res.data_wait_frac = sum(waits) / sum(times)
            if res.status == "ok":  # a loss after fewer steps would not compare with the baseline's
                res.loss = statistics.mean(res.losses[-3:])
            if plan.device.type == "cuda":
                res.peak_mem_bytes = torch.cuda.max_memory_allocated(plan.device)
                res.reserved_mem_bytes = torch.cuda.max_memory_reserved(plan.device)
            else:  # the CPU analogues: growth of the process's resident memory, and its peak
                res.peak_mem_bytes = rss_peak - rss0
                res.reserved_mem_bytes = rss_peak
        except Exception as e:
            if is_oom(e):
                res.status = "oom"
                res.note = f"out of memory at micro-batch {B}" + (
                    f" ({torch.cuda.memory_allocated(plan.device) / 2**30:.1f} GiB allocated, "
                    f"{torch.cuda.get_device_properties(plan.device).total_memory / 2**30:.1f} GiB total)"
                    if plan.device.type == "cuda" else "")
            else:
                res.status, res.note = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning(f"rung {rung.name} failed: {res.note}")
        finally:
            # What is still in flight here is an interrupt (Ctrl-C, SystemExit): the rung's own errors were
            # caught above. A clean-up error must not replace it, or a Ctrl-C reads as a crash.
            interrupted = sys.exc_info()[1] is not None
            try:
                del model, train_step
                gc.collect()
                if plan.device.type == "cuda":
                    torch.cuda.empty_cache()
                reset_dynamo()  # each rung compiles afresh; caches must not leak between rungs
                if reused:  # the next rung (the naive ones above all) runs with glibc's defaults
                    reuse_host_memory(False)
            except Exception as e:
                if not interrupted:
                    raise
                log.debug(f"clean-up after the interrupted rung {rung.name} failed: {type(e).__name__}: {e}")
        return res

    # -- the ladder ------------------------------------------------------------------------

    def run(self, rungs: list[Rung]) -> dict[str, Any]:
        bar = tqdm(rungs, desc="bench", dynamic_ncols=True, file=sys.stderr)
        monitor = Monitor(self.plan.device.index if self.plan.device.type == "cuda" else None).start()
        try:
            for rung in bar:
                bar.set_postfix_str(rung.name)
                if rung.name == SWEEP:
                    self.results += self._sweep()
                    continue
                same = self.identical_to(rung)
                self._effective[rung.name] = self.effective(rung)
                self.results.append(self.run_rung(rung) if same is None else self._identical(rung, same))
        except KeyboardInterrupt:  # what was measured is reported; the rest say why they have no figures
            self.stopped = True
            done = {r.name for r in self.results}
            self.results += [RungResult(name=r.name, what=r.what, status="skipped", note=STOPPED)
                             for r in rungs if r.name not in done]
        finally:
            bar.close()
            monitor.stop()
        # not after Ctrl-C: the report of what was measured comes first
        self.settle_peak(self.results, remeasure=not self.stopped)
        self._compare()
        self.monitor = monitor.summary()
        return self.summary()

    def settle_peak(self, results: Sequence[RungResult], *, remeasure: bool = True) -> None:
        """Every result's MFU against one peak: measured again after them (the faster of two moments, so
        one slow moment of a shared machine does not inflate them all), and raised to the fastest result's
        rate if that is higher still (flops.at_least)."""
        if remeasure:
            self.peak, self.peak_source = peak_flops(self.plan, remeasure=True)
        measured = [r for r in results if r.tokens_per_s]
        if measured:
            fastest = max(measured, key=lambda r: r.tokens_per_s or 0.0)
            self.peak, self.peak_source = at_least(self.peak, self.peak_source,
                                                   (fastest.tokens_per_s or 0.0) * self.fpt,
                                                   f"the fastest rung, {fastest.name}")
        for r in measured:
            r.mfu = mfu(r.tokens_per_s or 0.0, self.fpt, self.peak)

    def _identical(self, rung: Rung, same: RungResult) -> RungResult:
        """A rung that would repeat an earlier one: a row that says so, with no figures and no speedup."""
        cfg = self.config(rung)
        why = ("autocast resolves to fp32" if rung.overrides.get("use_amp") and not cfg.use_amp
               else "the same settings once the device policy resolves them")
        return self.result(rung, cfg, status="identical", same_as=same.name,
                           note=f"identical to {same.name} on this device ({why})")

    def _sweep(self) -> list[RungResult]:
        base = next(r for r in LADDER if r.name == "all")
        out, b = [], 1
        while b <= 4096:
            res = self.run_rung(base.but("sweep", f"'all' at micro-batch {b}"), batch_size=b)
            out.append(res)
            if res.status != "ok" or (self.plan.device.type == "cpu" and b >= 2 * self.batch_size):
                break  # on a CPU nothing runs out of memory soon: stop past the bench's batch
            b *= 2
        return out

    def _compare(self) -> None:
        ok = [r for r in self.results if r.status == "ok"]
        if not ok:
            return
        baseline = ok[0]
        prev: RungResult | None = None
        for r in ok:
            r.speedup_vs_baseline = r.tokens_per_s / baseline.tokens_per_s
            r.speedup_vs_previous = r.tokens_per_s / prev.tokens_per_s if prev else 1.0
            same_batch = r.batch_size == baseline.batch_size
            r.loss_ok = loss_matches(r.loss, baseline.loss, self.cfg.loss_tolerance) if same_batch else None
            if r.loss_ok is False:
                r.status, r.note = "failed", f"loss {r.loss:.4f} departs from the baseline's {baseline.loss:.4f}"
            prev = r

    def best(self) -> RungResult | None:
        good = [r for r in self.results if r.status == "ok" and r.loss_ok is not False and not r.hf]
        return max(good, key=lambda r: r.tokens_per_s) if good else None

    def summary(self) -> dict[str, Any]:
        peak, source = self.peak, self.peak_source
        best = self.best()
        baseline = next((r for r in self.results if r.status == "ok"), None)
        return {
            "preset": self.preset, "seq_len": self.seq_len, "batch_size": self.batch_size, "steps": self.cfg.steps,
            "warmup": self.cfg.warmup, "seed": self.cfg.seed, "device": self.cfg.device,
            "model": self.model_config.to_dict(), "params": self.params,
            "flops_per_token": self.fpt, "peak_flops": peak, "peak_source": source, "device_policy": self.plan.reason,
            "baseline": baseline.name if baseline else None, "best": best.name if best else None,
            "environment": environment(self.plan), "rungs": [dataclasses.asdict(r) for r in self.results],
            "monitor": format_summary(self.monitor) if self.monitor else None, "monitor_stats": self.monitor,
        }


def best_train_config(summary: dict[str, Any]) -> dict[str, Any] | None:
    """What best.toml holds: the winning rung's TrainConfig (toml_options), so `gptopt train --config best.toml`
    is that rung's run."""
    best = next((r for r in summary["rungs"] if r["name"] == summary["best"]), None)
    return None if best is None else toml_options(best["config"])


# What a TOML of a rung's TrainConfig always names: the run (model, data, length, seed) and the step's settings,
# which a reader of best.toml or tune.toml looks for; any other field only where it is not train's default.
NAMED = ("preset", "data_dir", "seq_len", "seed", "batch_size", "gradient_accumulation_steps", "attention", "use_amp",
         "amp_dtype", "compile", "compile_mode", "fused_optimizer", "gradient_checkpointing", "loss", *LOADER_FIELDS)


def toml_options(config: dict[str, Any]) -> dict[str, Any]:
    """A rung's TrainConfig (RungResult.config) as the flat options of best.toml or tune.toml, under the
    fields' own names. A value of None is left out, as train's default (toml_text writes no None)."""
    defaults = dataclasses.asdict(TrainConfig())
    return {k: v for k, v in config.items() if k in NAMED or v != defaults[k]}


def main(cfg: BenchConfig) -> int:
    """The training ladder (`gptopt bench`; bench/main.py dispatches --mode infer to infer_ladder.py)."""
    from gptopt.bench import report

    if cfg.rungs.strip() == "list":
        for r in LADDER + OPTIONAL:
            print(f"{r.name:<16} {r.what}")
        print(f"{SWEEP:<16} 'all' at doubling micro-batches until one does not fit")
        return 0
    rungs = select_rungs(cfg.rungs)
    bench = Bench(cfg)
    log.info(f"bench: {bench.preset} at {bench.seq_len} tokens x micro-batch {bench.batch_size}, "
             f"{cfg.warmup} warm-up + {cfg.steps} timed steps per rung, {len(rungs)} rungs")
    summary = bench.run(rungs)
    out = Path(cfg.output_dir).expanduser()  # the folder bench/main.py checked
    report.write_all(summary, out, best_train_config(summary))
    print(report.table(summary))
    best = summary["best"]
    print(f"\nreport: {out / 'report.md'}" + (f"; best rung '{best}' -> {out / 'best.toml'}" if best else ""))
    if cfg.json:
        print(to_json(summary))
    if bench.stopped:
        log.warning("bench was stopped: the report holds the rungs measured before it")
        return CTRL_C_EXIT
    return 0 if best else 1
