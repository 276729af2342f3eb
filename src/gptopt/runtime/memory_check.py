"""Memory before it is allocated: what the device has free, and the check of an estimate against it. The
estimates themselves are their users': a training step's (train/step_memory.py), a generator's
(infer/generator_memory.py).

    python -c "import torch, gptopt.runtime.memory_check as m; print(m.available_bytes(torch.device('cpu')))"

A run that cannot fit must be refused or reported, never killed: on a CPU the kernel's OOM killer
ends the process (exit 137) with no report, and a GPU that fills mid-step has already spent the
compile. So every command estimates first and compares with what is free:

- the estimate counts what a step holds at its peak, each part from the shapes (bytes per token per
  layer, read off what the model saves for backward), on the high side wherever there is a choice:
  eager kernels (torch.compile saves less), no credit for the causal split, the logits' copies at once;
- the refusal fires only when the estimate clearly exceeds what is free (REFUSE_ABOVE), so a run
  that fits is not refused; the OOM handlers stay for what the estimate cannot see (torch.compile's
  own memory, other processes growing meanwhile).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from gptopt.utils.errors import UserError

# Refuse when the estimate is above this share of the free memory: the estimate may understate a step's
# peak by up to a tenth (tests/test_memory.py holds it there against the peak a step's process reaches), so a
# run it understates still stays below the limit, and only runs within a tenth of the limit are refused.
REFUSE_ABOVE = 0.9

# Where a container's memory limit is read (cgroup v2, then v1); module constants so tests can point
# them at files of their own.
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")

F32 = 4  # bytes of an fp32 element: master weights, gradients, AdamW state, the residual stream


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n < 10 * 2**30 else f"{n / 2**30:,.0f} GiB"


@dataclass(frozen=True)
class Estimate:
    """Bytes at the peak, by what holds them (the parts add up: an upper-ish bound)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def without(self, *names: str) -> Estimate:
        """The estimate less parts already in memory (the CPU model a command built before checking)."""
        return Estimate({k: v for k, v in self.parts.items() if k not in names})

    def describe(self) -> str:
        largest = [kv for kv in sorted(self.parts.items(), key=lambda kv: -kv[1])[:4] if kv[1] >= self.total / 100]
        return f"{gib(self.total)} (" + ", ".join(f"{k} {gib(v)}" for k, v in largest) + ")"


def itemsize(dtype: torch.dtype | None) -> int:
    return F32 if dtype is None else dtype.itemsize


# ----------------------------------------------------------------------------------------------
# What the device has free


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _inactive_file(stat: Path, key: str) -> int:
    """Page cache the kernel reclaims before it kills: counted in a cgroup's usage, yet free to use."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_free() -> tuple[int, int] | None:
    """(bytes left under this container's memory limit, the limit), or None where no limit is set."""
    limit = _read_int(CGROUP_V2 / "memory.max")
    if limit is not None:
        used = _read_int(CGROUP_V2 / "memory.current") or 0
        reclaimable = _inactive_file(CGROUP_V2 / "memory.stat", "inactive_file")
    else:
        limit = _read_int(CGROUP_V1 / "memory.limit_in_bytes")
        # v1 writes a number near 2**63 for no limit
        if limit is None or limit >= 2**60:
            return None
        used = _read_int(CGROUP_V1 / "memory.usage_in_bytes") or 0
        reclaimable = _inactive_file(CGROUP_V1 / "memory.stat", "total_inactive_file")
    return max(0, limit - max(0, used - reclaimable)), limit


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Bytes this process can still allocate on the device, and where that figure comes from.

    CUDA: the driver's free memory plus what torch's caching allocator holds unused. Host (CPU, and
    MPS, whose memory is the host's): the least of the kernel's MemAvailable, the room under a
    cgroup limit and the room under this process's address-space limit (ulimit -v).
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"free on {device} (of {gib(total)})"
    options = [(psutil.virtual_memory().available, "available RAM")]
    cgroup = cgroup_free()
    if cgroup is not None:
        options.append((cgroup[0], f"left under the container's {gib(cgroup[1])} memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        vms = psutil.Process().memory_info().vms
        options.append((max(0, soft - vms), f"left under the address-space limit (ulimit -v) of {gib(soft)}"))
    return min(options)


def capacity_bytes(device: torch.device) -> int | None:
    """All the memory a run on the device could use: the GPU's total, or the host's RAM (a container's
    cgroup limit if it is lower); None for a device whose total is not known (MPS)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type != "cpu":
        return None
    total = psutil.virtual_memory().total
    cgroup = cgroup_free()
    return min(total, cgroup[1]) if cgroup is not None else total


def shortfall(estimate: Estimate, device: torch.device) -> str | None:
    """None when the estimate fits what the device has free; else the one line that says by how much."""
    free, source = available_bytes(device)
    if estimate.total <= REFUSE_ABOVE * free:
        return None
    return f"needs about {estimate.describe()} but {gib(free)} is {source}"


def require(estimate: Estimate, device: torch.device, what: str, fix: str) -> None:
    """Raise ValueError (the CLI's exit 2) naming the estimate, the memory free and the fix, before
    anything is allocated, when the estimate does not fit."""
    short = shortfall(estimate, device)
    if short is not None:
        raise UserError(f"{what} will not fit in memory: it {short}; {fix}")


def largest_batch(estimate_at: Callable[[int], Estimate], device: torch.device, upto: int, *,
                  share: float = REFUSE_ABOVE) -> int:
    """The largest batch size up to `upto` whose estimate fits `share` of what is free (0: not even
    one); the estimates grow with the batch, so a bisection finds it."""
    free, _ = available_bytes(device)
    lo, hi = 0, upto
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if estimate_at(mid).total <= share * free else (lo, mid - 1)
    return lo


def is_oom(e: BaseException) -> bool:
    """Whether an exception is the device (or host) running out of memory. A host allocation the kernel
    refuses (a cgroup or `ulimit -v` limit) raises torch's RuntimeError "DefaultCPUAllocator: can't
    allocate memory", or Python's MemoryError."""
    text = str(e).lower()
    return (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text)
