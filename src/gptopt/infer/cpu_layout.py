"""The CPU inference weight layouts, as module types of their own: CpuLinear (an nn.Linear whose weight is
stored in the layout its products read fastest, with a oneDNN-packed copy for products of several rows, or of
any rows in bf16), PackedGeluMLP (GPT-2's MLP with its GELU inside c_fc's packed product) and PackedSwiGLU
(Llama's and Qwen3's MLP with its gate and up projections packed as one product).

    python -c "from gptopt.infer.cpu_layout import inference_layout; help(inference_layout)"

A layer converts in place (its class becomes the subclass: the same Parameter objects, so tied weights stay
tied, the same state dict, and print(model) shows what runs). Inference only: the weights must not change or
train afterwards (the packed copy would not follow, and an optimizer would see a strided layout).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptopt.infer.cpu_fused import fuse_blocks
from gptopt.models.gpt import MLP, TanhGELU
from gptopt.runtime.torch_private import onednn_linear, onednn_pack

# The weight dtypes oneDNN's linear runs over a packed copy. bf16 only where its kernels run here (bf16_packs).
_PACKED_DTYPES = (torch.float32, torch.bfloat16)

# Up to this many rows a compiled CPU Linear is a multiply-and-sum (gemv_linears); from 2 rows the
# GEMM. The sum loops over the rows outermost, so it reads the whole weight once per row, which a large
# L3 hides and a small one does not; putting the weight's rows outermost reads it once, but inside the
# whole decode graph inductor then vectorises over the rows and runs one kernel over the reduction axis.
# Either way the GEMM is the faster from 2 rows (benchmarks/2026-12-02-inference-ladder.md, "The compiled
# decode at every batch size"). The weights' layout is the model's: compile_decode applies gemv_linears
# where the products of several rows do not read it (packed_products), else to a Generator of one slot only.
GEMV_MAX_ROWS = 1


@torch.library.custom_op("gptopt::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias, W given as onednn_pack(W) (oneDNN's blocked layout).

    An operator of gptopt's own so that torch.compile calls it as one opaque kernel: inductor has no
    lowering of the oneDNN linear for a packed weight that is a graph input (it packs only weights it
    froze itself, and fp32 ones through the BLAS)."""
    return onednn_linear(x, weight, bias)


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
        return _Packed(onednn_pack(self.weight.to_dense()))


def _one_row(x: torch.Tensor) -> bool:
    """At most GEMV_MAX_ROWS rows: a matrix-vector product."""
    return x.numel() <= GEMV_MAX_ROWS * x.shape[-1]


