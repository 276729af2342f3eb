"""GPU checks of the foundation: device policy, table peak, bf16 training step, flash attention.

    pytest -q -m cuda tests/test_cuda.py     # skipped without an NVIDIA GPU
"""

from __future__ import annotations

import pytest
import torch

from gptopt.config import preset
from gptopt.device import gpu_spec, measured_matmul_flops, peak_flops, resolve
from gptopt.model import GPT

pytestmark = pytest.mark.cuda


def test_default_plan_runs_on_the_gpu_in_a_dtype_it_computes_natively() -> None:
    plan = resolve()
    assert plan.device.type == "cuda"
    assert torch.cuda.get_device_name(plan.device) in plan.reason
    a = torch.randn(256, 256, device=plan.device)
    with plan.autocast():
        assert (a @ a).dtype == plan.amp_dtype  # the matmuls really run in 16 bits
    # torch's own answer, not gptopt's rule: bf16 only where the GPU has it, else fp16 with loss scaling
    if torch.cuda.is_bf16_supported(including_emulation=False):
        assert plan.amp_dtype == torch.bfloat16 and not plan.use_grad_scaler
    else:
        assert plan.amp_dtype == torch.float16 and plan.use_grad_scaler


def test_the_peak_is_a_ceiling_a_real_matmul_stays_under() -> None:
    plan = resolve()
    dtype = plan.amp_dtype or torch.float32
    flops, source = peak_flops(plan)
    achieved = measured_matmul_flops(str(plan.device), dtype)  # 8192^3 matmuls for half a second
    if gpu_spec(torch.cuda.get_device_name(plan.device)) is not None:
        assert "table peak" in source
        assert 0.1 * flops < achieved <= flops  # MFU against the table stays under 100%, and the row is this GPU's
    else:
        assert source.startswith("measured matmul peak") and flops == achieved


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
