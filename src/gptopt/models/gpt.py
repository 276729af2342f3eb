"""The GPT-2 model: one readable module with Hugging Face GPT-2's parameter names.

Single-device and plain on purpose: torch.compile, DDP/FSDP and quantisation are applied from
outside (train/wrap.py, infer/load.py). Names match HF (wte, wpe, h.N.ln_1, attn.c_attn, ...) so weights map
1:1; HF's Conv1D stores (in, out) and is transposed once at load time in hf.py.

    python -c "from gptopt.models.gpt import GPT; from gptopt.config import preset; print(GPT(preset('tiny')))"
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptopt.config import GPTConfig
from gptopt.models.loss import IGNORE_INDEX, linear_cross_entropy
from gptopt.utils.errors import UserError

__all__ = ["GPT", "GPTConfig", "KVCacheLayer"]

# Shortest sequence whose eager causal attention is split in two query blocks: below it the
# saved quarter of the scores is smaller than the cost of the extra kernels.
CAUSAL_SPLIT_MIN = 64


class KVCacheLayer(Protocol):
    """One layer's key/value cache: stores the new keys/values and returns all the layer may attend to. A cache
    may also attend by itself (an `attend(q, k, v)` method: it stores k and v and returns the attention's output
    (B, nh, T, hs), or None to leave the attention to the model), as a paged cache reads its blocks in place."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def _causal_mask(T: int, S: int, offset: int, device: torch.device) -> torch.Tensor:
    """(T, S) bool, True where query i may see key j: j <= i + offset."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=offset)


def document_mask(pos: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool for positions (B, T) of packed documents, each starting where its position is 0: True where
    query i may see key j, j <= i in the same document, so that packed conversations attend to themselves alone."""
    doc = (pos == 0).cumsum(-1)  # (B, T): the document each token belongs to
    causal = _causal_mask(pos.size(-1), pos.size(-1), 0, pos.device)
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm computed in fp32 and returned in its input's dtype, as transformers' Llama and Qwen3 do. Autocast
    leaves rms_norm to its input's dtype, and a bf16 input with the fp32 weight misses the fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).to(x.dtype)


def norm(config: GPTConfig, dim: int | None = None) -> nn.Module:
    """The family's norm over the last `dim` (default n_embd): GPT-2's LayerNorm, or Llama's and Qwen3's RMSNorm."""
    dim = dim or config.n_embd
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(dim, eps=config.layer_norm_epsilon, bias=config.bias)


