"""The training loop around TrainStep: the steps, their figures, evaluation, checkpoints and the stop conditions
(signals, the time budget, --max_steps / --max_tokens, --target_loss, bad steps). `gptopt train` (commands/train.py)
runs it.

    gptopt train --preset tiny --max_steps 20

Its parts have rooms of their own: checkpointing.py (the run's folder, checkpoints saved and restored, the old run
of --overwrite), auto_batch.py (--auto_batch_size's search), validation.py (the val loss, best and target),
run_record.py (run.json and the summary), metrics.py (metrics.jsonl, the progress), runtime/signals.py (stop
signals).

Exactness: batches are a pure function of (seed, micro-step), so a checkpoint needs only the step,
the optimizer, the scaler and the RNGs to continue bit for bit (train/resume.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gptopt.config import TrainConfig
from gptopt.data import loader as data
from gptopt.models import checkpoint
from gptopt.models.flops import at_least, flops_per_token, mfu
from gptopt.runtime import memory_check, signals
from gptopt.runtime.device import (
    DevicePlan,
    default_attention,
    fp8_unavailable,
    peak_flops,
    reuse_host_memory,
    sdpa_backend_unavailable,
)
from gptopt.runtime.memory_check import is_oom
from gptopt.runtime.monitor import Monitor, peak_memory_bytes
from gptopt.train import auto_batch, distributed, resume, step_memory, validation
from gptopt.train.checkpointing import Checkpointer, RunFolder
from gptopt.train.distributed import DistInfo
from gptopt.train.metrics import Metrics, Progress
from gptopt.train.run_record import RunRecord, Speed
from gptopt.train.step import StepResult, TrainStep, loader_options, read_all
from gptopt.train.tracing import scheduled_profiler
from gptopt.train.wrap import Prepared, wrap_for_training
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")
# Steps read at most this far apart when --log_interval logs rarer (or never): bad steps are counted and
# a run of them stopped within this many steps
READ_EVERY = 100


class DeviceBatches:
    """The loader's batches, moved to the device; counts the time spent waiting for the loader."""

    def __init__(self, batches: Iterator[tuple[torch.Tensor, ...]], device: torch.device) -> None:
        self.batches, self.device = batches, device
        self.wait = 0.0  # seconds; the caller resets it per step

    def __call__(self, micro: int) -> tuple[torch.Tensor, ...]:
        t = time.perf_counter()
        batch = next(self.batches)  # (x, y), or chat data's (x, y, pos)
        self.wait += time.perf_counter() - t
        return tuple(b.to(self.device, non_blocking=True) for b in batch)

    def close(self) -> None:
        """Let the loader go now: its iterator shuts its worker processes down as it is freed. Left to the end of
        the process, their exit would wait on workers that ignore the stop signals meant for the main process."""
        self.batches = iter(())


def _say_stopping(evaluates: bool, signum: int) -> None:
    """Said at once, from the signal's handler: the step under way may take long."""
    then = ", then its evaluation" if evaluates else ""
    print(f"gptopt train: {signals.name(signum)}: stopping after this step: its checkpoint first{then}; "
          "Ctrl-C again stops at once (before the checkpoint: without one)", file=sys.stderr, flush=True)


