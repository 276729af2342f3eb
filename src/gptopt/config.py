"""Configuration dataclasses: the single source of truth for every option, default and help text.

The CLI builds its flags from these fields (``cli.py``), ``--config FILE.toml`` fills them, and
checkpoints and benchmark results store them. Derived values live in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, cli: bool = True) -> Any:
    """A dataclass field with the help text (and allowed values) the CLI shows for it."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


# ----------------------------------------------------------------------------------------------
# Model


@dataclass(kw_only=True)
class GPTConfig:
    n_layer: int = opt(12, "number of Transformer blocks")
    n_head: int = opt(12, "attention heads per block")
    n_embd: int = opt(768, "model width")
    block_size: int = opt(1024, "context length (learned position embeddings)")
    vocab_size: int = opt(50257, "tokenizer vocabulary size")
    vocab_pad_multiple: int = opt(
        1, "pad the embedding rows up to a multiple of this (64 turns GPT-2's 50257 into 50304: tensor-core shapes)"
    )
    dropout: float = opt(0.0, "dropout on attention and residual paths (0 for pretraining speed)")
    bias: bool = opt(True, "biases in Linear and LayerNorm layers, as in GPT-2")
    layer_norm_epsilon: float = opt(1e-5, "LayerNorm epsilon (GPT-2 uses 1e-5)")
    attention: str = opt("sdpa", "attention kernel: sdpa (flash / mem-efficient) or eager", choices=("sdpa", "eager"))
    gradient_checkpointing: bool = opt(False, "recompute each block in backward: less memory, ~30% more compute")

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "vocab_pad_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention must be 'sdpa' or 'eager', got {self.attention!r}")

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Build from a stored dict; keys this version does not know are an error, not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**d)


ModelConfig = GPTConfig

# Parameter counts (tied lm_head counted once, position embeddings included) are pinned by
# tests/test_model.py. GPT-2 presets use GPT-2's tokenizer (50257); `tiny` and `debug` use a BPE
# trained on the corpus, so their vocabularies are small.
PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512),  # 0.14M, tests
    "tiny": dict(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=8192),  # 5.3M, the CPU default
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50257),  # 355M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50257),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50257),  # 1558M
}


def preset(name: str, **overrides: Any) -> GPTConfig:
    """The named preset as a config; overrides replace single fields (e.g. vocab_size from the data)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


# ----------------------------------------------------------------------------------------------
# Commands


@dataclass(kw_only=True)
class DoctorConfig:
    device: str = opt("auto", "device to check: auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    preset: str = opt("tiny", "model preset used to size the memory/disk checks and the smoke test")
    smoke: bool = opt(False, "also run a tiny forward+backward under autocast on the device")
    json: bool = opt(False, "print one JSON document instead of the table")

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