def rotary(inv_freq: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, (T, hs) or (B, 1, T, hs) for positions (T,) or (B, T): the halves
    of a head take the same frequencies, as Llama's rotate-half convention pairs channel i with i + hs / 2."""
    angles = pos.float()[..., None] * inv_freq  # (..., T, hs / 2)
    emb = torch.cat([angles, angles], dim=-1)
    if emb.dim() == 3:
        emb = emb[:, None]  # (B, 1, T, hs): broadcast over the heads
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.size(-1) // 2
    turned = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return (x * cos + turned * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.hs = config.n_head, config.kv_heads, config.head_dim
        self.attention = config.attention
        self.dropout = config.dropout
        # queries, then keys and values of the n_kv heads (grouped-query attention when fewer): one product
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv) * self.hs, bias=config.bias)
        self.c_proj = nn.Linear(self.n_head * self.hs, config.n_embd, bias=config.bias)
        if config.qk_norm:
            self.q_norm, self.k_norm = norm(config, self.hs), norm(config, self.hs)
        self.qk_norm = config.qk_norm
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: KVCacheLayer | None = None,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        hs, nh = self.hs, self.n_head
        q, k, v = self.qkv(x, rope)
        if kv_cache is not None:
            attend = getattr(kv_cache, "attend", None)
            y = attend(q, k, v) if attend is not None else None
            if y is not None:
                return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, nh * hs)))
            k, v = kv_cache.update(k, v)  # (B, nkv, S, hs), S >= T
        S = k.size(2)
        # Without a mask the T queries are the last T of S positions. SDPA's is_causal aligns the
        # triangle top-left, which is only right when S == T; otherwise build the bottom-right mask.
        is_causal = attn_mask is None and S == T and T > 1
        if attn_mask is None and S != T and T > 1:
            attn_mask = _causal_mask(T, S, S - T, x.device)
        dropout_p = self.dropout if self.training else 0.0

        if self.attention == "sdpa":
            y = self._sdpa(q, k, v, attn_mask, dropout_p, is_causal)
        elif is_causal and T >= CAUSAL_SPLIT_MIN:
            # The first half of the queries sees only the first half of the keys: computing that
            # quarter of the score matrix, all masked, is skipped (flash attention's block skipping,
            # at two blocks). Same values as one block, and faster forward and backward in bf16 on
            # CPUs (benchmarks/2026-12-02-training-ladder.md, "Code of 2026-12-03, before the shared
            # training step": what changed).
            h = T // 2
            y = torch.cat([self._eager(q[:, :, :h], k[:, :, :h], v[:, :, :h], _causal_mask(h, h, 0, x.device)),
                           self._eager(q[:, :, h:], k, v, _causal_mask(T - h, T, h, x.device))], dim=2)
        else:  # the textbook path: short sequences, cached decode, explicit masks
            y = self._eager(q, k, v, _causal_mask(T, S, 0, x.device) if is_causal else attn_mask)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries (B, nh, T, hs), keys and values (B, nkv, T, hs) of x (B, T, C): one product, then the
        qk-norm and the rotary positions where the family has them."""
        B, T, _ = x.shape
        hs, nh, nkv = self.hs, self.n_head, self.n_kv
        q, k, v = self.c_attn(x).split([nh * hs, nkv * hs, nkv * hs], dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        return q, k, v

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool) -> torch.Tensor:
        B, nh, T, hs = q.shape
        nkv = k.size(1)
        if nkv != nh and T == 1:
            # A decode step: a group's query heads are rows of their key/value head's one query, all seeing the
            # same keys (the (B, 1, 1, S) mask broadcasts over them), so the cache is attended as it is stored.
            y = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, hs), k, v, attn_mask=attn_mask,
                                               dropout_p=dropout_p)
            return y.view(B, nh, 1, hs)
        if nkv != nh:  # a prompt or a training step: each key/value head repeated for the nh / nkv heads it serves
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(hs)) v, with the positions attn_mask is False at left out. Under grouped-query
        attention each key/value head's query heads are stacked as rows of one product with it (B, nkv, G x T,
        hs): the keys and values are read as stored, never repeated per query head."""
        B, nh, T, hs = q.shape
        nkv, S = k.shape[1], k.shape[2]
        g = nh // nkv
        att = (q.reshape(B, nkv, g * T, hs) @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nkv, G x T, S)
        if attn_mask is not None:  # (T, S) or (B, 1, T, S): over each group's G heads alike
            att = att.view(B, nkv, g, T, S).masked_fill(~attn_mask.unsqueeze(-3), float("-inf")).view(B, nkv, g * T, S)
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return (att @ v).view(B, nh, T, hs)


