"""torch.profiler around training or generation steps, and a diagnosis of where the time goes.

A training step is the step `gptopt train` runs (step.TrainStep: clipping, the schedule, AdamW with decay
on matrices). A generation step is one decode step of the batch by the Generator that `gptopt generate`
and `gptopt serve` run (with --compile its compiled decode step, as `generate --compile`); the
prompts are prefilled once, before the first step, outside the profiled steps.

    gptopt profile --preset gpt2 --use_amp                    # table + findings; traces in profile_out/
    gptopt profile --preset tiny --device cpu --mode generate --json
    gptopt train --preset tiny --max_steps 20 --profile       # traces only (scheduled_profiler below)

output_dir gets tensorboard/ (TensorBoard's profiler plugin), trace.json (chrome://tracing, Perfetto),
memory_snapshot.pickle (CUDA only; https://pytorch.org/memory_viz opens it) and diagnosis.json.
The diagnosis is a pure function of a TraceSummary (step times, op records, memory, graph breaks), so each
rule is tested on synthetic summaries as well as on real CPU traces that show the problem.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import EventList, FunctionEvent
from torch.profiler import DeviceType, ProfilerActivity, profile, record_function, schedule

from gptopt.config import ProfileConfig, TrainConfig, preset_for_data
from gptopt.data import loader as data
from gptopt.infer import generator_memory
from gptopt.infer.cpu_layout import inference_layout
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.models.gpt import GPT
from gptopt.outputs import check_output, lock_output, replacing
from gptopt.runtime import memory_check, process
from gptopt.runtime.device import DevicePlan, cpu_has_fast_bf16, default_attention, resolve
from gptopt.runtime.monitor import peak_memory_bytes
from gptopt.runtime.torch_private import dump_memory_snapshot, graph_breaks, record_memory_history
from gptopt.train import step_memory
from gptopt.train.distributed import DistInfo
from gptopt.train.step import READOUT_RANGE, TrainStep, loader_options
from gptopt.train.wrap import wrap_for_training
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")

# Thresholds of the diagnosis. A clean run stays below every one of them.
DATA_WAIT_SHARE = 0.10  # of step time spent waiting for the next batch: the device has nothing to do then
DATA_WAIT_MIN_MS = 1.0  # median wait below this is the DataLoader's own bookkeeping, which workers do not remove
IDLE_SHARE = 0.20  # of step time the device is idle besides data waits (CUDA: between kernels; CPU: outside ops)
LAUNCH_KERNEL_US = 10.0  # median kernel no longer than the host takes to launch one eagerly ...
LAUNCH_MIN_KERNELS = 100  # ... this many of them a step ...
LAUNCH_KERNEL_SHARE = 0.5  # ... and all kernels together fill less of the step: the host's launches set the pace
FP32_MATMUL_SHARE = 0.50  # of matmul time in fp32 where bf16/fp16 tensor cores (or AMX / AVX512-BF16) exist
MEMORY_SHARE = 0.85  # of capacity at peak: a longer sequence or the allocator's fragmentation tips it over
# The step reads back only what it needs (train: the loss and the grad norm; generate: the sampled
# tokens), inside READOUT_RANGE, which is exempt: every other host sync in it is avoidable.
SYNCS_PER_STEP = 0.0

# What profile writes into --output_dir: on --overwrite these, and only these, are replaced.
FILES = ("tensorboard", "trace.json", "memory_snapshot.pickle", "diagnosis.json")
KIND = "profile"  # the outputs mark of a folder profile wrote into
STEP_RANGE = "gptopt::step"
DATA_WAIT_RANGE = "gptopt::data_wait"
SYNC_RANGE = "gptopt::sync"  # the barrier that ends each step so its wall time is true; exempt from the sync count
MATMUL_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::mv",
    "aten::addmv", "aten::dot", "aten::einsum", "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    # the CPU layout's products over oneDNN-packed weights (infer/cpu_layout.py)
    "mkldnn::_linear_pointwise",
})
# The namespaces of the ops a CPU step runs: ATen's, and oneDNN's for the CPU layout's packed products
OP_PREFIXES = ("aten::", "mkldnn::")
FP32 = frozenset({"float", "float32", "torch.float32"})  # how record_shapes spells float32 input dtypes
# Ops that only make a new view or an empty tensor: on a CPU they are not work units like kernels are.
CPU_METADATA_OPS = frozenset({
    "aten::view", "aten::as_strided", "aten::t", "aten::transpose", "aten::reshape", "aten::_reshape_alias",
    "aten::expand", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
    "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::split", "aten::split_with_sizes",
    "aten::chunk", "aten::unbind", "aten::narrow", "aten::to", "aten::contiguous", "aten::numpy_T",
})
CUDA_SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                             "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"})
# On a CPU nothing waits for a device, but these are the Python-side reads of a tensor value that on a
# GPU each stall the host until the device catches up: counted when called from Python (not inside an op).
HOST_READ_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"})


@dataclass(frozen=True)
class OpRecord:
    """One profiler event of a recorded step, reduced to what the rules need."""

    name: str
    step: int  # index of the recorded step it falls in
    start_us: float  # from the start of that step
    dur_us: float  # host time on a CPU; device time for CUDA kernels and matmuls
    self_us: float | None = None  # CPU ops: own time without callees' (a kernel counts this); None: dur_us
    dtypes: tuple[str, ...] | None = ()  # input dtypes, as record_shapes gives them; None: this torch records none
    kernel: bool = False  # a unit of device work: a CUDA kernel; on a CPU an aten op doing its own work
    busy: bool = False  # the device works meanwhile: CUDA kernels and copies; on a CPU a top-level aten op
    matmul: bool = False  # the innermost op of a matrix multiply (addmm inside linear, flash inside sdpa)
    sync: bool = False  # makes the host wait for the device (on a CPU: a host read of a tensor's value)


@dataclass
class TraceSummary:
    """Everything the diagnosis looks at; the settings only shape the fixes it proposes."""

    device_type: str  # cuda, cpu or mps
    step_s: list[float]  # wall time of each recorded step, the device synchronised
    data_wait_s: list[float]  # of which spent in next(loader)
    ops: list[OpRecord] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    memory_capacity_bytes: int | None = None
    graph_breaks: dict[str, int] | None = None  # reason -> count; None when not compiled
    amp_speeds_matmuls: bool = True  # the device has fast bf16/fp16 matmuls, so autocast pays
    mode: str = "train"
    batch_size: int = 8
    num_workers: int = 0
    pin_memory: bool = False
    use_amp: bool = False
    compile: bool = False
    compile_mode: str = "default"
    gradient_checkpointing: bool = False


@dataclass
class Figures:
    """The measurements every rule compares with its threshold; diagnosis.json carries them all."""

    steps: int
    step_ms: float  # median
    data_wait_share: float
    idle_share: float | None  # None without op records
    kernels_per_step: float
    median_kernel_us: float | None
    kernel_share: float  # of step time inside kernels (summed)
    fp32_matmul_share: float | None  # None when no matmul was recorded, or the dtypes are unknown (torch < 2.12)
    memory_share: float | None
    syncs_per_step: float
    sync_calls: dict[str, int]
    graph_breaks: int | None


@dataclass(frozen=True)
class Finding:
    name: str
    figure: str  # what was measured, with the number
    fix: str  # the gptopt flags (or code change) that address it
    value: float
    threshold: float


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length covered by intervals: nested and overlapping ones (an op inside an op) count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def figures(s: TraceSummary) -> Figures:
    n = len(s.step_s)
    if n == 0 or len(s.data_wait_s) != n:
        raise UserError(f"a summary needs one data wait per step, got {n} steps and {len(s.data_wait_s)} waits")
    total_s = sum(s.step_s)
    idle = None
    if s.ops:
        idle_s = 0.0
        for i, (step, wait) in enumerate(zip(s.step_s, s.data_wait_s, strict=True)):
            span = step * 1e6
            busy = _union_us([(max(0.0, o.start_us), min(span, o.start_us + o.dur_us))
                              for o in s.ops if o.step == i and o.busy and o.start_us < span])
            idle_s += max(0.0, span - busy - wait * 1e6) / 1e6
        idle = idle_s / total_s
    kernels = [o.dur_us if o.self_us is None else o.self_us for o in s.ops if o.kernel]
    matmuls = [o for o in s.ops if o.matmul]
    mm_total = sum(o.dur_us for o in matmuls)
    syncs = Counter(o.name for o in s.ops if o.sync)
    memory_share = None
    if s.peak_memory_bytes is not None and s.memory_capacity_bytes:
        memory_share = s.peak_memory_bytes / s.memory_capacity_bytes
    return Figures(
        steps=n, step_ms=statistics.median(s.step_s) * 1e3, data_wait_share=sum(s.data_wait_s) / total_s,
        idle_share=idle, kernels_per_step=len(kernels) / n,
        median_kernel_us=statistics.median(kernels) if kernels else None, kernel_share=sum(kernels) / 1e6 / total_s,
        fp32_matmul_share=sum(o.dur_us for o in matmuls if FP32 & set(o.dtypes or ())) / mm_total
        if mm_total and all(o.dtypes is not None for o in matmuls) else None,
        memory_share=memory_share, syncs_per_step=sum(syncs.values()) / n, sync_calls=dict(syncs),
        graph_breaks=None if s.graph_breaks is None else sum(s.graph_breaks.values()),
    )


def _faster_launches(s: TraceSummary) -> str:
    """The fixes for steps the host cannot launch fast enough, given what this run already uses."""
    fixes = [] if s.compile else ["--compile (fuses elementwise ops into fewer, larger kernels)"]
    if s.device_type == "cuda" and s.compile_mode != "reduce-overhead":
        fixes.append("--compile --compile_mode reduce-overhead (CUDA graphs: one launch replays the whole step)")
    fixes.append(f"a larger batch, e.g. --batch_size {s.batch_size * 2} (the same launches do more work each)")
    return "; ".join(fixes)


def diagnose(s: TraceSummary) -> list[Finding]:
    """The bottlenecks of the summarised run, each with its figure and its fix (in a fixed order: data, device
    utilisation, precision, memory, syncs, compile)."""
    f, out = figures(s), []
    gpu = s.device_type == "cuda"
    wait_ms = statistics.median(s.data_wait_s) * 1e3
    if f.data_wait_share > DATA_WAIT_SHARE and wait_ms > DATA_WAIT_MIN_MS:
        fix = f"more DataLoader workers: --num_workers {max(2, 2 * s.num_workers)}"
        if gpu and not s.pin_memory:
            fix += "; --pin_memory (asynchronous host-to-device copies)"
        fix += "; keep data_dir on fast local storage (the shards are memory-mapped: page cache, not NFS)"
        out.append(Finding("data_wait", f"waiting for the next batch takes {f.data_wait_share:.0%} of step time "
                           f"(median {wait_ms:.1f} of {f.step_ms:.1f} ms)", fix, f.data_wait_share, DATA_WAIT_SHARE))
    if f.idle_share is not None and f.idle_share > IDLE_SHARE:
        where = ("the GPU sits idle between kernels" if gpu else
                 "time outside any aten op (Python and framework overhead; stack tracing inflates it)")
        out.append(Finding("device_idle", f"{where}: {f.idle_share:.0%} of step time, besides data waits",
                           _faster_launches(s), f.idle_share, IDLE_SHARE))
    if (f.median_kernel_us is not None and f.median_kernel_us < LAUNCH_KERNEL_US
            and f.kernels_per_step >= LAUNCH_MIN_KERNELS and f.kernel_share < LAUNCH_KERNEL_SHARE):
        what = "kernels" if gpu else "compute ops (aten ops doing their own work)"
        out.append(Finding("launch_bound", f"{f.kernels_per_step:.0f} {what} per step, median "
                           f"{f.median_kernel_us:.1f} us, together {f.kernel_share:.0%} of the step: launching them, "
                           "not running them, sets the pace", _faster_launches(s), f.median_kernel_us,
                           LAUNCH_KERNEL_US))
    if f.fp32_matmul_share is not None and f.fp32_matmul_share > FP32_MATMUL_SHARE and s.amp_speeds_matmuls:
        tf32 = " (TF32 on tensor cores, still half bf16's rate)" if gpu else ""
        fix = ("--use_amp (bf16 autocast: matmuls at the low-precision rate, half the activation memory)"
               if not s.use_amp else "the fp32 matmuls run outside autocast: look for .float() before a matmul")
        out.append(Finding("fp32_matmul", f"{f.fp32_matmul_share:.0%} of matmul time has float32 inputs{tf32}",
                           fix, f.fp32_matmul_share, FP32_MATMUL_SHARE))
    if f.memory_share is not None and f.memory_share > MEMORY_SHARE:
        gib = 2**30
        if s.mode == "train":
            fix = (f"--batch_size {max(1, s.batch_size // 2)} --gradient_accumulation_steps 2 (same global batch)"
                   + ("" if s.gradient_checkpointing else "; --gradient_checkpointing (recompute activations)")
                   + ("" if s.use_amp else "; --use_amp (bf16 activations)"))
        else:
            fix = f"--batch_size {max(1, s.batch_size // 2)}" + ("" if s.use_amp else "; --use_amp")
        out.append(Finding("memory", f"peak memory {s.peak_memory_bytes / gib:.2f} GiB is {f.memory_share:.0%} of "
                           f"{s.memory_capacity_bytes / gib:.2f} GiB", fix, f.memory_share, MEMORY_SHARE))
    if f.syncs_per_step > SYNCS_PER_STEP:
        calls = ", ".join(f"{name} x{n}" for name, n in sorted(f.sync_calls.items()))
        what = "host-device synchronisations" if gpu else "host reads of tensor values (each a sync on a GPU)"
        out.append(Finding("host_sync", f"{f.syncs_per_step:g} {what} per step ({calls})",
                           "keep values on the device inside the step: no .item(), .tolist(), print(tensor) or "
                           "`if tensor:`; accumulate the loss in a tensor and read it every N steps (--log_interval)",
                           f.syncs_per_step, SYNCS_PER_STEP))
    if s.graph_breaks:
        reasons = "; ".join(f"{r} (x{n})" for r, n in sorted(s.graph_breaks.items(), key=lambda kv: -kv[1]))
        out.append(Finding("graph_breaks", f"{f.graph_breaks} torch.compile graph break(s): {reasons}",
                           "move print/.item()/data-dependent Python branches out of forward (for .item(): "
                           "torch._dynamo.config.capture_scalar_outputs = True); TORCH_LOGS=graph_breaks shows the "
                           "lines; gptopt train --compile_fullgraph stops at the first one", f.graph_breaks, 0))
    return out


def is_python_frame(e: FunctionEvent) -> bool:
    """A Python frame that with_stack recorded, not an operator. torch 2.12 started listing those frames
    among the events (and flagging them); before it they are not events, and the flag does not exist."""
    return bool(getattr(e, "is_python_function", False))


def activity_type(e: FunctionEvent) -> str | None:
    """kineto's kind of a device event ("kernel", "gpu_memcpy", "gpu_user_annotation", ...). torch 2.12
    added it to the events; before it, None, and is_user_annotation and the names of copies say the same
    (an H200 with torch 2.11 failed on the missing attribute)."""
    return getattr(e, "activity_type", None)


def input_dtypes(e: FunctionEvent) -> tuple[str, ...] | None:
    """The op's input dtypes (record_shapes), or None where they are unknown."""
    dtypes = getattr(e, "input_dtypes", None)
    return None if dtypes is None else tuple(map(str, dtypes))