class CpuLinear(nn.Linear):
    """nn.Linear for CPU inference, with the same weight and bias.

    gemv False (inference_layout): the weight column-major. One row (a batch-1 decode step) multiplies by
    weight.T, contiguous in this layout, on the CPU BLAS's matrix-vector path, which runs much faster on it
    (benchmarks/2026-12-04-serving-vs-transformers.md, "The one-row step of a many-slot engine").
    gemv True (gemv_linears): the weight row-major; a compiled step of at most GEMV_MAX_ROWS rows computes
    (x[..., None, :] * weight).sum(-1) + bias, which inductor fuses into one vectorised, multi-threaded pass
    over the weight with the bias in its epilogue (benchmarks/2026-12-02-inference-ladder.md, "After the fused
    multiply-and-sum decode").
    Several rows (a batched decode step, a prefill) and an eager row on row-major weights: oneDNN's linear over
    `packed`, the weight reordered once into its blocked layout, where the BLAS GEMM repacks it every call
    (benchmarks/2026-12-04-serving-vs-transformers.md, "Products of several rows on oneDNN-packed weights").
    The packed copy costs the weight's memory once more; fp32 weights only, and only while the layer is
    neither cast nor moved (F.linear otherwise).
    """

    packed: _Packed | None
    gemv: bool

    @classmethod
    def convert(cls, linear: nn.Linear) -> CpuLinear:
        """`linear`, in place, as a CpuLinear (column-major, no packed copy yet)."""
        if not isinstance(linear, cls):
            linear.__class__ = cls
            linear.packed, linear.gemv = None, False  # type: ignore[attr-defined]
        return linear  # type: ignore[return-value]

    def pack(self) -> None:
        """The oneDNN-packed copy, once (a layout change keeps the values it holds): fp32 weights, and bf16 ones
        where oneDNN's bf16 linear runs (bf16_packs); fp16 keeps the BLAS."""
        if self.packed is None and packable(self.weight.dtype):
            self.packed = _Packed(onednn_pack(self.weight.detach().contiguous()))

    def packed_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight if it still serves x; None without one, or for a model (or this layer) cast or
        moved since it was packed."""
        w = self.weight
        if self.packed is None or x.dtype != w.dtype or x.device.type != "cpu" or w.device.type != "cpu" \
                or self.packed.weight.dtype != w.dtype:
            return None
        return self.packed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one = _one_row(x)
        if one and self.gemv and torch.compiler.is_compiling():
            y = (x.unsqueeze(-2) * self.weight).sum(-1)
            return y if self.bias is None else y + self.bias
        # One row on column-major weights: the BLAS's matrix-vector path, which reads them fastest. One
        # eager row on row-major ones (a prompt's last position at the lm_head) takes the packed copy: the
        # BLAS's product on them ran slower than oneDNN's on the copy with two threads, over shapes of
        # tiny's and gpt2's, and slower than on column-major weights too
        # (benchmarks/2026-12-04-serving-vs-transformers.md, "The one-row step of a many-slot engine").
        # bf16 rows of any number take the packed copy: oneDNN's bf16 kernels beat the BLAS's on either
        # layout (benchmarks/2026-12-07-bf16-cpu-serving.md, "One projection").
        # A compiled step's bf16 products stay inductor's own (it packs the weights it freezes), as they were
        # before bf16 weights had packed copies.
        bf16 = self.weight.dtype == torch.bfloat16
        if bf16 and torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        packed = None if one and not self.gemv and not bf16 else self.packed_for(x)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, packed, self.bias)
        return onednn_linear(x, packed, self.bias)  # eager: no custom-op dispatch


class PackedGeluMLP(MLP):
    """GPT-2's MLP with the GELU applied by oneDNN inside c_fc's packed product (its tanh GELU post-op),
    eager and for several rows; compiled steps (inductor fuses the GELU itself) and one row keep MLP.forward.
    The separate GELU was a pass of its own over the widest activation, and c_fc with the post-op costs less
    than the product and the GELU apart (benchmarks/2026-12-04-serving-vs-transformers.md, "The GELU inside
    the prefill's first product"); the values differ in their last bits only."""

    c_fc: CpuLinear

    @classmethod
    def convert(cls, mlp: MLP) -> PackedGeluMLP:
        """`mlp`, in place, as a PackedGeluMLP: its c_fc must be a packed CpuLinear."""
        mlp.__class__ = cls
        return mlp  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = None
        if not torch.compiler.is_compiling() and not _one_row(x):
            packed = self.c_fc.packed_for(x)
        if packed is None:
            return super().forward(x)
        h = onednn_linear(x, packed, self.c_fc.bias, "gelu", "tanh")
        return self.dropout(self.c_proj(h))


class PackedSwiGLU(MLP):
    """Llama's and Qwen3's MLP, c_proj(silu(c_gate(x)) * c_fc(x)), with c_gate's and c_fc's packed weights
    stacked as one product (the gate's rows first): one pass over x and one kernel where there were two, as
    the inference engines fuse them (vLLM's gate_up_proj). c_gate and c_fc keep their weights (state dict,
    compiled steps, a layer cast or moved since: MLP.forward)."""

    c_gate: CpuLinear
    c_fc: CpuLinear
    gate_up: _Packed

    @classmethod
    def convert(cls, mlp: MLP) -> PackedSwiGLU:
        """`mlp`, in place, as a PackedSwiGLU: its c_gate and c_fc must be packed CpuLinears of one dtype."""
        stacked = torch.cat([mlp.c_gate.weight.detach(), mlp.c_fc.weight.detach()]).contiguous()
        mlp.__class__ = cls
        mlp.gate_up = _Packed(onednn_pack(stacked))  # type: ignore[attr-defined]
        return mlp  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.c_fc.weight
        if torch.compiler.is_compiling() or self.c_fc.packed_for(x) is None or self.gate_up.weight.dtype != w.dtype:
            return super().forward(x)
        bias = None if self.c_fc.bias is None else torch.cat([self.c_gate.bias, self.c_fc.bias])
        gate, up = onednn_linear(x, self.gate_up.weight, bias).chunk(2, dim=-1)
        return self.dropout(self.c_proj(F.silu(gate).mul_(up)))


@functools.cache
def bf16_packs() -> bool:
    """Whether oneDNN's linear runs bf16 over a packed weight on this CPU: its bf16 kernels need AVX512 (native
    bf16 or emulated); elsewhere, or where they fail, bf16 weights keep the BLAS. Checked once, on a tiny product."""
    try:
        w = torch.eye(16, dtype=torch.bfloat16)
        x = torch.arange(16, dtype=torch.bfloat16)[None]
        return bool(torch.backends.mkldnn.is_available() and torch.equal(onednn_linear(x, onednn_pack(w), None), x))
    except RuntimeError:
        return False


def packable(dtype: torch.dtype) -> bool:
    """Whether a weight of this dtype gets a oneDNN-packed copy here (CpuLinear.pack)."""
    if dtype not in _PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or bf16_packs()


def _float_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers with plain floating-point weights: quantised ones (tensor subclasses, integers) excluded."""
    return [m for m in model.modules() if type(m) in (nn.Linear, CpuLinear) and type(m.weight.data) is torch.Tensor
            and m.weight.is_floating_point() and m.weight.dim() == 2]


def inference_layout(model: nn.Module, device_type: str, *, stack: bool = False, fuse: bool = True) -> nn.Module:
    """CPU inference: each float Linear a CpuLinear with a oneDNN-packed copy (fp32, and bf16 where bf16_packs),
    its weight column-major (the BLAS's one-row products, and a compiled step's bf16 GEMMs, read it so),
    each GPT-2 MLP whose c_fc is packed a PackedGeluMLP and, with stack, each SwiGLU MLP whose projections are
    packed a PackedSwiGLU; in place. Same values, parameters and state dict.

    GPUs' GEMMs take either layout at full speed, so they are left alone. Quantised weights keep their layout;
    fp16 ones get no packed copy.

    stack: gate and up as one product. Off by default: the silu and the product over the stacked output's halves
    (strided views) cost more than the one product saves (benchmarks/2026-12-07-bf16-cpu-serving.md, "The
    levers"); the kv-stacked rung measures it. fuse: False keeps the Llama/Qwen3 blocks' elementwise steps as aten
    calls (cpu_fused.fuse_blocks otherwise), as the kv-unfused rung measures.
    """
    if device_type != "cpu":
        return model
    with torch.no_grad():
        for module in _float_linears(model):
            layer = CpuLinear.convert(module)
            layer.pack()
            w = layer.weight
            if not w.t().is_contiguous():  # for the BLAS's one-row products, and a compiled step's bf16 GEMMs
                w.data = w.data.t().contiguous().t()  # the Parameter object stays: ties (lm_head = wte) hold
            layer.gemv = False  # a multiply-and-sum along this layout ran much slower (gemv_linears)
    for mlp in model.modules():
        if type(mlp) is not MLP or getattr(mlp.c_fc, "packed", None) is None:
            continue
        if isinstance(mlp.gelu, TanhGELU):
            PackedGeluMLP.convert(mlp)
        elif stack and mlp.kind == "swiglu" and getattr(mlp.c_gate, "packed", None) is not None \
                and mlp.c_gate.weight.dtype == mlp.c_fc.weight.dtype:
            PackedSwiGLU.convert(mlp)
    return fuse_blocks(model) if fuse else model


def gemv_linears(model: nn.Module) -> nn.Module:
    """CPU compiled decode: each float Linear a CpuLinear whose compiled steps of at most GEMV_MAX_ROWS rows are
    the multiply-and-sum over its row-major weight, in place. Larger batches keep inference_layout's packed
    product (or F.linear), and so do eager one-row calls where there is a packed copy (F.linear otherwise). The
    weights go back to row-major (the sum runs along memory; inference_layout's column-major order made it much
    slower). Quantised weights are left as they are; the parameters and state dict are unchanged."""
    with torch.no_grad():
        for module in _float_linears(model):
            layer = CpuLinear.convert(module)
            layer.weight.data = layer.weight.data.contiguous()  # a no-op if already row-major; ties hold
            layer.gemv = True
    return model


def packed_products(model: nn.Module) -> bool:
    """Whether every float Linear of `model` multiplies several rows by its oneDNN-packed copy in a compiled step
    too (inference_layout: fp32 weights, oneDNN present), so that its weight's own layout serves compiled one-row
    products only. bf16 copies serve eager steps only (CpuLinear.forward)."""
    linears = _float_linears(model)
    return torch.backends.mkldnn.is_available() and bool(linears) and all(
        getattr(m, "packed", None) is not None and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        for m in linears)
