"""The CPU inference fusions of the Llama- and Qwen3-shaped models: the fused block kernels (infer/cpu_fused.py over
infer/cpu_kernels.py), the stacked gate-and-up product and bf16 weights packed for oneDNN (infer/cpu_layout.py), and
the default weights dtype that chooses them (infer/load.py).

    pytest -q tests/test_cpu_fused.py
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import make_varied_model

from gptopt.infer import cpu_kernels, paged_attention
from gptopt.infer.cpu_fused import FusedAttention, FusedNormBlock, FusedRMSNorm, fused_blocks
from gptopt.infer.cpu_layout import CpuLinear, PackedSwiGLU, bf16_packs, inference_layout, packable
from gptopt.infer.generator import Generator
from gptopt.infer.load import weights_dtype
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.runtime.device import cpu_has_fast_bf16, resolve

needs_kernels = pytest.mark.skipif(cpu_kernels.extension() is None, reason="the CPU kernels could not be built here")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not bf16_packs(), reason="oneDNN runs no bf16 linear on this CPU"))]


def _pair(family: str, dtype: torch.dtype, **first: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same random model twice in `dtype`, the first laid out with `first`'s switches, the second with all."""
    model = make_varied_model(300, family)
    with torch.no_grad():  # norm weights away from 1, so that a norm that skipped its weight would show
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
    a, b = copy.deepcopy(model).to(dtype), copy.deepcopy(model).to(dtype)
    return inference_layout(a, "cpu", **first), inference_layout(b, "cpu")


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to the rounding of the dtype: the kernels compute in fp32 and store what aten stores, but a sum's
    order may differ in its last bits (and one bf16 rounding apart grows through the layers)."""
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (a.float() - b.float()).abs().max().item() <= tol * max(1.0, a.float().abs().max().item())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_fused_blocks_give_the_aten_blocks_logits_and_leave_the_state_dict_alone(family: str,
                                                                                     dtype: torch.dtype) -> None:
    plain, fused = _pair(family, dtype, fuse=False)
    assert not fused_blocks(plain) and fused_blocks(fused)
    assert isinstance(fused.transformer.h[0].attn, FusedAttention) and isinstance(fused.transformer.ln_f, FusedRMSNorm)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    idx = torch.randint(0, 300, (3, 11))
    with torch.inference_mode():
        _close(plain(idx), fused(idx), dtype)
        # positions per row (a decode step's), where each row takes its own rotary angles
        pos = torch.tensor([[3], [7], [10]])
        _close(plain(idx[:, :1], pos=pos), fused(idx[:, :1], pos=pos), dtype)


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_fused_model_decodes_the_tokens_of_the_aten_one(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # its decode steps write their keys and values and attend straight from c_attn's output (attend_qkv), rows of
    # different lengths in one step
    plain, fused = _pair(family, torch.float32, fuse=False)
    calls = []
    direct = paged_attention.decode_attention_qkv
    monkeypatch.setattr(paged_attention, "decode_attention_qkv", lambda *a: calls.append(1) or direct(*a))
    plan = resolve("cpu", "fp32", quiet=True)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompts = [[5, 9, 2, 7], [11, 3, 8, 1, 4, 6, 13, 2, 9, 9, 1, 5, 7, 3, 2, 8, 4]]  # the second past a block
    outs = [generate(Generator(m, plan, max_batch_size=2, max_len=64), prompts, greedy) for m in (plain, fused)]
    assert outs[0] == outs[1] and len(set(outs[1][0])) > 3
    assert len(calls) == 11 * fused.config.n_layer  # every decode step of every layer (the first token: prefill)


@needs_kernels
def test_a_fused_block_adds_in_place_only_where_no_gradient_is_wanted() -> None:
    _, fused = _pair("llama", torch.float32)
    block = fused.transformer.h[0]
    assert isinstance(block, FusedNormBlock)
    x = torch.randn(2, 5, 64)
    hs = block.attn.hs
    rope = (torch.ones(5, hs), torch.zeros(5, hs))  # angle 0: rotary leaves the heads as they are
    kept = x.clone()
    with torch.inference_mode():
        y = block(x, rope=rope)
    assert y.data_ptr() == x.data_ptr()  # the residual stream, updated in place
    # a tensor whose gradient is wanted takes the aten path: its input is left as it was, and the values agree
    x2 = kept.clone().requires_grad_(True)
    y2 = block(x2, rope=rope)
    assert torch.equal(x2.detach(), kept) and y2.requires_grad
    _close(y2.detach(), y, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_and_up_run_as_one_packed_product_with_the_mlps_values(dtype: torch.dtype) -> None:
    stacked, apart = _pair("llama", dtype, stack=True)  # kept apart by default
    mlp = stacked.transformer.h[0].mlp
    assert isinstance(mlp, PackedSwiGLU) and not isinstance(apart.transformer.h[0].mlp, PackedSwiGLU)
    assert {"c_gate.weight", "c_fc.weight"} <= set(mlp.state_dict())  # checkpoints and exports see no change
    x = torch.randn(4, 64).to(dtype)
    with torch.inference_mode():
        _close(apart.transformer.h[0].mlp(x), mlp(x), dtype)
        # cast after packing, the stale copy is never used: the layer computes from its weights
        moved = copy.deepcopy(mlp).to(torch.float64)
        want = moved.c_proj(F.silu(moved.c_gate(x.double())) * moved.c_fc(x.double()))
        torch.testing.assert_close(moved(x.double()), want)


@pytest.mark.skipif(not bf16_packs(), reason="oneDNN runs no bf16 linear on this CPU")
def test_bf16_linears_get_a_packed_copy_that_serves_any_rows() -> None:
    layer = CpuLinear.convert(torch.nn.Linear(64, 48).to(torch.bfloat16))
    layer.pack()
    assert packable(torch.bfloat16) and layer.packed is not None
    for rows in (1, 5):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert layer.packed_for(x) is not None
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()),
                                   rtol=0.02, atol=0.02)
    assert layer.packed_for(torch.randn(2, 64)) is None  # fp32 rows are not the packed weight's


@pytest.mark.policy
def test_auto_weights_are_bf16_on_a_cpu_with_native_bf16_and_fp32_where_quantised_or_without() -> None:
    plan = resolve("cpu", quiet=True)
    want = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert weights_dtype("auto", plan) == want
    assert weights_dtype("auto", plan, quantized=True) == torch.float32  # the int8 kernels take fp32 activations
    assert weights_dtype("fp32", plan) == torch.float32 and weights_dtype("bf16", plan) == torch.bfloat16