class TanhGELU(nn.Module):
    """GPT-2's GELU ("gelu_new": 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3)).

    Compiled, it is written as x * sigmoid(2z): the same function, since 0.5 (1 + tanh(z)) equals
    sigmoid(2z), but inductor's CPU code vectorises exp far better than tanh, so forward and
    backward run faster (benchmarks/2026-12-02-training-ladder.md, "Code of 2026-12-03, before the
    shared training step": what changed). Eager keeps F.gelu: one kernel where the rewrite would
    launch five.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return F.gelu(x, approximate="tanh")
        xf = x.float()  # in fp32 whatever the autocast dtype, as F.gelu computes it
        return (xf * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (xf + 0.044715 * xf * xf * xf))).to(x.dtype)


class MLP(nn.Module):
    """GPT-2's tanh-GELU MLP; or swiglu, Llama's and Qwen3's c_proj(silu(c_gate(x)) * c_fc(x)); or relu2,
    c_proj(relu(c_fc(x))^2)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_hidden
        self.kind = config.mlp
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        if self.kind == "swiglu":
            self.c_gate = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = TanhGELU() if self.kind == "gelu" else None
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu is not None:
            h = self.gelu(self.c_fc(x))
        elif self.kind == "swiglu":
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        else:
            h = F.relu(self.c_fc(x)).square()
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, kv_cache: KVCacheLayer | None = None, attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, attn_mask, rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        V = config.padded_vocab_size
        parts: dict[str, nn.Module] = {"wte": nn.Embedding(V, config.n_embd)}
        if config.positions == "learned":
            parts["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.transformer = nn.ModuleDict(
            dict(**parts, drop=nn.Dropout(config.dropout),
                 h=nn.ModuleList(Block(config) for _ in range(config.n_layer)), ln_f=norm(config))
        )
        if config.positions == "rope":  # not a weight: recomputed from the config, kept out of the state dict
            self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        # zero_init starts every block as the identity and the untied head at zero (modded-nanogpt): the
        # residual stream begins as the embedding, and each block's output grows from nothing.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if config.zero_init:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.zero_init and not config.tie_embeddings:
            nn.init.zeros_(self.lm_head.weight)
        with torch.no_grad():  # padding rows are never tokens: zeros, as the HF loader writes them
            self.transformer.wte.weight[config.vocab_size :].zero_()
            self.lm_head.weight[config.vocab_size :].zero_()

    def init_buffers(self) -> None:
        """Recompute the buffers made from the config and kept out of the state dict (the rotary frequencies):
        a model built on the meta device and given memory by to_empty() holds garbage there until this runs,
        and load_state_dict does not replace it."""
        if self.config.positions == "rope":
            self.inv_freq = self._inv_freq(self.inv_freq.device)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        hs = self.config.head_dim
        return 1.0 / self.config.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float32, device=device) / hs)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's own signature)
        """.to(bf16) and .half() cast every floating buffer: the rotary frequencies stay fp32 (rounded to bf16,
        the angles drift with the position), as transformers keeps them."""
        super()._apply(fn, recurse)
        if getattr(self, "inv_freq", None) is not None and self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._inv_freq(self.inv_freq.device)
        return self

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters, the tied lm_head counted once (FLOPs count without wpe: flops.non_embedding_params)."""
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        pos: torch.Tensor | None = None,
        kv_cache: Sequence[KVCacheLayer] | None = None,
        attn_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size), or the mean cross-entropy when targets (B, T) are given.

        pos: positions (T,) or (B, T), default 0..T-1. kv_cache: one cache per layer.
        attn_mask: bool, True = may attend, broadcastable to (B, nh, T, S).
        last_only: logits of the last position only, (B, 1, vocab_size), for decoding.
        Targets equal to -100 are ignored by the loss.
        """
        B, T = idx.shape
        if pos is None:
            if T > self.config.block_size:
                raise UserError(f"sequence length {T} exceeds the model's context {self.config.block_size}")
            pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if self.config.positions == "learned":
            x = x + self.transformer.wpe(pos)
        else:
            rope = rotary(self.inv_freq, pos)
        x = self.transformer.drop(x)
        recompute = self.config.gradient_checkpointing and self.training and kv_cache is None
        for i, block in enumerate(self.transformer.h):
            cache = kv_cache[i] if kv_cache is not None else None
            if recompute:
                x = checkpoint(block, x, None, attn_mask, rope, use_reentrant=False)
            else:
                x = block(x, cache, attn_mask, rope)
        x = self.transformer.ln_f(x)
        V = self.config.vocab_size
        if targets is None:
            if last_only:
                x = x[:, -1:, :]  # only the last position feeds the next token
            return self.lm_head(x)[..., :V]
        if self.config.loss == "chunked":  # the same loss and gradients, without the full logits (loss.py)
            return linear_cross_entropy(x, self.lm_head.weight, targets, V)
        logits = self.lm_head(x)[..., :V]  # padded rows are never real tokens
        t = targets.reshape(-1)
        # the mean over the counted targets; a batch with none counts 0, not NaN (a chat row may supervise nothing)
        total = F.cross_entropy(logits.reshape(-1, V).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / (t != IGNORE_INDEX).sum().clamp(min=1)
