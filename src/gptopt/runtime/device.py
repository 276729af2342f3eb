"""Device and precision policy, in one place: which device, which autocast dtype, and why.

Also the hardware ceilings every MFU and bandwidth figure is measured against: a table of
NVIDIA GPUs matched by device name, and a short measured matmul peak for everything else.

    python -c "from gptopt.runtime.device import resolve, peak_flops; p = resolve(); print(p.reason, peak_flops(p))"
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")

AMP_DTYPES = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DevicePlan:
    """The resolved device and precision; `reason` is the one line that explains the choice."""

    device: torch.device
    amp_dtype: torch.dtype | None  # None: plain fp32, no autocast
    use_grad_scaler: bool  # fp16 needs loss scaling; bf16 has fp32's exponent range and does not
    tf32: bool
    reason: str

    @property
    def amp_name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[self.amp_dtype]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# GPTOPT_CPU_BF16=1 or 0 overrides the detection below: to test the other CPU policy on this machine
# (CI runs the policy tests under both), or where the flags lie (a VM that hides avx512_bf16).
CPU_BF16_ENV = "GPTOPT_CPU_BF16"


def parse_cpu_bf16(value: str | None) -> bool | None:
    """A GPTOPT_CPU_BF16 value: '1' native bf16, '0' none, unset or empty None (detect)."""
    value = (value or "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise UserError(f"{CPU_BF16_ENV}={value!r}: use 1 (treat the CPU as having native bf16), "
                         "0 (as lacking it), or unset it to detect")
    return value == "1"


def cpu_bf16_override() -> bool | None:
    """What GPTOPT_CPU_BF16 says (1: native bf16, 0: none); None when unset or empty."""
    return parse_cpu_bf16(os.environ.get(CPU_BF16_ENV))


def cpu_bf16_detected() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX), so bf16 matmuls beat fp32."""
    cap = ""
    with contextlib.suppress(Exception):
        cap = torch.backends.cpu.get_cpu_capability()
    if "AMX" in cap.upper():
        return True
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
        except OSError:
            return False
        return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return False  # Apple CPUs lack bf16 matmul units reachable from torch; mps is the fast path there
    return False


def cpu_has_fast_bf16() -> bool:
    """The CPU policy's answer: GPTOPT_CPU_BF16 when set, else what the hardware has (cpu_bf16_detected)."""
    forced = cpu_bf16_override()
    return cpu_bf16_detected() if forced is None else forced


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise UserError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"--device {device}: CUDA is not available to this torch ({torch.__version__}); "
                "run `gptopt doctor` for the reason, or use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError(f"--device {device}: MPS is not available; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unsupported device type {dev.type!r}: use cpu, cuda or mps")
    return dev


