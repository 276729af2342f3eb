"""The device and precision policy, the GPU peak table and the measured peak.

    pytest -q tests/test_device.py
"""

from __future__ import annotations

import pytest
import torch

from gptopt.runtime import device as dev
from gptopt.runtime.device import gpu_spec, peak_flops, resolve


@pytest.mark.policy
def test_cpu_plan_names_its_reason() -> None:
    plan = resolve("cpu")
    assert plan.device.type == "cpu"
    assert plan.reason.startswith("device cpu:")
    assert not plan.use_grad_scaler
    expected = torch.bfloat16 if dev.cpu_has_fast_bf16() else None
    assert plan.amp_dtype == expected


def test_cpu_without_native_bf16_stays_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "cpu_has_fast_bf16", lambda: False)
    plan = resolve("cpu")
    assert plan.amp_dtype is None
    assert "fp32" in plan.reason


@pytest.mark.parametrize(("value", "amp"), [("0", None), ("1", torch.bfloat16)])
def test_the_environment_overrides_the_cpu_bf16_detection(monkeypatch: pytest.MonkeyPatch, value: str,
                                                           amp: torch.dtype | None) -> None:
    monkeypatch.setenv(dev.CPU_BF16_ENV, value)
    assert dev.cpu_has_fast_bf16() is (value == "1")
    plan = resolve("cpu", quiet=True)
    assert plan.amp_dtype == amp
    assert f"GPTOPT_CPU_BF16={value}" in plan.reason  # the log line says the environment decided
    assert resolve("cpu", "bf16", quiet=True).amp_dtype == torch.bfloat16  # an explicit ask still wins
    assert ("expect it slower" in resolve("cpu", "bf16", quiet=True).reason) is (value == "0")


@pytest.mark.policy
def test_without_the_override_the_hardware_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dev.CPU_BF16_ENV, raising=False)
    plan = resolve("cpu", quiet=True)
    assert plan.amp_dtype == (torch.bfloat16 if dev.cpu_bf16_detected() else None)
    assert "GPTOPT_CPU_BF16" not in plan.reason
    monkeypatch.setenv(dev.CPU_BF16_ENV, "")  # set but empty, as `GPTOPT_CPU_BF16= cmd` leaves it
    assert resolve("cpu", quiet=True).amp_dtype == plan.amp_dtype


@pytest.mark.parametrize("value", ["yes", "true", "2", "bf16"])
def test_an_invalid_override_names_the_valid_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(dev.CPU_BF16_ENV, value)
    with pytest.raises(ValueError, match=r"GPTOPT_CPU_BF16=.*use 1 .*0 .*or unset it"):
        resolve("cpu", quiet=True)


def test_explicit_dtypes_on_cpu() -> None:
    assert resolve("cpu", "fp32").amp_dtype is None
    assert resolve("cpu", "bf16").amp_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp16 autocast on a CPU"):
        resolve("cpu", "fp16")
    with pytest.raises(ValueError, match="unknown amp dtype"):
        resolve("cpu", "int3")


def test_bad_devices_get_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        resolve("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cpu"):
            resolve("cuda")


def test_autocast_context_casts_matmuls() -> None:
    plan = resolve("cpu", "bf16")
    a = torch.randn(4, 4)
    with plan.autocast():
        assert (a @ a).dtype == torch.bfloat16
    with resolve("cpu", "fp32").autocast():
        assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_gpu_table_matches_device_names(name: str, expected: str) -> None:
    spec = gpu_spec(name)
    assert spec is not None and spec.name == expected


def test_unknown_gpu_is_not_guessed() -> None:
    assert gpu_spec("NVIDIA GeForce GTX 1080") is None


def test_table_peaks_are_dense_figures() -> None:
    # H100 SXM: 989 TFLOP/s dense bf16 (1979 is the sparse figure, which MFU must not use)
    assert gpu_spec("NVIDIA H100 80GB HBM3").bf16 == 989
    assert gpu_spec("Tesla T4").bf16 is None  # Turing has no bf16 tensor cores


def test_cpu_peak_is_measured_labelled_and_cached() -> None:
    plan = resolve("cpu", "bf16")
    flops, source = peak_flops(plan)
    assert flops > 0  # a CPU without native bf16 emulates it, far below 1 GFLOP/s
    assert source.startswith("measured matmul peak (bf16, cpu")
    assert peak_flops(plan)[0] == flops  # cached for the process, not re-measured
    fp32, source32 = peak_flops(plan, torch.float32)
    assert "fp32" in source32 and fp32 > 1e9


def test_environment_record_says_what_it_ran_on() -> None:
    rec = dev.environment(resolve("cpu"))
    for key in ("gptopt", "python", "torch", "cuda", "cudnn", "device", "device_name", "amp_dtype"):
        assert key in rec
    assert rec["torch"] == torch.__version__


def test_measuring_the_peak_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    dev.measured_matmul_flops("cpu", torch.float32, remeasure=True)
    assert torch.equal(torch.rand(3), expected)


def test_a_remeasured_peak_keeps_the_faster_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    speeds = iter([2e11, 1e11, 3e11])  # a slow second must not lower the ceiling MFU is stated against
    monkeypatch.setattr(dev, "_MEASURED", {})
    monkeypatch.setattr(dev, "_measure_matmul", lambda device, dtype: next(speeds))
    plan = resolve("cpu", "fp32", quiet=True)
    assert peak_flops(plan)[0] == 2e11
    assert peak_flops(plan)[0] == 2e11  # cached: nothing measured
    assert peak_flops(plan, remeasure=True)[0] == 2e11  # measured 1e11, kept 2e11
    flops, source = peak_flops(plan, remeasure=True)
    assert flops == 3e11 and "0.3 TFLOP/s" in source


def _in_heap(ptr: int) -> bool:
    """Whether an address lies in the brk heap ([heap] in /proc/self/maps) rather than its own mapping."""
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.mark.skipif(not dev.reuse_host_memory(False), reason="needs Linux with glibc")
def test_host_memory_reuse_serves_large_tensors_from_the_heap_and_can_be_undone() -> None:
    size = 64 * 2**20  # above any mmap threshold glibc picks by itself
    try:
        assert dev.reuse_host_memory()
        big = torch.empty(size, dtype=torch.uint8)
        assert _in_heap(big.data_ptr())  # kept after free, so the next step's tensor finds it mapped
        del big
    finally:
        assert dev.reuse_host_memory(False)
    big = torch.empty(size, dtype=torch.uint8)
    assert not _in_heap(big.data_ptr())  # glibc's default: a fresh mapping, unmapped on free


def test_auto_attention_is_sdpa_except_for_a_bf16_step_on_a_cpu() -> None:
    """`--attention auto`: a CPU step in fp32 runs SDPA (faster there, compiled or not), one under bf16
    autocast the two-block eager kernel (faster compiled); GPUs run SDPA whatever the dtype."""
    assert dev.default_attention("cpu") == "sdpa"
    assert dev.default_attention("cpu", torch.bfloat16) == "eager"
    assert dev.default_attention("cuda", torch.bfloat16) == dev.default_attention("cuda") == "sdpa"
