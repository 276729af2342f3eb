"""The training loop around TrainStep: AMP, accumulation, compile, DDP/FSDP2, eval, metrics, checkpoints,
signals and faults. `gptopt train` (commands/train.py) runs it.

    gptopt train --preset tiny --max_steps 20

Exactness: batches are a pure function of (seed, micro-step), so a checkpoint needs only the step,
the optimizer, the scaler and the RNGs to continue bit for bit (train/resume.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gptopt import outputs
from gptopt.config import TrainConfig
from gptopt.data import loader as data
from gptopt.data.bpb import bits_per_byte, bytes_per_token
from gptopt.data.tokenizer import TOKENIZER, tokenizer_digest
from gptopt.models import checkpoint
from gptopt.models.flops import at_least, flops_per_token, mfu
from gptopt.runtime import memory_check as memory
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
from gptopt.runtime.monitor import Monitor, peak_memory_bytes
from gptopt.train import distributed, resume
from gptopt.train import step_memory as train_memory
from gptopt.train.distributed import DistInfo
from gptopt.train.metrics import Metrics, Progress, sample
from gptopt.train.resume import RUN_ENTRIES, RUN_KIND
from gptopt.train.step import StepResult, TrainStep, loader_options, read_all
from gptopt.train.tracing import scheduled_profiler
from gptopt.train.wrap import Prepared, wrap_for_training
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
# Steps read at most this far apart when --log_interval logs rarer (or never): bad steps are counted and
# a run of them stopped within this many steps
READ_EVERY = 100


class DeviceBatches:
    """The loader's batches, moved to the device; counts the time spent waiting for the loader."""

    def __init__(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.batches, self.device = batches, device
        self.wait = 0.0  # seconds; the caller resets it per step

    def __call__(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = time.perf_counter()
        x, y = next(self.batches)
        self.wait += time.perf_counter() - t
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class Trainer:
    """One training run. __init__ validates everything (the output folder, data, where to resume from,
    the model) and writes nothing; run() trains.

    run() = (rank 0) the old run of --overwrite moved aside, the folder marked; the signal handlers;
    _setup (model preparation, the TrainStep, the loader, the MFU peak, metrics, monitor, profiler),
    then _loop, per step: _train_one (the step), _read_steps (its figures, read with those of the steps
    before it: the bad-step count and the log), _evaluate, _save (which lets the old run go), and the stop
    conditions (signals, time budget, max steps/tokens; bad steps end the run from _read_steps).
    """

    # the loop's parts, made by _setup
    prep: Prepared
    train_step: TrainStep
    batches: DeviceBatches
    tokens_per_step: int
    fpt: float  # model FLOPs per trained token
    peak: float  # the MFU peak, FLOP/s of the whole job: one for every figure of the run (_step_mfu)
    peak_source: str
    measured_source: str  # where the peak came from at the start
    host_reuse: bool
    metrics: Metrics | None  # rank 0 only, as are the monitor and the profiler
    monitor: Monitor | None
    profiler: Any
    t_start: float
    interval_start: float  # when the first step not yet read began
    pending: list[tuple[int, StepResult, float]]  # (step, its result, its lr): trained, not yet read
    bar: tqdm

    def __init__(self, cfg: TrainConfig, info: DistInfo, plan: DevicePlan) -> None:
        self.cfg, self.info, self.plan = cfg, info, plan
        self.out = Path(cfg.output_dir)
        if cfg.fp8 and (why := fp8_unavailable(self.plan.device)):
            raise UserError(f"--fp8: {why}; drop --fp8")
        if why := sdpa_backend_unavailable(cfg.sdpa_backend, self.plan.device, self.plan.amp_dtype):
            raise UserError(f"--sdpa_backend {cfg.sdpa_backend}: {why}")
        if cfg.fsdp and not info.enabled:
            raise UserError("--fsdp needs torchrun: torchrun --nproc_per_node N -m gptopt train --fsdp ...")
        auto = default_attention(self.plan.device.type, self.plan.amp_dtype)  # the kernel by device and dtype
        self.attention = cfg.attention if cfg.attention != "auto" else auto
        torch.manual_seed(cfg.seed)
        # Everything is validated before anything is written or deleted; the old run of --overwrite is
        # only moved aside in run(), and deleted once the new run has saved a checkpoint.
        self.replaced = resume.check_run_output(cfg, info)
        self.aside: outputs.Aside | None = None
        self.run_info: dict[str, Any] | None = None  # run.json, which the closing summary extends
        self.data = self._load_data()
        self.resume_dir = resume.resume_dir(cfg)
        self.raw = resume.build_model(cfg, self.attention, self.data.model_vocab_size, self.resume_dir)
        resume.check_tokenizer(cfg, self.data, self.resume_dir)
        self.model_config = self.raw.config
        # A pretrained model's own context, known only once it is loaded: gpt2's 1024, a debug model's 64.
        self.seq_len = cfg.seq_len or self.model_config.block_size
        if self.seq_len > self.model_config.block_size:
            context = self.model_config.block_size
            raise UserError(f"--seq_len {self.seq_len} exceeds the model's context {context}: use --seq_len {context} "
                             "or less")
        self.data.check_vocab(self.model_config.vocab_size)
        self.state: dict[str, Any] = checkpoint.load_train_state(self.resume_dir) if self.resume_dir else {}
        resume.check_ranks_resume_alike(self.state, self.resume_dir, info, self.plan.device)
        self.lineage = resume.lineage(self.out, self.resume_dir, info)

    # -- before the loop ----------------------------------------------------------------------

    def _load_data(self) -> data.TokenData:
        return data.open_data(self.cfg.data_dir, is_main=self.info.is_main,
                              barrier=lambda: distributed.barrier(self.info))

    def _setup(self) -> Progress:
        """The loop's parts, and the progress of the run being resumed (if any)."""
        cfg, info, plan, main = self.cfg, self.info, self.plan, self.info.is_main
        loss, why = train_memory.pick_loss(cfg.loss, lambda loss: self._memory_estimate(cfg.batch_size, loss),
                                           plan.device, f"{cfg.batch_size} x {self.seq_len}")
        if cfg.loss == "auto" and info.world_size > 1 and distributed.any_rank(loss == "chunked", info, plan.device):
            loss = "chunked"  # one loss on every rank, the one that fits where memory is least
        if loss != self.model_config.loss:  # a switch of the forward alone: no module changes
            self.raw.config = self.model_config = dataclasses.replace(self.model_config, loss=loss)
        if main:
            kernel = f" ({cfg.sdpa_backend} kernel only)" if cfg.sdpa_backend != "auto" else ""
            log.info(f"attention: {self.attention}{kernel}; loss: {loss} ({why})"
                     + ("; float8 matmuls in the blocks (--fp8)" if cfg.fp8 else ""))
        train_memory.require_training(self._memory_estimate, plan.device, cfg, self.seq_len)
        self.prep = wrap_for_training(
            self.raw, plan, info, fsdp=cfg.fsdp, cpu_offload=cfg.cpu_offload, compile=cfg.compile,
            compile_mode=cfg.compile_mode, compile_fullgraph=cfg.compile_fullgraph, fp8=cfg.fp8,
        )
        self.train_step = TrainStep(self.prep.model, self.raw, plan, cfg, info)
        progress = self._restore(Progress(last_good=self.resume_dir))
        loader_opts = loader_options(self.cfg, self.plan.device.type)
        ds = data.BatchDataset(self.data, "train", cfg.batch_size, self.seq_len, cfg.seed, info.rank, info.world_size,
                               align=cfg.align_documents)
        start_micro = progress.step * cfg.gradient_accumulation_steps
        self.batches = DeviceBatches(iter(data.make_loader(ds, start_micro, **loader_opts)), plan.device)
        self.peak, self.peak_source = self._peak()
        self.measured_source = self.peak_source
        self.fpt = flops_per_token(self.model_config, self.seq_len)
        self.tokens_per_step = cfg.batch_size * self.seq_len * cfg.gradient_accumulation_steps * info.world_size
        # on CPUs the step's large activations would otherwise be page-faulted in afresh every step
        self.host_reuse = plan.device.type == "cpu" and reuse_host_memory()
        self.metrics = Metrics(self.out, progress.step, cfg.tensorboard) if main else None
        if main:
            self._write_run_info(plan, self.peak_source, self.train_step.fused, loader_opts, self.host_reuse)
            log.info(
                f"{self.raw.num_params() / 1e6:.2f}M parameters, {self.tokens_per_step:,} tokens/step "
                f"(micro-batch {cfg.batch_size} x {self.seq_len} x accumulation {cfg.gradient_accumulation_steps} x "
                f"{info.world_size} ranks); MFU against {self.peak_source}"
            )
        self.profiler = (scheduled_profiler(self.out / "logs" / "profile", plan.device.type) if cfg.profile and main
                         else None)
        self.monitor = Monitor(plan.device.index if plan.device.type == "cuda" else None).start() if main else None
        return progress

    def _restore(self, progress: Progress) -> Progress:
        """Optimizer, GradScaler, RNGs, step and tokens of the checkpoint being resumed."""
        if not self.state:
            return progress
        optimizer, scaler = self.train_step.optimizer, self.train_step.scaler
        distributed.load_optimizer_state(self.raw, optimizer, self.state["optimizer"], self.prep.sharded)
        if scaler is not None and self.state.get("scaler"):
            scaler.load_state_dict(self.state["scaler"])
        resume.set_rng_state(self.state["rng"])
        progress.step, progress.tokens_seen = self.state["step"], self.state["tokens_seen"]
        progress.train_s = self.state.get("train_s", 0.0)  # absent from checkpoints of older versions
        progress.first_steps_s = self.state.get("first_steps_s", 0.0)
        progress.best_val = self.state.get("best_val_loss")
        done = self.state.get("target")  # a run resumed after reaching this target does not train on
        progress.target = done if done and done["loss"] == self.cfg.target_loss else None
        if self.info.is_main:
            log.info(f"resumed from {self.resume_dir} at step {progress.step} ({progress.tokens_seen:,} tokens)")
        return progress

    def _peak(self) -> tuple[float, str]:
        """The MFU peak of the whole job (every rank brings its own device) and where it comes from."""
        peak, source = peak_flops(self.plan)
        if self.info.world_size > 1:
            source += f" x {self.info.world_size} ranks"
        return peak * self.info.world_size, source

    def _memory_estimate(self, batch_size: int, loss: str | None = None) -> memory.Estimate:
        """The step's peak memory at a micro-batch (with `loss`, or the model's), less the weights where the model
        already is (the CPU, or the device after --auto_batch_size's search)."""
        config = self.model_config if loss is None else dataclasses.replace(self.model_config, loss=loss)
        est = train_memory.for_training(config, self.cfg, self.seq_len, self.plan.amp_dtype,
                                  batch_size=batch_size, world_size=self.info.world_size)
        there = next(self.raw.parameters()).device.type == self.plan.device.type
        return est.without("weights") if there else est

    def _auto_batch_size(self, global_batch: int) -> None:
        cfg, plan = self.cfg, self.plan
        model = self.raw.to(plan.device)
        largest = global_batch if plan.device.type == "cuda" else cfg.batch_size
        if cfg.loss == "auto":  # searched with the leaner loss; _setup keeps the full one if it fits the batch found
            self.raw.config = self.model_config = dataclasses.replace(self.model_config, loss="chunked")

        def try_batch(b: int) -> None:
            x = torch.randint(0, self.model_config.vocab_size, (b, self.seq_len), device=plan.device)
            try:
                with plan.autocast():
                    loss = model(x, x)
                loss.backward()
            finally:
                model.zero_grad(set_to_none=True)

        b = train_memory.find_batch_size(try_batch, global_batch, largest,
                            lambda b: memory.shortfall(self._memory_estimate(b), plan.device) is None)
        if b != cfg.batch_size:
            cfg.batch_size, cfg.gradient_accumulation_steps = b, global_batch // b
            log.info(f"auto batch size: micro-batch {b} x accumulation {cfg.gradient_accumulation_steps} "
                     f"(global batch {global_batch})")

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Train; under --overwrite the old run stays aside until the new one saves its first checkpoint,
        and comes back if the new one fails before that (rank 0 does all of it: it alone writes)."""
        if not self.info.is_main:
            return self._run()
        created, marked = not self.out.exists(), outputs.marked_kind(self.out) is not None
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            with outputs.Aside(self.out, self.replaced, RUN_ENTRIES) as self.aside:
                outputs.mark(self.out, RUN_KIND)
                rc = self._run()
                if rc != 0:  # failed before its first checkpoint (after it, the old run is gone already)
                    self.aside.rollback()
                return rc
        except UserError:
            # A refusal found once the run had begun (the step will not fit, --auto_batch_size found no
            # micro-batch that does) comes before anything but the mark is written: the folder the run made
            # for itself goes, and a folder the user made is left as it was.
            if not checkpoint.checkpoint_dirs(self.out):
                if created:
                    outputs.remove(self.out)
                elif not marked:
                    outputs.remove(self.out / outputs.OWNER_FILE)
            raise

    def _run(self) -> int:
        stop_signal: list[int] = []
        # From before the setup on (a compile can take minutes): a stop signal then still ends in a saved
        # checkpoint after the first step, where the default action would kill the run mid-write.
        old_handlers = self._install_signals(stop_signal)
        try:
            if self.cfg.auto_batch_size:
                self._auto_batch_size(self.cfg.batch_size * self.cfg.gradient_accumulation_steps)
            return self._loop(self._setup(), stop_signal)
        finally:
            self._restore_signals(old_handlers)

    def _loop(self, progress: Progress, stop_signal: list[int]) -> int:
        cfg, main = self.cfg, self.info.is_main
        self.t_start = time.perf_counter()
        bar = self.bar = tqdm(total=cfg.max_steps, initial=progress.step, disable=not main, dynamic_ncols=True,
                              mininterval=1.0, desc="train")
        self.pending = []
        exit_code = 0
        try:
            if progress.target is not None and main:
                log.info(f"the target val loss {progress.target['loss']} was reached at step "
                         f"{progress.target['steps_to_target']} before this resume: nothing to train")
            while not self._reached_the_end(progress) and progress.target is None:
                self._train_one(progress)
                last_step = self._reached_the_end(progress)
                every = cfg.eval_every
                evaluated = bool(every) and (progress.step % every == 0 or last_step)
                if evaluated or last_step or self._read_due(progress):
                    self._read_steps(progress)
                if evaluated:
                    self._record_eval(progress, self._evaluate(progress.step, progress.train_s))
                stop = self._stop_requested(stop_signal)
                reached = progress.target is not None
                save = stop or reached or last_step or (cfg.save_interval and progress.step % cfg.save_interval == 0)
                if save:  # a checkpoint holds the train time and counts up to its step
                    self._read_steps(progress)
                # the model a stop saves gets its val loss (every rank agrees on `stop`, so all evaluate)
                if stop and every and not evaluated:
                    self._record_eval(progress, self._evaluate(progress.step, progress.train_s))
                if save:
                    # A checkpoint taken because of Ctrl-C / SIGTERM does not retire an old run that --overwrite
                    # set aside: stopping a mistaken --overwrite must give the old run back (run() does).
                    progress.last_good = self._save(progress, retire_old=not stop_signal)
                if stop:
                    exit_code = self._stopped_early(progress, stop_signal)
                    break
                if reached:
                    if main:
                        log.info(f"target val loss {cfg.target_loss} reached at step {progress.step}: saved "
                                 f"{progress.last_good}")
                    break
        except Exception as e:
            if is_oom(e):
                raise RuntimeError(train_memory.oom_advice(cfg, self.plan)) from e
            raise
        finally:
            bar.close()
            self._teardown()
        if main:
            self._summary(progress)
        return exit_code

    def _train_one(self, progress: Progress) -> None:
        """One optimizer step and its counters. Its figures may stay on the device: _read_steps reads them."""
        lr = self.train_step.lr(progress.step)
        if not self.pending:
            self.interval_start = time.perf_counter()
        result = self.train_step(progress.step, self.batches)
        progress.step += 1
        progress.tokens_seen += self.tokens_per_step
        self.pending.append((progress.step, result, lr))
        self.bar.update(1)
        if self.profiler is not None:
            self.profiler.step()

    def _read_due(self, progress: Progress) -> bool:
        """Whether the steps trained since the last read are read now: the process's first step (it compiles:
        its time is kept apart), a logged step, and at least every READ_EVERY steps."""
        interval = self.cfg.log_interval
        return (progress.compile_s is None or progress.step == 1 or bool(interval and progress.step % interval == 0)
                or len(self.pending) >= READ_EVERY)

    def _read_steps(self, progress: Progress) -> None:
        """The pending steps' losses, norms and finite flags in one transfer (step.read_all: the loop's one host
        sync, where the optimizer skips bad steps on the device); then each step's bookkeeping: its share of the
        steps' wall time since the first of them began, the bad-step count and stop, its metrics record."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        read_all([result for _, result, _ in pending])
        dt = (time.perf_counter() - self.interval_start) / len(pending)  # one mean: the device ran them in a row
        wait = self.batches.wait / len(pending)
        self.batches.wait = 0.0
        cfg = self.cfg
        for step, result, lr in pending:
            progress.train_s += dt
            if progress.compile_s is None:
                progress.compile_s = dt
                progress.first_steps_s += dt
            else:
                progress.times.append(dt)
                progress.waits.append(wait / dt)
            if result.finite:
                progress.bad_steps = 0
            else:
                progress.bad_steps += 1
                log.warning(f"step {step - 1}: non-finite loss {result.loss} / grad norm {result.grad_norm}: "
                            f"optimizer step skipped ({progress.bad_steps}/{cfg.max_bad_steps})")
            if progress.bad_steps >= cfg.max_bad_steps:
                where = f"; the last good checkpoint is {progress.last_good}" if progress.last_good else ""
                raise RuntimeError(
                    f"{progress.bad_steps} consecutive non-finite steps at step {step}: stopping{where}. "
                    "Lower --learning_rate, keep --grad_clip on, or use bf16 instead of fp16"
                )
            if self.info.is_main:
                self._log_step(step, progress, result, lr, dt, wait)

    def _log_step(self, step: int, progress: Progress, result: StepResult, lr: float, dt: float,
                  wait: float) -> None:
        tps = self.tokens_per_step / dt
        step_mfu = self._step_mfu(tps, step)
        mem = peak_memory_bytes(self.plan)
        self.bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{step_mfu:.0%}",
                             mem=f"{mem / 2**30:.2f}G", refresh=False)
        interval = self.cfg.log_interval
        if (interval and step % interval == 0) or step == 1:
            assert self.metrics is not None and self.monitor is not None  # rank 0 has both
            seen = progress.tokens_seen - (progress.step - step) * self.tokens_per_step  # at that step
            self.metrics.write({
                "step": step, "loss": result.loss, "lr": lr, "tokens_per_s": tps, "mfu": step_mfu,
                "step_time_s": dt, "data_wait_frac": wait / dt, "grad_norm": result.grad_norm,
                "peak_mem_bytes": mem, "tokens_seen": seen,
                "elapsed_s": time.perf_counter() - self.t_start,
                # fp16: the GradScaler's scale; one that keeps falling means overflowing gradients
                **({"loss_scale": scaler.get_scale()} if (scaler := self.train_step.scaler) is not None else {}),
                **{k: v for k, v in self.monitor.latest().items() if k != "t"},
            })

    def _step_mfu(self, tokens_per_s: float, step: int) -> float:
        """A step's MFU against the run's peak, the one the bar, metrics.jsonl and the summary all take;
        a step faster than it raises it (flops.at_least). The peak only rises, and the summary takes the
        last one."""
        achieved = tokens_per_s * self.fpt
        if achieved > self.peak:
            if self.peak_source == self.measured_source:
                log.warning(f"step {step} achieved {achieved / 1e12:.3g} TFLOP/s, above the {self.measured_source}: "
                            "that measurement was low; MFU is stated against the fastest step from here on")
            self.peak, self.peak_source = at_least(self.peak, self.measured_source, achieved,
                                                   f"the fastest step, {step}")
        return mfu(tokens_per_s, self.fpt, self.peak)

    # -- stop conditions ------------------------------------------------------------------------

    def _reached_the_end(self, progress: Progress) -> bool:
        cfg = self.cfg
        return progress.step >= cfg.max_steps or (cfg.max_tokens is not None and progress.tokens_seen >= cfg.max_tokens)

    def _stop_requested(self, stop_signal: list[int]) -> bool:
        """A signal arrived or the time budget is spent, on any rank: every rank stops at this step."""
        budget = self.cfg.time_budget_s
        out_of_time = budget is not None and time.perf_counter() - self.t_start >= budget
        return distributed.any_rank(bool(stop_signal) or out_of_time, self.info, self.plan.device)

    def _stopped_early(self, progress: Progress, stop_signal: list[int]) -> int:
        """Say why the run stopped (its checkpoint is saved); the exit code: 143/130 for SIGTERM/SIGINT."""
        main = self.info.is_main
        if stop_signal:
            if main and self.aside is not None and self.aside.folder is not None:
                log.info(f"signal {signal.Signals(stop_signal[0]).name}: the run --overwrite was replacing is put back "
                         f"in {self.out} (this run had no checkpoint before the signal)")
            elif main:
                log.info(f"signal {signal.Signals(stop_signal[0]).name}: saved {progress.last_good}; resume with "
                         "--resume auto")
            return EXIT_CODES.get(stop_signal[0], 1)
        if main:
            log.info(f"time budget {self.cfg.time_budget} reached at step {progress.step}: saved {progress.last_good}")
        return 0

    def _teardown(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if self.monitor is not None:
            self.monitor.stop()
            (self.out / "monitor.json").write_text(json.dumps(self.monitor.summary(), indent=2))
        if self.metrics is not None:
            self.metrics.close()
        if self.host_reuse:  # the process goes back to glibc's defaults (a caller may run more than training)
            reuse_host_memory(False)

    # -- eval, save, report --------------------------------------------------------------------

    def _record_eval(self, progress: Progress, val: float) -> None:
        """The best val loss so far, and --target_loss reached: what it took (step time summed, evals and
        saves left out; with and without each process's first step, which compiles)."""
        if math.isfinite(val):  # a diverged evaluation is neither the best nor a target reached
            progress.best_val = val if progress.best_val is None else min(progress.best_val, val)
        target = self.cfg.target_loss
        if target is None or not val <= target or progress.target is not None:
            return
        progress.target = {
            "loss": target, "reached": True, "val_loss": val, "time_to_target_s": progress.train_s,
            "time_to_target_excl_compile_s": progress.train_s - progress.first_steps_s,
            "tokens_to_target": progress.tokens_seen, "steps_to_target": progress.step,
            "best_val_loss": progress.best_val,
        }
        if self.metrics is not None:
            self.metrics.write({"step": progress.step, "target": progress.target})

    def _target_report(self, progress: Progress) -> dict[str, Any] | None:
        if self.cfg.target_loss is None:
            return None
        return progress.target or {
            "loss": self.cfg.target_loss, "reached": False, "time_to_target_s": None,
            "time_to_target_excl_compile_s": None, "tokens_to_target": None, "steps_to_target": None,
            "best_val_loss": progress.best_val}

    @torch.no_grad()
    def _evaluate(self, step: int, train_s: float) -> float:
        """The val loss, logged with train_s: the training steps' wall time so far (bench --mode quality's
        curves of val loss against training time)."""
        cfg, plan, info = self.cfg, self.plan, self.info
        self.raw.eval()
        ds = data.BatchDataset(self.data, "val", cfg.batch_size, self.seq_len, cfg.seed, info.rank, info.world_size)
        losses = []
        for x, y in ds.eval_batches(cfg.eval_iters):
            with plan.autocast():
                losses.append(self.raw(x.to(plan.device), y.to(plan.device)).float())
        val = distributed.all_reduce_mean(torch.stack(losses).mean(), info).item()
        text = ""
        if cfg.sample_tokens:
            text = sample(self.raw, plan, self.data.tokenizer(), self.data.eot_id, cfg.sample_tokens, cfg.seed + step)
        self.raw.train()
        if info.is_main:
            assert self.metrics is not None
            ppl = math.exp(min(val, 50.0))
            bpb = bits_per_byte(val, bytes_per_token(self.data, "val"))  # None for nanoGPT data (no tokenizer)
            tqdm.write(f"step {step}: val loss {val:.4f}, perplexity {ppl:.2f}"
                       + (f", {bpb:.4f} bits/byte" if bpb is not None else "")
                       + (f"\n  sample: {text!r}" if text else ""))
            self.metrics.write({"step": step, "val_loss": val, "val_ppl": ppl, "val_bpb": bpb, "sample": text,
                                "train_s": train_s})
        return val

    def _save(self, progress: Progress, *, retire_old: bool = True) -> Path | None:
        optimizer, scaler = self.train_step.optimizer, self.train_step.scaler
        model_state, optim_state = distributed.full_state_dicts(self.raw, optimizer, self.prep.sharded)
        path = None
        if self.info.is_main:
            train_state = {
                "step": progress.step, "tokens_seen": progress.tokens_seen, "bad_steps": progress.bad_steps,
                "optimizer": optim_state, "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": resume.rng_state(), "world_size": self.info.world_size, "train_s": progress.train_s,
                "first_steps_s": progress.first_steps_s, "best_val_loss": progress.best_val,
                "target": progress.target,
            }
            # The tokenizer travels in the checkpoint (generate and serve prefer that copy); the recorded
            # path is absolute, so even an older reader finds it from any working directory.
            tokenizer = self.data.tokenizer()
            # data_dir too: compress and bench evaluate on it by default, from whatever folder they run in
            meta = {"environment": environment(self.plan), "train_config": dataclasses.asdict(self.cfg),
                    "data_dir": str(Path(self.cfg.data_dir).resolve()),
                    **({"tokenizer": str(Path(self.cfg.data_dir).resolve() / TOKENIZER),
                        "tokenizer_digest": tokenizer_digest(tokenizer)} if tokenizer else {})}
            path = checkpoint.save_checkpoint(self.out, progress.step, self.model_config, model_state, train_state,
                                              meta=meta, keep=self.cfg.save_total_limit, parent=self.lineage,
                                              tokenizer=tokenizer)
            self.lineage = checkpoint.lineage(path)
            if self.aside is not None and retire_old:
                self.aside.commit()  # the new run has a checkpoint of its own: the old run goes
        distributed.barrier(self.info)
        return path if path is not None else checkpoint.latest_checkpoint(self.out)

    def _write_run_info(self, plan: DevicePlan, peak_source: str, fused: bool, loader: dict[str, Any],
                        host_memory_reuse: bool) -> None:
        info = {"config": dataclasses.asdict(self.cfg), "model": self.model_config.to_dict(),
                "environment": environment(plan), "device_policy": plan.reason, "peak_source": peak_source,
                "fused_adamw": fused, "dataloader": loader, "host_memory_reuse": host_memory_reuse,
                "seq_len": self.seq_len}
        self.run_info = info
        (self.out / "run.json").write_text(json.dumps(info, indent=2, default=str))

    def _summary(self, progress: Progress) -> None:
        """The closing lines, and the same figures as run.json's "summary" (and "target") for scripts
        (.ci/gpu_check.py, bench --mode quality)."""
        summary: dict[str, Any] = {"step": progress.step, "best_val_loss": progress.best_val}
        if progress.times:
            peak, peak_source = self.peak, self.peak_source  # the steps' own (_step_mfu)
            med = statistics.median(progress.times)
            tps = self.tokens_per_step / med
            wait, run_mfu = statistics.mean(progress.waits), mfu(tps, self.fpt, peak)
            log.info(
                f"done: step {progress.step}; first step (compile/warm-up) {progress.compile_s:.1f}s; median step "
                f"{med * 1e3:.1f} ms, {tps:,.0f} tokens/s, MFU {run_mfu:.1%} of {peak_source}; "
                f"data wait {wait:.1%} of step time"
            )
            summary.update({"first_step_s": progress.compile_s, "median_step_s": med, "tokens_per_s": tps,
                            "mfu": run_mfu, "peak_flops": peak, "peak_source": peak_source, "data_wait": wait,
                            "peak_memory_bytes": peak_memory_bytes(self.plan)})
        else:
            log.info(f"stopped at step {progress.step}")
        target = self._target_report(progress)
        if target is not None:
            if target["reached"]:
                log.info(f"target val loss {target['loss']}: reached at step {target['steps_to_target']} "
                         f"({target['tokens_to_target']:,} tokens) after {target['time_to_target_s']:.1f} s of "
                         f"training, {target['time_to_target_excl_compile_s']:.1f} s without the first step "
                         f"(compile); val loss {target['val_loss']:.4f}")
            else:
                best = "none measured" if progress.best_val is None else f"{progress.best_val:.4f}"
                log.info(f"target val loss {target['loss']}: not reached in {progress.step} steps; best val loss "
                         f"{best}")
        if self.run_info is not None:
            extra = {"summary": summary, **({"target": target} if target is not None else {})}
            outputs.write_text_atomic(self.out / "run.json",
                                     json.dumps({**self.run_info, **extra}, indent=2, default=str))

    def _install_signals(self, flag: list[int]) -> dict[int, Any]:
        """The first SIGTERM/SIGINT sets a flag, said at once: the loop saves at the next step boundary, then
        exits. A second one stops at once (KeyboardInterrupt: no checkpoint of this step; an --overwrite not
        yet replaced by a checkpoint comes back)."""
        main = self.info.is_main

        def handler(signum: int, frame: Any) -> None:
            if flag:
                raise KeyboardInterrupt
            flag.append(signum)
            if main:
                print(f"gptopt train: {signal.Signals(signum).name}: stopping after this step, with a checkpoint; "
                      "Ctrl-C again stops at once, without one", file=sys.stderr, flush=True)

        old: dict[int, Any] = {}
        with contextlib.suppress(ValueError):  # not the main thread (e.g. a test runner's worker)
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, handler)
        return old

    @staticmethod
    def _restore_signals(old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)