def resolve(device: str = "auto", amp_dtype: str = "auto", *, tf32: bool = True, quiet: bool = False) -> DevicePlan:
    """Choose the device and autocast dtype once; raise ValueError naming the fix for impossible asks. The plan
    says whether fp32 matmuls may use TF32 (plan.tf32); the command switches it on (process.set_matmul_precision).

    quiet: do not log the reason (inference logs its own line: it runs in the weights' dtype)."""
    if amp_dtype not in AMP_DTYPES:
        raise UserError(f"unknown amp dtype {amp_dtype!r}; choose one of: {', '.join(AMP_DTYPES)}")
    dev = _pick_device(device)
    why: list[str] = []
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        major, minor = torch.cuda.get_device_capability(dev)
        bf16_ok = major >= 8
        where = f"{name} (sm_{major}{minor})"
        if amp_dtype == "auto":
            amp = "bf16" if bf16_ok else "fp16"
            how = ("bf16 autocast (compute capability >= 8.0)" if bf16_ok
                   else "fp16 autocast + GradScaler (no fast bf16 before sm_80)")
            why.append(f"{where}: {how}")
        else:
            if amp_dtype == "bf16" and not bf16_ok:
                raise UserError(f"bf16 needs compute capability >= 8.0; {where} has none: use --amp_dtype fp16")
            amp = amp_dtype
            why.append(f"{where}: {amp} as asked")
        use_tf32 = tf32 and major >= 8
        if use_tf32:
            why.append("TF32 for fp32 matmuls")
    elif dev.type == "mps":
        amp = "fp16" if amp_dtype == "auto" else amp_dtype
        use_tf32 = False
        why.append(f"Apple MPS: {amp}{' (auto)' if amp_dtype == 'auto' else ' as asked'}")
    else:
        if amp_dtype == "fp16":
            raise UserError("fp16 autocast on a CPU is slow and needs loss scaling: use --amp_dtype bf16 or fp32")
        forced, fast = cpu_bf16_override(), cpu_has_fast_bf16()
        if amp_dtype == "auto":
            amp = "bf16" if fast else "fp32"
            if forced is not None:  # the reason says when the environment, not the hardware, decided
                why.append(f"CPU treated as {'having' if fast else 'lacking'} native bf16 ({CPU_BF16_ENV}="
                           f"{int(forced)}): {'bf16 autocast' if fast else 'fp32'}")
            elif fast:
                why.append("CPU with native bf16 (AVX512-BF16/AMX): bf16 autocast")
            else:
                why.append("CPU without native bf16 matmul: fp32 (bf16 would be emulated and slower)")
        else:
            amp = amp_dtype
            said = "" if forced is None else f" per {CPU_BF16_ENV}=0"
            why.append(f"CPU: {amp} as asked"
                       + ("" if fast or amp == "fp32" else f" (no native bf16{said}: expect it slower)"))
        use_tf32 = False
    dtype = None if amp == "fp32" else _DTYPES[amp]
    plan = DevicePlan(
        device=dev, amp_dtype=dtype, use_grad_scaler=amp == "fp16" and dev.type == "cuda", tf32=use_tf32,
        reason=f"device {dev}: " + "; ".join(why),
    )
    if not quiet:
        log.info(plan.reason)
    return plan


# --sdpa_backend: the one SDPA kernel a training step may use (auto: torch's own choice among them)
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def sdpa_backend_unavailable(name: str, device: torch.device, amp_dtype: torch.dtype | None) -> str | None:
    """Why the SDPA kernel `name` (SDPA_BACKENDS, or auto) cannot be the only one on `device` for a step under
    autocast to amp_dtype (None: fp32), or None."""
    if name == "auto":
        return None
    if device.type != "cuda":
        return (f"the {name} kernel is one of SDPA's CUDA kernels; this run is on the {device.type}, where SDPA "
                "picks among its own: leave --sdpa_backend at auto")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return f"the {name} kernel needs compute capability 8.0 or newer; {torch.cuda.get_device_name(device)} is " \
               f"{cap[0]}.{cap[1]}"
    if name in ("flash", "cudnn") and amp_dtype is None:
        return f"the {name} kernel takes fp16 or bf16 only, and this step runs in fp32: add --use_amp"
    if name == "cudnn" and (torch.backends.cudnn.version() or 0) < 90000:
        return f"SDPA's cuDNN kernel needs cuDNN 9 or newer; this torch has {torch.backends.cudnn.version()}"
    return None


