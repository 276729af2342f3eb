"""A generator's memory, planned before it is allocated: the weights and every copy of them, the KV cache's
block pool, and the largest forward; and the pool a server gets within a memory budget (plan_kv).

    python -c "import gptopt.infer.generator_memory as m; print(m.kv_bytes_per_token(m.GPTConfig(), None))"

The KV cache is a pool of blocks of `block_size` tokens shared by every sequence: a sequence holds the blocks
its tokens fill, not a whole context. So memory is a budget in bytes turned into blocks at start-up, as vLLM's
and SGLang's engines do:

- on a CPU, the least of DEFAULT_CPU_KV_BYTES (vLLM's CPU build gives its KV cache 4 GiB by default,
  VLLM_CPU_KVCACHE_SPACE) and CPU_KV_SHARE of the RAM free once the weights are loaded and the largest
  forward has its room, raised to one sequence of max_len where that fits: a CPU is shared with the machine's
  other work, so a bounded share, not all of it;
- on a GPU, what is left of GPU_MEMORY_UTILIZATION of the device's memory (vLLM's gpu_memory_utilization;
  SGLang's mem_fraction_static is the same share of the total) after the weights, what else holds the device
  and a warm-up forward's measured peak: the device serves nothing else;
- either way never more than max_batch_size sequences of max_len fill: blocks past those could only keep
  finished requests' prefixes (a small model's 4 GiB would be millions of tokens, zeroed at start-up).

A budget whose pool cannot hold one sequence of max_len is refused with the fix, as vLLM refuses a
max_model_len larger than its KV cache: max_len is a promise to each request, not to be broken silently.

The largest forward is counted as the engine runs it: a prefill chunk gathers its rows' keys and values from the
pool to its longest row's length (infer/kv_cache.py), and so does a decode step of rows x max_len, unless its
attention reads the blocks in place (infer/paged_attention.py: a CPU's eager decode). Where that does not fit, a
default max_batch_size is lowered to the most rows that do (and the start-up line says so); one given is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from gptopt.config import GPTConfig
from gptopt.infer.generator import GATHER_CHUNKS
from gptopt.models.flops import param_count
from gptopt.models.gpt import CAUSAL_SPLIT_MIN
from gptopt.runtime import memory_check
from gptopt.runtime.memory_check import F32, REFUSE_ABOVE, Estimate, gib, itemsize
from gptopt.utils.errors import UserError

GIB = 2**30
DEFAULT_CPU_KV_BYTES = 4 * GIB  # vLLM's VLLM_CPU_KVCACHE_SPACE default
CPU_KV_SHARE = 0.5  # of the RAM left free: the rest stays for the machine's other work and the allocator's slack
GPU_MEMORY_UTILIZATION = 0.9  # of the device's total memory, as vLLM's gpu_memory_utilization default
# --max_batch_size's default: CPU decode steps stop gaining throughput well before 64 rows; a GPU's at a few
# hundred rows of a GPT-2-class model, where the step turns compute-bound (vLLM's max_num_seqs is 256 too)
DEFAULT_MAX_BATCH = {"cpu": 64, "cuda": 256}


def default_max_batch(device: torch.device) -> int:
    """--max_batch_size's default on the device: the most requests decoded together."""
    return DEFAULT_MAX_BATCH.get(device.type, DEFAULT_MAX_BATCH["cpu"])


def kv_bytes_per_token(config: GPTConfig, dtype: torch.dtype | None) -> int:
    """Bytes one token's keys and values take in every layer: 2 x layers x kv_heads x head_dim x itemsize."""
    return 2 * config.n_layer * config.kv_heads * config.head_dim * itemsize(dtype)


def live_widths(config: GPTConfig, *, decode: bool = False) -> tuple[int, int, int]:
    """What a forward holds per token at its widest points (no gradients: one layer's tensors at a time), in
    elements: (the residual, its norm and the new residual; attention's: c_attn's output, the rotated or normed
    queries and keys, under grouped-query attention the keys and values repeated to every query head where SDPA
    takes a prompt (a decode step and the eager path read them as stored, the queries regrouped instead), the
    output and its transpose; the MLP's: GELU's input and output, SwiGLU's activation, up projection and product).
    decode: a decode step's widths (one token a row)."""
    C, A, K, H = config.n_embd, config.n_head * config.head_dim, config.kv_heads * config.head_dim, config.mlp_hidden
    moved = config.positions == "rope" or config.qk_norm
    grouped = config.kv_heads != config.n_head
    repeated = grouped and config.attention != "eager" and not decode
    regrouped = grouped and not repeated and not moved  # a copy of the queries (a view of c_attn's output before)
    attention = (A + 2 * K) + (A + K if moved else 0) + (2 * A if repeated else 0) + (A if regrouped else 0) + 2 * A
    return 3 * C, attention, (3 if config.mlp == "swiglu" else 2) * H


