"""The training loop: AMP, accumulation, compile, DDP/FSDP2, eval, metrics, checkpoints, faults.

    gptopt train --preset tiny --use_amp --use_compile            # the CPU default, data/stdlib
    gptopt train --model_name gpt2 --batch_size 8 --use_compile --use_amp --profile --output_dir ./checkpoints
    torchrun --nproc_per_node 8 -m gptopt train --preset gpt2 --use_amp --use_compile

Exactness: batches are a pure function of (seed, micro-step), so a checkpoint needs only the step,
the optimizer, the scaler and the RNGs to continue bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import resource
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gptopt import checkpoint, data, distributed, hf
from gptopt.config import PRESETS, GPTConfig, TrainConfig, preset_for_data
from gptopt.device import DevicePlan, default_attention, environment, peak_flops, resolve, reuse_host_memory
from gptopt.distributed import DistInfo
from gptopt.flops import flops_per_token
from gptopt.model import GPT
from gptopt.monitor import Monitor
from gptopt.optim import lr_at, make_adamw
from gptopt.prepare_model import prepare
from gptopt.step import forward_backward, is_oom
from gptopt.tracing import scheduled_profiler

log = logging.getLogger("gptopt")
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def oom_advice(cfg: TrainConfig, plan: DevicePlan) -> str:
    figures = ""
    if plan.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(plan.device)
        figures = (
            f" (allocated {torch.cuda.memory_allocated(plan.device) / 2**30:.1f} GiB, reserved "
            f"{torch.cuda.memory_reserved(plan.device) / 2**30:.1f} GiB, free {free / 2**30:.1f} of {total / 2**30:.1f} GiB)"
        )
    fixes = [f"--batch_size {max(1, cfg.batch_size // 2)} --gradient_accumulation_steps {cfg.gradient_accumulation_steps * 2}"]
    if not cfg.gradient_checkpointing:
        fixes.append("--gradient_checkpointing")
    if not cfg.use_amp:
        fixes.append("--use_amp")
    fixes.append("--auto_batch_size")
    return f"out of memory at micro-batch {cfg.batch_size}{figures}; try: " + ", or ".join(fixes)


def find_batch_size(try_batch: Callable[[int], None], global_batch: int, largest: int) -> int:
    """Largest divisor of global_batch (<= largest) for which try_batch does not run out of memory."""
    for b in sorted((d for d in range(1, global_batch + 1) if global_batch % d == 0 and d <= largest), reverse=True):
        try:
            try_batch(b)
            return b
        except Exception as e:
            if not is_oom(e):
                raise
            log.info(f"auto batch size: micro-batch {b} does not fit")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    raise ValueError("not even a micro-batch of 1 fits: use --gradient_checkpointing, --use_amp, or a smaller model")


def peak_memory_bytes(plan: DevicePlan) -> int:
    if plan.device.type == "cuda":
        return torch.cuda.max_memory_allocated(plan.device)
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(_tuples(state["python"]))
    np.random.set_state(("MT19937", state["numpy"]["keys"].numpy().astype(np.uint32), state["numpy"]["pos"], 0, 0.0))


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


@torch.no_grad()
def sample(model: GPT, plan: DevicePlan, tokenizer: Any, eot_id: int | None, n_tokens: int, seed: int) -> str:
    """A short sample for the eval log. Its own generator: training's RNG stream is left untouched."""
    g = torch.Generator(device=plan.device).manual_seed(seed)
    start = eot_id if eot_id is not None else 0
    idx = torch.tensor([[start]], device=plan.device)
    for _ in range(n_tokens):
        with plan.autocast():
            logits = model(idx[:, -model.config.block_size :], last_only=True)[:, -1].float()
        top = torch.topk(logits, k=min(40, logits.size(-1)))
        probs = torch.softmax(top.values / 0.8, dim=-1)
        idx = torch.cat([idx, top.indices.gather(-1, torch.multinomial(probs, 1, generator=g))], dim=1)
    ids = idx[0, 1:].tolist()
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))


