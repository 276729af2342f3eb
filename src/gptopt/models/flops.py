"""FLOPs per token and model FLOPs utilisation (MFU).

Convention (PaLM appendix B, as nanoGPT): 6N + 12*L*d*T FLOPs per trained token, where N counts
parameters without the position table and the tied lm_head once; the second term is attention's
QK^T and AV, which N does not see. Inference (forward only) is a third of that.

    python -c "import gptopt.models.flops as f, gptopt.config as c; print(f.flops_per_token(c.preset('gpt2'), 1024))"
"""

from __future__ import annotations

from gptopt.config import GPTConfig


def non_embedding_params(config: GPTConfig) -> int:
    """Parameter count without position embeddings, lm_head tied to wte (counted once; an untied head counts
    apart), from the config."""
    d, L, V = config.n_embd, config.n_layer, config.padded_vocab_size
    b = 1 if config.bias else 0
    a = config.n_head * config.head_dim  # the attention's width: d, unless heads are sized apart (Qwen3)
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    h = config.mlp_hidden
    norm = d * (1 + b) if config.norm == "layernorm" else d  # RMSNorm: a weight, no bias
    per_block = (
        2 * norm  # ln_1, ln_2
        + d * qkv + b * qkv  # c_attn
        + (2 * config.head_dim if config.qk_norm else 0)  # q_norm, k_norm
        + a * d + b * d  # attn.c_proj
        + (2 if config.mlp == "swiglu" else 1) * (d * h + b * h)  # mlp.c_fc (and c_gate)
        + h * d + b * d  # mlp.c_proj
    )
    head = 0 if config.tie_embeddings else V * d
    return V * d + head + L * per_block + norm


def flops_per_token(config: GPTConfig, seq_len: int, *, training: bool = True) -> float:
    """Model FLOPs for one token at context seq_len: 6N + 12*L*a*T when training (a: the attention's width,
    n_head x head_dim), a third when not."""
    train = 6 * non_embedding_params(config) + 12 * config.n_layer * config.n_head * config.head_dim * seq_len
    return train if training else train / 3


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Achieved model FLOP/s as a fraction of the peak (the caller names the peak's source)."""
    return tokens_per_s * flops_per_token / peak_flops


def at_least(peak: float, source: str, achieved: float, what: str) -> tuple[float, str]:
    """The peak MFU is stated against, raised to an achieved rate above it, and its source.

    A measured peak is the best of a few matmuls timed at one moment (on a shared machine perhaps a slow
    one): a lower bound of what the device can do, as every achieved model FLOP/s is. A rate above it
    proves the measurement low (against a table peak: the FLOP count high), so that rate is the peak; an
    MFU above 1 would claim more than the device can do. what: the rate's name ("step 12", "rung all")."""
    if achieved <= peak:
        return peak, source
    return achieved, f"{what} ({achieved / 1e12:.3g} TFLOP/s; the {source} was low)"


def param_count(config: GPTConfig) -> int:
    """Parameters of GPT(config), the tied lm_head once, position table included: from the config alone."""
    table = config.block_size * config.n_embd if config.positions == "learned" else 0  # rotary has none
    return non_embedding_params(config) + table
