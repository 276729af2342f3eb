"""A scheduled torch.profiler for a running loop: what `gptopt train --profile` records.

    gptopt train --preset debug --max_steps 12 --profile --output_dir out   # traces under out/logs/profile
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule


def scheduled_profiler(trace_dir: str | Path, device_type: str, *, wait: int = 3, warmup: int = 2,
                       active: int = 3) -> profile:
    """Started profiler: skip `wait` steps (compile, warm-up), warm up, record `active` steps, then stop.

    The caller calls .step() after each training step and .stop() at the end.
    """
    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)),
        record_shapes=True,
        profile_memory=True,
        with_stack=False,  # stacks make traces large; `gptopt profile` turns them on
    )
    prof.start()
    return prof
