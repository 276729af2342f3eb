"""Memory before it is allocated: the peak a training step or a generator will need, what the device
has free, and the check between the two.

    python -c "from gptopt import memory as m, config as c; print(m.train_step_bytes(c.preset('tiny'), 16, 256))"

A run that cannot fit must be refused or reported, never killed: on a CPU the kernel's OOM killer
ends the process (exit 137) with no report, and a GPU that fills mid-step has already spent the
compile. So every command estimates first and compares with what is free:

- the estimate counts what a step holds at its peak, each part from the shapes (bytes per token per
  layer, read off what the model saves for backward), on the high side wherever there is a choice:
  eager kernels (torch.compile saves less), no credit for the causal split, the logits' copies at once;
- the refusal fires only when the estimate clearly exceeds what is free (REFUSE_ABOVE), so a run
  that fits is not refused; the OOM handlers stay for what the estimate cannot see (torch.compile's
  own memory, other processes growing meanwhile).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from gptopt.config import GPTConfig, TrainConfig
from gptopt.models.flops import non_embedding_params
from gptopt.models.loss import chunk_rows

# Refuse when the estimate is above this share of the free memory. Against the peak measured on a
# CPU (ru_maxrss growth over two steps; debug and tiny presets, fp32 and bf16, eager and SDPA, with
# and without checkpointing; steps large enough that the allocator's fixed overhead does not
# dominate) the estimate came out close to it on both sides, understating by less than this margin:
# refusing above 90% of what is free keeps a run the estimate understates below the limit, and
# refuses only runs within a tenth of it.
REFUSE_ABOVE = 0.9

# Where a container's memory limit is read (cgroup v2, then v1); module constants so tests can point
# them at files of their own.
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")

_F32 = 4  # bytes of an fp32 element: master weights, gradients, AdamW state, the residual stream


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n < 10 * 2**30 else f"{n / 2**30:,.0f} GiB"


@dataclass(frozen=True)
class Estimate:
    """Bytes at the peak, by what holds them (the parts add up: an upper-ish bound)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def without(self, *names: str) -> Estimate:
        """The estimate less parts already in memory (the CPU model a command built before checking)."""
        return Estimate({k: v for k, v in self.parts.items() if k not in names})

    def describe(self) -> str:
        largest = [kv for kv in sorted(self.parts.items(), key=lambda kv: -kv[1])[:4] if kv[1] >= self.total / 100]
        return f"{gib(self.total)} (" + ", ".join(f"{k} {gib(v)}" for k, v in largest) + ")"


def param_count(config: GPTConfig) -> int:
    """Parameters of GPT(config), the tied lm_head once, position table included: from the config alone."""
    table = config.block_size * config.n_embd if config.positions == "learned" else 0  # rotary has none
    return non_embedding_params(config) + table


def _itemsize(dtype: torch.dtype | None) -> int:
    return _F32 if dtype is None else dtype.itemsize


