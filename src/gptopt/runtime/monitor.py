"""A background sampler of GPU (NVML) and host (psutil) figures for `gptopt bench` and `gptopt train`.

    python -m gptopt.runtime.monitor          # watch this machine for 3 s and print the summary

A sample is a flat dict of numbers, so it merges straight into metrics.jsonl: `t` (s since start),
`proc_cpu_pct` (this process, % of all cores), `sys_cpu_pct`, `proc_rss_bytes`, `sys_mem_pct`, and for
GPU i (CUDA's numbering): `gpu{i}_util_pct`, `gpu{i}_mem_busy_pct`, `gpu{i}_mem_used_bytes`,
`gpu{i}_mem_total_bytes`, `gpu{i}_power_w`, `gpu{i}_power_limit_w`, `gpu{i}_temp_c`, `gpu{i}_sm_clock_mhz`.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psutil

from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

if TYPE_CHECKING:
    from gptopt.runtime.device import DevicePlan


def peak_memory_bytes(plan: DevicePlan) -> int:
    """The run's peak memory so far: CUDA's peak allocation on a GPU, the process's peak RSS elsewhere."""
    if plan.device.type == "cuda":
        import torch  # only here: the sampler itself runs without torch (`python -m gptopt.runtime.monitor`)

        return torch.cuda.max_memory_allocated(plan.device)
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


Reader = tuple[str, Callable[[], dict[str, float]]]  # (name for the error reason, one call -> its fields)


class _Stats:
    """Count, sum, min and max per field, updated per sample: a week-long run costs the same memory."""

    def __init__(self) -> None:
        self.fields: dict[str, list[float]] = {}  # name -> [n, sum, min, max]
        self.n, self.t_first, self.t_last = 0, 0.0, 0.0

    def add(self, sample: dict[str, Any]) -> None:
        t = float(sample.get("t", 0.0))
        self.t_first, self.t_last, self.n = (t if self.n == 0 else self.t_first), t, self.n + 1
        for k, v in sample.items():
            if k != "t" and isinstance(v, (int, float)) and not isinstance(v, bool):
                s = self.fields.setdefault(k, [0, 0.0, v, v])
                s[0], s[1], s[2], s[3] = s[0] + 1, s[1] + v, min(s[2], v), max(s[3], v)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: {"mean": s[1] / s[0], "min": s[2], "max": s[3]}
                               for k, s in sorted(self.fields.items())}
        out.update(n_samples=self.n, duration_s=self.t_last - self.t_first,
                   gpu_available=any(k.startswith("gpu") for k in self.fields), gpu_reason=None)
        return out