class Metrics:
    """metrics.jsonl (one JSON object per logged step or eval) and TensorBoard scalars, rank 0 only."""

    def __init__(self, out: Path, start_step: int, tensorboard: bool) -> None:
        self.path = out / "metrics.jsonl"
        if self.path.exists():  # a resumed run drops records past its checkpoint: they are being redone
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.fh = open(self.path, "a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "logs"), purge_step=start_step or None)
            except ImportError:
                log.info("TensorBoard logs off: pip install 'gptopt[tensorboard]'")

    def write(self, record: dict[str, Any]) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


class Trainer:
    def __init__(self, cfg: TrainConfig, info: DistInfo, device: str) -> None:
        self.cfg, self.info = cfg, info
        self.plan = resolve(device, cfg.amp_dtype if cfg.use_amp else "fp32")
        self.out = Path(cfg.output_dir)
        self.attention = cfg.attention if cfg.attention != "auto" else default_attention(self.plan.device.type)
        torch.manual_seed(cfg.seed)
        self.data = self._load_data()
        resume_dir = self._resume_dir()
        self.resume_dir = resume_dir
        self.model_config = self._model_config(resume_dir)
        self.seq_len = cfg.seq_len or self.model_config.block_size
        if self.seq_len > self.model_config.block_size:
            raise ValueError(f"--seq_len {self.seq_len} exceeds the model's context {self.model_config.block_size}: use --seq_len {self.model_config.block_size} or less")
        self.raw = self._build_model(resume_dir)
        self.data.check_vocab(self.model_config.vocab_size)
        self.state: dict[str, Any] = checkpoint.load_train_state(resume_dir) if resume_dir else {}

    # -- setup -----------------------------------------------------------------------------

    def _load_data(self) -> data.TokenData:
        return data.open_data(self.cfg.data_dir, is_main=self.info.is_main,
                              barrier=lambda: distributed.barrier(self.info))

    def _resume_dir(self) -> Path | None:
        cfg, latest = self.cfg, checkpoint.latest_checkpoint(self.cfg.output_dir)
        if cfg.resume == "auto":
            if latest is None:
                log.info(f"--resume auto: no checkpoint in {cfg.output_dir}, starting afresh")
            return latest
        if cfg.resume:
            path = Path(cfg.resume)
            if not (path / checkpoint.TRAIN_STATE).is_file():
                raise ValueError(f"--resume {cfg.resume}: not a training checkpoint (no {checkpoint.TRAIN_STATE})")
            return path
        if latest is not None and not cfg.overwrite:
            raise ValueError(
                f"{cfg.output_dir} holds checkpoints of a run (latest {latest.name}): pass --resume auto to continue "
                "it, --overwrite to start afresh there, or another --output_dir"
            )
        if latest is not None and self.info.is_main:  # --overwrite: the user asked for the old run to go
            for d in checkpoint.checkpoint_dirs(cfg.output_dir):
                shutil.rmtree(d)
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
        distributed.barrier(self.info)
        return None

    def _model_config(self, resume_dir: Path | None) -> GPTConfig:
        cfg = self.cfg
        runtime = dict(attention=self.attention, gradient_checkpointing=cfg.gradient_checkpointing, dropout=cfg.dropout)
        if resume_dir is not None:
            stored = GPTConfig.from_dict(checkpoint.read_meta(resume_dir)["model"])
            return dataclasses.replace(stored, **runtime)
        if cfg.init_from == "scratch":
            return preset_for_data(cfg.preset, self.data.model_vocab_size, vocab_pad_multiple=cfg.vocab_pad_multiple, **runtime)
        return GPTConfig()  # replaced by the pretrained model's own config in _build_model

    def _build_model(self, resume_dir: Path | None) -> GPT:
        cfg = self.cfg
        if resume_dir is not None:
            model = checkpoint.load_model(resume_dir)
            model = self._with_config(model, self.model_config)
        elif cfg.init_from == "scratch":
            model = GPT(self.model_config)
        else:
            if cfg.init_from in PRESETS and cfg.init_from in ("debug", "tiny"):
                raise ValueError(f"--init_from {cfg.init_from}: no pretrained weights exist; use --preset {cfg.init_from}")
            overrides = dict(attention=self.attention, gradient_checkpointing=cfg.gradient_checkpointing,
                             dropout=cfg.dropout, vocab_pad_multiple=cfg.vocab_pad_multiple)
            model = hf.load_pretrained(cfg.init_from, **overrides)
            self.model_config = model.config
        return model

    @staticmethod
    def _with_config(model: GPT, config: GPTConfig) -> GPT:
        """Same weights, new runtime switches (attention kernel, checkpointing, dropout)."""
        fresh = GPT(config)
        fresh.load_state_dict(model.state_dict())
        return fresh

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        cfg, info, plan = self.cfg, self.info, self.plan
        main = info.is_main
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
        global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
        if cfg.auto_batch_size:
            self._auto_batch_size(global_batch)
        B, accum = cfg.batch_size, cfg.gradient_accumulation_steps
        prep = prepare(
            self.raw, plan, info, fsdp=cfg.fsdp, cpu_offload=cfg.cpu_offload, use_compile=cfg.use_compile,
            compile_mode=cfg.compile_mode, compile_fullgraph=cfg.compile_fullgraph,
        )
        model = prep.model
        optimizer, fused = make_adamw(
            self.raw, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
            device_type=plan.device.type, fused=cfg.fused_optimizer and not cfg.cpu_offload,
        )
        scaler = torch.amp.GradScaler(plan.device.type) if plan.use_grad_scaler else None
        step, tokens_seen, bad_steps = 0, 0, 0
        if self.state:
            distributed.load_optimizer_state(self.raw, optimizer, self.state["optimizer"], prep.sharded)
            if scaler is not None and self.state.get("scaler"):
                scaler.load_state_dict(self.state["scaler"])
            set_rng_state(self.state["rng"])
            step, tokens_seen = self.state["step"], self.state["tokens_seen"]
            if main:
                log.info(f"resumed from {self.resume_dir} at step {step} ({tokens_seen:,} tokens)")
        ds = data.BatchDataset(self.data, "train", B, self.seq_len, cfg.seed, info.rank, info.world_size)
        loader_opts = {**data.default_loader_settings(plan.device.type)}
        for key in ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers"):
            if getattr(cfg, key) is not None:
                loader_opts[key] = getattr(cfg, key)
        batches = iter(data.make_loader(ds, step * accum, **loader_opts))
        peak, peak_source = peak_flops(plan)
        peak *= info.world_size  # MFU of the whole job: every rank brings its own device
        if info.world_size > 1:
            peak_source += f" x {info.world_size} ranks"
        fpt = flops_per_token(self.model_config, self.seq_len)
        tokens_per_step = B * self.seq_len * accum * info.world_size
        # on CPUs the step's large activations would otherwise be page-faulted in afresh every step
        host_reuse = plan.device.type == "cpu" and reuse_host_memory()
        metrics = Metrics(self.out, step, cfg.tensorboard) if main else None
        if main:
            self._write_run_info(plan, peak_source, fused, loader_opts, host_reuse)
            log.info(
                f"{self.raw.num_params() / 1e6:.2f}M parameters, {tokens_per_step:,} tokens/step "
                f"(micro-batch {B} x {self.seq_len} x accumulation {accum} x {info.world_size} ranks); "
                f"MFU against {peak_source}"
            )
        profiler = self._profiler(step) if cfg.profile and main else None
        monitor = Monitor(plan.device.index if plan.device.type == "cuda" else None).start() if main else None
        stop_signal: list[int] = []
        old_handlers = self._install_signals(stop_signal)
        t_start = time.perf_counter()
        budget = cfg.time_budget_s
        times: list[float] = []
        waits: list[float] = []
        compile_s = None
        exit_code = 0
        bar = tqdm(total=cfg.max_steps, initial=step, disable=not main, dynamic_ncols=True, mininterval=1.0, desc="train")
        last_good = self.resume_dir
        try:
            while step < cfg.max_steps and not (cfg.max_tokens is not None and tokens_seen >= cfg.max_tokens):
                lr = lr_at(step, cfg.learning_rate, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                t0 = time.perf_counter()
                wait = 0.0
                loss_sum = torch.zeros((), device=plan.device)
                for micro in range(accum):
                    tw = time.perf_counter()
                    x, y = next(batches)
                    wait += time.perf_counter() - tw
                    x = x.to(plan.device, non_blocking=True)
                    y = y.to(plan.device, non_blocking=True)
                    with distributed.no_sync(model, micro < accum - 1 and info.world_size > 1):
                        loss_sum += forward_backward(model, x, y, plan, scaler, accum)
                if scaler is not None:
                    scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.raw.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                    grad_norm = grad_norm.full_tensor()
                loss_sum = distributed.all_reduce_mean(loss_sum, info)
                loss_val, norm_val = torch.stack([loss_sum.float(), grad_norm.float().to(loss_sum.device)]).tolist()
                finite = math.isfinite(loss_val) and (scaler is not None or math.isfinite(norm_val))
                if finite:
                    (scaler.step(optimizer) if scaler else optimizer.step())
                    bad_steps = 0
                else:
                    bad_steps += 1
                    log.warning(f"step {step}: non-finite loss {loss_val} / grad norm {norm_val}: optimizer step skipped ({bad_steps}/{cfg.max_bad_steps})")
                if scaler is not None:
                    scaler.update()
                optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                step += 1
                tokens_seen += tokens_per_step
                if compile_s is None:
                    compile_s = dt  # the first step pays compile / warm-up; kept out of the speed figures
                else:
                    times.append(dt)
                    waits.append(wait / dt)
                if bad_steps >= cfg.max_bad_steps:
                    where = f"; the last good checkpoint is {last_good}" if last_good else ""
                    raise RuntimeError(
                        f"{bad_steps} consecutive non-finite steps at step {step}: stopping{where}. "
                        "Lower --learning_rate, keep --grad_clip on, or use bf16 instead of fp16"
                    )
                tps = tokens_per_step / dt
                if main:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{tps * fpt / peak:.0%}",
                                    mem=f"{peak_memory_bytes(plan) / 2**30:.2f}G", refresh=False)
                    if step % cfg.log_interval == 0 or step == 1:
                        metrics.write({
                            "step": step, "loss": loss_val, "lr": lr, "tokens_per_s": tps, "mfu": tps * fpt / peak,
                            "step_time_s": dt, "data_wait_frac": wait / dt, "grad_norm": norm_val,
                            "peak_mem_bytes": peak_memory_bytes(plan), "tokens_seen": tokens_seen,
                            "elapsed_s": time.perf_counter() - t_start,
                            **{k: v for k, v in monitor.latest().items() if k != "t"},
                        })
                if profiler is not None:
                    profiler.step()
                last_step = step >= cfg.max_steps or (cfg.max_tokens is not None and tokens_seen >= cfg.max_tokens)
                if cfg.eval_interval and (step % cfg.eval_interval == 0 or last_step):
                    self._evaluate(step, metrics)
                out_of_time = budget is not None and time.perf_counter() - t_start >= budget
                stop = distributed.any_rank(bool(stop_signal) or out_of_time, info, plan.device)
                if stop or last_step or step % cfg.save_interval == 0:
                    last_good = self._save(step, tokens_seen, bad_steps, optimizer, scaler, prep.sharded)
                if stop:
                    if stop_signal:
                        exit_code = EXIT_CODES.get(stop_signal[0], 1)
                        if main:
                            log.info(f"signal {signal.Signals(stop_signal[0]).name}: saved {last_good}; resume with --resume auto")
                    elif main:
                        log.info(f"time budget {cfg.time_budget} reached at step {step}: saved {last_good}")
                    break
        except Exception as e:
            if is_oom(e):
                raise RuntimeError(oom_advice(cfg, plan)) from e
            raise
        finally:
            bar.close()
            self._restore_signals(old_handlers)
            if profiler is not None:
                profiler.stop()
            if monitor is not None:
                monitor.stop()
                (self.out / "monitor.json").write_text(json.dumps(monitor.summary(), indent=2))
            if metrics is not None:
                metrics.close()
            if host_reuse:  # the process goes back to glibc's defaults (a caller may run more than training)
                reuse_host_memory(False)
        if main:
            if times:  # measured again: the summary's MFU is against the faster of the start and the end
                end_peak, peak_source = peak_flops(plan, remeasure=True)
                peak = end_peak * info.world_size
                if info.world_size > 1:
                    peak_source += f" x {info.world_size} ranks"
            self._summary(step, times, waits, compile_s, fpt, peak, peak_source, tokens_per_step)
        return exit_code

    # -- pieces of the loop ------------------------------------------------------------------

    def _auto_batch_size(self, global_batch: int) -> None:
        cfg, plan = self.cfg, self.plan
        model = self.raw.to(plan.device)
        largest = global_batch if plan.device.type == "cuda" else cfg.batch_size

        def try_batch(b: int) -> None:
            x = torch.randint(0, self.model_config.vocab_size, (b, self.seq_len), device=plan.device)
            try:
                with plan.autocast():
                    loss = model(x, x)
                loss.backward()
            finally:
                model.zero_grad(set_to_none=True)

        b = find_batch_size(try_batch, global_batch, largest)
        if b != cfg.batch_size:
            cfg.batch_size, cfg.gradient_accumulation_steps = b, global_batch // b
            log.info(f"auto batch size: micro-batch {b} x accumulation {cfg.gradient_accumulation_steps} (global batch {global_batch})")

    @torch.no_grad()
    def _evaluate(self, step: int, metrics: Metrics | None) -> None:
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
            ppl = math.exp(min(val, 50.0))
            tqdm.write(f"step {step}: val loss {val:.4f}, perplexity {ppl:.2f}" + (f"\n  sample: {text!r}" if text else ""))
            metrics.write({"step": step, "val_loss": val, "val_ppl": ppl, "sample": text})

    def _save(self, step: int, tokens_seen: int, bad_steps: int, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler | None, sharded: bool) -> Path | None:
        model_state, optim_state = distributed.full_state_dicts(self.raw, optimizer, sharded)
        path = None
        if self.info.is_main:
            train_state = {
                "step": step, "tokens_seen": tokens_seen, "bad_steps": bad_steps, "optimizer": optim_state,
                "scaler": scaler.state_dict() if scaler is not None else None, "rng": rng_state(),
                "world_size": self.info.world_size,
            }
            meta = {"environment": environment(self.plan), "train_config": dataclasses.asdict(self.cfg),
                    "tokenizer": str(Path(self.cfg.data_dir) / "tokenizer.json")}
            path = checkpoint.save_checkpoint(self.out, step, self.model_config, model_state, train_state,
                                              meta=meta, keep=self.cfg.save_total_limit)
        distributed.barrier(self.info)
        return path if path is not None else checkpoint.latest_checkpoint(self.out)

    def _profiler(self, step: int) -> Any:
        return scheduled_profiler(self.out / "logs" / "profile", self.plan.device.type)

    def _write_run_info(self, plan: DevicePlan, peak_source: str, fused: bool, loader: dict[str, Any],
                        host_memory_reuse: bool) -> None:
        info = {"config": dataclasses.asdict(self.cfg), "model": self.model_config.to_dict(),
                "environment": environment(plan), "device_policy": plan.reason, "peak_source": peak_source,
                "fused_adamw": fused, "dataloader": loader, "host_memory_reuse": host_memory_reuse,
                "seq_len": self.seq_len}
        (self.out / "run.json").write_text(json.dumps(info, indent=2, default=str))

    def _summary(self, step: int, times: list[float], waits: list[float], compile_s: float | None,
                 fpt: float, peak: float, peak_source: str, tokens_per_step: int) -> None:
        if not times:
            log.info(f"stopped at step {step}")
            return
        med = statistics.median(times)
        tps = tokens_per_step / med
        log.info(
            f"done: step {step}; first step (compile/warm-up) {compile_s:.1f}s; median step {med * 1e3:.1f} ms, "
            f"{tps:,.0f} tokens/s, MFU {tps * fpt / peak:.1%} of {peak_source}; data wait {statistics.mean(waits):.1%} of step time"
        )

    @staticmethod
    def _install_signals(flag: list[int]) -> dict[int, Any]:
        """SIGTERM/SIGINT only set a flag: the loop saves at the next step boundary, then exits."""
        old: dict[int, Any] = {}
        with contextlib.suppress(ValueError):  # not the main thread (e.g. a test runner's worker)
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, lambda signum, frame: flag.append(signum))
        return old

    @staticmethod
    def _restore_signals(old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def main(cfg: TrainConfig) -> int:
    info, device = distributed.init(cfg.device)
    if not info.is_main:  # one voice: only rank 0 logs
        logging.getLogger("gptopt").setLevel(logging.WARNING)
    try:
        return Trainer(cfg, info, device).run()
    except RuntimeError as e:
        if info.is_main:
            print(f"gptopt train: {e}", file=sys.stderr)
        return 1
    finally:
        distributed.cleanup()