def _rotary(config: GPTConfig, w: int) -> int:
    """Rotary in a model cast to a 16-bit dtype: its products with the fp32 cos and sin are fp32 before the cast
    back, the queries' width of them, and the keys' too where QK-norm's fp32 output is what is rotated."""
    A, K = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    return F32 * (A + (K if config.qk_norm else 0)) if config.positions == "rope" and w < F32 else 0


def prefill_bytes(config: GPTConfig, tokens: int, attended: int, *, rows: int = 1,
                  dtype: torch.dtype | None = None) -> int:
    """Peak bytes of a prefill forward of `tokens` prompt tokens in all, over `rows` sequences whose queries attend
    to up to `attended` positions (a chunk of a longer prompt attends to what came before it too): one layer's
    widths (live_widths); where earlier positions are cached, each row's keys and values gathered from its blocks
    over the longest row's length (infer/kv_cache.py), repeated to every query head under grouped-query attention,
    and the mask; under eager attention the scores and the softmax beside them."""
    w, K, H = itemsize(dtype), config.kv_heads * config.head_dim, config.n_head
    A = H * config.head_dim
    base, attention, mlp = live_widths(config)
    eager = config.attention == "eager"
    # three quarters of the scores from CAUSAL_SPLIT_MIN tokens on: the two query blocks
    scores = 2 * w * H * tokens * attended * (3 / 4 if tokens >= CAUSAL_SPLIT_MIN else 1) if eager else 0
    if attended <= tokens:  # a prompt from its start: it attends to its own keys, as computed
        widths = tokens * (w * attention + _rotary(config, w))
    else:  # a chunk after cached positions: every row's keys and values read from the pool, and the bool mask
        repeated = config.kv_heads != config.n_head and not eager
        # eager attention's products take a contiguous copy of the gathered keys or values
        copies = 2 * K + (2 * A if repeated else 0) + (K if eager else 0)
        # of the chunk's own widths, only its queries and the attention's output outlive the gather
        widths = tokens * w * 2 * A + rows * attended * w * copies + tokens * attended
    return tokens * w * base + max(widths + int(scores), tokens * w * mlp)


def decode_bytes(config: GPTConfig, rows: int, attended: int, *, dtype: torch.dtype | None = None,
                 in_place: bool = False) -> int:
    """Peak bytes of a decode step of `rows` sequences, the longest attending to `attended` positions: per row the
    widths (live_widths) and fp32 logits, and one layer's keys and values gathered for every row over the longest
    row's length (infer/kv_cache.py: a row's table is read to that width), with eager attention's scores.
    in_place: the attention reads the blocks where they lie (infer/paged_attention.py): nothing is gathered, and
    what its tasks hold (a row's scores) is small beside the widths."""
    w, K, H, V = itemsize(dtype), config.kv_heads * config.head_dim, config.n_head, config.vocab_size
    base, _, mlp = live_widths(config)
    _, row_widths, _ = live_widths(config, decode=True)
    eager = config.attention == "eager"
    # eager attention: its scores and softmax, and a contiguous copy of the gathered keys or values
    if in_place:  # the peak is a layer's (its keys and values copied once to be written) or the logits after
        return rows * (w * base + max(w * row_widths + _rotary(config, w) + 2 * w * K, w * mlp, F32 * V))
    gathered = rows * attended * (2 * w * K + (w * K + 2 * w * H if eager else 0))
    return rows * (w * base + F32 * V) + max(rows * (w * row_widths + _rotary(config, w)) + gathered,
                                             rows * w * mlp)


