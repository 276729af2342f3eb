"""The model's config: GPTConfig (GPT-2, and the Llama / Qwen3 block by its switches), the presets, and
the block's fields a new run may set over a preset (train --arch).

    python -c "from gptopt.config.model import preset; print(preset('tiny'))"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gptopt.config.fields import (
    MAX_LAYERS,
    MAX_PAD_MULTIPLE,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    MAX_WIDTH,
    check_fields,
    field_types,
    opt,
)
from gptopt.utils.errors import UserError

LOSSES = ("full", "chunked")  # GPTConfig.loss; TrainConfig.loss adds "auto"


@dataclass(kw_only=True)
class GPTConfig:
    n_layer: int = opt(12, "number of Transformer blocks", ge=1, le=MAX_LAYERS)
    n_head: int = opt(12, "attention heads per block", ge=1, le=MAX_WIDTH)
    n_embd: int = opt(768, "model width", ge=1, le=MAX_WIDTH)
    block_size: int = opt(1024, "context length (learned position embeddings)", ge=1, le=MAX_SEQ_LEN)
    vocab_size: int = opt(50257, "tokenizer vocabulary size", ge=1, le=MAX_VOCAB)
    vocab_pad_multiple: int = opt(
        1, "pad the embedding rows up to a multiple of this (64 turns GPT-2's 50257 into 50304: tensor-core shapes)",
        ge=1, le=MAX_PAD_MULTIPLE,
    )
    dropout: float = opt(0.0, "dropout on attention and residual paths (0 for pretraining speed)", ge=0.0, lt=1.0)
    bias: bool = opt(True, "biases in Linear and LayerNorm layers, as in GPT-2")
    layer_norm_epsilon: float = opt(1e-5, "the norms' epsilon (GPT-2 uses 1e-5)", gt=0.0, lt=1.0)
    # The family: GPT-2's block by default; Llama / Qwen3 set the fields below (their presets and hf.py's import)
    n_kv_head: int | None = opt(None, "key/value heads, grouped-query attention; none: n_head", ge=1, le=MAX_WIDTH)
    positions: str = opt("learned", "learned position embeddings (GPT-2), or rope: rotary on queries and keys",
                         choices=("learned", "rope"))
    rope_theta: float = opt(10000.0, "the rotary base (with positions rope)", gt=0.0)
    norm: str = opt("layernorm", "layernorm (GPT-2) or rmsnorm (Llama, Qwen3)", choices=("layernorm", "rmsnorm"))
    mlp: str = opt("gelu", "gelu: GPT-2's tanh-GELU MLP; swiglu: the gated SiLU of Llama and Qwen3; relu2: squared "
                   "ReLU", choices=("gelu", "swiglu", "relu2"))
    intermediate_size: int | None = opt(None, "the MLP's hidden width; none: 4 x n_embd", ge=1, le=MAX_WIDTH * 8)
    qk_norm: bool = opt(False, "an RMSNorm over each head's queries and keys, before rotary (Qwen3)")
    head_size: int | None = opt(None, "each head's width; none: n_embd / n_head (Qwen3 sets its own)", ge=1,
                                le=MAX_WIDTH)
    tie_embeddings: bool = opt(True, "the head shares the token embedding's weights (GPT-2); false: its own")
    zero_init: bool = opt(False, "start each block's output projections (attention's and the MLP's c_proj) and an "
                          "untied head at zero, so every block begins as the identity (modded-nanogpt's init); "
                          "false: GPT-2's scaled normal init")
    attention: str = opt("sdpa", "attention kernel: sdpa (flash / mem-efficient) or eager", choices=("sdpa", "eager"))
    gradient_checkpointing: bool = opt(False, "recompute each block in backward: less memory, one more forward of "
                                       "each block")
    loss: str = opt("full", "training loss: full (every position's logits, then cross-entropy) or chunked (the "
                    "projection and cross-entropy a chunk of positions at a time: the full logits never exist)",
                    choices=LOSSES)

    def __post_init__(self) -> None:
        check_fields(self, prefix="")  # stored in gptopt.json, so named as there, not as flags
        if self.head_size is None and self.n_embd % self.n_head:
            raise UserError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads:
            raise UserError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.positions == "rope" and self.head_dim % 2:
            raise UserError(f"rotary positions need an even head_dim, got {self.head_dim}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head without grouped-query attention."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_hidden(self) -> int:
        return self.intermediate_size or 4 * self.n_embd

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Build from a stored dict; keys this version does not know are an error, not silently dropped."""
        if not isinstance(d, dict):
            raise UserError(f"the model config must be a table of settings, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        # A missing size would silently take GPT-2's default and fail later as a shape mismatch;
        # the other fields came later and default to what older files meant.
        missing = [k for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size") if k not in d]
        if missing:
            raise UserError(f"model config lacks {', '.join(missing)}")
        return cls(**d)


# Parameter counts (tied lm_head counted once, position embeddings included) are pinned by
# tests/test_model.py. GPT-2 presets use GPT-2's tokenizer (50257); `tiny` and `debug` use a BPE
# trained on the corpus, so their vocabularies are small.
PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512),  # 0.14M, tests
    "tiny": dict(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=8192),  # 5.3M, the CPU default
    # a draft for tiny's speculative decoding: its context and tokenizer, a quarter of its per-token arithmetic
    "tiny-draft": dict(n_layer=2, n_head=2, n_embd=128, block_size=256, vocab_size=8192),  # 1.5M
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50257),  # 355M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50257),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50257),  # 1558M
    # Llama-shaped: rotary, RMSNorm, SwiGLU, grouped-query attention, no biases. llama-tiny is tiny's size for
    # CPUs (the MLP 8/3 of the width, as Llama's, rounded to 16); the others are the published models' shapes.
    "llama-tiny": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=256, block_size=256, vocab_size=8192, bias=False,
                       positions="rope", norm="rmsnorm", mlp="swiglu", intermediate_size=688),
    "smollm2-135m": dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, block_size=8192, vocab_size=49152,
                         bias=False, positions="rope", rope_theta=100000.0, norm="rmsnorm", mlp="swiglu",
                         intermediate_size=1536),
    "qwen3-0.6b": dict(n_layer=28, n_head=16, n_kv_head=8, head_size=128, n_embd=1024, block_size=40960,
                       vocab_size=151936, bias=False, positions="rope", rope_theta=1e6, norm="rmsnorm",
                       layer_norm_epsilon=1e-6, mlp="swiglu", intermediate_size=3072, qk_norm=True),
}
# Presets whose embedding is sized for the corpus' tokenizer; the others keep their own vocabulary
DATA_VOCAB_PRESETS = ("debug", "tiny", "tiny-draft", "llama-tiny")
DEFAULT_PRESET = "tiny"  # what a new training run is without --preset


