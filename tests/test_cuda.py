"""GPU checks of the foundation: device policy, table peak, bf16 training step, flash attention.

    pytest -q -m cuda tests/test_cuda.py     # skipped without an NVIDIA GPU
"""

from __future__ import annotations

import pytest
import torch

from gptopt.config import preset
from gptopt.device import gpu_spec, peak_flops, resolve
from gptopt.model import GPT

pytestmark = pytest.mark.cuda


def test_policy_picks_cuda_and_bf16_on_ampere_or_newer() -> None:
    plan = resolve()
    assert plan.device.type == "cuda"
    major, _ = torch.cuda.get_device_capability()
    assert plan.amp_dtype == (torch.bfloat16 if major >= 8 else torch.float16)
    assert plan.use_grad_scaler == (major < 8)


def test_peak_comes_from_the_table_for_known_gpus() -> None:
    plan = resolve()
    flops, source = peak_flops(plan)
    if gpu_spec(torch.cuda.get_device_name()) is not None:
        assert "table peak" in source
    else:
        assert source.startswith("measured matmul peak")
    assert flops > 1e12


def test_bf16_step_on_gpu_matches_fp32_loss() -> None:
    plan = resolve()
    model = GPT(preset("tiny")).to(plan.device)
    idx = torch.randint(0, 8192, (4, 256), device=plan.device)
    with torch.no_grad():
        ref = model(idx, idx).item()
        with plan.autocast():
            amp = model(idx, idx).item()
    assert abs(ref - amp) < 0.05 * ref
    with plan.autocast():
        loss = model(idx, idx)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_flash_attention_kernel_runs_and_matches_eager() -> None:
    plan = resolve()
    if plan.amp_dtype != torch.bfloat16:
        pytest.skip("flash attention needs sm_80+")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = GPT(preset("tiny")).to(plan.device).eval()
    eager = GPT(preset("tiny", attention="eager")).to(plan.device).eval()
    eager.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 8192, (2, 256), device=plan.device)
    with torch.no_grad(), plan.autocast():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = sdpa(idx).float()
        ref = eager(idx).float()
    assert (out - ref).abs().max().item() < 0.1