class Trainer:
    """One training run. __init__ validates everything (the output folder, data, where to resume from,
    the model) and writes nothing; run() trains.

    run() = (rank 0) the run's folder opened (checkpointing.RunFolder: the old run of --overwrite set aside, the
    mark); the stop signals' handler; --auto_batch_size's search; _setup (model preparation, the TrainStep, the
    loader, the MFU peak, metrics, run.json, monitor, profiler), then _loop, per step: _train_one (the step),
    _read_steps (its figures, read with those of the steps before it: the bad-step count and the log), the
    evaluation, the checkpoint (which lets the old run go), and the stop conditions (a stop saves first, then
    evaluates: _stop; bad steps end the run from _read_steps).
    """

    # the loop's parts, made by _setup
    prep: Prepared
    train_step: TrainStep
    checkpoints: Checkpointer
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
        replaced = resume.check_run_output(cfg, info)
        self.folder = RunFolder(self.out, replaced) if info.is_main else None  # rank 0 alone writes
        self.record = RunRecord(self.out)
        self.data = data.open_data(cfg.data_dir, is_main=info.is_main, barrier=lambda: distributed.barrier(info))
        self.resume_dir = resume.resume_dir(cfg)
        self.raw = resume.build_model(cfg, self.attention, self.data.model_vocab_size, self.resume_dir)
        resume.check_tokenizer(cfg, self.data, self.resume_dir)
        if self.resume_dir is None and cfg.init_from != "scratch":
            self.raw = resume.fit_added_tokens(self.raw, self.data)
        self.raw = resume.with_lora(self.raw, cfg, self.resume_dir)
        # the source's template and end ids; chat data's template, which the run learns to follow
        self.carried = resume.carried_files(cfg, self.resume_dir, self.data)
        self.model_config = self.raw.config
        # A pretrained model's own context, known only once it is loaded: gpt2's 1024, a debug model's 64.
        self.seq_len = cfg.seq_len or self.model_config.block_size
        context = self.model_config.block_size
        if self.data.chat is not None:  # conversations were packed into rows of this length at prepare time
            rows = self.data.chat["seq_len"]
            if cfg.seq_len is not None and cfg.seq_len != rows:
                raise UserError(f"--seq_len {cfg.seq_len}: {cfg.data_dir} holds conversations packed into rows of "
                                 f"{rows} tokens; drop --seq_len, or prepare them again with --seq_len {cfg.seq_len}")
            if cfg.align_documents:
                raise UserError("--align_documents: conversations always start where they were packed; drop it")
            if rows > context:
                raise UserError(f"{cfg.data_dir} holds rows of {rows} tokens, more than the model's context "
                                 f"{context}: prepare the conversations again with --seq_len {context} or less")
            self.seq_len = rows
        if self.seq_len > context:
            raise UserError(f"--seq_len {self.seq_len} exceeds the model's context {context}: use --seq_len {context} "
                             "or less")
        self.data.check_vocab(self.model_config.vocab_size)
        # Both splits the run reads, before its first step: a val split found too short at the first evaluation
        # would cost every step before it.
        if self.data.chat is not None:
            data.check_rows(self.data, "train")
            if cfg.eval_every:
                data.check_rows(self.data, "val")
        else:
            data.check_split(self.data, "train", self.seq_len)
            if cfg.eval_every:
                data.check_split(self.data, "val", self.seq_len,
                                 other_fix="train without evaluation (--eval_interval 0)")
        self.state: dict[str, Any] = checkpoint.load_train_state(self.resume_dir) if self.resume_dir else {}
        resume.check_ranks_resume_alike(self.state, self.resume_dir, info, self.plan.device)
        self.lineage = resume.lineage(self.out, self.resume_dir, info)

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train; under --overwrite the old run stays aside until the new one saves its first checkpoint,
        and comes back if the new one fails or is stopped before that (rank 0 does all of it: it alone writes)."""
        if self.folder is None:
            return self._run()
        with self.folder.open():
            rc = self._run()
            if rc != 0:  # stopped before its first checkpoint but a stop's: the old run comes back
                self.folder.give_back()
            return rc

    def _run(self) -> int:
        # From before the setup on (a compile can take minutes): a stop signal then still ends in a saved
        # checkpoint after the first step, where the default action would kill the run mid-write.
        self.stop = signals.StopRequest(functools.partial(_say_stopping, bool(self.cfg.eval_every))
                                        if self.info.is_main else None)
        with signals.handling(self.stop):
            if self.cfg.auto_batch_size:
                self._auto_batch_size()
            return self._loop(self._setup())

    def _auto_batch_size(self) -> None:
        """--auto_batch_size: the run takes the search's micro-batch and accumulation (the global batch kept)."""
        cfg = self.cfg
        def fits(batch: int, loss: str) -> bool:
            return memory_check.shortfall(self._memory_estimate(batch, loss), self.plan.device) is None

        choice = auto_batch.search(self.raw, self.plan, cfg, self.seq_len, fits)
        if choice.batch_size != cfg.batch_size:
            self.cfg = dataclasses.replace(cfg, batch_size=choice.batch_size,
                                           gradient_accumulation_steps=choice.accumulation)
            log.info(f"auto batch size: micro-batch {choice.batch_size} x accumulation {choice.accumulation} "
                     f"(global batch {choice.batch_size * choice.accumulation})")

    # -- before the loop ----------------------------------------------------------------------

    def _setup(self) -> Progress:
        """The loop's parts, and the progress of the run being resumed (if any)."""
        cfg, info, plan, main = self.cfg, self.info, self.plan, self.info.is_main
        loss, why = step_memory.pick_loss(cfg.loss, lambda loss: self._memory_estimate(cfg.batch_size, loss),
                                           plan.device, f"{cfg.batch_size} x {self.seq_len}")
        if cfg.loss == "auto" and info.world_size > 1 and distributed.any_rank(loss == "chunked", info, plan.device):
            loss = "chunked"  # one loss on every rank, the one that fits where memory is least
        if loss != self.model_config.loss:  # a switch of the forward alone: no module changes
            self.raw.config = self.model_config = dataclasses.replace(self.model_config, loss=loss)
        if main:
            kernel = f" ({cfg.sdpa_backend} kernel only)" if cfg.sdpa_backend != "auto" else ""
            log.info(f"attention: {self.attention}{kernel}; loss: {loss} ({why})"
                     + ("; float8 matmuls in the blocks (--fp8)" if cfg.fp8 else ""))
        step_memory.require_training(self._memory_estimate, plan.device, cfg, self.seq_len)
        self.prep = wrap_for_training(
            self.raw, plan, info, fsdp=cfg.fsdp, cpu_offload=cfg.cpu_offload, compile=cfg.compile,
            compile_mode=cfg.compile_mode, compile_fullgraph=cfg.compile_fullgraph, fp8=cfg.fp8,
        )
        self.train_step = TrainStep(self.prep.model, self.raw, plan, cfg, info)
        self.checkpoints = Checkpointer(cfg, info, plan, self.data, self.lineage, self.folder, self.carried)
        progress = self.checkpoints.restore(self.state, self.raw, self.train_step, self.prep.sharded,
                                            Progress(last_good=self.resume_dir))
        loader_opts = loader_options(self.cfg, self.plan.device.type)
        ds: torch.utils.data.Dataset = (
            data.ChatRows(self.data, "train", cfg.batch_size, cfg.seed, info.rank, info.world_size)
            if self.data.chat is not None else
            data.BatchDataset(self.data, "train", cfg.batch_size, self.seq_len, cfg.seed, info.rank, info.world_size,
                              align=cfg.align_documents))
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
            self.record.start(cfg, self.model_config, plan, self.seq_len, peak_source=self.peak_source,
                              fused_adamw=self.train_step.fused, dataloader=loader_opts,
                              host_memory_reuse=self.host_reuse)
            log.info(
                f"{self.raw.num_params() / 1e6:.2f}M parameters, {self.tokens_per_step:,} tokens/step "
                f"(micro-batch {cfg.batch_size} x {self.seq_len} x accumulation {cfg.gradient_accumulation_steps} x "
                f"{info.world_size} ranks); MFU against {self.peak_source}"
            )
        self.profiler = (scheduled_profiler(self.out / "logs" / "profile", plan.device.type) if cfg.profile and main
                         else None)
        self.monitor = Monitor(plan.device.index if plan.device.type == "cuda" else None).start() if main else None
        return progress

    def _peak(self) -> tuple[float, str]:
        """The MFU peak of the whole job (every rank brings its own device) and where it comes from."""
        peak, source = peak_flops(self.plan)
        if self.info.world_size > 1:
            source += f" x {self.info.world_size} ranks"
        return peak * self.info.world_size, source

    def _memory_estimate(self, batch_size: int, loss: str | None = None) -> memory_check.Estimate:
        """The step's peak memory at a micro-batch (with `loss`, or the model's), less the weights where the model
        already is (the CPU, or the device after --auto_batch_size's search)."""
        config = self.model_config if loss is None else dataclasses.replace(self.model_config, loss=loss)
        est = step_memory.for_training(config, self.cfg, self.seq_len, self.plan.amp_dtype,
                                        batch_size=batch_size, world_size=self.info.world_size)
        there = next(self.raw.parameters()).device.type == self.plan.device.type
        return est.without("weights") if there else est

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self, progress: Progress) -> int:
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
                if self._stop_requested():  # every rank agrees, so all save and evaluate alike
                    exit_code = self._stop(progress)
                    break
                if evaluated or last_step or self._read_due(progress):
                    self._read_steps(progress)
                if evaluated:
                    self._evaluate(progress)
                elif cfg.sample_every and progress.step % cfg.sample_every == 0:
                    validation.log_sample(self.raw, self.data, cfg, self.plan, self.info, progress.step, self.metrics)
                reached = progress.target is not None
                if reached or last_step or (cfg.save_interval and progress.step % cfg.save_interval == 0):
                    self._read_steps(progress)  # a checkpoint holds the train time and counts up to its step
                    progress.last_good = self._save(progress)
                if reached:
                    if main:
                        log.info(f"target val loss {cfg.target_loss} reached at step {progress.step}: saved "
                                 f"{progress.last_good}")
                    break
        except Exception as e:
            if is_oom(e):
                raise RuntimeError(step_memory.oom_advice(cfg, self.plan)) from e
            raise
        finally:
            bar.close()
            self._teardown()
        if main:
            self.record.finish(progress, Speed(self.tokens_per_step, self.fpt, self.peak, self.peak_source),
                               self.plan, cfg.target_loss)
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

    # -- stop conditions, evaluation, checkpoints ----------------------------------------------

    def _reached_the_end(self, progress: Progress) -> bool:
        cfg = self.cfg
        return progress.step >= cfg.max_steps or (cfg.max_tokens is not None and progress.tokens_seen >= cfg.max_tokens)

    def _stop_requested(self) -> bool:
        """A signal arrived or the time budget is spent, on any rank: every rank stops at this step."""
        budget = self.cfg.time_budget_s
        out_of_time = budget is not None and time.perf_counter() - self.t_start >= budget
        return distributed.any_rank(bool(self.stop) or out_of_time, self.info, self.plan.device)

    def _stop(self, progress: Progress) -> int:
        """A stop (a signal, the time budget) at this step: its checkpoint first, then its evaluation, so that an
        evaluation that fails (or a second Ctrl-C during it) loses no training. The exit code: 128 + the signal's
        number (130 for SIGINT, 143 for SIGTERM), 0 for the time budget."""
        signum = self.stop.signum
        self._read_steps(progress)
        # A checkpoint taken because of Ctrl-C / SIGTERM does not retire an old run that --overwrite set aside:
        # stopping a mistaken --overwrite must give the old run back (run() does), and its checkpoint with it.
        progress.last_good = self._save(progress, retire_old=signum is None)
        replacing = self.folder is not None and self.folder.replacing  # rank 0's: it alone sets aside
        given_back = distributed.any_rank(replacing, self.info, self.plan.device)
        evaluate = bool(self.cfg.eval_every) and not given_back  # a checkpoint that goes back needs no val loss
        then = "; its evaluation follows (Ctrl-C stops it, the checkpoint stays)" if evaluate else ""
        if self.info.is_main and signum is not None and given_back:
            log.info(f"signal {signals.name(signum)}: the run --overwrite was replacing is put back in {self.out} "
                     "(this run had no checkpoint before the signal)")
        elif self.info.is_main and signum is not None:
            log.info(f"signal {signals.name(signum)}: saved {progress.last_good}; resume with --resume auto{then}")
        elif self.info.is_main:
            log.info(f"time budget {self.cfg.time_budget} reached at step {progress.step}: saved {progress.last_good}"
                     + then)
        if evaluate:
            self._evaluate(progress)
        return signals.exit_code(signum) if signum is not None else 0

    def _evaluate(self, progress: Progress) -> None:
        val = validation.evaluate(self.raw, self.data, self.cfg, self.plan, self.info, self.seq_len, progress.step,
                                  progress.train_s, self.metrics)
        validation.record(progress, val, self.cfg.target_loss, self.metrics)

    def _save(self, progress: Progress, *, retire_old: bool = True) -> Path | None:
        return self.checkpoints.save(progress, self.raw, self.train_step, self.prep.sharded, retire_old=retire_old)

    def _teardown(self) -> None:
        self.batches.close()
        if self.profiler is not None:
            self.profiler.stop()
        if self.monitor is not None:
            self.monitor.stop()
            (self.out / "monitor.json").write_text(json.dumps(self.monitor.summary(), indent=2))
        if self.metrics is not None:
            self.metrics.close()
        if self.host_reuse:  # the process goes back to glibc's defaults (a caller may run more than training)
            reuse_host_memory(False)
