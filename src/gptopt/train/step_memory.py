"""A training step's memory, estimated before it is allocated: the peak of one step from the shapes, the loss
that fits (--loss auto), the refusal with its fix, and the advice after an out-of-memory error (the search of
--auto_batch_size, which the estimate guides, is train/auto_batch.py).

    python -c "import gptopt.train.step_memory as m; print(m.train_step_bytes(m.GPTConfig(), 8, 256))"

The estimate counts what a step holds at its peak, each part from the shapes (bytes per token per layer, read
off what the model saves for backward), on the high side wherever there is a choice: eager kernels
(torch.compile saves less), no credit for the causal split, the logits' copies at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gptopt.config import GPTConfig, TrainConfig
from gptopt.models.flops import param_count
from gptopt.models.gpt import CAUSAL_SPLIT_MIN
from gptopt.models.loss import chunk_rows
from gptopt.runtime import memory_check
from gptopt.runtime.device import DevicePlan
from gptopt.runtime.memory_check import F32, Estimate, itemsize
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")


def norm_saved(config: GPTConfig, a: int) -> int:
    """Bytes a norm of the model's width keeps for backward per token, with the product after it: LayerNorm (one
    fused kernel) its fp32 input; RMSNorm (torch's composite of products) its fp32 input and the normalised
    values; and the next product its input, in the matmul dtype (a)."""
    return (F32 * (2 if config.norm == "rmsnorm" else 1) + a) * config.n_embd


def saved_per_token(config: GPTConfig, a: int) -> int:
    """Bytes one block saves for backward per token, from its shapes (a: the matmul dtype's size, the autocast
    dtype's, 4 without): what GPT-2's, Llama's and Qwen3's blocks keep, read off the model's forward.

    Two norms (norm_saved). Attention: its output and c_proj's input (the heads' width A = n_head x head_dim,
    Qwen3's apart from the model's); the queries, keys and values SDPA keeps: views of c_attn's output, except the
    rotated queries and keys, and under grouped-query attention with SDPA keys and values repeated to every query
    head (the eager path: the queries regrouped); its
    log-sum-exp. QK-norm keeps its inputs and the normalised queries and keys, in fp32. The MLP: GELU's and
    ReLU^2's input and output (2 of the hidden width H); SwiGLU's gate, its activation, the up projection and
    their product (4)."""
    C, A, K, H = config.n_embd, config.n_head * config.head_dim, config.kv_heads * config.head_dim, config.mlp_hidden
    grouped = config.kv_heads != config.n_head
    moved = config.positions == "rope" or config.qk_norm  # queries and keys made anew from c_attn's output
    attention = 2 * a * A + F32 * config.n_head  # SDPA's output, c_proj's input; the log-sum-exp
    if config.attention == "eager":  # softmax(q k^T) v keeps the scores (counted apart) and v, no output or lse
        attention -= a * A + F32 * config.n_head
    # SDPA takes the keys and values repeated per query head; the eager path reads them as stored, the queries
    # regrouped by key/value head instead (a copy where they are a view of c_attn's output)
    repeated = grouped and config.attention != "eager"
    attention += a * A if moved or grouped and not repeated else 0  # the queries
    attention += a * A if repeated else (a * K if moved else 0)  # the keys
    attention += a * A if repeated else 0  # the values, repeated
    views_kept = not repeated or config.qk_norm and a == F32  # c_attn's output itself, through views of it
    attention += a * (A + 2 * K) if views_kept else 0
    if config.qk_norm:  # the normalised queries and keys; under autocast also the fp32 copies of their inputs
        attention += F32 * (A + K) * (2 if a != F32 else 1)
    mlp = (4 if config.mlp == "swiglu" else 2) * a * H
    dropout = (C + A + H + C) if config.dropout else 0  # byte masks: attention, both residual branches, MLP
    return 2 * norm_saved(config, a) + attention + mlp + dropout


def train_step_bytes(config: GPTConfig, batch_size: int, seq_len: int, *, amp_dtype: torch.dtype | None = None,
                     accumulation: int = 1, shards: int = 1) -> Estimate:
    """Peak bytes of one training step (step.TrainStep) of GPT(config) on micro-batches of batch_size x seq_len.

    amp_dtype: the autocast dtype (None: fp32). The config's attention and gradient_checkpointing
    decide the attention-score and activation terms. accumulation: micro-batches per step (only the
    loaded batch grows with it). shards: FSDP ranks the weights, gradients and AdamW state are split over.
    """
    P, C, L, H = param_count(config), config.n_embd, config.n_layer, config.n_head
    V, Vp = config.vocab_size, config.padded_vocab_size
    a = itemsize(amp_dtype)  # a matmul's inputs and outputs: the autocast dtype's size, fp32's without
    tokens = batch_size * seq_len
    per_layer = saved_per_token(config, a)
    # Eager attention keeps the (T x T) softmax per head: fp32, plus its cast to the matmul dtype under
    # autocast (and a byte mask with dropout); from CAUSAL_SPLIT_MIN tokens only three quarters of it (the two
    # query blocks), and backward briefly holds about three more of one layer's.
    score = (F32 + (a if amp_dtype is not None else 0) + (1 if config.dropout else 0)
             if config.attention == "eager" else 0)
    scores_per_layer = batch_size * H * seq_len * seq_len * score * (3 / 4 if seq_len >= CAUSAL_SPLIT_MIN else 1)
    backward_scores = 3 * F32 * batch_size * H * seq_len * seq_len if score else 0
    if config.gradient_checkpointing:  # each block keeps its input; backward recomputes one block at a time
        activations = tokens * (L * F32 * C + per_layer)
        scores = int(scores_per_layer) + backward_scores
    else:
        activations = tokens * L * per_layer
        scores = int(L * scores_per_layer) + backward_scores
    activations += tokens * norm_saved(config, a)  # ln_f's, and lm_head's input
    if config.loss == "chunked":
        # loss.py: one chunk's logits at a time (the same four copies as below), and the gradients it keeps for
        # backward: the hidden states' and the head weight's, both fp32
        logits = chunk_rows(tokens, C, V) * (a * V + 3 * F32 * V) + F32 * tokens * C + F32 * Vp * C
    else:
        # The lm_head output (padded vocabulary, matmul dtype), then cross-entropy in fp32: its input copy and
        # log-softmax output in forward, the gradients of both in backward.
        logits = tokens * (a * Vp + 3 * F32 * V)
    shards = max(1, shards)
    parts = {
        "weights": F32 * P // shards,
        "gradients": F32 * P // shards,
        "AdamW state": 2 * F32 * P // shards,  # exp_avg and exp_avg_sq
        # autocast keeps each weight's cast for the step's backward
        "autocast weight copies": (a * P if amp_dtype is not None else 0),
        "activations": activations,
        "attention scores": scores,
        "logits": logits,
        "batch": 2 * 8 * tokens * accumulation,  # int64 inputs and targets of the whole step
        # Backward's short-lived buffers (an op's input gradient beside its output's, casts) and the
        # allocator's slack: a quarter of what grows with the batch, so that the sum is not below a step's
        # peak under bf16 + checkpointing either (tests/test_memory.py measures that peak).
        "temporaries": (activations + scores + logits) // 4,
    }
    return Estimate(parts)


def for_training(config: GPTConfig, train: TrainConfig, seq_len: int, amp_dtype: torch.dtype | None, *,
                 batch_size: int | None = None, world_size: int = 1) -> Estimate:
    """The step estimate of a `gptopt train` run on one device: its micro-batch (or batch_size), FSDP's
    sharding over world_size; with --cpu_offload the weights, gradients and AdamW state stay on the host."""
    est = train_step_bytes(config, batch_size or train.batch_size, seq_len, amp_dtype=amp_dtype,
                           accumulation=train.gradient_accumulation_steps, shards=world_size if train.fsdp else 1)
    return est.without("weights", "gradients", "AdamW state") if train.cpu_offload else est


def pick_loss(choice: str, estimate_at: Callable[[str], Estimate], device: torch.device,
              batch: str) -> tuple[str, str]:
    """The loss a run trains with, and why. choice: --loss; estimate_at: a loss -> the step's estimate with it;
    batch: the micro-batch, as the reason names it ("16 x 1024"). Under auto the full loss, which runs faster
    where both fit (benchmarks/2026-12-05-chunked-loss.md), unless only the chunked loss fits; where neither
    does, the chunked one, the smaller (the step is then refused with the fixes, naming its estimate)."""
    if choice != "auto":
        return choice, f"--loss {choice}"
    if memory_check.shortfall(estimate_at("full"), device) is None:
        return "full", "auto: the full logits fit"
    if memory_check.shortfall(estimate_at("chunked"), device) is None:
        return "chunked", f"auto: the full logits of micro-batch {batch} would not fit"
    return "chunked", f"auto: micro-batch {batch} does not fit with either loss; the chunked one is the smaller"


def train_fix(train: TrainConfig, seq_len: int, largest: int | None = None) -> str:
    """The options that make a training step smaller, as the user types them; `largest`: the largest
    micro-batch that fits, where known (0: none does)."""
    b, accum = train.batch_size, train.gradient_accumulation_steps
    fixes = []
    if largest is None and b > 1:
        fixes.append(f"--batch_size {b // 2} --gradient_accumulation_steps {accum * 2} (the same global batch)")
    elif largest:  # the largest micro-batch that fits and divides the global batch, which accumulation keeps
        d = max(d for d in range(1, min(largest, b * accum) + 1) if b * accum % d == 0)
        fixes.append(f"--batch_size {d} --gradient_accumulation_steps {b * accum // d} (the same global batch)")
    if not train.gradient_checkpointing:
        fixes.append("--gradient_checkpointing")
    if train.loss == "full":  # under auto, chunked is already taken where it alone makes the step fit
        fixes.append("--loss chunked")
    if seq_len > 1:
        fixes.append(f"--seq_len {seq_len // 2}")
    return "use " + ", or ".join(fixes) if fixes else "use a smaller --preset"


def require_training(estimate_at: Callable[[int], Estimate], device: torch.device, train: TrainConfig,
                     seq_len: int) -> None:
    """Refuse a `gptopt train` step that cannot fit (ValueError: exit 2), naming the estimate, the memory
    free and the fix, with the largest micro-batch that fits. estimate_at: micro-batch -> its estimate."""
    short = memory_check.shortfall(estimate_at(train.batch_size), device)
    if short is not None:
        fix = train_fix(train, seq_len, memory_check.largest_batch(estimate_at, device, train.batch_size - 1))
        raise UserError(f"a training step of micro-batch {train.batch_size} x {seq_len} tokens will not fit in "
                         f"memory: it {short}; {fix}")


def oom_advice(cfg: TrainConfig, plan: DevicePlan) -> str:
    figures = ""
    if plan.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(plan.device)
        figures = (
            f" (allocated {torch.cuda.memory_allocated(plan.device) / 2**30:.1f} GiB, reserved "
            f"{torch.cuda.memory_reserved(plan.device) / 2**30:.1f} GiB, free {free / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB)"
        )
    fixes = [f"--batch_size {max(1, cfg.batch_size // 2)} "
             f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps * 2}"]
    if not cfg.gradient_checkpointing:
        fixes.append("--gradient_checkpointing")
    if not cfg.use_amp:
        fixes.append("--use_amp")
    fixes.append("--auto_batch_size")
    return f"out of memory at micro-batch {cfg.batch_size}{figures}; try: " + ", or ".join(fixes)