def train_step_bytes(config: GPTConfig, batch_size: int, seq_len: int, *, amp_dtype: torch.dtype | None = None,
                     accumulation: int = 1, shards: int = 1) -> Estimate:
    """Peak bytes of one training step (step.TrainStep) of GPT(config) on micro-batches of batch_size x seq_len.

    amp_dtype: the autocast dtype (None: fp32). The config's attention and gradient_checkpointing
    decide the attention-score and activation terms. accumulation: micro-batches per step (only the
    loaded batch grows with it). shards: FSDP ranks the weights, gradients and AdamW state are split over.
    """
    P, C, L, H = param_count(config), config.n_embd, config.n_layer, config.n_head
    V, Vp = config.vocab_size, config.padded_vocab_size
    a = _itemsize(amp_dtype)  # a matmul's inputs and outputs: the autocast dtype's size, fp32's without
    tokens = batch_size * seq_len
    # Saved for backward, per token and layer: ln_1's and ln_2's fp32 inputs (2 x 4C); c_attn's input
    # (C), q, k, v (3C), attention's output (C) and c_proj's input (C), c_fc's input (C), its output and
    # GELU's output (2 x 4C), in the matmul dtype: 15 a C in all. Dropout adds its byte masks.
    per_layer = 2 * _F32 * C + 15 * a * C + (7 * C if config.dropout else 0)
    # Eager attention keeps the (T x T) softmax per head: fp32, plus its cast to the matmul dtype under
    # autocast (and a byte mask with dropout); backward briefly holds about three more of one layer's.
    score = (_F32 + (a if amp_dtype is not None else 0) + (1 if config.dropout else 0)
             if config.attention == "eager" else 0)
    scores_per_layer = batch_size * H * seq_len * seq_len * score
    backward_scores = 3 * _F32 * batch_size * H * seq_len * seq_len if score else 0
    if config.gradient_checkpointing:  # each block keeps its input; backward recomputes one block at a time
        activations = tokens * (L * _F32 * C + per_layer)
        scores = scores_per_layer + backward_scores
    else:
        activations = tokens * L * per_layer
        scores = L * scores_per_layer + backward_scores
    activations += tokens * (_F32 + a) * C  # ln_f's input and lm_head's
    if config.loss == "chunked":
        # loss.py: one chunk's logits at a time (the same four copies as below), and the gradients it keeps for
        # backward: the hidden states' and the head weight's, both fp32
        logits = chunk_rows(tokens, C, V) * (a * V + 3 * _F32 * V) + _F32 * tokens * C + _F32 * Vp * C
    else:
        # The lm_head output (padded vocabulary, matmul dtype), then cross-entropy in fp32: its input copy and
        # log-softmax output in forward, the gradients of both in backward.
        logits = tokens * (a * Vp + 3 * _F32 * V)
    shards = max(1, shards)
    parts = {
        "weights": _F32 * P // shards,
        "gradients": _F32 * P // shards,
        "AdamW state": 2 * _F32 * P // shards,  # exp_avg and exp_avg_sq
        # autocast keeps each weight's cast for the step's backward
        "autocast weight copies": (a * P if amp_dtype is not None else 0),
        "activations": activations,
        "attention scores": scores,
        "logits": logits,
        "batch": 2 * 8 * tokens * accumulation,  # int64 inputs and targets of the whole step
        # Backward's short-lived buffers (an op's input gradient beside its output's, casts) and the
        # allocator's slack: a quarter of what grows with the batch. Without it the sum fell short of
        # the peak resident growth measured on a CPU for bf16 + checkpointing.
        "temporaries": (activations + scores + logits) // 4,
    }
    return Estimate(parts)


def inference_bytes(config: GPTConfig, slots: int, max_len: int, *, dtype: torch.dtype | None = None) -> Estimate:
    """Peak bytes of a Generator with `slots` sequences of up to max_len tokens, weights in `dtype`
    (None: fp32): the weights, the KV cache, and the largest forward (a max_len prefill, a full decode)."""
    P, C, L, H, V = param_count(config), config.n_embd, config.n_layer, config.n_head, config.vocab_size
    w = _itemsize(dtype)
    # a prefill of max_len tokens: the residual, q/k/v, the MLP's hidden layer (12 C per token, one
    # layer live at a time) and eager attention's scores (several fp32 copies of one layer's)
    prefill = max_len * 12 * C * w + 3 * _F32 * H * max_len * max_len
    # a decode step of every slot: the same per token, the scores over the cache, a gather of one
    # layer's keys and values for non-consecutive slots, and fp32 logits
    kv = config.kv_heads * config.head_dim  # a position's keys in one layer: grouped-query attention keeps fewer
    decode = slots * (12 * C * w + 3 * _F32 * H * max_len + (w + _F32) * V) + 2 * slots * max_len * kv * w
    return Estimate({
        "weights": P * w,
        "KV cache": 2 * L * slots * max_len * kv * w,  # keys and values, every layer
        "forward": prefill + decode,
    })


