"""The CPU inference weight layouts (infer/cpu_layout.py) and the inference compile that rely on them.

    pytest -q tests/test_prepare_model.py
    pytest -q -m slow tests/test_prepare_model.py   # the compiled decode's paths (slow: they compile)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import graph_ops, make_varied_model

from gptopt.config import preset
from gptopt.infer.cpu_layout import (
    GEMV_MAX_ROWS,
    CpuLinear,
    bf16_packs,
    gemv_linears,
    inference_layout,
    packed_products,
)
from gptopt.infer.decode_graphs import compile_decode
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.runtime.compile import compile_model
from gptopt.runtime.device import resolve


def _ops(run: Callable[[], Any]) -> tuple[set[str], Any]:
    """The operators run() calls (torch.profiler's names), and what it returns."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = run()
    return {e.name for e in prof.events()}, out


def _pair(vocab: int = 512) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    plain = GPT(preset("debug", vocab_size=vocab)).eval()
    moved = GPT(preset("debug", vocab_size=vocab)).eval()
    moved.load_state_dict(plain.state_dict())
    return plain, moved


def test_cpu_layout_keeps_values_ties_and_state_dict() -> None:
    plain, moved = _pair()
    assert inference_layout(moved, "cpu") is moved
    assert moved.lm_head.weight is moved.transformer.wte.weight  # still one tied Parameter
    linears = [m for m in moved.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    x = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(moved(x), plain(x))
    theirs, ours = plain.state_dict(), moved.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)


def test_cpu_layout_runs_products_of_several_rows_on_a_packed_weight_copies_included() -> None:
    """A prefill or a batched decode step: oneDNN's linear over the packed weight, the plain model's
    values; one row keeps F.linear (the BLAS's matrix-vector path on the column-major weight)."""
    plain, moved = _pair()
    inference_layout(moved, "cpu")
    layer, ref = moved.transformer.h[0].mlp.c_fc, plain.transformer.h[0].mlp.c_fc
    one, many = torch.randn(1, 1, layer.in_features), torch.randn(4, 7, layer.in_features)
    names, got = _ops(lambda: layer(many))
    assert "mkldnn::_linear_pointwise" in names
    names, got_one = _ops(lambda: layer(one))
    assert "mkldnn::_linear_pointwise" not in names
    with torch.no_grad():
        torch.testing.assert_close(got, ref(many))
        torch.testing.assert_close(got_one, ref(one))
        twin = copy.deepcopy(moved)  # bench and tests copy prepared models: the packed weight is repacked
        x = torch.randint(0, 512, (3, 16))
        torch.testing.assert_close(twin(x), plain(x))
        torch.testing.assert_close(moved(x), plain(x))
        # cast afterwards (bf16): the packed fp32 copy no longer applies, F.linear runs on the cast weights
        # (compared at bf16's tolerance: the column-major layout sums in another order, and on a CPU without
        # native bf16 the rounding then differs in the last bits)
        torch.testing.assert_close(moved.to(torch.bfloat16)(x), plain.to(torch.bfloat16)(x))


def test_cpu_layout_applies_an_mlps_gelu_inside_its_packed_product() -> None:
    """A prefill's MLP: c_fc's packed product applies the tanh GELU itself (oneDNN's post-op), with no
    GELU pass of its own, and gives the plain model's values; a single row keeps the GELU apart."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: inference_layout packs nothing")
    plain, moved = _pair()
    inference_layout(moved, "cpu")
    mlp, ref = moved.transformer.h[0].mlp, plain.transformer.h[0].mlp
    many, one = torch.randn(3, 9, mlp.c_fc.in_features), torch.randn(1, 1, mlp.c_fc.in_features)
    names, got = _ops(lambda: mlp(many))
    assert "mkldnn::_linear_pointwise" in names and "aten::gelu" not in names
    names_one, got_one = _ops(lambda: mlp(one))
    assert "aten::gelu" in names_one
    with torch.no_grad():
        torch.testing.assert_close(got, ref(many))
        torch.testing.assert_close(got_one, ref(one))


def test_fp16_weights_are_not_packed_and_bf16_ones_are_where_onednn_runs_bf16() -> None:
    _, moved = _pair()
    inference_layout(moved.to(torch.float16), "cpu")
    assert not any(getattr(m, "packed", None) is not None for m in moved.modules())
    _, moved = _pair()
    inference_layout(moved.to(torch.bfloat16), "cpu")
    assert all((getattr(m, "packed", None) is not None) == bf16_packs() for m in moved.modules()
               if isinstance(m, CpuLinear))
    assert not packed_products(moved)  # a compiled step's bf16 products are inductor's own


def test_layout_saves_and_loads_like_any_model(tmp_path: Path) -> None:
    plain, moved = _pair()
    inference_layout(moved, "cpu")
    checkpoint.save_model(moved, tmp_path / "m")
    back = checkpoint.load_model(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), plain.state_dict().values(), strict=True))


def test_gpu_layout_is_left_alone() -> None:
    _, moved = _pair()
    inference_layout(moved, "cuda")
    assert all(m.weight.is_contiguous() for m in moved.modules() if isinstance(m, torch.nn.Linear))


def test_inference_compile_needs_the_default_mode() -> None:
    with pytest.raises(ValueError, match="default compile mode"):
        compile_model(torch.nn.Linear(2, 2), mode="max-autotune", inference=True)


def test_gemv_linears_multiply_and_sum_small_compiled_batches_only() -> None:
    plain, moved = _pair()
    inference_layout(moved, "cpu")  # column-major first, as load_for_inference leaves them
    assert gemv_linears(moved) is moved
    assert isinstance(moved.lm_head, CpuLinear) and moved.lm_head.weight is moved.transformer.wte.weight
    assert all(m.weight.is_contiguous() for m in moved.modules() if isinstance(m, torch.nn.Linear))
    theirs, ours = plain.state_dict(), moved.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    layer, ref = moved.transformer.h[0].mlp.c_fc, plain.transformer.h[0].mlp.c_fc
    x = torch.randn(GEMV_MAX_ROWS, 1, layer.in_features)  # a decode step's rows, one token each
    with torch.no_grad():
        # eager (a prompt's last row at the lm_head): oneDNN on the packed copy, not the BLAS on row-major weights
        eager_ops, out = _ops(lambda: layer(x))
        assert ("mkldnn::_linear_pointwise" in eager_ops) == packed_products(moved)
        torch.testing.assert_close(out, ref(x))
        ops, out = graph_ops(layer, x)  # compiled: a multiply and a sum, no matmul
        assert {"mul", "sum"} <= ops and "linear" not in ops
        torch.testing.assert_close(out, ref(x))
        # More rows: the GEMM (oneDNN's, on inference_layout's packed weight). From 2 rows the
        # multiply-and-sum lost to it (issue 17: it reads the whole weight once per row, and at 8 rows
        # made the compiled decode slower than the eager one).
        for rows in {2, GEMV_MAX_ROWS + 1}:
            many = torch.randn(rows, 1, layer.in_features)
            ops, out = graph_ops(layer, many)
            assert "packed_linear.default" in ops and "sum" not in ops
            torch.testing.assert_close(out, ref(many))


def test_a_compiled_cpu_decode_keeps_row_major_weights_where_several_rows_use_the_packed_copy() -> None:
    # fp32 with oneDNN: products of several rows multiply the packed copy, so the weights stay
    # row-major for every bucket, and a many-slot Generator's 1-row bucket is the multiply-and-sum.
    _, model = _pair()
    inference_layout(model, "cpu")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert packed_products(model) == torch.backends.mkldnn.is_available()
    compile_decode(model, model, [], torch.device("cpu"), rows=8)  # torch.compile is lazy: nothing compiles here
    if packed_products(model):
        assert all(m.weight.is_contiguous() and m.gemv for m in linears)
    model.to(torch.bfloat16)  # cast after packing: the packed copies no longer serve its products
    assert not packed_products(model)


def test_a_compiled_cpu_decode_without_packed_copies_gets_the_gemm_layout_back() -> None:
    # bench --mode infer sweeps one model through batch 1, 2, 4...: batch 1's multiply-and-sum made
    # the weights row-major, and on them batch 2's compiled GEMMs ran slower than the eager decode
    # (benchmarks/2026-12-02-inference-ladder.md). fp16 weights have no packed copy: their GEMMs read the
    # weights themselves.
    _, model = _pair()
    model.to(torch.float16)
    inference_layout(model, "cpu")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not packed_products(model)
    cpu = torch.device("cpu")
    compile_decode(model, model, [], cpu, rows=GEMV_MAX_ROWS)
    assert all(m.weight.is_contiguous() and m.gemv for m in linears)
    compile_decode(model, model, [], cpu, rows=GEMV_MAX_ROWS + 1)
    # column-major, and no multiply-and-sum along it (much slower than along rows)
    assert all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() and not m.gemv for m in linears)


_MATMULS = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}  # the BLAS, or the packed product


def _decode_ops(gen: Generator, rows: int) -> set[str]:
    """The operators one compiled decode step of `rows` rows runs (after the step that compiles it)."""
    for s in range(rows):
        gen.prefill(s, [3, 1, 4])
    gen.decode(list(range(rows)), [1] * rows, [3] * rows)
    names, _ = _ops(lambda: gen.decode(list(range(rows)), [5] * rows, [4] * rows))
    for s in range(rows):
        gen.free(s)
    return names


@pytest.mark.slow
def test_compiled_cpu_decode_multiplies_and_sums_one_row_and_runs_gemms_at_8() -> None:
    """The path each batch size's compiled CPU decode takes, and the tokens it gives.

    The multiply-and-sum at one row, also in a Generator of many slots (a server with one request running;
    there it ran faster than the GEMM); the GEMM at 8 (at 4 and 8 rows the multiply-and-sum made the compiled
    decode slower than the eager one, issue 17)."""
    cpu = resolve("cpu", quiet=True)
    model = make_varied_model(512)
    few = Generator(copy.deepcopy(model), cpu, max_batch_size=GEMV_MAX_ROWS, max_len=32, compile=True)
    assert not _decode_ops(few, GEMV_MAX_ROWS) & _MATMULS
    prompts = [[5, 17, 99, 4], [42], [7] * 9, [120, 3, 64], [1, 2], [300, 301, 302], [9] * 3, [511, 0]]
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    eager = generate(Generator(copy.deepcopy(model), cpu, max_batch_size=8, max_len=32), prompts, greedy)
    eight = Generator(model, cpu, max_batch_size=8, max_len=32, compile=True)
    assert generate(eight, prompts, greedy) == eager
    if packed_products(model):  # 8 rows on the packed copies, never the BLAS on row-major weights
        assert _decode_ops(eight, 8) & _MATMULS == {"mkldnn::_linear_pointwise"}
        assert not _decode_ops(eight, 1) & _MATMULS
        # an eager prefill of one token: every Linear gets one row, on the packed copy as well
        names, _ = _ops(lambda: eight.prefill(0, [42]))
        eight.free(0)
        assert names & _MATMULS == {"mkldnn::_linear_pointwise"}
    else:
        assert _decode_ops(eight, 8) & _MATMULS
    alone = generate(Generator(copy.deepcopy(model), cpu, max_batch_size=1, max_len=32), prompts[:1], greedy)
    assert generate(eight, prompts[:1], greedy) == alone


def test_gemv_linears_leave_quantised_weights_alone() -> None:
    layer = torch.nn.Linear(8, 4)
    layer.weight = torch.nn.Parameter(torch.randn(4, 8).to(torch.int8), requires_grad=False)
    gemv_linears(layer)
    assert "forward" not in vars(layer)