def forward_bytes(config: GPTConfig, *, prefill_chunk: int, max_batch_size: int, max_len: int,
                  dtype: torch.dtype | None = None, in_place: bool = False) -> int:
    """The largest forward a generator runs: a prefill chunk of `prefill_chunk` tokens, one row at the end of a
    max_len sequence, or as many rows as it may hold, their gathered positions within GATHER_CHUNKS chunks
    (Generator.prefill_step); or a decode step of max_batch_size rows, one of them max_len long: every row is read
    to the longest one's length (gathered, unless in_place: decode_bytes)."""
    chunk = min(prefill_chunk, max_len)
    rows = max(1, min(chunk, max_batch_size))
    many = prefill_bytes(config, chunk, max(chunk, min(max_len, GATHER_CHUNKS * chunk // rows)), rows=rows,
                         dtype=dtype)
    return max(prefill_bytes(config, chunk, max_len, rows=1, dtype=dtype), many,
               decode_bytes(config, max_batch_size, max_len, dtype=dtype, in_place=in_place))


def _blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def pool_bytes(config: GPTConfig, blocks: int, block_size: int, dtype: torch.dtype | None) -> int:
    """Bytes of a pool of `blocks` blocks: theirs and the null block's (infer/block_pool.NULL_BLOCK, where every
    table's unused entries point)."""
    return (blocks + 1) * block_size * kv_bytes_per_token(config, dtype)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the weights' copies a CPU layout keeps beside them (cpu_layout.inference_layout: each fp32
    Linear's oneDNN-packed weight, the weight's size once more)."""
    total = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        weight = getattr(packed, "weight", None)
        if isinstance(weight, torch.Tensor):
            total += weight.numel() * weight.element_size()
    return total


def model_bytes(model: nn.Module) -> Estimate:
    """What a loaded model holds: its parameters and buffers (a tied weight once) and the packed copies."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"}
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    return Estimate({"weights": held, "packed weights": packed_bytes(model)})


def inference_bytes(config: GPTConfig, slots: int, max_len: int, *, dtype: torch.dtype | None = None) -> Estimate:
    """Peak bytes of a generator of `slots` sequences of up to max_len tokens each, all of them held at once,
    weights in `dtype` (None: fp32; no packed copies: what a draft model or a profiled one holds): the weights,
    the KV cache of slots x max_len tokens, and the larger forward (a max_len prefill, a decode step of every
    sequence over the whole cache)."""
    w = itemsize(dtype)
    return Estimate({
        "weights": param_count(config) * w,
        "KV cache": slots * max_len * kv_bytes_per_token(config, dtype),
        "forward": max(prefill_bytes(config, max_len, max_len, dtype=dtype),
                       decode_bytes(config, slots, max_len, dtype=dtype)),
    })


@dataclass(frozen=True)
class KVPlan:
    """A KV cache's block pool and why it is that size: what build_engine hands the Generator."""

    num_blocks: int
    block_size: int
    block_bytes: int
    max_batch_size: int
    max_len: int
    forward: int  # bytes of the largest forward, beside the pool
    source: str  # where the budget came from: the option, or the default and its reason
    batch_note: str = ""  # why max_batch_size is below the device's default, if it is

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        """The pool's tensors: its blocks and the null block."""
        return (self.num_blocks + 1) * self.block_bytes

    def line(self) -> str:
        """The start-up line: memory, tokens and blocks, and the requests it decodes at once."""
        return (f"KV cache: {self.bytes / GIB:.2f} GiB ({self.source}), {self.tokens:,} tokens in "
                f"{self.num_blocks:,} blocks of {self.block_size}; up to {self.max_batch_size} requests at once"
                f"{self.batch_note}, each up to {self.max_len:,} tokens")


