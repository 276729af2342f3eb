"""The runtime transforms of prepare_model.py that inference relies on.

    pytest -q tests/test_prepare_model.py
    pytest -q -m slow tests/test_prepare_model.py   # the compiled decode's paths (about 30 s)
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import graph_ops, make_varied_model

from gptopt import checkpoint
from gptopt.config import preset
from gptopt.device import resolve
from gptopt.generate import Generator, SamplingParams, generate
from gptopt.model import GPT
from gptopt.prepare_model import GEMV_MAX_ROWS, compile_model, gemv_linears, inference_layout


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
    assert type(moved.lm_head) is torch.nn.Linear and moved.lm_head.weight is moved.transformer.wte.weight
    assert all(m.weight.is_contiguous() for m in moved.modules() if isinstance(m, torch.nn.Linear))
    theirs, ours = plain.state_dict(), moved.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    layer, ref = moved.transformer.h[0].mlp.c_fc, plain.transformer.h[0].mlp.c_fc
    x = torch.randn(GEMV_MAX_ROWS, 1, layer.in_features)  # a decode step's rows, one token each
    with torch.no_grad():
        assert torch.equal(layer(x), ref(x))  # eager: F.linear itself
        ops, out = graph_ops(layer, x)  # compiled: a multiply and a sum, no matmul
        assert {"mul", "sum"} <= ops and "linear" not in ops
        torch.testing.assert_close(out, ref(x))
        many = torch.randn(GEMV_MAX_ROWS + 1, 1, layer.in_features)  # more rows than the GEMV path takes
        ops, out = graph_ops(layer, many)
        assert "linear" in ops and "sum" not in ops
        torch.testing.assert_close(out, ref(many))


def test_gemv_reads_each_weight_row_once_for_all_rows() -> None:
    # Inductor loops over a reduction's output in its dims' order. With the rows first, (rows, out),
    # the loop streamed the whole weight once per row: at 8 rows the tiny model's 8 MB lm_head was
    # read 8 times a step, and the compiled decode fell behind the eager one (issue 17). With the
    # weight's rows first, (out, rows), each weight row is read once and used for every row of x.
    layer = gemv_linears(torch.nn.Linear(32, 48))
    x = torch.randn(max(GEMV_MAX_ROWS, 2), 1, 32)
    shapes: list[tuple[int, ...]] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        shapes.extend(tuple(n.meta["example_value"].shape) for n in gm.graph.nodes
                      if n.op in ("call_method", "call_function") and getattr(n.target, "__name__", n.target) == "sum")
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, backend=backend)(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert shapes == [(48, x.shape[0])]


_MATMULS = {"aten::mm", "aten::addmm"}


def _decode_ops(gen: Generator, rows: int) -> set[str]:
    """The operators one compiled decode step of `rows` rows runs (after the step that compiles it)."""
    for s in range(rows):
        gen.prefill(s, [3, 1, 4])
    gen.decode(list(range(rows)), [1] * rows, [3] * rows)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gen.decode(list(range(rows)), [5] * rows, [4] * rows)
    for s in range(rows):
        gen.free(s)
    return {e.name for e in prof.events()}


@pytest.mark.slow
def test_compiled_cpu_decode_multiplies_and_sums_few_rows_and_runs_gemms_at_8() -> None:
    """The path each batch size's compiled CPU decode takes, and the tokens it gives at batch 8.

    Measured on a 2-core AMD EPYC (tiny preset, one process, eager and compiled interleaved): the
    fused multiply-and-sum beats the GEMM at 1 and 2 rows; from 4 rows the GEMM is as fast or faster."""
    cpu = resolve("cpu", quiet=True)
    model = make_varied_model(512)
    few = Generator(copy.deepcopy(model), cpu, max_batch_size=GEMV_MAX_ROWS, max_len=32, compile=True)
    assert not _decode_ops(few, GEMV_MAX_ROWS) & _MATMULS
    prompts = [[5, 17, 99, 4], [42], [7] * 9, [120, 3, 64], [1, 2], [300, 301, 302], [9] * 3, [511, 0]]
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    eager = generate(Generator(copy.deepcopy(model), cpu, max_batch_size=8, max_len=32), prompts, greedy)
    eight = Generator(model, cpu, max_batch_size=8, max_len=32, compile=True)
    assert generate(eight, prompts, greedy) == eager
    assert _decode_ops(eight, 8) & _MATMULS


def test_gemv_linears_leave_quantised_weights_alone() -> None:
    layer = torch.nn.Linear(8, 4)
    layer.weight = torch.nn.Parameter(torch.randn(4, 8).to(torch.int8), requires_grad=False)
    gemv_linears(layer)
    assert "forward" not in vars(layer)
