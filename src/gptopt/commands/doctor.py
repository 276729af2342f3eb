"""`gptopt doctor`: the playbook's environment check as one command, each finding with its fix.

    gptopt doctor                          # table on stdout, exit 1 if any check fails
    gptopt doctor --json --smoke --device cpu
    gptopt doctor --preset qwen3-0.6b --seq_len 4096   # memory sized for a training step of 4,096 tokens

Probing (`probe`) gathers plain facts; judging (`checks`) is a pure function of those facts and
the preset, so every verdict is tested on a CPU machine with synthetic facts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from gptopt.config import DOCTOR_SEQ_LEN, PRESETS, DoctorConfig, GPTConfig, TrainConfig, preset
from gptopt.models.flops import param_count
from gptopt.runtime import device as device_mod
from gptopt.runtime import process
from gptopt.train.step_memory import train_step_bytes
from gptopt.utils.extras import installed_extras

log = logging.getLogger("gptopt")

# CUDA versions of PyTorch's wheel indexes (download.pytorch.org/whl/cuXYZ), newest first. Each
# torch release ships only some of them; pip picks the newest torch that index has.
WHEEL_CUDA = ("13.0", "12.9", "12.8", "12.6", "12.4", "12.1", "11.8")
DEFAULT_WHEEL_CUDA = "12.6"
SMI_TIMEOUT_S = 5  # a hung driver must not hang the doctor
ENV_PREFIXES = ("NCCL_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "CUBLAS_WORKSPACE_CONFIG", device_mod.CPU_BF16_ENV)


@dataclass(kw_only=True)
class GPU:
    index: int
    name: str
    memory_total: int  # bytes
    memory_free: int | None = None  # bytes, only for the device the plan chose
    capability: tuple[int, int] | None = None  # None where only the driver (not torch) sees the GPU


@dataclass(kw_only=True)
class Facts:
    """What the machine is; every field has an 'absent/unknown' default so tests state only what matters."""

    os_name: str = "Linux"  # platform.system()
    os_detail: str = ""  # platform.platform()
    python: str = platform.python_version()
    torch_version: str = torch.__version__
    torch_cuda: str | None = None  # CUDA the torch build targets; None for a CPU build
    torch_hip: str | None = None
    cuda_available: bool = False
    cuda_error: str | None = None  # why CUDA init failed, in torch's words
    cudnn: int | None = None
    arch_list: list[str] = field(default_factory=list)  # kernels in the torch build: sm_80, compute_90, ...
    flash_build: bool | None = None  # flash attention compiled into this torch
    gpus: list[GPU] = field(default_factory=list)  # as torch sees them
    driver: str | None = None
    driver_cuda: str | None = None  # newest CUDA the driver supports
    driver_source: str | None = None  # nvml | nvidia-smi
    driver_gpus: list[GPU] = field(default_factory=list)  # as the driver sees them, torch or not
    nccl: str | None = None
    triton: str | None = None
    cxx: str | None = None  # C++ compiler: Inductor's CPU backend
    cc: str | None = None  # C compiler: Triton builds its launcher with it
    cpu_model: str = ""
    cpu_logical: int = 1
    cpu_usable: int = 1  # cores this process may run on (affinity, containers)
    cpu_physical: int | None = None
    cpu_bf16: bool | None = None  # native bf16 in the hardware, whatever GPTOPT_CPU_BF16 says
    torch_threads: int = 1
    ram_total: int | None = None
    ram_available: int | None = None
    disk_path: str = "."
    disk_free: int | None = None
    extras: dict[str, bool] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    device: str | None = None  # the resolved device, e.g. cuda:0
    device_reason: str | None = None
    device_error: str | None = None  # why device.resolve refused


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    value: str
    fix: str = ""


# ----------------------------------------------------------------------------------------------
# Probing: the only part that touches the machine.


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def _bytes(text: str) -> int:
    """'81920 MiB' or '81920' (nounits) from nvidia-smi, in bytes; 0 for '[N/A]' (some MIG setups)."""
    num = re.findall(r"[\d.]+", text)
    return int(float(num[0]) * 1024 ** (3 if "GiB" in text else 2)) if num else 0


def probe_driver() -> dict[str, Any]:
    """Driver version, its CUDA version and the GPUs it sees: NVML if installed, else nvidia-smi."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            ver = pynvml.nvmlSystemGetDriverVersion()
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                gpus.append(GPU(index=i, name=name.decode() if isinstance(name, bytes) else name,
                                memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(h).total)))
        finally:
            pynvml.nvmlShutdown()
        return dict(driver=ver.decode() if isinstance(ver, bytes) else ver,
                    driver_cuda=f"{cuda // 1000}.{cuda % 1000 // 10}", driver_source="nvml", driver_gpus=gpus)
    except Exception as e:  # not installed, or no driver library: nvidia-smi may still answer
        log.debug("NVML unavailable: %s", e)
    if shutil.which("nvidia-smi") is None:
        return {}
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if not out:
        return {}
    gpus, ver = [], None
    try:
        for i, line in enumerate(ln for ln in out.splitlines() if ln.strip()):
            name, ver, mem = (p.strip() for p in line.rsplit(",", 2))
            gpus.append(GPU(index=i, name=name, memory_total=_bytes(mem)))
    except ValueError:  # a format this parser does not know: report no driver, not a crash
        log.warning("could not parse nvidia-smi output: %r", out)
        return {}
    header = re.search(r"CUDA Version:\s*([\d.]+)", _run(["nvidia-smi"]) or "")
    return dict(driver=ver, driver_cuda=header.group(1) if header else None, driver_source="nvidia-smi",
                driver_gpus=gpus)


