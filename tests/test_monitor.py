"""pytest -q tests/test_monitor.py

The sampler thread on this machine's CPU, GPU-less without NVML, and the GPU path through a fake pynvml.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import wait_for

from gptopt.runtime.monitor import Monitor, format_summary, summarize

GiB = 2**30



class FakeNVML(types.ModuleType):
    """pynvml's calls used by the monitor, with fixed readings per physical GPU, and a switch to break power."""

    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM = 0, 1

    class NVMLError(Exception):
        pass

    def __init__(self, n_gpus: int = 2) -> None:
        super().__init__("pynvml")
        self.n_gpus = n_gpus
        self.inits = self.shutdowns = self.power_calls = 0
        self.power_fails_after: int | None = None  # raise on every power call after this many

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.n_gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> int:
        return int(uuid.decode().rsplit("-", 1)[1])  # the fake's UUIDs end in the physical index

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=87 + h, memory=40 + h)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(41 + h) * GiB, total=80 * GiB, free=(39 - h) * GiB)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self.power_calls += 1
        if self.power_fails_after is not None and self.power_calls > self.power_fails_after:
            raise self.NVMLError("GPU is lost")
        return 350_000 + 1000 * h  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 64 + h

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return 1980


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    fake = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def run_for(mon: Monitor, n_samples: int) -> Monitor:
    with mon:
        wait_for(lambda: len(mon.samples()) >= n_samples)
    return mon


