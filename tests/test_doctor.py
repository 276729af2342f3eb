"""gptopt doctor: verdicts and fixes from synthetic facts, and the real command on this machine.

    pytest -q tests/test_doctor.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import pytest
import torch

from gptopt.cli import main
from gptopt.commands import doctor
from gptopt.commands.doctor import GPU, Check, Facts, checks
from gptopt.config import GPTConfig, preset
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.train import step_memory

GiB = 1024**3
ALL_EXTRAS = {"hf": True, "serve": True, "plot": True, "gpu": True, "quant": True, "data": True}


def healthy_cpu(**overrides: Any) -> Facts:
    base = Facts(
        os_name="Linux", os_detail="Linux-6.1-x86_64", torch_version="2.13.0+cpu", cxx="/usr/bin/g++",
        cc="/usr/bin/cc", cpu_model="Test CPU", cpu_logical=8, cpu_usable=8, cpu_physical=4, torch_threads=8,
        ram_total=64 * GiB, ram_available=48 * GiB, disk_path="/data", disk_free=500 * GiB,
        extras=dict(ALL_EXTRAS), device="cpu", device_reason="device cpu: fp32",
    )
    return dataclasses.replace(base, **overrides)


H100 = GPU(index=0, name="NVIDIA H100 80GB HBM3", memory_total=80 * GiB, memory_free=79 * GiB,
           capability=(9, 0))
ARCHS_CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def healthy_gpu(**overrides: Any) -> Facts:
    base = healthy_cpu(
        torch_version="2.13.0+cu126", torch_cuda="12.6", cuda_available=True, cudnn=91000,
        arch_list=ARCHS_CU126, flash_build=True, gpus=[H100], driver="560.35.03", driver_cuda="12.6",
        driver_source="nvml",
        driver_gpus=[dataclasses.replace(H100, capability=None, memory_free=None)], nccl="2.21.5",
        triton="3.1.0", device="cuda:0", device_reason="device cuda:0: bf16",
    )
    return dataclasses.replace(base, **overrides)


def by_name(results: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in results}


def statuses(results: list[Check]) -> set[str]:
    return {c.status for c in results}


def test_healthy_machines_give_no_warning_or_failure() -> None:
    for facts in (healthy_cpu(), healthy_gpu()):
        results = checks(facts, "tiny")
        assert statuses(results) == {"ok"}, [c for c in results if c.status != "ok"]
    gpu0 = by_name(checks(healthy_gpu(), "gpt2"))["gpu0"].value
    assert "sm_90" in gpu0 and "bf16 yes" in gpu0 and "flash attention yes" in gpu0


def test_pre_ampere_gpu_reports_no_bf16_and_no_flash() -> None:
    t4 = GPU(index=0, name="Tesla T4", memory_total=16 * GiB, memory_free=15 * GiB, capability=(7, 5))
    gpu0 = by_name(checks(healthy_gpu(gpus=[t4]), "tiny"))["gpu0"]
    assert gpu0.status == "ok"
    assert "bf16 no" in gpu0.value and "TF32 no" in gpu0.value and "flash attention no" in gpu0.value


@pytest.mark.parametrize(("driver_cuda", "tag"), [("12.4", "cu124"), ("12.8", "cu128"), (None, "cu126")])
def test_cpu_torch_on_a_gpu_machine_fails_with_the_cuda_reinstall(driver_cuda: str | None, tag: str) -> None:
    facts = healthy_cpu(driver="550.54.15", driver_cuda=driver_cuda, driver_source="nvidia-smi",
                        driver_gpus=[GPU(index=0, name="NVIDIA A100-SXM4-40GB", memory_total=40 * GiB)])
    torch_check = by_name(checks(facts, "tiny"))["torch"]
    assert torch_check.status == "fail"
    assert "A100" in torch_check.value
    url = f"https://download.pytorch.org/whl/{tag}"
    assert f"pip install --force-reinstall torch --index-url {url}" in torch_check.fix


def test_driver_older_than_torch_cuda_fails_with_both_fixes() -> None:
    facts = healthy_gpu(torch_cuda="12.8", cuda_available=False, gpus=[], cuda_error="driver too old",
                        driver_cuda="11.8")
    results = by_name(checks(facts, "tiny"))
    assert results["driver"].status == "fail"
    assert "upgrade the NVIDIA driver" in results["driver"].fix
    assert "whl/cu118" in results["driver"].fix
    assert results["cuda"].status == "fail" and "driver too old" in results["cuda"].value


def test_driver_one_minor_behind_that_still_runs_is_a_warning() -> None:
    # CUDA minor-version compatibility: a 12.4 driver runs a 12.6 torch, minus some features.
    driver = by_name(checks(healthy_gpu(driver_cuda="12.4"), "tiny"))["driver"]
    assert driver.status == "warn" and "whl/cu124" in driver.fix


def test_gpu_newer_than_the_build_fails_with_a_build_that_has_its_kernels() -> None:
    b200 = GPU(index=0, name="NVIDIA B200", memory_total=180 * GiB, memory_free=179 * GiB, capability=(10, 0))
    gpu0 = by_name(checks(healthy_gpu(gpus=[b200], driver_cuda="12.8"), "tiny"))["gpu0"]
    assert gpu0.status == "fail"
    assert "sm_100" in gpu0.fix and "whl/cu128" in gpu0.fix


def test_gpu_older_than_the_build_fails_with_the_cuda_12_6_build() -> None:
    p100 = GPU(index=0, name="Tesla P100", memory_total=16 * GiB, memory_free=15 * GiB, capability=(6, 0))
    archs = ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"]
    facts = healthy_gpu(gpus=[p100], torch_cuda="12.8", arch_list=archs, driver_cuda="12.8")
    gpu0 = by_name(checks(facts, "tiny"))["gpu0"]
    assert gpu0.status == "fail" and "whl/cu126" in gpu0.fix


@pytest.mark.parametrize(
    ("cap", "archs", "ok"),
    [
        ((8, 6), ["sm_80"], True),  # cubins run on later minors of the same major
        ((8, 0), ["sm_86"], False),  # ... but not on earlier ones
        ((9, 0), ["sm_80", "compute_80"], True),  # PTX JIT-compiles forward
        ((9, 0), ["sm_80"], False),  # cubins never cross majors
        ((10, 0), ["sm_90a"], False),  # arch-specific code runs on its own chip only
        ((9, 0), ["sm_90a"], True),
        ((12, 0), ["sm_120"], True),  # three-digit capability parsing
    ],
)
def test_arch_support_follows_cuda_compatibility_rules(cap: tuple[int, int], archs: list[str],
                                                        ok: bool) -> None:
    assert doctor.arch_supported(cap, archs) is ok


def test_rocm_build_is_not_judged_by_cuda_arch_names() -> None:
    mi300 = GPU(index=0, name="AMD Instinct MI300X", memory_total=192 * GiB, memory_free=190 * GiB,
                capability=(9, 4))
    facts = healthy_cpu(torch_hip="6.2", cuda_available=True, gpus=[mi300], arch_list=["gfx942"],
                        device="cuda:0")
    assert by_name(checks(facts, "tiny"))["gpu0"].status == "ok"


def test_windows_warns_that_torch_compile_is_unavailable() -> None:
    os_check = by_name(checks(healthy_cpu(os_name="Windows", os_detail="Windows-11"), "tiny"))["os"]
    assert os_check.status == "warn" and "WSL2" in os_check.fix


def test_disk_too_small_for_the_preset_fails_and_names_one_that_fits() -> None:
    need = doctor.disk_bytes(preset("gpt2-xl"))
    low = by_name(checks(healthy_cpu(disk_free=10 * GiB), "gpt2-xl"))["disk"]
    assert low.status == "fail"
    assert "(--preset gpt2)" in low.fix  # 10 GiB holds gpt2's checkpoints with room, not gpt2-medium's
    tight = by_name(checks(healthy_cpu(disk_free=int(1.2 * need)), "gpt2-xl"))["disk"]
    assert tight.status == "warn"
    assert by_name(checks(healthy_cpu(disk_free=2 * need), "gpt2-xl"))["disk"].status == "ok"


def test_too_little_ram_to_train_on_cpu_fails() -> None:
    ram = by_name(checks(healthy_cpu(ram_available=4 * GiB), "gpt2-xl"))["ram"]
    assert ram.status == "fail" and "--preset" in ram.fix


def test_a_long_context_preset_is_sized_at_a_stated_length_not_its_whole_context() -> None:
    # Qwen3-0.6B's context is 40,960 tokens: a step of it at batch 1 fits a 32 GiB machine at 2,048 tokens, and
    # the check says at which length it sized the step and how to ask for another
    ram = by_name(checks(healthy_cpu(ram_available=32 * GiB), "qwen3-0.6b"))["ram"]
    assert ram.status != "fail", ram
    assert "batch 1 x 2,048 tokens of the 40,960-token context" in ram.value and "--seq_len" in ram.value
    whole = by_name(checks(healthy_cpu(ram_available=32 * GiB), "qwen3-0.6b", seq_len=40960))["ram"]
    assert whole.status == "fail" and "batch 1 x 40,960 tokens in fp32" in whole.value
    # a preset whose context is shorter than the default length is sized at its context
    assert "batch 1 x 1,024 tokens in fp32" in by_name(checks(healthy_cpu(), "gpt2"))["ram"].value


@pytest.mark.parametrize("name", ["gpt2", "smollm2-135m", "qwen3-0.6b"])
def test_the_memory_checks_need_what_train_refuses_a_batch_1_step_against(name: str) -> None:
    # the family's own shape (grouped-query heads, head size apart from the width, SwiGLU's width) as the
    # training step's estimate counts it, so doctor and `gptopt train --batch_size 1 --seq_len T` agree
    cfg = preset(name)
    T = min(cfg.block_size, 2048)
    step = min(step_memory.train_step_bytes(dataclasses.replace(cfg, loss=loss), 1, T).total
               for loss in ("full", "chunked"))
    have = int(1.2 * step)  # room for the step, less than the 1.5x an ok asks
    assert by_name(checks(healthy_cpu(ram_available=have), name))["ram"].status == "warn"
    assert by_name(checks(healthy_cpu(ram_available=step - 1), name))["ram"].status == "fail"


def test_a_sequence_longer_than_the_presets_context_is_refused_before_any_check(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["doctor", "--preset", "tiny", "--seq_len", "4096"])
    assert stop.value.code == 2
    assert "--seq_len 4096 exceeds --preset tiny's context of 256 tokens" in capsys.readouterr().err


def test_too_little_gpu_memory_for_the_preset_fails() -> None:
    small = GPU(index=0, name="NVIDIA L4", memory_total=24 * GiB, memory_free=8 * GiB, capability=(8, 9))
    results = by_name(checks(healthy_gpu(gpus=[small]), "gpt2-xl"))
    assert results["gpu memory"].status == "fail"
    assert "gptopt train --fsdp" in results["gpu memory"].fix
    assert results["ram"].status == "ok"  # on a GPU the host only stages weights, 48 GiB is plenty


def test_omp_threads_above_the_cores_warns() -> None:
    threads = by_name(checks(healthy_cpu(env={"OMP_NUM_THREADS": "32"}), "tiny"))["threads"]
    assert threads.status == "warn" and "export OMP_NUM_THREADS=8" in threads.fix
    assert "threads" not in by_name(checks(healthy_cpu(env={"OMP_NUM_THREADS": "8"}), "tiny"))


@pytest.mark.parametrize(("native", "env", "status", "autocast"), [
    (True, {}, "ok", "bf16"),
    (False, {}, "ok", "fp32"),
    (True, {"GPTOPT_CPU_BF16": "1"}, "ok", "bf16"),
    (True, {"GPTOPT_CPU_BF16": "0"}, "warn", "fp32"),  # a fast CPU run as a slow one: on purpose only
    (False, {"GPTOPT_CPU_BF16": "1"}, "warn", "bf16"),
])
def test_cpu_bf16_line_says_what_decides_the_cpu_autocast(native: bool, env: dict[str, str], status: str,
                                                           autocast: str) -> None:
    line = by_name(checks(healthy_cpu(cpu_bf16=native, env=env), "tiny"))["cpu bf16"]
    assert line.status == status
    assert line.value.endswith(f"CPU autocast uses {autocast}")
    assert ("GPTOPT_CPU_BF16" in line.value) is bool(env)
    assert ("unset GPTOPT_CPU_BF16" in line.fix) is (status == "warn")


def test_invalid_cpu_bf16_override_fails_with_the_valid_values() -> None:
    results = by_name(checks(healthy_cpu(cpu_bf16=True, env={"GPTOPT_CPU_BF16": "yes"}), "tiny"))
    assert results["cpu bf16"].status == "fail"
    assert "GPTOPT_CPU_BF16=1 or GPTOPT_CPU_BF16=0" in results["cpu bf16"].fix


def test_the_cpu_bf16_override_is_listed_with_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTOPT_CPU_BF16", "0")
    facts = doctor.probe(None)
    assert facts.env["GPTOPT_CPU_BF16"] == "0"
    assert "GPTOPT_CPU_BF16=0" in by_name(checks(facts, "tiny"))["env"].value


def test_missing_compiler_warns_that_cpu_compile_fails() -> None:
    compiler = by_name(checks(healthy_cpu(cxx=None), "tiny"))["compiler"]
    assert compiler.status == "warn" and "build-essential" in compiler.fix


def test_missing_extras_are_informational_with_the_install_line() -> None:
    extras = dict(ALL_EXTRAS, hf=False, serve=False)
    results = checks(healthy_cpu(extras=extras), "tiny")
    assert by_name(results)["extras"].status == "ok"
    assert "pip install 'gptopt[hf,serve]'" in by_name(results)["extras"].fix
    gpu_extra = by_name(checks(healthy_gpu(extras=dict(ALL_EXTRAS, gpu=False)), "tiny"))["extras"]
    assert gpu_extra.status == "warn" and "gptopt[gpu]" in gpu_extra.fix


def test_env_hiding_every_gpu_warns() -> None:
    env = by_name(checks(healthy_gpu(env={"CUDA_VISIBLE_DEVICES": ""}), "tiny"))["env"]
    assert env.status == "warn" and "CUDA_VISIBLE_DEVICES" in env.fix


def test_impossible_device_is_a_failure_not_a_crash() -> None:
    device = by_name(checks(healthy_cpu(device=None, device_error="CUDA is not available"), "tiny"))["device"]
    assert device.status == "fail" and "--device cpu" in device.fix


NO_BIAS_PADDED = GPTConfig(**{**preset("debug").to_dict(), "bias": False, "vocab_pad_multiple": 64})


@pytest.mark.parametrize("cfg", [preset("debug"), preset("tiny"), NO_BIAS_PADDED])
def test_param_count_matches_the_model(cfg: GPTConfig) -> None:
    assert doctor.param_count(cfg) == GPT(cfg).num_params()


def test_nvidia_smi_is_parsed_when_nvml_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setattr(doctor.shutil, "which", lambda name: f"/usr/bin/{name}")
    answers = {
        "--query-gpu=name,driver_version,memory.total": "NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB\n"
                                                        "NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB\n",
        "": "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |\n",
    }
    monkeypatch.setattr(doctor, "_run", lambda cmd: answers[cmd[1] if len(cmd) > 1 else ""])
    found = doctor.probe_driver()
    assert found["driver"] == "550.54.15" and found["driver_cuda"] == "12.4"
    assert found["driver_source"] == "nvidia-smi"
    assert [g.memory_total for g in found["driver_gpus"]] == [81559 * 1024**2] * 2


def test_a_hung_command_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "SMI_TIMEOUT_S", 0.2)
    assert doctor._run([sys.executable, "-c", "import time; time.sleep(30)"]) is None


def test_smoke_failure_is_a_failed_check() -> None:
    # A device where nothing can run (meta tensors have no data) must report, not raise.
    plan = DevicePlan(device=torch.device("meta"), amp_dtype=None, use_grad_scaler=False, tf32=False,
                      reason="meta")
    result = doctor.smoke(plan)
    assert result["passed"] is False and result["error"]
    assert doctor.smoke_check(result).status == "fail"


# ----------------------------------------------------------------------------------------------
# The real command, through the CLI.


@pytest.mark.policy
def test_json_smoke_on_cpu_is_one_document_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["doctor", "--json", "--smoke", "--device", "cpu"])
    doc = json.loads(capsys.readouterr().out)  # raises if anything else shared stdout
    assert doc["smoke"]["passed"] is True and doc["smoke"]["finite"] is True
    assert by_name([Check(**c) for c in doc["checks"]])["smoke"].status == "ok"
    assert doc["facts"]["torch_version"] == torch.__version__
    assert doc["environment"]["device"] == "cpu"
    assert doc["summary"]["fail"] == 0 and doc["summary"]["exit_status"] == status == 0


def test_table_names_torch_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out and "0 fail" in out


def test_a_failing_check_exits_1_and_prints_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    broken = healthy_cpu(driver="550.54.15", driver_cuda="12.4",
                         driver_gpus=[GPU(index=0, name="NVIDIA L4", memory_total=24 * GiB)])
    monkeypatch.setattr(doctor, "probe", lambda plan, error=None: broken)
    assert main(["doctor", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] torch" in out and "whl/cu124" in out
    assert main(["doctor", "--device", "cpu", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["summary"]["exit_status"] == 1


@pytest.mark.cuda
def test_gpu_machine_reports_its_gpu_and_trains_on_it(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["doctor", "--json", "--smoke", "--device", "cuda"])
    doc = json.loads(capsys.readouterr().out)
    found = by_name([Check(**c) for c in doc["checks"]])
    assert doc["facts"]["gpus"] and found["gpu0"].status == "ok"
    assert torch.cuda.get_device_name(0) in found["gpu0"].value
    assert doc["facts"]["driver"] and found["driver"].status != "fail"
    assert doc["smoke"]["passed"] is True and doc["smoke"]["device"].startswith("cuda")
    assert status == 0, [c for c in found.values() if c.status == "fail"]
