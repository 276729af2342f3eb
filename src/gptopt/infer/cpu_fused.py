"""The Llama- and Qwen3-shaped blocks with their elementwise steps fused for CPU inference, as module types of their
own: FusedRMSNorm (the norm in one pass), FusedAttention (qk-norm and rotary applied in place on c_attn's output) and
FusedNormBlock (the residual add fused with the norm after it), over cpu_kernels.py's add_rms_norm and qk_rope_.

    python -c "from gptopt.infer.cpu_fused import fuse_blocks; help(fuse_blocks)"

A layer converts in place, as cpu_layout's do: its class becomes the subclass (the same parameters and state dict,
and print(model) shows what runs). Each falls back to its parent's forward where the kernels do not apply: a
compiled step (inductor fuses these itself), a tensor that needs its gradient, another dtype or device, or no built
extension. Inference only: FusedNormBlock adds into the residual stream in place.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gptopt.infer import cpu_kernels
from gptopt.models.gpt import Block, CausalSelfAttention, KVCacheLayer, RMSNorm

__all__ = ["FusedAttention", "FusedNormBlock", "FusedRMSNorm", "fuse_blocks", "fused_blocks"]

_NONE = torch.empty(0)  # an absent optional tensor, as the kernels take it


def _kernels(x: torch.Tensor, weight: torch.Tensor | None = None) -> object | None:
    """The extension if its kernels serve x (with this norm weight), else None."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) \
            or (weight is not None and weight.dtype != x.dtype) or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return cpu_kernels.extension()


def _eps(norm: RMSNorm) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps


class FusedRMSNorm(RMSNorm):
    """RMSNorm in one pass over each row (fp32 inside, stored in the input's dtype): where RMSNorm.forward casts
    the input and the weight to fp32, normalises and casts back, four calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = _kernels(x, self.weight)
        if ext is None or not x.is_contiguous():
            return super().forward(x)
        return ext.add_rms_norm(x, _NONE, self.weight, _eps(self))  # type: ignore[attr-defined]


class FusedAttention(CausalSelfAttention):
    """The attention whose queries and keys are RMS-normed per head (Qwen3's qk-norm, where the model has it) and
    rotated in place on c_attn's output, one kernel: where the textbook rotate-half concatenates, negates and
    multiplies each of them in several calls, in fp32 and cast back. A decode step over the paged cache then
    writes its keys and values and attends in one more (kv_cache's attend_qkv)."""

    def forward(self, x: torch.Tensor, kv_cache: KVCacheLayer | None = None, attn_mask: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # A decode step over the paged cache: from c_attn's output to the attention's in two kernels (rotary, then
        # the keys' and values' write with the attention), where the generic path splits, views and copies each.
        # Its rows' lengths stand for the mask there, as in the cache's attend.
        serves = getattr(kv_cache, "serves_qkv", None)
        if serves is None or rope is None or not serves(x) or self._kernels(x) is None:
            return super().forward(x, kv_cache, attn_mask, rope)
        y = kv_cache.attend_qkv(self._rotated(x, rope), self.n_head, self.n_kv)  # type: ignore[union-attr]
        return self.resid_dropout(self.c_proj(y))

    def _kernels(self, x: torch.Tensor) -> object | None:
        # c_attn may be quantised (no weight tensor): its output is in x's dtype all the same
        return _kernels(x, self.q_norm.weight if self.qk_norm else None)

    def _rotated(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """c_attn's output (B, T, W), its queries and keys normed (qk-norm) and rotated in place."""
        hs, nh, nkv = self.hs, self.n_head, self.n_kv
        qkv = self.c_attn(x).contiguous()
        cos, sin = (t.reshape(-1, hs).contiguous() for t in rope)  # (T or B x T, hs): row n takes row n % M
        qw, kw, eps = _NONE, _NONE, 0.0
        if self.qk_norm:
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, _eps(self.q_norm)
        cpu_kernels.extension().qk_rope_(qkv, cos, sin, qw, kw, nh, nkv, hs, eps)  # type: ignore[union-attr]
        return qkv

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if rope is None or self._kernels(x) is None:
            return super().qkv(x, rope)
        B, T, _ = x.shape
        hs, nh, nkv = self.hs, self.n_head, self.n_kv
        q, k, v = self._rotated(x, rope).split([nh * hs, nkv * hs, nkv * hs], dim=2)
        return (q.view(B, T, nh, hs).transpose(1, 2), k.view(B, T, nkv, hs).transpose(1, 2),
                v.view(B, T, nkv, hs).transpose(1, 2))


class FusedNormBlock(Block):
    """The block whose attention output is added into the residual stream in place by the kernel that norms the
    sum for the MLP (add_rms_norm): one pass where the add, the casts and the norm were five calls; the MLP's
    output is added in place too."""

    ln_2: RMSNorm

    def forward(self, x: torch.Tensor, kv_cache: object = None, attn_mask: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        ext = _kernels(x, self.ln_2.weight)
        if ext is None or not x.is_contiguous():
            return super().forward(x, kv_cache, attn_mask, rope)  # type: ignore[arg-type]
        a = self.attn(self.ln_1(x), kv_cache, attn_mask, rope).contiguous()
        h = ext.add_rms_norm(x, a, self.ln_2.weight, _eps(self.ln_2))  # type: ignore[attr-defined]  # x += a
        return x.add_(self.mlp(h))


def fuse_blocks(model: nn.Module) -> nn.Module:
    """A Llama- or Qwen3-shaped model's norms, attentions and blocks as their fused types, in place, where the
    kernels are built (cpu_kernels.extension); GPT-2's LayerNorm blocks, and everything where they are not, are
    left alone. Same parameters, state dict and values (to the last bits of fp32 arithmetic's order)."""
    config = getattr(model, "config", None)
    if config is None or config.norm != "rmsnorm" or cpu_kernels.extension() is None:
        return model
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = FusedRMSNorm
        elif type(module) is CausalSelfAttention and config.positions == "rope":
            module.__class__ = FusedAttention
        elif type(module) is Block:
            module.__class__ = FusedNormBlock
    return model


def fused_blocks(model: nn.Module) -> bool:
    """Whether `model`'s blocks run the fused kernels (fuse_blocks)."""
    return any(isinstance(m, FusedNormBlock) for m in model.modules())
