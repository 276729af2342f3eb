"""What a run says of itself for people and scripts: run.json (its config, model, environment and settings, written
as it starts) and, as it ends, the closing lines and the same figures as run.json's "summary" and "target"
(.ci/gpu_check.py and bench --mode quality read them).

    python -c "import json; print(json.load(open('out/run.json'))['summary'])"   # after gptopt train
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptopt import outputs
from gptopt.config import GPTConfig, TrainConfig
from gptopt.models.flops import mfu
from gptopt.runtime.device import DevicePlan, environment
from gptopt.runtime.monitor import peak_memory_bytes
from gptopt.train.metrics import Progress

log = logging.getLogger("gptopt")


@dataclass
class Speed:
    """What the summary's speed figures are stated against: the run's tokens per step, the model FLOPs per token,
    and the MFU peak the steps' own figures took last (the loop raises it: flops.at_least)."""

    tokens_per_step: int
    flops_per_token: float
    peak: float
    peak_source: str


class RunRecord:
    """run.json in the run's folder (rank 0 writes it)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "run.json"
        self.info: dict[str, Any] | None = None  # what start() wrote, which the summary extends

    def start(self, cfg: TrainConfig, model: GPTConfig, plan: DevicePlan, seq_len: int, *, peak_source: str,
              fused_adamw: bool, dataloader: dict[str, Any], host_memory_reuse: bool) -> None:
        self.info = {"config": dataclasses.asdict(cfg), "model": model.to_dict(), "environment": environment(plan),
                     "device_policy": plan.reason, "peak_source": peak_source, "fused_adamw": fused_adamw,
                     "dataloader": dataloader, "host_memory_reuse": host_memory_reuse, "seq_len": seq_len}
        self.path.write_text(json.dumps(self.info, indent=2, default=str))

    def finish(self, progress: Progress, speed: Speed, plan: DevicePlan, target_loss: float | None) -> None:
        """The closing lines, and the same figures as run.json's "summary" (and "target")."""
        summary: dict[str, Any] = {"step": progress.step, "best_val_loss": progress.best_val}
        if progress.times:
            med = statistics.median(progress.times)
            tps = speed.tokens_per_step / med
            wait, run_mfu = statistics.mean(progress.waits), mfu(tps, speed.flops_per_token, speed.peak)
            log.info(
                f"done: step {progress.step}; first step (compile/warm-up) {progress.compile_s:.1f}s; median step "
                f"{med * 1e3:.1f} ms, {tps:,.0f} tokens/s, MFU {run_mfu:.1%} of {speed.peak_source}; "
                f"data wait {wait:.1%} of step time"
            )
            summary.update({"first_step_s": progress.compile_s, "median_step_s": med, "tokens_per_s": tps,
                            "mfu": run_mfu, "peak_flops": speed.peak, "peak_source": speed.peak_source,
                            "data_wait": wait, "peak_memory_bytes": peak_memory_bytes(plan)})
        else:
            log.info(f"stopped at step {progress.step}")
        target = target_report(target_loss, progress)
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
        if self.info is not None:
            extra = {"summary": summary, **({"target": target} if target is not None else {})}
            outputs.write_text_atomic(self.path, json.dumps({**self.info, **extra}, indent=2, default=str))


def target_report(target_loss: float | None, progress: Progress) -> dict[str, Any] | None:
    """run.json's "target": what reaching --target_loss took, or that it was not reached; None without one."""
    if target_loss is None:
        return None
    return progress.target or {
        "loss": target_loss, "reached": False, "time_to_target_s": None,
        "time_to_target_excl_compile_s": None, "tokens_to_target": None, "steps_to_target": None,
        "best_val_loss": progress.best_val}