def preset(name: str, **overrides: Any) -> GPTConfig:
    """The named preset as a config; overrides replace single fields (e.g. vocab_size from the data)."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


def check_seq_len(seq_len: int | None, context: int, name: str) -> None:
    """Refuse a --seq_len beyond a preset's context (name: the preset) as the options are read, before any work."""
    if seq_len is not None and seq_len > context:
        raise UserError(f"--seq_len {seq_len} exceeds the model's context {context} (preset {name}): "
                        f"use --seq_len {context} or less")


def preset_for_data(name: str, data_vocab: int, **overrides: Any) -> GPTConfig:
    """The preset sized for a corpus: the published models' shapes keep their own embedding (GPT-2's 50257 tokens:
    their FLOPs and memory are the model's whatever the corpus' tokenizer), the small ones take the data's."""
    base = PRESETS.get(name, {}).get("vocab_size", 0)
    vocab = data_vocab if name in DATA_VOCAB_PRESETS else max(base, data_vocab)
    return preset(name, **{"vocab_size": vocab, **overrides})


# GPTConfig's fields a new run may set over its preset (train --arch): the block's design. The sizes are the
# preset's, the vocabulary the data's, and how the model runs (attention kernel, checkpointing, loss) train's flags.
ARCH_FIELDS = ("positions", "rope_theta", "norm", "mlp", "intermediate_size", "qk_norm", "n_kv_head", "head_size",
               "tie_embeddings", "bias", "zero_init", "layer_norm_epsilon")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def arch_overrides(spec: str | None) -> dict[str, Any]:
    """--arch 'field=value,...' as GPTConfig fields of the right types (ranges and choices: GPTConfig's own check)."""
    if not spec:
        return {}
    kinds = field_types(GPTConfig)
    out: dict[str, Any] = {}
    for item in (i.strip() for i in spec.split(",") if i.strip()):
        name, sep, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or name not in ARCH_FIELDS:
            raise UserError(f"--arch: {item!r} is not FIELD=VALUE of a block field; fields: {', '.join(ARCH_FIELDS)}")
        kind, optional = kinds[name]
        if optional and text.lower() == "none":
            out[name] = None
        elif kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise UserError(f"--arch: {name} takes true or false, got {text!r}")
            out[name] = text.lower() in _TRUE
        else:
            try:
                out[name] = kind(text)
            except ValueError:
                raise UserError(f"--arch: {name} must be {kind.__name__}, got {text!r}") from None
    return out