def summarize(samples: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per field {mean, min, max}, plus n_samples, duration_s (span of `t`), gpu_available, gpu_reason."""
    stats = _Stats()
    for s in samples:
        stats.add(s)
    return stats.result()


# (key or per-GPU suffix, label, unit, stats shown); no stats: its max joins the previous part
_Spec = list[tuple[str, str, str, tuple[str, ...]]]
_MEAN_MAX = ("mean", "max")
_HOST: _Spec = [("proc_cpu_pct", "process CPU (of all cores)", "%", _MEAN_MAX),
                ("sys_cpu_pct", "system CPU", "%", _MEAN_MAX), ("proc_rss_bytes", "process RSS", "B", ("max",)),
                ("sys_mem_pct", "system memory used", "%", ("max",))]
_GPU: _Spec = [("util_pct", "utilisation", "%", _MEAN_MAX), ("mem_busy_pct", "memory busy", "%", _MEAN_MAX),
               ("mem_used_bytes", "memory used", "B", ("max",)), ("mem_total_bytes", " of", "B", ()),
               ("power_w", "power", " W", _MEAN_MAX), ("power_limit_w", ", limit", " W", ()),
               ("temp_c", "temperature", " °C", ("max",)), ("sm_clock_mhz", "SM clock", " MHz", ("mean", "min"))]


def _fmt(v: float, unit: str) -> str:
    if unit != "B":
        return f"{v:.0f}{unit}"
    return f"{v / 2**30:.1f} GiB" if v >= 2**30 else f"{v / 2**20:.0f} MiB"


def _line(summary: dict[str, Any], prefix: str, spec: _Spec) -> str:
    parts: list[str] = []
    for key, label, unit, shown in spec:
        st = summary.get(prefix + key)
        if isinstance(st, dict) and shown:
            parts.append(f"{label} " + " / ".join(f"{_fmt(st[w], unit)} {w}" for w in shown))
        elif isinstance(st, dict) and parts:
            parts[-1] += f"{label} {_fmt(st['max'], unit)}"
    return "; ".join(parts)


def format_summary(summary: dict[str, Any]) -> str:
    """Markdown bullets: how long it sampled, the host, each GPU, and why a figure is missing."""
    lines = [f"- monitor: {summary.get('n_samples', 0)} samples over {summary.get('duration_s', 0):.1f} s"]
    if host := _line(summary, "", _HOST):
        lines.append(f"- host: {host}")
    gpus = sorted({int(m.group(1)) for k in summary if (m := re.match(r"gpu(\d+)_", k))})
    lines += [f"- GPU {i}: {_line(summary, f'gpu{i}_', _GPU)}" for i in gpus]
    lines += [f"- {w} note: {summary[f'{w}_reason']}" for w in ("gpu", "host") if summary.get(f"{w}_reason")]
    return "\n".join(lines)


def _visible_handles(nv: Any) -> list[Any]:
    """NVML handles in CUDA's numbering: NVML counts every GPU, CUDA only those CUDA_VISIBLE_DEVICES lists."""
    count, env = nv.nvmlDeviceGetCount(), os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    handles = []
    for tok in (t.strip() for t in env.split(",")):
        if tok.isdigit() and int(tok) < count:
            handles.append(nv.nvmlDeviceGetHandleByIndex(int(tok)))
        elif tok.startswith(("GPU-", "MIG-")):
            handles.append(nv.nvmlDeviceGetHandleByUUID(tok.encode()))
        else:
            break  # CUDA ignores everything from the first invalid entry on ("-1" hides every GPU)
    return handles


def _gpu_readers(nv: Any, i: int, h: Any) -> list[Reader]:
    """One reader per NVML call: a call this GPU does not support (power, on some) drops only its fields."""
    def util() -> dict[str, float]:
        u = nv.nvmlDeviceGetUtilizationRates(h)  # .memory: % of time DRAM was read or written, not % full
        return {f"gpu{i}_util_pct": u.gpu, f"gpu{i}_mem_busy_pct": u.memory}

    def memory() -> dict[str, float]:
        m = nv.nvmlDeviceGetMemoryInfo(h)
        return {f"gpu{i}_mem_used_bytes": m.used, f"gpu{i}_mem_total_bytes": m.total}

    return [(f"gpu{i} utilisation", util), (f"gpu{i} memory", memory),
            (f"gpu{i} power", lambda: {f"gpu{i}_power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000}),  # NVML: mW
            (f"gpu{i} power limit",
             lambda: {f"gpu{i}_power_limit_w": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000}),
            (f"gpu{i} temperature",
             lambda: {f"gpu{i}_temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)}),
            (f"gpu{i} SM clock",
             lambda: {f"gpu{i}_sm_clock_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)})]


class Monitor:
    """Samples every `interval_s` on a daemon thread: GPU `device_index` (CUDA's numbering), or all if None.

    Never raises into the caller: without NVML or a GPU, `gpu_reason` says why; a call that fails mid-run
    is recorded once and not made again. The last `max_samples` samples are kept; summary() covers all.
    """

    def __init__(self, device_index: int | None = None, interval_s: float = 0.5, *,
                 max_samples: int = 10_000) -> None:
        if interval_s <= 0:
            raise UserError(f"interval_s must be > 0, got {interval_s}")
        self.device_index, self.interval_s = device_index, interval_s
        self._samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._stats = _Stats()
        self._lock = threading.Lock()  # the thread appends while callers read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = self._t_end = 0.0
        self.gpu_errors: list[str] = []
        self.host_errors: list[str] = []

    def start(self) -> Monitor:
        if self._thread is not None:
            raise RuntimeError("a Monitor runs once: make a new one")
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="gptopt-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5.0)  # a hung driver call must not hang the run; the thread is a daemon
        self._t_end = time.perf_counter()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def samples(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._samples)

    def latest(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._samples[-1]) if self._samples else {}

    def summary(self) -> dict[str, Any]:
        with self._lock:
            out = self._stats.result()
        if self._thread is not None:  # the time watched, not just the span between the first and last sample
            out["duration_s"] = (self._t_end or time.perf_counter()) - self._t0
        gpu = self.gpu_errors[:]
        out["gpu_reason"] = gpu[0] + (f" (+{len(gpu) - 1} more)" if len(gpu) > 1 else "") if gpu else None
        out["host_reason"] = "; ".join(self.host_errors) or None
        return out

    # -- the thread ----------------------------------------------------------------------------

    def _host_readers(self) -> list[Reader]:
        proc, ncpu = psutil.Process(), psutil.cpu_count() or 1
        proc.cpu_percent(), psutil.cpu_percent()  # a first call only sets the reference (per thread)
        return [("process CPU", lambda: {"proc_cpu_pct": proc.cpu_percent() / ncpu}),  # psutil: 100 per core
                ("system CPU", lambda: {"sys_cpu_pct": psutil.cpu_percent()}),
                ("process memory", lambda: {"proc_rss_bytes": proc.memory_info().rss}),
                ("system memory", lambda: {"sys_mem_pct": psutil.virtual_memory().percent})]

    def _open_nvml(self) -> tuple[Any, list[Reader]]:
        try:
            nv = require("pynvml", "gpu", "GPU monitoring")
            nv.nvmlInit()  # once per run; the readers' closures hold the device handles
        except Exception as e:  # not installed, or no driver library: a CPU machine
            self.gpu_errors.append(f"NVML unavailable: {e}")
            return None, []
        try:
            visible = _visible_handles(nv)
            wanted = range(len(visible)) if self.device_index is None else [self.device_index]
            if not visible or not 0 <= wanted[-1] < len(visible):
                raise UserError(f"GPU {self.device_index} is not among the {len(visible)} visible"
                                 if visible else "NVML sees no GPU")
            return nv, [r for i in wanted for r in _gpu_readers(nv, i, visible[i])]
        except Exception as e:
            self.gpu_errors.append(f"no GPU sampled: {e}")
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()
            return None, []

    def _sample(self, sources: list[tuple[list[Reader], list[str]]]) -> None:
        sample: dict[str, Any] = {"t": time.perf_counter() - self._t0}
        for readers, errors in sources:
            for reader in list(readers):
                try:
                    sample.update(reader[1]())
                except Exception as e:
                    readers.remove(reader)  # recorded once: a failing call would only fail again, at a cost
                    errors.append(f"{reader[0]}: {type(e).__name__}: {e}")
        with self._lock:
            self._samples.append(sample)
            self._stats.add(sample)

    def _run(self) -> None:
        nv = None
        try:
            nv, gpu = self._open_nvml()
            sources = [(self._host_readers(), self.host_errors), (gpu, self.gpu_errors)]
            while not self._stop.wait(self.interval_s):  # wakes at once on stop(), unlike sleep
                self._sample(sources)
        except Exception as e:  # the last line of defence: a monitor must never take the run down
            self.host_errors.append(f"monitor stopped: {type(e).__name__}: {e}")
        finally:
            if nv is not None:
                with contextlib.suppress(Exception):  # shutting down: nothing left to record it for
                    nv.nvmlShutdown()


if __name__ == "__main__":
    with Monitor() as _mon:
        time.sleep(3)
    print(format_summary(_mon.summary()))