def measure_forward_peak(model: nn.Module, device: torch.device, tokens: int) -> int:
    """CUDA: the bytes a forward of `tokens` tokens adds at its peak (torch.cuda.max_memory_allocated), measured
    before the pool is allocated, as vLLM profiles its largest batch; what the estimate cannot see (kernels'
    workspaces, the allocator's rounding) is in it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    idx = torch.zeros(1, tokens, dtype=torch.long, device=device)
    with torch.no_grad():
        model(idx)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def _default_budget(device: torch.device, room: int, measured: Callable[[], int]) -> tuple[int, str]:
    """The default pool's bytes on the device, and the reason the start-up line gives. room: what the pool may
    take at most (what is free, less the largest forward)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # the device's memory less what torch does not hold (the CUDA context, other processes): not the pool's
        others = total - free - torch.cuda.memory_reserved(device)
        held = torch.cuda.memory_allocated(device) + measured() + others
        return min(room, int(GPU_MEMORY_UTILIZATION * total) - held), \
            f"default: {GPU_MEMORY_UTILIZATION:g} of the device's {gib(total)} less the weights and a forward"
    share = int(CPU_KV_SHARE * room)
    if share >= DEFAULT_CPU_KV_BYTES:
        return DEFAULT_CPU_KV_BYTES, "default: 4 GiB"
    return share, f"default: {CPU_KV_SHARE:g} of the free RAM"


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in lo..hi with fits(n) (fits shrinks as n grows), or lo - 1 if none."""
    lo -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_kv(model: nn.Module, device: torch.device, *, max_len: int, max_batch_size: int | None, prefill_chunk: int,
            block_size: int, kv_cache_memory: float | None = None, dtype: torch.dtype | None = None,
            in_place: bool = False) -> KVPlan:
    """The block pool of a loaded model's server: kv_cache_memory GiB (None: the device's default, module
    docstring), checked against what the device has free beside the largest forward. max_batch_size None: the
    device's default (default_max_batch), lowered to the most rows whose largest forward fits beside a pool of one
    max_len sequence. Raises UserError (exit 2) with the numbers and the fix for a budget that does not fit, or
    whose pool cannot hold one sequence of max_len. in_place: the decode's attention reads the blocks where they
    lie (decode_bytes)."""
    config = model.config
    dtype = dtype or next(model.parameters()).dtype
    per_block = block_size * kv_bytes_per_token(config, dtype)
    free, where = memory_check.available_bytes(device)
    limit = int(REFUSE_ABOVE * free)

    def forward(rows: int, length: int = max_len) -> int:
        return forward_bytes(config, prefill_chunk=prefill_chunk, max_batch_size=rows, max_len=length, dtype=dtype,
                             in_place=in_place)

    def pool(blocks: int) -> int:
        return pool_bytes(config, blocks, block_size, dtype)

    one_sequence = _blocks(max_len, block_size)
    rows, batch_note = max_batch_size or default_max_batch(device), ""
    if max_batch_size is None:  # a step reads every row's keys to the longest row's length: rows cost memory
        most = _largest(lambda r: forward(r) + pool(one_sequence) <= limit, 1, rows)
        if 1 <= most < rows:
            rows, batch_note = most, " (the most whose forwards fit the memory)"
    fwd = forward(rows)
    if kv_cache_memory is not None:
        blocks, source = max(0, int(kv_cache_memory * GIB) // per_block - 1), f"--kv_cache_memory {kv_cache_memory:g}"
        if blocks < one_sequence:
            need = math.ceil(pool(one_sequence) / GIB * 100) / 100
            raise UserError(
                f"--kv_cache_memory {kv_cache_memory:g} GiB holds {blocks * block_size:,} tokens ({blocks:,} blocks "
                f"of {block_size}), fewer than one sequence of --max_len {max_len:,} needs ({need:g} GiB); raise "
                f"--kv_cache_memory to {need:g} or more, or lower --max_len to {blocks * block_size:,} or less")
    else:
        room = limit - fwd
        budget, source = _default_budget(
            device, room, lambda: measure_forward_peak(model, device, min(prefill_chunk, max_len)))
        blocks = max(0, budget // per_block - 1)
        if blocks > rows * one_sequence:  # more could only keep finished requests' prefixes
            blocks, source = rows * one_sequence, "default: --max_batch_size sequences of --max_len"
        if blocks < one_sequence:
            if pool(one_sequence) <= room:  # the default's share is raised to one whole sequence
                blocks, source = one_sequence, "default: one sequence of --max_len"
            else:
                fits = _largest(lambda n: pool(_blocks(n, block_size)) + forward(rows, n) <= limit, 2, max_len)
                lower = f"lower --max_len to {fits:,} or less" if fits >= 2 else "free memory"
                raise UserError(
                    f"one sequence of --max_len {max_len:,} tokens needs {gib(pool(one_sequence))} of KV cache, "
                    f"more than this machine can give it: {gib(free)} is {where}, and the largest forward (a step of "
                    f"{rows} requests, each read to the longest one's length) takes {gib(fwd)} of it; {lower}, or "
                    f"lower --max_batch_size, or "
                    f"use --dtype bf16")
    if rows > blocks:  # a running request holds a block at least: more rows than blocks never run at once
        rows, batch_note = blocks, " (one block each at least: the pool's blocks)"
    plan = KVPlan(num_blocks=blocks, block_size=block_size, block_bytes=per_block, max_batch_size=rows,
                  max_len=max_len, forward=fwd, source=source, batch_note=batch_note)
    if plan.bytes + plan.forward > limit:
        most = math.floor(max(0, limit - plan.forward) / GIB * 100) / 100
        raise UserError(
            f"a KV cache of {gib(plan.bytes)} ({source}) and the largest forward's {gib(plan.forward)} will not "
            f"fit in memory: {gib(free)} is {where}; lower --kv_cache_memory to {most:g} or less, or "
            f"--max_batch_size or --prefill_chunk (the forward), or use --dtype bf16")
    return plan
