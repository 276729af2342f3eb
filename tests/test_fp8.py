"""Float8 training (train --fp8, the bench's fp8 rung): where it runs, where it is refused, and its numerics;
and the bench's other GPU-only lever, SDPA's cuDNN kernel, skipped off CUDA.

    pytest -q tests/test_fp8.py

The CPU emulates float8 matmuls, so the numerics are checked here with the device check lifted; the speed
is a GPU's question (gpu_check's bench step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from gptopt import cli
from gptopt.bench import ladder
from gptopt.commands import train as train_cmd
from gptopt.config import TrainConfig, preset
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.runtime import device
from gptopt.train import loop as train
from gptopt.train.wrap import to_float8

FAST = dict(preset="debug", seq_len=64, batch_size=4, device="cpu", sample_tokens=0, tensorboard=False,
            eval_interval=0, log_interval=1, warmup_steps=2, use_amp=True, amp_dtype="bf16", learning_rate=3e-3)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_float8_is_refused_off_gpus_with_float8_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "compute capability 8.9" in device.fp8_unavailable(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert "NVIDIA A100 is 8.0" in device.fp8_unavailable(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert device.fp8_unavailable(torch.device("cuda")) is None


def test_train_fp8_on_the_cpu_exits_2_with_the_reason_before_writing(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    assert cli.main(["train", "--data_dir", str(train_data), "--output_dir", str(out), "--preset", "debug",
                     "--device", "cpu", "--fp8", "--max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--fp8: float8 training needs an NVIDIA GPU of compute capability 8.9" in err and "drop --fp8" in err
    assert not out.exists()


@pytest.mark.parametrize(("rung", "reason"), [("fp8", "compute capability 8.9"),
                                              ("cudnn_attention", "one of SDPA's CUDA kernels")])
def test_the_bench_skips_the_gpu_only_rungs_with_the_reason(train_data: Path, tmp_path: Path, rung: str,
                                                           reason: str) -> None:
    from gptopt.bench.ladder import Bench
    from gptopt.config import BenchConfig

    bench = Bench(BenchConfig(preset="debug", seq_len=32, batch_size=4, warmup=1, device="cpu",
                              data_dir=str(train_data), output_dir=str(tmp_path / "b")))
    (selected,) = ladder.select_rungs(rung)
    res = bench.run_rung(selected)
    assert res.status == "skipped" and reason in res.note


def test_float8_swaps_the_blocks_linears_and_leaves_the_head_and_the_weights_names() -> None:
    model = GPT(preset("debug", n_embd=64))
    names = set(model.state_dict())
    swapped = to_float8(model)
    assert swapped == 4 * model.config.n_layer  # c_attn, attn.c_proj, c_fc, mlp.c_proj of every block
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    assert set(model.state_dict()) == names  # checkpoints load into a plain GPT


def test_fp8_training_follows_the_bf16_loss_curve_and_saves_a_plain_checkpoint(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train, "fp8_unavailable", lambda dev: None)  # the CPU emulates the float8 matmuls

    def run(out: Path, **kw: Any) -> list[float]:
        cfg = TrainConfig(data_dir=str(train_data), output_dir=str(out), max_steps=12, **{**FAST, **kw})
        assert train_cmd.main(cfg) == 0
        return losses(out)

    bf16, fp8 = run(tmp_path / "bf16"), run(tmp_path / "fp8", fp8=True)
    assert fp8[-1] < fp8[0] - 0.5  # it learns
    assert fp8 == pytest.approx(bf16, rel=0.05)  # float8's rounding, not another run
    saved = checkpoint.load_model(tmp_path / "fp8" / "ckpt-0000012")
    assert type(saved) is GPT and all(type(m) is nn.Linear for m in saved.modules() if isinstance(m, nn.Linear))
