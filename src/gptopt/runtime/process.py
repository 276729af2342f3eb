"""Process-wide switches: torch settings that hold for the whole process once set. A command sets those it
needs here, by name, where it starts; no library function sets one behind a command's back.

    python -c "from gptopt.runtime import process; help(process)"

- set_matmul_precision: TF32 for fp32 matmuls where the device plan chose it (device.resolve decides: GPUs of
  compute capability 8.0 and up).
- allow_recompiles: the graphs dynamo keeps per function; a compiled decode takes one per batch bucket, and
  several Generators (bench's ladder, a server's warm-up) share the decode's code.
The serving engine's torch thread count is the engine's own per-forward policy (serve/engine.py).
"""

from __future__ import annotations

import torch

from gptopt.runtime.device import DevicePlan
from gptopt.runtime.torch_private import raise_recompile_limit

# The graphs per function a command that compiles decode steps allows: one per bucket of cache rows (powers
# of two up to 4096: 13) on GPUs, with room for several Generators' (one per model, per measured rung).
DECODE_GRAPHS = 64


def set_matmul_precision(plan: DevicePlan) -> None:
    """TF32 for fp32 matmuls where the plan chose it (plan.tf32); torch's default, exact fp32, elsewhere."""
    if plan.tf32:
        torch.set_float32_matmul_precision("high")


def allow_recompiles(graphs: int = DECODE_GRAPHS) -> None:
    """Let dynamo keep at least `graphs` graphs per function, for the rest of the process."""
    raise_recompile_limit(graphs)