def attach_dtypes(prof: Any, events: Sequence[FunctionEvent]) -> None:
    """torch before 2.12 keeps record_shapes' input dtypes on its kineto events only, not on the
    FunctionEvents built from them: copy them over, matched by the id and start time each was given."""
    if not events or all(hasattr(e, "input_dtypes") for e in events):
        return
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None or not hasattr(results, "trace_start_ns"):
        return
    start = results.trace_start_ns()
    dtypes = {(k.correlation_id(), (k.start_ns() - start) / 1000): k.dtypes() for k in results.events()
              if k.device_type() == DeviceType.CPU}
    for e in events:
        found = dtypes.get((e.id, e.time_range.start))
        if found is not None and not hasattr(e, "input_dtypes"):
            e.input_dtypes = found


def trace_ops(events: Sequence[FunctionEvent]) -> list[OpRecord]:
    """The events inside the `gptopt::step` ranges of a real torch.profiler trace, as OpRecords."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not is_python_frame(e)]
    steps = sorted((e.time_range.start, e.time_range.end) for e in cpu if e.name == STEP_RANGE)
    exempt = [(e.time_range.start, e.time_range.end) for e in cpu if e.name in (SYNC_RANGE, READOUT_RANGE)]
    starts = [a for a, _ in steps]

    def step_of(t: float) -> int | None:
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 and t <= steps[i][1] else None

    def ancestors(e: FunctionEvent) -> list[FunctionEvent]:
        chain, p = [], e.cpu_parent
        while p is not None:
            chain.append(p)
            p = p.cpu_parent
        return chain

    aten = [e for e in cpu if e.name.startswith(OP_PREFIXES)]
    parents = {id(e): [p for p in ancestors(e) if p.name.startswith(OP_PREFIXES)] for e in aten}
    outer_matmul = {id(p) for e in aten if e.name in MATMUL_OPS for p in parents[id(e)] if p.name in MATMUL_OPS}
    gpu = any(e.device_type == DeviceType.CUDA for e in events)
    records = []
    for e in events:
        t0, t1 = e.time_range.start, e.time_range.end
        i = step_of(t0)
        if i is None or is_python_frame(e):
            continue
        base = dict(name=e.name, step=i, start_us=t0 - steps[i][0], dur_us=t1 - t0)
        if e.device_type == DeviceType.CUDA:
            kind = activity_type(e)
            if e.is_user_annotation or kind == "gpu_user_annotation":
                continue
            copy = kind in ("gpu_memcpy", "gpu_memset") or e.name.startswith(("Memcpy", "Memset"))
            records.append(OpRecord(**base, kernel=not copy, busy=True))
        elif e.device_type == DeviceType.CPU and e.name.startswith(OP_PREFIXES):
            top = not parents[id(e)]
            matmul = e.name in MATMUL_OPS and id(e) not in outer_matmul
            if gpu:  # the device's side of the story comes from its own events
                if matmul:
                    records.append(OpRecord(**{**base, "dur_us": e.device_time_total},
                                            dtypes=input_dtypes(e), matmul=True))
                continue
            # A CPU 'kernel' does its own work: most of its time is its own, not its callees' (addmm runs the
            # GEMM and calls copy_ for the bias; linear only calls addmm). Views and empty tensors are no work.
            kernel = e.name not in CPU_METADATA_OPS and e.self_cpu_time_total >= 0.5 * e.cpu_time_total
            sync = top and e.name in HOST_READ_OPS and not any(a <= t0 <= b for a, b in exempt)
            if top or kernel or matmul or sync:
                records.append(OpRecord(**base, self_us=e.self_cpu_time_total, dtypes=input_dtypes(e),
                                        kernel=kernel, busy=top, matmul=matmul, sync=sync))
        elif e.name in CUDA_SYNC_CALLS and not any(a <= t0 <= b for a, b in exempt):
            records.append(OpRecord(**base, sync=True))
    return records


# ----------------------------------------------------------------------------------------------
# Running the steps


def amp_speeds_matmuls(plan: DevicePlan) -> bool:
    """Whether autocast would run matmuls faster here: tensor cores (sm_70+), MPS, AMX / AVX512-BF16 CPUs."""
    if plan.device.type == "cuda":
        return torch.cuda.get_device_capability(plan.device)[0] >= 7
    return plan.device.type == "mps" or cpu_has_fast_bf16()


def train_config(cfg: ProfileConfig) -> TrainConfig:
    """The TrainConfig of the profiled run: the profile's batch, precision, compile and checkpointing;
    `gptopt train`'s defaults for the rest (learning rate, schedule, clipping, weight decay)."""
    return TrainConfig(preset=cfg.preset, data_dir=cfg.data_dir, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                       device=cfg.device, use_amp=cfg.use_amp, amp_dtype=cfg.amp_dtype, compile=cfg.compile,
                       compile_mode=cfg.compile_mode, attention=cfg.attention,
                       gradient_checkpointing=cfg.gradient_checkpointing, num_workers=cfg.num_workers,
                       pin_memory=cfg.pin_memory)


