"""The step bench measures is the step train runs: the same losses and gradient norms, step by step.

    pytest -q tests/test_step.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptopt import cli
from gptopt.bench import report
from gptopt.bench.ladder import LADDER, Bench, best_train_config
from gptopt.config import BenchConfig


def _no_compile(model: torch.nn.Module, *args: object, **kwargs: object) -> torch.nn.Module:
    return model


def test_benchs_all_rung_and_train_with_its_best_toml_take_the_same_steps(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compiling is slow on a CPU: both sides run eagerly, while best.toml still says compile = true,
    # so the very settings the bench measured are the ones train reads back.
    monkeypatch.setattr(torch, "compile", _no_compile)
    out = tmp_path / "b"
    cfg = BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu", data_dir=str(train_data),
                      output_dir=str(out))
    summary = Bench(cfg).run([r for r in LADDER if r.name == "all"])
    report.write_all(summary, out, best_train_config(summary))
    (bench_all,) = summary["rungs"]
    assert summary["best"] == "all"
    assert bench_all["config"]["compile"] and bench_all["config"]["fused_optimizer"]
    written = cli.tomllib.loads((out / "best.toml").read_text())
    assert written["compile"] is True and "use_compile" not in written  # the option's name, not its old one

    # every step inside train's 100-step warmup: the learning rate does not depend on max_steps
    n = cfg.warmup + cfg.steps
    assert cli.main(["train", "--config", str(out / "best.toml"), "--output_dir", str(tmp_path / "t"),
                     "--max_steps", str(n), "--log_interval", "1", "--eval_interval", "0", "--sample_tokens", "0",
                     "--device", "cpu", "--no-tensorboard"]) == 0
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, n + 1))
    assert bench_all["losses"] == pytest.approx([r["loss"] for r in steps], rel=1e-5)
    assert bench_all["grad_norms"] == pytest.approx([r["grad_norm"] for r in steps], rel=1e-5)
    assert bench_all["losses"][-1] < bench_all["losses"][0]  # and it learns: the update was applied


def test_a_host_allocation_the_kernel_refuses_is_out_of_memory() -> None:
    from gptopt.runtime.memory_check import is_oom

    # what torch's CPU allocator raises under a cgroup or `ulimit -v` limit (a bench rung reported it as failed)
    refused = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 3276800000 bytes. Error code 12 (Cannot allocate memory)")
    assert is_oom(refused) and is_oom(MemoryError()) and is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    try:  # a terabyte: refused at once under the kernel's default overcommit policy, and never touched
        torch.empty(2**40, dtype=torch.uint8)
    except RuntimeError as e:
        assert is_oom(e)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_step_is_skipped_and_the_fused_adamw_skips_it_without_reading_the_device(fused: bool) -> None:
    from gptopt.config import TrainConfig, preset
    from gptopt.models.gpt import GPT
    from gptopt.runtime.device import resolve
    from gptopt.train.step import TrainStep

    model = GPT(preset("debug"))
    step = TrainStep(model, model, resolve("cpu", "fp32", quiet=True), TrainConfig(fused_optimizer=fused))
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for poison in (True, False):
        loss = model(x, x)
        (loss * float("nan") if poison else loss).backward()
        result = step.update((loss * float("nan") if poison else loss).detach())
        # with the fused kernel the decision stays on the device: nothing was read to make it
        assert result.on_device is fused
        if poison:
            assert not result.finite and result.loss != result.loss
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # no update at all
        else:
            assert result.finite and result.loss == pytest.approx(loss.item())
            assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # this one applied


def test_the_step_runs_sdpa_under_the_one_kernel_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.functional as F

    from gptopt.config import TrainConfig, preset
    from gptopt.models.gpt import GPT
    from gptopt.runtime.device import resolve
    from gptopt.train.step import TrainStep

    seen: list[tuple[bool, bool, bool]] = []

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        b = torch.backends.cuda
        seen.append((b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled()))
        return torch.zeros_like(q)  # the kernels themselves are CUDA's: only which ones may run is checked

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = GPT(preset("debug"))
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    for backend, want in [("cudnn", (False, False, True)), ("flash", (True, False, False))]:
        seen.clear()
        step = TrainStep(model, model, resolve("cpu", "fp32", quiet=True), TrainConfig(sdpa_backend=backend))
        step(0, lambda micro: (x, x))
        assert seen and set(seen) == {want}, backend
    # outside the step, every kernel is allowed again
    b = torch.backends.cuda
    assert (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled()) == (True, True, True)


def test_an_sdpa_kernel_is_refused_off_cuda_and_with_eager_attention(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["train", "--data_dir", str(train_data), "--output_dir", str(tmp_path / "o"), "--preset", "debug",
            "--device", "cpu", "--max_steps", "1", "--sdpa_backend", "cudnn"]
    assert cli.main(base) == 2
    assert "--sdpa_backend cudnn: the cudnn kernel is one of SDPA's CUDA kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # refused as the options are read
        cli.main([*base, "--attention", "eager"])
    assert e.value.code == 2 and "--attention eager does not use SDPA" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_flash_and_cudnn_kernels_are_refused_in_fp32_and_on_old_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from gptopt.runtime.device import sdpa_backend_unavailable

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    for name in ("flash", "cudnn"):
        assert "fp16 or bf16 only" in sdpa_backend_unavailable(name, cuda, None)
        assert sdpa_backend_unavailable(name, cuda, torch.bfloat16) is None
    assert sdpa_backend_unavailable("efficient", cuda, None) is None  # the memory-efficient kernel takes fp32
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8907)
    assert "cuDNN 9 or newer" in sdpa_backend_unavailable("cudnn", cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    assert "compute capability 8.0" in sdpa_backend_unavailable("flash", cuda, torch.float16)