def sdpa_backends(name: str) -> contextlib.AbstractContextManager[Any]:
    """Inside: SDPA uses only the kernel `name` (auto: no restriction). Around a compiled model's first call, the
    kernel it traces."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name])])


FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first NVIDIA GPUs whose tensor cores multiply float8


def fp8_unavailable(device: torch.device) -> str | None:
    """Why float8 training (torchao's Float8Linear) cannot run on `device`, or None where it can.

    Only GPUs with float8 tensor cores gain from it: elsewhere torch emulates the float8 matmul, slower than
    the bf16 one it replaces."""
    if device.type != "cuda":
        return (f"float8 training needs an NVIDIA GPU of compute capability {FP8_MIN_CAPABILITY[0]}."
                f"{FP8_MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell); this run is on the {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return (f"float8 training needs compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer "
                f"(Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    from gptopt.utils.extras import has

    if not has("torchao"):
        return "float8 training needs torchao: pip install 'gptopt[quant]'"
    return None


def default_attention(device_type: str, amp_dtype: torch.dtype | None = None) -> str:
    """The attention kernel to use when the user does not say, for a step under autocast to amp_dtype
    (None: fp32).

    CUDA/MPS: SDPA (flash / memory-efficient kernels). CPU, by measurement: under bf16 autocast the
    two-block eager path, since the compiled bf16 step ran faster with it than with SDPA's CPU flash
    kernel (benchmarks/2026-12-02-training-ladder.md, "Code of 2026-12-03, before the shared training
    step": what changed); in fp32 SDPA, faster there compiled and not (benchmarks/2026-12-05-cpu-attention.md).
    """
    return "eager" if device_type == "cpu" and amp_dtype == torch.bfloat16 else "sdpa"


# glibc's mallopt parameters (malloc.h); the defaults are restored with these values
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}


def reuse_host_memory(enable: bool = True) -> bool:
    """Keep freed host memory for the next tensor instead of returning it to the kernel (glibc only).

    glibc serves every block above 128 KiB-32 MiB with a fresh mmap and unmaps it on free, so each CPU
    training step page-faults its large activations in again: the tiny preset's lm_head matmul and the
    whole compiled bf16 step run faster with this (benchmarks/2026-12-02-training-ladder.md, "Code of
    2026-12-03, before the shared training step": what changed).
    The cost: the process keeps its peak heap (returned above 1 GiB of free space at the top, and all
    of it when this is turned off again). Returns whether the setting was applied (False on other C
    libraries, where nothing changes).
    """
    libc = _glibc()
    if libc is None:
        return False
    values = {_M_TRIM_THRESHOLD: 2**30, _M_MMAP_MAX: 0} if enable else _GLIBC_DEFAULTS
    ok = all(libc.mallopt(param, value) == 1 for param, value in values.items())
    if not enable:
        libc.malloc_trim(0)  # the kept free memory goes back now, not at some later free
    return ok


def give_back_host_memory() -> None:
    """Return the host heap's free memory to the kernel now (glibc's malloc_trim; elsewhere nothing). Loading a
    model frees its first copies of the weights (a cast, the CPU layout's reordering) into the heap, which glibc
    keeps: counted in the RSS and missing from what is free, though nothing holds it."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------
# Hardware ceilings. Dense (no sparsity) tensor-core peaks in TFLOP/s, bandwidth in GB/s, from the
# vendors' data sheets. Consumer cards list the fp32-accumulate rate, which is what autocast uses.


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16: float | None  # TFLOP/s; None where the chip has no bf16 tensor cores
    fp16: float
    tf32: float | None
    bandwidth_gbs: float


# Order matters: the first pattern that matches the device name wins (A100 before A10, L40S before L4).
GPU_SPECS: list[tuple[str, GPUSpec]] = [
    (r"B200", GPUSpec("B200", 2250, 2250, 1100, 8000)),
    (r"H200", GPUSpec("H200", 989, 989, 494, 4800)),
    (r"H100.*PCIe", GPUSpec("H100 PCIe", 756, 756, 378, 2000)),
    (r"H100", GPUSpec("H100 SXM", 989, 989, 494, 3350)),
    (r"A100.*80\s*GB.*PCIe|A100.*PCIe.*80\s*GB", GPUSpec("A100 80GB PCIe", 312, 312, 156, 1935)),
    (r"A100.*80\s*GB", GPUSpec("A100 80GB SXM", 312, 312, 156, 2039)),
    (r"A100", GPUSpec("A100 40GB", 312, 312, 156, 1555)),
    (r"L40S", GPUSpec("L40S", 362, 362, 183, 864)),
    (r"\bL4\b", GPUSpec("L4", 121, 121, 60, 300)),
    (r"\bA10\b", GPUSpec("A10", 125, 125, 62.5, 600)),
    (r"RTX 4090", GPUSpec("RTX 4090", 165, 165, 82.6, 1008)),
    (r"RTX 3090", GPUSpec("RTX 3090", 71, 71, 35.6, 936)),
    (r"V100", GPUSpec("V100", None, 125, None, 900)),
    (r"\bT4\b", GPUSpec("T4", None, 65, None, 320)),
]


def gpu_spec(device_name: str) -> GPUSpec | None:
    for pattern, spec in GPU_SPECS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return spec
    return None


_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def measured_matmul_flops(device: str, dtype: torch.dtype, *, remeasure: bool = False) -> float:
    """Best FLOP/s of a square matmul on the device: a short measurement, cached for the process.

    remeasure: measure again and keep the better figure. A shared VM's speed drifts within minutes
    (benchmarks/2026-12-02-training-ladder.md, "Code of 2026-12-03, before the shared training step":
    its 17:24 run); a run that measures at its start and its end states its MFU against the faster of the
    two moments, never against one slow second.
    """
    key = (device, dtype)
    if key not in _MEASURED or remeasure:
        _MEASURED[key] = max(_MEASURED.get(key, 0.0), _measure_matmul(torch.device(device), dtype))
    return _MEASURED[key]


def _measure_matmul(dev: torch.device, dtype: torch.dtype) -> float:
    n = 2048 if dev.type == "cpu" else 8192
    if dev.type == "cpu":  # smaller where one product is slow (bf16 emulated without native support): a rep stays short
        n = _cpu_size(dtype, n)
    # its own generator: measuring must not move the global RNG (dropout, init) of the run it serves
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for _ in range(2):  # warm-up: library init, thread pool, clocks
        a @ b
    sync()
    best = float("inf")
    deadline = time.perf_counter() + (1.0 if dev.type == "cpu" else 0.5)
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
        reps += 1
        if reps >= 50:
            break
    return 2 * n**3 / best


def _cpu_size(dtype: torch.dtype, largest: int) -> int:
    """The side of the square matmul that measures a CPU: doubled from 256 while one product takes under 50 ms,
    up to `largest`. A fast path (fp32, native bf16) reaches `largest`; an emulated one stops early, so the
    measurement takes seconds where 2048 would take minutes."""
    n = 256
    while n < largest:
        a = torch.ones(n, n, dtype=dtype)
        t0 = time.perf_counter()
        a @ a
        if time.perf_counter() - t0 > 0.05:
            break
        n *= 2
    return n


def peak_flops(plan: DevicePlan, dtype: torch.dtype | None = None, *, remeasure: bool = False) -> tuple[float, str]:
    """The peak FLOP/s MFU is measured against, and where that number comes from (remeasure: see
    measured_matmul_flops; a table peak is not measured)."""
    dtype = dtype if dtype is not None else (plan.amp_dtype or torch.float32)
    key = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32" if plan.tf32 else "fp32"}[dtype]
    if plan.device.type == "cuda":
        name = torch.cuda.get_device_name(plan.device)
        spec = gpu_spec(name)
        value = getattr(spec, key, None) if spec is not None and key != "fp32" else None
        if value:
            return value * 1e12, f"{spec.name} {key} table peak ({value:g} TFLOP/s)"
    flops = measured_matmul_flops(str(plan.device), dtype, remeasure=remeasure)
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return flops, f"measured matmul peak ({dt}, {plan.device.type}: {flops / 1e12:.3g} TFLOP/s)"


def memory_bandwidth(plan: DevicePlan) -> tuple[float | None, str]:
    """Peak memory bandwidth in bytes/s from the table, or None with the reason where unknown."""
    if plan.device.type == "cuda":
        spec = gpu_spec(torch.cuda.get_device_name(plan.device))
        if spec is not None:
            return spec.bandwidth_gbs * 1e9, f"{spec.name} table ({spec.bandwidth_gbs:g} GB/s)"
        return None, "GPU not in gptopt's table"
    return None, f"no bandwidth table for {plan.device.type}"


# ----------------------------------------------------------------------------------------------
# The environment record stored with every checkpoint and benchmark result.


def environment(plan: DevicePlan | None = None) -> dict[str, Any]:
    from gptopt import __version__

    rec: dict[str, Any] = {
        "gptopt": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu": cpu_name(),
    }
    if plan is not None:
        rec["device"] = str(plan.device)
        rec["amp_dtype"] = plan.amp_name
        if plan.device.type == "cuda":
            rec["device_name"] = torch.cuda.get_device_name(plan.device)
            rec["gpu_count"] = torch.cuda.device_count()
        else:
            rec["device_name"] = rec["cpu"]
            rec["cpu_threads"] = torch.get_num_threads()
            rec["cpu_count"] = os.cpu_count()
    return rec