def _train_step(tcfg: TrainConfig, raw: GPT, plan: DevicePlan, batches: Any) -> Callable[[], float]:
    """gptopt train's step on the next batch; it returns the seconds it waited for that batch."""
    model = wrap_for_training(raw, plan, DistInfo(), compile=tcfg.compile, compile_mode=tcfg.compile_mode).model
    train_step = TrainStep(model, raw, plan, tcfg)
    step = 0

    def run() -> float:
        nonlocal step
        with record_function(DATA_WAIT_RANGE):
            t0 = time.perf_counter()
            x, y = next(batches)
            wait = time.perf_counter() - t0
        x, y = x.to(plan.device, non_blocking=True), y.to(plan.device, non_blocking=True)
        train_step(step, lambda micro: (x, y))
        step += 1
        return wait

    return run


def _generate_step(cfg: ProfileConfig, raw: GPT, plan: DevicePlan, prompts: torch.Tensor,
                   steps: int) -> Callable[[], float]:
    """One greedy decode step of the whole batch by the Generator, after the prompts' prefill (done here,
    before any profiled step). The sequences grow to seq_len tokens: the prompts are `steps` shorter."""
    seq_len = prompts.size(1)  # longer than steps: ProfileConfig refuses a --seq_len that leaves no prompt
    # Generation runs in the weights' dtype, without autocast (load_for_inference casts them once):
    # --use_amp gives the weights the autocast dtype the device policy resolves to.
    raw.to(device=plan.device, dtype=plan.amp_dtype or torch.float32).eval()
    inference_layout(raw, plan.device.type)
    B = prompts.size(0)
    gen = Generator(raw, plan, max_batch_size=B, max_len=seq_len, compile=cfg.compile)
    rows = prompts[:, : seq_len - steps].tolist()
    slots = [gen.alloc() for _ in rows]
    greedy = [SamplingParams(temperature=0.0)] * B
    logits = torch.stack([gen.prefill(s, p) for s, p in zip(slots, rows, strict=True)])
    tokens = gen.sample(logits, greedy, rows, [None] * B)

    def run() -> float:
        nonlocal tokens
        for r, t in zip(rows, tokens, strict=True):
            r.append(t)
        logits = gen.decode(slots, tokens, [len(r) - 1 for r in rows])
        with record_function(READOUT_RANGE):  # the tokens come back to the host, as every decode loop reads them
            tokens = gen.sample(logits, greedy, rows, [None] * B)
        return 0.0

    return run


