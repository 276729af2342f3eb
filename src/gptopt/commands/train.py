"""gptopt train: train or fine-tune, on one device, several GPUs (DDP, FSDP2) or machines (torchrun).

    gptopt train --preset tiny --use_amp --compile                # the CPU default, data/stdlib
    gptopt train --model_name gpt2 --batch_size 8 --use_compile --use_amp --profile --output_dir ./checkpoints
    torchrun --nproc_per_node 8 -m gptopt train --preset gpt2 --use_amp --compile
    gptopt train --init_from out --output_dir ft --learning_rate 3e-4   # fine-tune out's latest checkpoint

The loop itself is gptopt.train.loop.Trainer; this is the command around it: the process group, the one-writer
lock on the output folder, and the exit status.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from gptopt import outputs
from gptopt.config import TrainConfig
from gptopt.runtime import process
from gptopt.runtime.device import resolve
from gptopt.train import distributed
from gptopt.train.loop import Trainer


def main(cfg: TrainConfig) -> int:
    info, device = distributed.init(cfg.device)
    if not info.is_main:  # one voice: only rank 0 logs
        logging.getLogger("gptopt").setLevel(logging.WARNING)
    try:
        # One run in a folder at a time, from its checks to its last checkpoint; rank 0 alone writes.
        with outputs.lock_output(cfg.output_dir) if info.is_main else contextlib.nullcontext():
            plan = resolve(device, cfg.amp_dtype if cfg.use_amp else "fp32")
            process.set_matmul_precision(plan)
            return Trainer(cfg, info, plan).run()
    except RuntimeError as e:
        if info.is_main:
            print(f"gptopt train: {e}", file=sys.stderr)
        return 1
    finally:
        distributed.cleanup()