def test_host_figures_are_sampled_and_rss_tracks_an_allocation() -> None:
    with Monitor(interval_s=0.2) as mon:
        wait_for(lambda: len(mon.samples()) >= 1)
        before = mon.latest()["proc_rss_bytes"]
        buf = np.ones(300 * 2**20 // 8)  # 300 MB, every page written, so it is resident
        t_alloc = time.perf_counter() - mon._t0
        wait_for(lambda: mon.latest()["t"] > t_alloc)
        time.sleep(0.6)
    samples, summary = mon.samples(), mon.summary()
    assert len(samples) >= 2 and summary["n_samples"] == len(samples)
    assert all(s["proc_rss_bytes"] > 0 for s in samples)
    assert summary["proc_rss_bytes"]["max"] - before > 250e6
    for key in ("sys_cpu_pct", "sys_mem_pct"):
        assert 0 <= summary[key]["min"] <= summary[key]["max"] <= 100
    assert summary["proc_cpu_pct"]["min"] >= 0
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    assert summary["duration_s"] >= samples[-1]["t"]
    del buf


def test_without_nvml_gpu_fields_are_absent_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    mon = run_for(Monitor(interval_s=0.05), 2)
    summary = mon.summary()
    assert not any(k.startswith("gpu") for s in mon.samples() for k in s)
    assert summary["gpu_available"] is False
    assert "gptopt[gpu]" in summary["gpu_reason"]
    assert summary["host_reason"] is None and "proc_rss_bytes" in summary
    assert "gptopt[gpu]" in format_summary(summary)


def test_fake_nvml_gives_every_gpu_field_in_units(fake_nvml: FakeNVML) -> None:
    mon = run_for(Monitor(interval_s=0.05), 3)
    s, summary = mon.latest(), mon.summary()
    assert s["gpu0_util_pct"] == 87 and s["gpu0_mem_busy_pct"] == 40
    assert s["gpu0_mem_used_bytes"] == 41 * GiB and s["gpu0_mem_total_bytes"] == 80 * GiB
    assert s["gpu0_power_w"] == 350.0 and s["gpu0_power_limit_w"] == 700.0  # NVML reports mW
    assert s["gpu0_temp_c"] == 64 and s["gpu0_sm_clock_mhz"] == 1980
    assert s["gpu1_util_pct"] == 88 and s["gpu1_power_w"] == 351.0  # every GPU when no index is given
    assert summary["gpu_available"] is True and summary["gpu_reason"] is None
    assert fake_nvml.inits == 1 and fake_nvml.shutdowns == 1  # once per run, not per sample
    text = format_summary(summary)
    assert "- GPU 0: utilisation 87% mean / 87% max" in text and "- GPU 1:" in text
    assert "memory used 41.0 GiB max of 80.0 GiB" in text and "power 350 W mean / 350 W max, limit 700 W" in text


def test_device_index_follows_cuda_visible_devices(fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # CUDA's device 0 is NVML's device 1
    s = run_for(Monitor(device_index=0, interval_s=0.05), 1).latest()
    assert s["gpu0_util_pct"] == 88 and not any(k.startswith("gpu1") for k in s)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-0,GPU-fake-1")
    assert run_for(Monitor(device_index=1, interval_s=0.05), 1).latest()["gpu1_temp_c"] == 65


def test_an_invisible_device_index_is_a_reason_not_a_crash(fake_nvml: FakeNVML) -> None:
    mon = run_for(Monitor(device_index=5, interval_s=0.05), 1)
    summary = mon.summary()
    assert summary["gpu_available"] is False and "GPU 5" in summary["gpu_reason"]
    assert fake_nvml.shutdowns == fake_nvml.inits == 1


def test_an_nvml_error_mid_run_stops_that_call_only(fake_nvml: FakeNVML) -> None:
    fake_nvml.power_fails_after = 4  # two samples of two GPUs, then the call fails
    mon = Monitor(interval_s=0.05).start()
    wait_for(lambda: len(mon.samples()) >= 8)
    assert mon._thread is not None and mon._thread.is_alive()
    mon.stop()
    samples, summary = mon.samples(), mon.summary()
    assert all("gpu0_power_w" in s for s in samples[:2]) and not any("gpu0_power_w" in s for s in samples[2:])
    assert all(s["gpu0_util_pct"] == 87 for s in samples)  # the other readings carry on
    assert fake_nvml.power_calls == 6  # each GPU's failing call was tried once more, then never again
    assert "gpu0 power: NVMLError: GPU is lost (+1 more)" == summary["gpu_reason"]
    assert summary["gpu_available"] is True


def test_a_failing_host_reading_is_recorded_and_the_rest_carry_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    monkeypatch.setitem(sys.modules, "pynvml", None)

    def denied() -> None:
        raise psutil.AccessDenied()

    monkeypatch.setattr(psutil, "virtual_memory", denied)
    summary = run_for(Monitor(interval_s=0.05), 2).summary()
    assert "sys_mem_pct" not in summary and summary["proc_rss_bytes"]["max"] > 0
    assert summary["host_reason"].startswith("system memory: AccessDenied")


def test_summarize_math_on_synthetic_samples() -> None:
    samples = [{"t": 0.0, "a": 1, "gpu0_util_pct": 10.0, "note": "x"}, {"t": 1.0, "a": 3},
               {"t": 2.5, "a": 2, "gpu0_util_pct": 30.0}]
    out = summarize(samples)
    assert out["a"] == {"mean": 2.0, "min": 1, "max": 3}
    assert out["gpu0_util_pct"] == {"mean": 20.0, "min": 10.0, "max": 30.0}  # over the samples that have it
    assert out["n_samples"] == 3 and out["duration_s"] == 2.5 and out["gpu_available"] is True
    assert "note" not in out and "t" not in out
    empty = summarize([])
    assert empty["n_samples"] == 0 and empty["gpu_available"] is False
    assert format_summary(empty).startswith("- monitor: 0 samples")


def test_stop_returns_promptly_even_with_a_long_interval() -> None:
    mon = Monitor(interval_s=60).start()
    thread = mon._thread
    assert thread is not None and thread.daemon
    t0 = time.monotonic()
    mon.stop()
    assert time.monotonic() - t0 < 5  # an Event wait wakes on stop(); a sleep would take the full minute
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="runs once"):
        mon.start()


def test_memory_is_bounded_while_the_summary_covers_every_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    mon = Monitor(interval_s=0.01, max_samples=5).start()
    wait_for(lambda: mon.summary()["n_samples"] >= 20)
    mon.stop()
    kept, summary = mon.samples(), mon.summary()
    assert len(kept) == 5 and summary["n_samples"] >= 20
    assert kept[-1] == mon.latest() and kept[0]["t"] > 0.01 * 10  # the newest are kept, the oldest dropped
    assert summary["proc_rss_bytes"]["min"] <= min(s["proc_rss_bytes"] for s in kept)


def test_the_thread_never_raises_into_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    def broken(*args: Any) -> None:
        raise OSError("no /proc here")

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(psutil, "Process", broken)
    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    with Monitor(interval_s=0.05) as mon:
        wait_for(lambda: mon.host_errors != [])
    assert raised == [] and "monitor stopped: OSError" in mon.summary()["host_reason"]