def _memory_snapshot(out: Path) -> None:
    """Every allocation since recording began, with its stack: https://pytorch.org/memory_viz draws it."""
    dump_memory_snapshot(str(out / "memory_snapshot.pickle"))


def profile_steps(cfg: ProfileConfig) -> tuple[TraceSummary, str]:
    """Profile the configured steps, write the traces to cfg.output_dir; returns the summary and op table.
    (main checks the folder first; this writes into it as it is.)"""
    plan = resolve(cfg.device, cfg.amp_dtype if cfg.use_amp else "fp32")
    process.set_matmul_precision(plan)
    if cfg.compile:
        process.allow_recompiles()
    out = Path(cfg.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokens = data.open_data(cfg.data_dir)  # the default corpus is prepared on first use, as train does
    tcfg = train_config(cfg)
    auto = default_attention(plan.device.type, plan.amp_dtype)
    model_cfg = preset_for_data(cfg.preset, tokens.model_vocab_size, vocab_pad_multiple=tcfg.vocab_padding,
                       attention=cfg.attention if cfg.attention != "auto" else auto,
                       gradient_checkpointing=cfg.gradient_checkpointing)
    tokens.check_vocab(model_cfg.vocab_size)
    seq_len = cfg.seq_len or model_cfg.block_size  # within the preset's context: ProfileConfig refuses one beyond
    memory_check.require(step_memory.train_step_bytes(model_cfg, cfg.batch_size, seq_len, amp_dtype=plan.amp_dtype)
                   if cfg.mode == "train"
                   else generator_memory.inference_bytes(model_cfg, cfg.batch_size, seq_len, dtype=plan.amp_dtype),
                   plan.device, f"profiling {cfg.mode} steps at batch {cfg.batch_size} x {seq_len} tokens",
                   "use a smaller --batch_size or --seq_len" + ("" if cfg.gradient_checkpointing or cfg.mode != "train"
                                                                else ", or --gradient_checkpointing"))
    loader_opts = loader_options(tcfg, plan.device.type)  # what gptopt train would feed the steps
    ds = data.BatchDataset(tokens, "train", cfg.batch_size, seq_len, seed=tcfg.seed)
    batches = iter(data.make_loader(ds, **loader_opts))
    torch.manual_seed(tcfg.seed)  # the initial weights `gptopt train` starts from
    raw = GPT(model_cfg)
    if cfg.compile:
        graph_breaks().clear()  # count this model's breaks only
    total = cfg.wait + cfg.warmup + cfg.active
    if cfg.mode == "generate":
        step = _generate_step(cfg, raw, plan, next(batches)[0], total)
    else:
        step = _train_step(tcfg, raw, plan, batches)
    gpu = plan.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    if gpu:
        torch.cuda.reset_peak_memory_stats(plan.device)
        record_memory_history(max_entries=100_000)
    prof = profile(activities=activities,
                   schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
                   on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out / "tensorboard")),
                   record_shapes=True, profile_memory=True, with_stack=True)
    first_active = cfg.wait + cfg.warmup
    snapshot_at = first_active or total  # before the recorded steps: the history's stack capture slows the host
    step_s: list[float] = []
    waits: list[float] = []
    what = "decode steps (prefilled before them)" if cfg.mode == "generate" else "train steps"
    log.info(f"profiling {what}: {cfg.wait} skipped, {cfg.warmup} warm-up, {cfg.active} recorded "
             f"({cfg.preset}, batch {cfg.batch_size} x {seq_len}, {plan.amp_name}"
             f"{', compiled' if cfg.compile else ''})")
    with prof:
        for i in range(total):
            if gpu and i == snapshot_at:
                _memory_snapshot(out)
            t0 = time.perf_counter()
            with record_function(STEP_RANGE):
                wait = step()
                with record_function(SYNC_RANGE):
                    plan.synchronize()
            dt = time.perf_counter() - t0
            if i >= first_active:
                step_s.append(dt)
                waits.append(wait)
            log.info(f"step {i + 1}/{total}: {dt * 1e3:.1f} ms" + (" (recorded)" if i >= first_active else ""))
            prof.step()
    if gpu and snapshot_at == total:
        _memory_snapshot(out)
    # A trace can be exported once: the TensorBoard handler has done it, so trace.json is a copy of that file.
    written = max((out / "tensorboard").glob("*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
    shutil.copyfile(written, out / "trace.json")
    log.info("reading the trace")
    breaks = None
    if cfg.compile:  # reason (its first line) -> count
        breaks = {str(r).strip().splitlines()[0]: n for r, n in graph_breaks().items()}
    events = prof.events()
    attach_dtypes(prof, events)
    summary = TraceSummary(
        device_type=plan.device.type, step_s=step_s, data_wait_s=waits, ops=trace_ops(events),
        peak_memory_bytes=peak_memory_bytes(plan), memory_capacity_bytes=memory_check.capacity_bytes(plan.device),
        graph_breaks=breaks, amp_speeds_matmuls=amp_speeds_matmuls(plan), mode=cfg.mode,
        batch_size=cfg.batch_size, num_workers=loader_opts["num_workers"], pin_memory=loader_opts["pin_memory"],
        use_amp=cfg.use_amp, compile=cfg.compile, compile_mode=cfg.compile_mode,
        gradient_checkpointing=cfg.gradient_checkpointing,
    )
    # Operators only: Python frames (with_stack) and our own ranges would otherwise lead a CPU table by self time.
    python = {e.name for e in events if is_python_frame(e)}
    ops = [a for a in prof.key_averages() if a.key not in python and not a.is_user_annotation]
    table = EventList(ops, use_device="cuda" if gpu else None, profile_memory=True).table(
        sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=cfg.row_limit)
    return summary, table


def main(cfg: ProfileConfig) -> int:
    out = Path(cfg.output_dir).expanduser()
    with lock_output(out):  # one writer in the folder, from its checks to the last trace
        return _profile(cfg, out)


def _profile(cfg: ProfileConfig, out: Path) -> int:
    # Before any data, model or measurement: an earlier profile's files there are refused without --overwrite,
    # and with it replaced only in a folder gptopt marked as a profile output. The user's own files stay.
    old = check_output(out, kind=KIND, overwrite=cfg.overwrite, ours=FILES)
    # The profiler writes its traces as it runs, so the old ones are set aside for the whole run (a new
    # trace must not land beside an old one) and come back if it fails (an error, Ctrl-C).
    with replacing(out, kind=KIND, ours=FILES, old=old):
        summary, table = profile_steps(cfg)
        findings, f = diagnose(summary), figures(summary)
        # Every figure goes in, not only the findings': a clean run shows how far it is from each threshold.
        doc = {"config": dataclasses.asdict(cfg), "device_type": summary.device_type, "figures": dataclasses.asdict(f),
               "findings": [dataclasses.asdict(finding) for finding in findings]}
        (out / "diagnosis.json").write_text(json.dumps(doc, indent=2))
    print(table)
    print(f"diagnosis of {f.steps} recorded {cfg.mode} steps (median {f.step_ms:.1f} ms):")
    for finding in findings:
        print(f"  [{finding.name}] {finding.figure}\n      fix: {finding.fix}")
    if not findings:
        print("  no bottleneck found above the thresholds")
    log.info(f"traces in {cfg.output_dir}: tensorboard/, trace.json, diagnosis.json"
             + (", memory_snapshot.pickle" if summary.device_type == "cuda" else ""))
    if cfg.json:
        print(json.dumps(doc))
    return 0