def _triton_version() -> str | None:
    for dist in ("triton", "pytorch-triton", "triton-windows", "pytorch-triton-rocm"):  # one module, 4 wheels
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def _which(*names: str | None) -> str | None:
    return next((path for n in names if n and (path := shutil.which(n))), None)


def probe(plan: device_mod.DevicePlan | None, device_error: str | None = None) -> Facts:
    f = Facts(os_name=platform.system(), os_detail=platform.platform(), torch_cuda=torch.version.cuda,
              torch_hip=getattr(torch.version, "hip", None))
    f.cuda_available = torch.cuda.is_available()
    if f.torch_cuda and not f.cuda_available:
        try:  # is_available() only warns, once per process; init raises the reason every time
            torch.cuda.init()
        except Exception as e:
            f.cuda_error = str(e).strip().splitlines()[0]
    if torch.backends.cudnn.is_available():
        f.cudnn = torch.backends.cudnn.version()
    if f.cuda_available:
        f.arch_list = list(torch.cuda.get_arch_list())
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            f.gpus.append(GPU(index=i, name=props.name, memory_total=props.total_memory,
                              capability=(props.major, props.minor)))
        if plan is not None and plan.device.type == "cuda":
            f.gpus[plan.device.index].memory_free = torch.cuda.mem_get_info(plan.device)[0]
        is_flash = getattr(torch.backends.cuda, "is_flash_attention_available", None)
        f.flash_build = bool(is_flash()) if is_flash else None
        try:
            f.nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # no NCCL in this build (Windows, CPU)
            pass
    for k, v in probe_driver().items():
        setattr(f, k, v)
    f.triton = _triton_version()
    f.cxx = _which(os.environ.get("CXX"), "g++", "c++", "clang++")
    f.cc = _which(os.environ.get("CC"), "cc", "gcc", "clang")
    f.cpu_model = device_mod.cpu_name()
    f.cpu_logical = os.cpu_count() or 1
    f.cpu_usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else f.cpu_logical
    f.cpu_physical = psutil.cpu_count(logical=False)
    f.cpu_bf16 = device_mod.cpu_bf16_detected()
    f.torch_threads = torch.get_num_threads()
    vm = psutil.virtual_memory()
    f.ram_total, f.ram_available = vm.total, vm.available
    f.disk_path = os.getcwd()
    f.disk_free = shutil.disk_usage(f.disk_path).free
    f.extras = installed_extras()
    f.env = {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    if plan is not None:
        f.device, f.device_reason = str(plan.device), plan.reason
    f.device_error = device_error
    return f


# ----------------------------------------------------------------------------------------------
# Sizing: what training a preset needs, from its config alone (building even a meta model is slow).


def sizing_seq_len(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """The sequence length the memory checks size a step of this model at: seq_len (--seq_len), capped at the
    model's context; without it the context, at most DOCTOR_SEQ_LEN."""
    return min(cfg.block_size, seq_len or DOCTOR_SEQ_LEN)


def train_bytes(cfg: GPTConfig, seq_len: int) -> int:
    """Memory of a `gptopt train` step at batch 1 x seq_len under train's defaults (fp32, no checkpointing): the
    training step's own estimate (step_memory), from the family's shape (layers, heads and key/value heads, head
    size, MLP width, vocabulary), with the smaller of the two losses, as --loss auto would take where only it fits."""
    return min(train_step_bytes(dataclasses.replace(cfg, loss=loss), 1, seq_len).total for loss in ("full", "chunked"))


def disk_bytes(cfg: GPTConfig) -> int:
    """`gptopt train` keeps the last K resumable checkpoints, each fp32 weights (4 B/param) + AdamW's
    moments (8 B/param), and writes the newest before dropping the oldest: K + 1 at the peak."""
    keep = TrainConfig().save_total_limit
    return (keep + 1) * 12 * param_count(cfg)


# ----------------------------------------------------------------------------------------------
# Judging: pure functions of Facts.


def _ver(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def _size(n: int | float) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def wheel_cuda(driver_cuda: str | None, at_least: str | None = None) -> str:
    """The newest PyTorch wheel CUDA the driver can run (and, if given, not older than `at_least`)."""
    if driver_cuda is None:
        return at_least or DEFAULT_WHEEL_CUDA
    fits = [w for w in WHEEL_CUDA if _ver(w) <= _ver(driver_cuda)]
    if at_least:
        fits = [w for w in fits if _ver(w) >= _ver(at_least)] or [at_least]
    return fits[0] if fits else WHEEL_CUDA[-1]


def reinstall(cuda: str) -> str:
    tag = "cu" + cuda.replace(".", "")
    return f"pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/{tag}"


def _arch(name: str) -> tuple[str, tuple[int, int], str] | None:
    """'sm_90a' -> ('sm', (9, 0), 'a'); None for names this rule does not cover (gfx942)."""
    m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", name)
    return (m[1], (int(m[2][:-1]), int(m[2][-1])), m[3]) if m else None


def arch_supported(cap: tuple[int, int], arch_list: list[str]) -> bool:
    cap = tuple(cap)  # a list once read back from JSON
    for kind, have, suffix in filter(None, map(_arch, arch_list)):
        if have == cap:
            return True
        if suffix:  # sm_90a-style kernels run on that exact chip only
            continue
        if kind == "sm" and have[0] == cap[0] and have[1] <= cap[1]:
            return True  # cubins run on later minor revisions of the same major
        if kind == "compute" and have <= cap:
            return True  # PTX is JIT-compiled for newer GPUs
    return False


def _fits(name: str, have: int | None, need_of: Callable[[GPTConfig], int], cfg: GPTConfig, what: str,
          fix: str, sizing: str = "") -> Check:
    """fail below the estimate, warn below 1.5x (the estimate is a floor: batch 1, no fragmentation).
    sizing: what the estimate is of, where it depends on a choice (the step's sequence length)."""
    need = need_of(cfg)
    needs = f"preset needs ~{_size(need)}{f' {sizing}' if sizing else ''}"
    if have is None:
        return Check(name, "ok", f"unknown; {needs}")
    value = f"{_size(have)} {what}; {needs}"
    if have >= 1.5 * need:
        return Check(name, "ok", value)
    # the largest of the same family (GPT-2's block, or the Llama-shaped one) that fits with room
    family = (cfg.positions, cfg.norm, cfg.mlp)
    configs = {p: preset(p) for p in PRESETS}
    roomy = [p for p, c in configs.items() if (c.positions, c.norm, c.mlp) == family
             and 1.5 * need_of(c) <= have]
    best = max(roomy, key=lambda p: need_of(configs[p]), default=None)
    hint = f"the largest preset with room is {best} (--preset {best}), or {fix}" if best else fix
    return Check(name, "fail" if have < need else "warn", value, hint)


def _gpu_checks(f: Facts, wheel: str) -> list[Check]:
    out = []
    for g in f.gpus:
        cap = tuple(g.capability or (0, 0))
        new = cap >= (8, 0)  # Ampere: bf16 and TF32 tensor cores, flash attention
        flash = new and f.flash_build is not False
        value = (f"{g.name}, {_size(g.memory_total)}, sm_{cap[0]}{cap[1]}, bf16 {'yes' if new else 'no'}, "
                 f"TF32 {'yes' if new else 'no'}, flash attention {'yes' if flash else 'no'}")
        # ROCm builds list gfx targets, which this sm_XY rule does not cover
        if f.torch_cuda and f.arch_list and not arch_supported(cap, f.arch_list):
            newest = max((a[1] for a in map(_arch, f.arch_list) if a), default=(0, 0))
            if cap > newest:  # too new: Blackwell (sm_100, sm_120) kernels arrived with CUDA 12.8
                cuda = wheel_cuda(f.driver_cuda, "12.8" if cap >= (10, 0) else None)
            else:  # too old: the CUDA 12.6 builds still carry Maxwell/Pascal kernels
                cuda = "12.6" if not f.driver_cuda or _ver(f.driver_cuda) >= (12, 6) else wheel
            out.append(Check(f"gpu{g.index}", "fail", f"{value}; not in this build's {' '.join(f.arch_list)}",
                             f"install a torch built for sm_{cap[0]}{cap[1]}: {reinstall(cuda)}"))
        else:
            out.append(Check(f"gpu{g.index}", "ok", value))
    return out


def _cpu_bf16_check(f: Facts) -> Check:
    """Native bf16 on the CPU decides its autocast dtype; GPTOPT_CPU_BF16 may override the detection."""
    name, env = "cpu bf16", device_mod.CPU_BF16_ENV
    hardware = {True: "native (AVX512-BF16/AMX)", False: "none", None: "unknown"}[f.cpu_bf16]
    try:
        forced = device_mod.parse_cpu_bf16(f.env.get(env))
    except ValueError as e:
        return Check(name, "fail", f"{hardware}; {e}", f"export {env}=1 or {env}=0, or unset {env}")
    if forced is None:
        autocast = {True: ": CPU autocast uses bf16", False: ": CPU autocast uses fp32", None: ""}[f.cpu_bf16]
        return Check(name, "ok", hardware + autocast)
    value = (f"{hardware}; {env}={f.env[env].strip()} decides instead of the detection: CPU autocast uses "
             f"{'bf16' if forced else 'fp32'}")
    if f.cpu_bf16 is None or forced == f.cpu_bf16:
        return Check(name, "ok", value)
    return Check(name, "warn", value, f"unset {env} unless you mean to run the other CPU policy "
                 "(tests of it, or flags a VM hides)")


def checks(facts: Facts, preset_name: str, seq_len: int | None = None) -> list[Check]:
    """Every verdict with its fix; a pure function of the facts, the preset and the sequence length the memory
    checks size a training step at (--seq_len; None: sizing_seq_len's default)."""
    f, cfg, out = facts, preset(preset_name), []
    add = out.append
    wheel = wheel_cuda(f.driver_cuda)
    gpu_here = bool(f.gpus or f.driver_gpus)

    if f.os_name == "Windows":
        add(Check("os", "warn", f.os_detail or "Windows", "torch.compile needs Triton, which official "
                  "Windows builds lack: use WSL2 or Linux, or train without --compile"))
    else:
        add(Check("os", "ok", f.os_detail or f.os_name))
    add(Check("python", "ok", f.python))

    build = f"ROCm {f.torch_hip}" if f.torch_hip else f"CUDA {f.torch_cuda}" if f.torch_cuda else "CPU build"
    if build == "CPU build" and f.driver_gpus:
        add(Check("torch", "fail", f"{f.torch_version} ({build}), but the driver sees {len(f.driver_gpus)} "
                  f"GPU(s): {f.driver_gpus[0].name}", f"install a CUDA build of torch: {reinstall(wheel)}"))
    else:
        add(Check("torch", "ok", f"{f.torch_version} ({build})"))

    if f.torch_cuda:
        if f.cuda_available:
            add(Check("cuda", "ok", f"runtime {f.torch_cuda}, {len(f.gpus)} GPU(s) visible"))
        elif f.driver_gpus:
            add(Check("cuda", "fail", f"runtime {f.torch_cuda}, unusable: {f.cuda_error or 'no GPU visible'}",
                      "see the driver and env checks; `nvidia-smi` must work in this shell"))
        else:
            add(Check("cuda", "ok", f"runtime {f.torch_cuda}; no NVIDIA GPU here, so CPU only"))
        add(Check("cudnn", "ok", str(f.cudnn)) if f.cudnn else
            Check("cudnn", "warn", "missing", f"this torch build lacks cuDNN: {reinstall(wheel)}"))

    if f.driver is None:
        add(Check("driver", "ok", "no NVIDIA driver found"))
    elif f.torch_cuda and f.driver_cuda and _ver(f.driver_cuda) < _ver(f.torch_cuda):
        # Within one major version, CUDA's minor-version compatibility usually still runs (minus PTX JIT).
        broken = _ver(f.driver_cuda)[0] < _ver(f.torch_cuda)[0] or not f.cuda_available
        add(Check("driver", "fail" if broken else "warn", f"{f.driver} supports CUDA {f.driver_cuda}, older "
                  f"than torch's CUDA {f.torch_cuda}", f"upgrade the NVIDIA driver to one for CUDA >= "
                  f"{f.torch_cuda}, or match torch to the driver: {reinstall(wheel)}"))
    else:
        add(Check("driver", "ok", f"{f.driver} (CUDA {f.driver_cuda or '?'}, via {f.driver_source})"))

    out += _gpu_checks(f, wheel)
    if f.cuda_available and f.os_name == "Linux":
        lacking = len(f.gpus) > 1 and not f.nccl
        add(Check("nccl", "warn" if lacking else "ok", f.nccl or "missing",
                  f"multi-GPU training needs NCCL: {reinstall(wheel)}" if lacking else ""))
    if f.triton is None and gpu_here and f.os_name != "Windows":
        add(Check("triton", "warn", "missing", "torch.compile on GPU needs Triton: pip install triton"))
    else:
        add(Check("triton", "ok", f.triton or "not installed (only torch.compile on GPU needs it)"))

    missing = ([] if f.cxx else ["C++ (torch.compile on CPU generates C++)"]) + (
        ["C (Triton builds its GPU launcher with one)"] if not f.cc and gpu_here else [])
    add(Check("compiler", "warn" if missing else "ok", f"c++: {f.cxx or 'none'}; cc: {f.cc or 'none'}",
              f"no {' or '.join(missing)} compiler: sudo apt install build-essential (Debian/Ubuntu), "
              "xcode-select --install (macOS)" if missing else ""))

    physical = f", {f.cpu_physical} physical" if f.cpu_physical else ""
    add(Check("cpu", "ok", f"{f.cpu_model or '?'}: {f.cpu_usable} usable of {f.cpu_logical} logical cores"
              f"{physical}; torch uses {f.torch_threads} threads"))
    add(_cpu_bf16_check(f))
    omp = f.env.get("OMP_NUM_THREADS")
    if omp is not None and (not omp.isdigit() or int(omp) > f.cpu_usable):
        add(Check("threads", "warn", f"OMP_NUM_THREADS={omp} with {f.cpu_usable} usable cores",
                  f"more threads than cores thrash: export OMP_NUM_THREADS={f.cpu_usable}"))

    on_gpu = (f.device or "").startswith("cuda")
    T = sizing_seq_len(cfg, seq_len)
    context = f" of the {cfg.block_size:,}-token context" if T < cfg.block_size else ""
    sizing = f"to train batch 1 x {T:,} tokens{context} in fp32 (--seq_len sizes another)"

    def step(c: GPTConfig) -> int:  # this preset, or another (the one with room) at the same length within its context
        return train_bytes(c, min(c.block_size, T))

    # Training on a GPU needs host RAM only to stage the fp32 weights (model + loaded state dict).
    if on_gpu:
        add(_fits("ram", f.ram_available, lambda c: 8 * param_count(c), cfg, f"available of {_size(f.ram_total or 0)}",
                  "free or add RAM", "to stage the weights"))
    else:
        add(_fits("ram", f.ram_available, step, cfg, f"available of {_size(f.ram_total or 0)}", "free or add RAM",
                  sizing))
    if on_gpu:
        idx = int(f.device.split(":")[1]) if ":" in (f.device or "") else 0
        g = next((g for g in f.gpus if g.index == idx), None)
        have = None if g is None else g.memory_free if g.memory_free is not None else g.memory_total
        add(_fits("gpu memory", have, step, cfg, f"free on {f.device}",
                  "shard it over GPUs: torchrun --nproc_per_node N -m gptopt train --fsdp", sizing))
    add(_fits("disk", f.disk_free, disk_bytes, cfg, f"free in {f.disk_path}",
              "free space, or point --output_dir at a larger disk"))

    absent = [k for k, ok in f.extras.items() if not ok]
    installed = f"installed: {', '.join(k for k, ok in f.extras.items() if ok) or 'none'}"
    if "gpu" in absent and gpu_here:
        add(Check("extras", "warn", installed, "GPU monitoring needs NVML: pip install 'gptopt[gpu]'"))
    else:
        hint = f"optional: pip install 'gptopt[{','.join(absent)}]'" if absent else ""
        add(Check("extras", "ok", installed, hint))

    env_warn = []
    if f.env.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"):
        env_warn.append("unset CUDA_LAUNCH_BLOCKING (it serialises every kernel launch: debugging only)")
    if f.env.get("CUDA_VISIBLE_DEVICES") in ("", "-1") and f.driver_gpus:
        env_warn.append("CUDA_VISIBLE_DEVICES hides every GPU: unset it or list the GPUs to use")
    add(Check("env", "warn" if env_warn else "ok",
              "; ".join(f"{k}={v}" for k, v in f.env.items()) or "none of the tuning variables set",
              "; ".join(env_warn)))

    if f.device_error:
        fix = ("see the cpu bf16 check" if device_mod.CPU_BF16_ENV in f.device_error
               else "use --device auto or --device cpu")
        add(Check("device", "fail", f.device_error, fix))
    else:
        add(Check("device", "ok", f.device_reason or f.device or "?"))
    return out


# ----------------------------------------------------------------------------------------------
# Smoke test and output.


def smoke(plan: device_mod.DevicePlan) -> dict[str, Any]:
    """One forward+backward of the debug model under the plan's autocast: does this device really train?"""
    from gptopt.models.gpt import GPT

    t0 = time.perf_counter()
    try:
        model = GPT(preset("debug")).to(plan.device).train()
        cfg = model.config
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g).to(plan.device)
        with plan.autocast():
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        plan.synchronize()
        value = loss.item()
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    except Exception as e:  # any failure here is the finding itself
        log.warning("smoke test failed", exc_info=True)
        return dict(passed=False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    finite = math.isfinite(value) and grads_ok
    return dict(passed=finite, loss=value, finite=finite, seconds=time.perf_counter() - t0,
                device=str(plan.device), amp_dtype=plan.amp_name)


def smoke_check(result: dict[str, Any] | None) -> Check:
    if result is None:
        return Check("smoke", "fail", "not run: no usable device", "see the device check")
    if not result["passed"]:
        detail = result.get("error") or f"loss {result.get('loss')} or its gradients not finite"
        return Check("smoke", "fail", detail, "see the checks above; the log on stderr has the traceback")
    return Check("smoke", "ok", f"forward+backward on {result['device']} ({result['amp_dtype']}): "
                 f"loss {result['loss']:.3f}, finite, {result['seconds']:.2f} s")


def render(results: list[Check], summary: dict[str, int]) -> str:
    tag = {"ok": "[ok]  ", "warn": "[warn]", "fail": "[FAIL]"}
    width = max(len(c.name) for c in results)
    lines = []
    for c in results:
        lines.append(f"{tag[c.status]} {c.name:<{width}}  {c.value}")
        if c.fix:
            lines.append(f"       {'':<{width}}  fix: {c.fix}")
    lines.append(f"{summary['ok']} ok, {summary['warn']} warn, {summary['fail']} fail")
    return "\n".join(lines)


def run(config: DoctorConfig) -> int:
    plan, error = None, None
    try:
        plan = device_mod.resolve(config.device)
        process.set_matmul_precision(plan)
    except ValueError as e:  # an impossible --device is a finding, not a crash
        error = str(e)
    facts = probe(plan, error)
    results = checks(facts, config.preset, config.seq_len)
    smoke_result = None
    if config.smoke:
        smoke_result = smoke(plan) if plan is not None else None
        results.append(smoke_check(smoke_result))
    summary = {s: sum(c.status == s for c in results) for s in ("ok", "warn", "fail")}
    status = 1 if summary["fail"] else 0
    if config.json:
        doc = dict(facts=dataclasses.asdict(facts), checks=[dataclasses.asdict(c) for c in results],
                   summary={**summary, "exit_status": status}, smoke=smoke_result,
                   environment=device_mod.environment(plan) if plan is not None else None)
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    else:
        print(render(results, summary))
    return status
