"""The one place that applies runtime transforms to a plain model, in a fixed order:
device -> FSDP2 or DDP -> torch.compile. (Quantisation, for inference, swaps modules before compile.)

The model code stays single-device; train, bench and tune all call this.

    python -c "from gptopt.infer.cpu_layout import compile_model; help(compile_model)"
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptopt.models.gpt import MLP, TanhGELU
from gptopt.runtime.device import DevicePlan
from gptopt.train import distributed
from gptopt.train.distributed import DistInfo


@dataclass
class Prepared:
    model: nn.Module  # what the step calls: maybe wrapped, maybe compiled
    raw: nn.Module  # the plain GPT underneath (weights, config, sampling)
    sharded: bool  # FSDP2: parameters are DTensors, state dicts need gathering


def compile_model(model: nn.Module, *, mode: str = "default", fullgraph: bool = False,
                  inference: bool = False, dynamic: bool | None = None) -> nn.Module:
    """torch.compile. inference (default mode only): inductor's freezing, which folds a compiled
    module's weights into the graph as constants (a method that reaches the model through an
    attribute, like Generator's decode step, gets them as inputs still), and fewer guards on the
    modules' attributes (_inference_guards). dynamic: torch.compile's (False: one graph per shape)."""
    if inference:
        if mode != "default":
            raise ValueError(f"an inference compile uses the default compile mode only, not {mode!r}")
        return torch.compile(model, fullgraph=fullgraph, dynamic=dynamic,
                             options={"freezing": True, "guard_filter_fn": _inference_guards})
    # "default" is passed as None: torch.compile's own default, without the mode lookup
    return torch.compile(model, mode=None if mode == "default" else mode, fullgraph=fullgraph, dynamic=dynamic)


# The guards on modules' attributes that an inference graph keeps: their tensors (shape, dtype,
# subclass: another model, or a quantised one, is compiled anew) and their types (swapped modules).
_KEPT_MODULE_GUARDS = frozenset({"TENSOR_MATCH", "TYPE_MATCH", "DUPLICATE_INPUT", "SEQUENCE_LENGTH"})


def _inference_guards(entries: list) -> list[bool]:
    # Dropped: the per-call checks of every module's hooks, attribute dict and constants, which an
    # inference model does not change, and which made a small model's decode step slow to look its
    # graph up (benchmarks/2026-12-02-inference-ladder.md, "After the fused multiply-and-sum decode").
    # Dropping every module guard would be quicker still, but would also run one model's graph on
    # another model's tensors of a different dtype or kind.
    return [not e.orig_guard.source.is_unspecialized_nn_module() or e.guard_type in _KEPT_MODULE_GUARDS
            for e in entries]


def prepare(
    model: nn.Module,
    plan: DevicePlan,
    info: DistInfo,
    *,
    fsdp: bool = False,
    cpu_offload: bool = False,
    compile: bool = False,
    compile_mode: str = "default",
    compile_fullgraph: bool = False,
    fp8: bool = False,
) -> Prepared:
    raw = model
    if fp8:  # before the wrappers: FSDP2 and DDP then see the float8 layers (torchao's order)
        to_float8(model)
    if fsdp:
        if not info.enabled:
            raise ValueError("--fsdp needs torchrun: torchrun --nproc_per_node N -m gptopt train --fsdp ...")
        if not cpu_offload:
            model.to(plan.device)
        model = distributed.wrap_fsdp(model, param_dtype=plan.amp_dtype, cpu_offload=cpu_offload)
    else:
        model.to(plan.device)
        if info.enabled and info.world_size > 1:
            model = distributed.wrap_ddp(model, plan.device)
    if compile:
        model = compile_model(model, mode=compile_mode, fullgraph=compile_fullgraph)
    return Prepared(model=model, raw=raw, sharded=fsdp)


def to_float8(model: nn.Module) -> int:
    """Train the blocks' Linear layers with float8 matmuls: torchao's Float8Linear, in place (dynamic tensorwise
    scales; weights, gradients and optimizer state stay in their dtype, so checkpoints are unchanged). The head
    stays as it is: it is tied to the embedding, and its logits are where float8's range costs the most. A
    layer with a dimension that is not a multiple of 16 stays too (float8 GEMMs need it). Returns how many
    layers were swapped. Needs the 'quant' extra; device.fp8_unavailable says where it pays."""
    from torchao.float8 import convert_to_float8_training

    def swap(module: nn.Module, name: str) -> bool:
        return (name != "lm_head" and isinstance(module, nn.Linear)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    before = sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=swap)
    return sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules()) - before


def inference_layout(model: nn.Module, device_type: str) -> nn.Module:
    """CPU inference: each fp32 Linear's weight stored column-major, in place, plus a oneDNN-packed
    copy for products of several rows. Same values, same parameters and state dict.

    One row (a batch-1 decode step): F.linear multiplies by weight.T; with this layout that operand
    is contiguous, and the CPU BLAS's matrix-vector path runs much faster on it
    (benchmarks/2026-12-04-serving-vs-transformers.md, "The one-row step of a many-slot engine").
    Several rows (a batched decode step, a prefill): oneDNN's linear over a weight reordered once into
    its blocked layout (packed_linear), where the BLAS GEMM repacks it every call, so each Linear and
    the compiled decode step of several rows run faster (benchmarks/2026-12-04-serving-vs-transformers.md,
    "Products of several rows on oneDNN-packed weights"). The packed copy costs the Linear weights'
    memory once more. Eager, on several rows, an MLP's GELU runs inside its first product, as
    oneDNN's post-op (_packed_mlp_forward).

    GPUs' GEMMs take either layout at full speed, so they are left alone. Inference only: the weights
    must not change or train afterwards (the packed copy would not follow, and the optimizer would see
    a strided layout). Quantised and half-precision weights are left as they are.
    """
    if device_type != "cpu":
        return model
    with torch.no_grad():
        for module in _float_linears(model):
            w = module.weight
            if not w.t().is_contiguous():
                w.data = w.data.t().contiguous().t()  # the Parameter object stays: ties (lm_head = wte) hold
            module._gemv = False  # a multiply-and-sum along this layout ran much slower (gemv_linears)
            if not hasattr(module, "_packed"):  # once: a layout change keeps the values the copy holds
                _pack(module)
    for mlp in model.modules():
        if isinstance(mlp, MLP) and isinstance(mlp.gelu, TanhGELU) and hasattr(mlp.c_fc, "_packed"):
            mlp.forward = types.MethodType(_packed_mlp_forward, mlp)
    return model


def _float_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers with plain floating-point weights: quantised ones (tensor subclasses, integers) excluded."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and type(m.weight.data) is torch.Tensor
            and m.weight.is_floating_point() and m.weight.dim() == 2]


# Up to this many rows a compiled CPU Linear is a multiply-and-sum (gemv_linears); from 2 rows the
# GEMM. The sum loops over the rows outermost, so it reads the whole weight once per row (at 8 rows
# tiny's 8 MB lm_head 8 times a step), which a large L3 hides and a small one does not: a 2-core
# Intel Xeon's compiled decode fell behind the eager one at batch 4 and 8 (issue 17). Putting the
# weight's rows outermost, (out, rows), read it once, but inside the whole decode graph inductor then
# vectorised over the 2 rows and ran one kernel over the reduction axis, far slower than the GEMM
# (benchmarks/2026-12-02-inference-ladder.md, "The compiled decode at every batch size"). The weights'
# layout is the model's: compile_decode applies gemv_linears where the products of several rows do
# not read it (packed_products), else to a Generator of one slot only.
GEMV_MAX_ROWS = 1


def gemv_linears(model: nn.Module) -> nn.Module:
    """CPU compiled decode: each float Linear, given at most GEMV_MAX_ROWS rows inside torch.compile,
    computes (x[..., None, :] * weight).sum(-1) + bias over its row-major weight, in place.

    Inductor fuses that into one vectorised, multi-threaded pass over the weight with the bias in its
    epilogue, where the BLAS's matrix-vector path reads the weight at a fraction of this CPU's memory
    bandwidth and leaves the second thread idle (benchmarks/2026-12-02-inference-ladder.md, "After the fused
    multiply-and-sum decode"). Larger batches keep inference_layout's packed product (or F.linear), and
    so do eager one-row calls where there is a packed copy (F.linear otherwise). The weights go back to
    row-major (the sum runs along memory; inference_layout's column-major order made it much slower).
    Inference only, like inference_layout; quantised weights are left as they are. The model's type,
    parameters and state dict are unchanged.
    """
    with torch.no_grad():
        for module in _float_linears(model):
            w = module.weight
            w.data = w.data.contiguous()  # a no-op if already row-major; a tied Parameter stays one
            module._gemv = True
            module.forward = types.MethodType(_inference_forward, module)
    return model


def packed_products(model: nn.Module) -> bool:
    """Whether every float Linear of `model` multiplies several rows by its oneDNN-packed copy
    (inference_layout: fp32 weights, oneDNN present), so that its weight's own layout serves compiled
    one-row products only."""
    linears = _float_linears(model)
    return torch.backends.mkldnn.is_available() and bool(linears) and all(
        hasattr(m, "_packed") and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" for m in linears)


@torch.library.custom_op("gptopt::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias, W given as torch.ops.mkldnn._reorder_linear_weight(W) (oneDNN's blocked layout).

    An operator of gptopt's own so that torch.compile calls it as one opaque kernel: inductor has no
    lowering of the oneDNN linear for a packed weight that is a graph input (it packs only weights it
    froze itself, and fp32 ones through the BLAS)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class _Packed:
    """A Linear's oneDNN-packed weight. Held in this box so that copy.deepcopy of a model (bench,
    tests) repacks it: the packed tensor itself has no storage to copy."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __deepcopy__(self, memo: dict[int, object]) -> _Packed:
        return _Packed(torch.ops.mkldnn._reorder_linear_weight(self.weight.to_dense()))


def _pack(module: nn.Linear) -> None:
    if module.weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return  # half precision keeps the BLAS (oneDNN's bf16 path depends on the CPU's bf16 support)
    module._packed = _Packed(torch.ops.mkldnn._reorder_linear_weight(module.weight.detach().contiguous()))
    module.forward = types.MethodType(_inference_forward, module)


def _packed_for(self: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """The Linear's packed weight if it still serves x; None without one, or for a model (or this layer)
    cast or moved since it was packed."""
    packed, w = getattr(self, "_packed", None), self.weight
    if packed is None or x.dtype != torch.float32 or x.device.type != "cpu" or w.dtype != torch.float32 \
            or w.device.type != "cpu":
        return None
    return packed.weight


def _one_row(x: torch.Tensor) -> bool:
    """At most GEMV_MAX_ROWS rows: a matrix-vector product."""
    return x.numel() <= GEMV_MAX_ROWS * x.shape[-1]


def _inference_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    one, row_major = _one_row(x), getattr(self, "_gemv", False)
    if one and row_major and torch.compiler.is_compiling():
        y = (x.unsqueeze(-2) * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias
    # One row on column-major weights: the BLAS's matrix-vector path, which reads them fastest. One
    # eager row on row-major ones (a prompt's last position at the lm_head) takes the packed copy: the
    # BLAS's product on them ran slower than oneDNN's on the copy with two threads, over shapes of
    # tiny's and gpt2's, and slower than on column-major weights too
    # (benchmarks/2026-12-04-serving-vs-transformers.md, "The one-row step of a many-slot engine").
    packed = None if one and not row_major else _packed_for(self, x)
    if packed is None:
        return F.linear(x, self.weight, self.bias)
    if torch.compiler.is_compiling():
        return packed_linear(x, packed, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")  # no custom-op dispatch


def _packed_mlp_forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
    """MLP.forward with the GELU applied by oneDNN inside c_fc's packed product (its tanh GELU post-op),
    eager and for several rows; compiled steps (inductor fuses the GELU itself) and one row keep
    MLP.forward. The separate GELU was a pass of its own over the widest activation, and c_fc with the
    post-op costs less than the product and the GELU apart (benchmarks/2026-12-04-serving-vs-transformers.md,
    "The GELU inside the prefill's first product"); the values differ in their last bits only."""
    packed = None
    if not torch.compiler.is_compiling() and not _one_row(x):
        packed = _packed_for(self.c_fc, x)
    if packed is None:
        return MLP.forward(self, x)
    h = torch.ops.mkldnn._linear_pointwise(x, packed, self.c_fc.bias, "gelu", [], "tanh")
    return self.dropout(self.c_proj(h))


def graph_break_reason(exc: BaseException) -> str | None:
    """The reason torch.compile gave up under fullgraph=True, or None if exc is something else."""
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover
        return None
    kinds = tuple(k for k in (getattr(dynamo_exc, "Unsupported", None), getattr(dynamo_exc, "UserError", None)) if k)
    if isinstance(exc, kinds):
        return str(exc).strip().splitlines()[0]
    return None