# ----------------------------------------------------------------------------------------------
# What the device has free


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _inactive_file(stat: Path, key: str) -> int:
    """Page cache the kernel reclaims before it kills: counted in a cgroup's usage, yet free to use."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_free() -> tuple[int, int] | None:
    """(bytes left under this container's memory limit, the limit), or None where no limit is set."""
    limit = _read_int(CGROUP_V2 / "memory.max")
    if limit is not None:
        used = _read_int(CGROUP_V2 / "memory.current") or 0
        reclaimable = _inactive_file(CGROUP_V2 / "memory.stat", "inactive_file")
    else:
        limit = _read_int(CGROUP_V1 / "memory.limit_in_bytes")
        # v1 writes a number near 2**63 for no limit
        if limit is None or limit >= 2**60:
            return None
        used = _read_int(CGROUP_V1 / "memory.usage_in_bytes") or 0
        reclaimable = _inactive_file(CGROUP_V1 / "memory.stat", "total_inactive_file")
    return max(0, limit - max(0, used - reclaimable)), limit


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Bytes this process can still allocate on the device, and where that figure comes from.

    CUDA: the driver's free memory plus what torch's caching allocator holds unused. Host (CPU, and
    MPS, whose memory is the host's): the least of the kernel's MemAvailable, the room under a
    cgroup limit and the room under this process's address-space limit (ulimit -v).
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"free on {device} (of {gib(total)})"
    options = [(psutil.virtual_memory().available, "available RAM")]
    cgroup = cgroup_free()
    if cgroup is not None:
        options.append((cgroup[0], f"left under the container's {gib(cgroup[1])} memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        vms = psutil.Process().memory_info().vms
        options.append((max(0, soft - vms), f"left under the address-space limit (ulimit -v) of {gib(soft)}"))
    return min(options)


def capacity_bytes(device: torch.device) -> int | None:
    """All the memory a run on the device could use: the GPU's total, or the host's RAM (a container's
    cgroup limit if it is lower); None for a device whose total is not known (MPS)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type != "cpu":
        return None
    total = psutil.virtual_memory().total
    cgroup = cgroup_free()
    return min(total, cgroup[1]) if cgroup is not None else total


def shortfall(estimate: Estimate, device: torch.device) -> str | None:
    """None when the estimate fits what the device has free; else the one line that says by how much."""
    free, source = available_bytes(device)
    if estimate.total <= REFUSE_ABOVE * free:
        return None
    return f"needs about {estimate.describe()} but {gib(free)} is {source}"


def require(estimate: Estimate, device: torch.device, what: str, fix: str) -> None:
    """Raise ValueError (the CLI's exit 2) naming the estimate, the memory free and the fix, before
    anything is allocated, when the estimate does not fit."""
    short = shortfall(estimate, device)
    if short is not None:
        raise ValueError(f"{what} will not fit in memory: it {short}; {fix}")


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
    if shortfall(estimate_at("full"), device) is None:
        return "full", "auto: the full logits fit"
    if shortfall(estimate_at("chunked"), device) is None:
        return "chunked", f"auto: the full logits of micro-batch {batch} would not fit"
    return "chunked", f"auto: micro-batch {batch} does not fit with either loss; the chunked one is the smaller"


def largest_batch(estimate_at: Callable[[int], Estimate], device: torch.device, upto: int, *,
                  share: float = REFUSE_ABOVE) -> int:
    """The largest batch size up to `upto` whose estimate fits `share` of what is free (0: not even
    one); the estimates grow with the batch, so a bisection finds it."""
    free, _ = available_bytes(device)
    lo, hi = 0, upto
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if estimate_at(mid).total <= share * free else (lo, mid - 1)
    return lo


# Default KV-cache slots of a server (auto_slots): CPU decode steps stop gaining throughput well before
# 64 rows; a GPU's at a few hundred rows of a GPT-2-class model, where the step turns compute-bound.
AUTO_SLOTS = {"cpu": 64, "cuda": 256}
AUTO_SLOTS_SHARE = 0.5  # of the free memory: the rest stays for the allocator's slack and the machine's other work


def auto_slots(config: GPTConfig, max_len: int, device: torch.device, *, dtype: torch.dtype | None = None) -> int:
    """A server's default KV-cache slots: as many as fit in AUTO_SLOTS_SHARE of the memory free now (the
    weights are loaded), with their forwards (inference_bytes), up to AUTO_SLOTS for the device; at least 1
    (a model that does not fit even so is refused by `require` with its figures)."""
    cap = AUTO_SLOTS.get(device.type, AUTO_SLOTS["cpu"])
    return max(1, largest_batch(lambda n: inference_bytes(config, n, max_len, dtype=dtype).without("weights"),
                                device, cap, share=AUTO_SLOTS_SHARE))


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
    short = shortfall(estimate_at(train.batch_size), device)
    if short is not None:
        fix = train_fix(train, seq_len, largest_batch(estimate_at, device, train.batch_size - 1))
        raise ValueError(f"a training step of micro-batch {train.batch_size} x {seq_len} tokens will not fit in "
                         f"memory: it {short}; {fix}")
