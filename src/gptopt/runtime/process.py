"""Process-wide switches: torch settings that hold for the whole process once set. A command sets those it
needs here, by name, where it starts; no library function sets one behind a command's back.

    python -c "from gptopt.runtime import process; help(process)"

- set_matmul_precision: TF32 for fp32 matmuls where the device plan chose it (device.resolve decides: GPUs of
  compute capability 8.0 and up).
- allow_recompiles: the graphs dynamo keeps per function; a compiled decode takes one per batch bucket, and
  several Generators (bench's ladder, a server's warm-up) share the decode's code.
The serving engine's torch thread count is the engine's own per-forward policy (serve/engine.py).
And `interruptible`, how a command runs a long call that never returns to Python so that Ctrl-C stays prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

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


T = TypeVar("T")
INTERRUPT_POLL_S = 0.1  # how long Ctrl-C may wait in interruptible() when another thread receives the signal


def interruptible(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in a daemon thread, the caller waiting for it: a call that runs for seconds in native
    code (a tokenizer's encode_batch or BPE training in Rust) would hold the main thread, and with it Python's
    signal handlers, for all that time; waiting on a thread takes Ctrl-C at once (KeyboardInterrupt), and the
    process need not wait for the abandoned call to end."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller, with its traceback
            result["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="gptopt-interruptible")
    worker.start()
    # Joined in short waits: the kernel may deliver SIGINT to any thread (tqdm's monitor, torch's pool), and then
    # nothing wakes a main thread blocked in one long join to run Python's handler until the call ends.
    while worker.is_alive():
        worker.join(INTERRUPT_POLL_S)
    if "error" in result:
        raise result["error"]
    return result["value"]
