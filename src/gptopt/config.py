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


def preset_for_data(name: str, data_vocab: int, **overrides: Any) -> GPTConfig:
    """The preset sized for a corpus: the GPT-2 sizes keep GPT-2's 50257-token embedding (their
    FLOPs and memory are GPT-2's whatever the corpus' tokenizer), the small ones take the data's."""
    base = PRESETS.get(name, {}).get("vocab_size", 0)
    vocab = max(base, data_vocab) if name.startswith("gpt2") else data_vocab
    return preset(name, **{"vocab_size": vocab, **overrides})


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


@dataclass(kw_only=True)
class PrepareConfig:
    input: str | None = opt(None, "text file or folder to tokenize (*.txt, *.md, *.py, ...); default: the stdlib corpus")
    dataset: str | None = opt(None, "Hugging Face dataset name instead of --input (needs the 'data' extra, online)")
    dataset_config: str | None = opt(None, "the dataset's configuration name, if it has several")
    dataset_split: str = opt("train", "which split of the dataset to read")
    text_field: str = opt("text", "the dataset column that holds the text")
    max_documents: int | None = opt(None, "stop after this many documents (quick experiments on big datasets)")
    tokenizer: str = opt(
        "bpe", "bpe (train a byte-level BPE on the corpus), gpt2 (GPT-2's own), or a tokenizer.json / directory"
    )
    vocab_size: int = opt(8192, "vocabulary size of the trained BPE (ignored for gpt2 or a given tokenizer)")
    val_fraction: float = opt(0.005, "share of documents held out for validation")
    output_dir: str = opt("data/stdlib", "where train.bin, val.bin, meta.json and tokenizer.json go")
    num_workers: int = opt(0, "tokenizer threads; 0 = every core")
    seed: int = opt(1337, "seed of the document shuffle that makes the train/val split")
    overwrite: bool = opt(False, "replace the train.bin, val.bin, meta.json and tokenizer.json an earlier prepare wrote "
                                 "in output_dir (other files there are never touched)")

    def __post_init__(self) -> None:
        if self.input and self.dataset:
            raise ValueError("give either --input or --dataset, not both")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")
        if self.vocab_size < 256 + 1:
            raise ValueError(f"vocab_size must exceed 256 (the byte alphabet), got {self.vocab_size}")
        if self.vocab_size > 2**32 - 1:
            raise ValueError("vocab_size must fit in uint32")


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '1.5h' -> seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            return float(t[:-1]) * units[t[-1]]
        return float(t)
    except ValueError:
        raise ValueError(f"bad duration {text!r}: use seconds or a suffix, e.g. 90s, 10m, 1.5h") from None


@dataclass(kw_only=True)
class TrainConfig:
    # what to train
    preset: str = opt("tiny", "model size when training from scratch: " + ", ".join(PRESETS))
    init_from: str = field(
        default="scratch",
        metadata={
            "help": "scratch (random --preset), a GPT-2 name (gpt2, gpt2-medium, ... from the hub), "
            "or a Hugging Face / gptopt model directory to fine-tune",
            "aliases": ("--model_name",),  # the playbook's spelling
        },
    )
    data_dir: str = opt("data/stdlib", "token shards written by `gptopt prepare` (or nanoGPT train.bin/val.bin)")
    output_dir: str = opt("out", "checkpoints, metrics.jsonl, TensorBoard logs and traces go here")
    seq_len: int | None = opt(None, "tokens per sequence; default: the model's context")
    dropout: float = opt(0.0, "dropout (0 for pretraining; 0.1 is common when fine-tuning small data)")
    vocab_pad_multiple: int = opt(64, "pad the vocabulary to a multiple of this (tensor-core friendly shapes)")
    # batch and length of the run
    batch_size: int = opt(16, "micro-batch: sequences per forward/backward on each device")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step (global batch = this x batch x ranks)")
    auto_batch_size: bool = opt(False, "find the largest micro-batch that fits and raise accumulation to keep the global batch")
    max_steps: int = opt(600, "optimizer steps to run")
    max_tokens: int | None = opt(None, "stop after this many training tokens (all ranks together)")
    time_budget: str | None = opt(None, "stop (and save) after this wall time, e.g. 10m, 2h")
    # optimizer
    learning_rate: float = opt(1e-3, "peak learning rate")
    min_lr: float | None = opt(None, "final learning rate of the cosine decay; default: learning_rate / 10")
    warmup_steps: int = opt(100, "linear warmup steps")
    weight_decay: float = opt(0.1, "AdamW weight decay on matrices (not biases or LayerNorm)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 disables)")
    fused_optimizer: bool = opt(True, "the fused AdamW kernel where torch has it")
    # speed
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    use_amp: bool = opt(False, "mixed precision autocast (bf16, or fp16 with GradScaler on older GPUs)")
    amp_dtype: str = opt("auto", "autocast dtype: auto picks by device", choices=("auto", "bf16", "fp16"))
    use_compile: bool = opt(False, "torch.compile the model (compile time is reported apart from step time)")
    compile_mode: str = opt("default", "torch.compile mode",
                            choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    compile_fullgraph: bool = opt(False, "fail on graph breaks instead of splitting the graph (reports the reason)")
    attention: str = opt("auto", "attention kernel; auto: sdpa on GPUs, eager on CPUs (measured faster there)",
                         choices=("auto", "sdpa", "eager"))
    gradient_checkpointing: bool = opt(False, "recompute activations in backward: less memory, more compute")
    # data loading
    num_workers: int | None = opt(None, "DataLoader worker processes; default chosen for the device")
    pin_memory: bool | None = opt(None, "page-locked host batches for async copies; default: on with CUDA")
    prefetch_factor: int | None = opt(None, "batches each worker prepares ahead; default 2 with workers")
    persistent_workers: bool | None = opt(None, "keep workers alive between epochs/evals; default: on with workers")
    # several devices
    fsdp: bool = opt(False, "shard parameters, gradients and optimizer state with FSDP2 (under torchrun)")
    cpu_offload: bool = opt(False, "with --fsdp: keep parameters, gradients and optimizer state in host memory")
    # evaluation, logging, checkpoints
    eval_interval: int = opt(250, "evaluate (val loss, perplexity, a sample) every N steps; 0 disables")
    eval_iters: int = opt(20, "val batches per evaluation")
    sample_tokens: int = opt(48, "tokens of generated sample shown at each evaluation; 0 disables")
    log_interval: int = opt(10, "write a metrics.jsonl record every N steps")
    save_interval: int = opt(500, "checkpoint every N steps (and always at the end)")
    save_total_limit: int = opt(3, "keep the last K checkpoints")
    resume: str | None = opt(None, "auto (latest checkpoint in output_dir, if any) or a checkpoint directory")
    max_bad_steps: int = opt(5, "stop after this many consecutive NaN/Inf steps (each one is skipped)")
    profile: bool = opt(False, "write torch.profiler traces of a few steady-state steps (TensorBoard opens them)")
    tensorboard: bool = opt(True, "TensorBoard event files under output_dir/logs (if tensorboard is installed)")
    seed: int = opt(1337, "seed for init, data order and dropout")
    overwrite: bool = opt(False, "start afresh even if output_dir holds checkpoints of another run")

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        for name in ("batch_size", "gradient_accumulation_steps", "max_steps", "save_total_limit", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "eval_iters", "log_interval", "save_interval", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"--seq_len must be >= 1, got {self.seq_len}")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}")
        if self.cpu_offload and not self.fsdp:
            raise ValueError("--cpu_offload needs --fsdp (it is FSDP2's offload policy)")
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        if self.min_lr is None:
            self.min_lr = self.learning_rate / 10

    @property
    def time_budget_s(self) -> float | None:
        return None if self.time_budget is None else parse_duration(self.time_budget)


@dataclass(kw_only=True)
class BenchConfig:
    preset: str | None = opt(None, "model size; default: tiny on a CPU, gpt2 on a GPU")
    batch_size: int | None = opt(None, "micro-batch of every rung; default: 16 on a CPU, 16 on a GPU")
    seq_len: int | None = opt(None, "sequence length; default: 256 on a CPU, 1024 on a GPU")
    steps: int = opt(10, "timed steps per rung (after warm-up); the median and p10/p90 come from these")
    warmup: int = opt(3, "untimed steps per rung before timing (compile happens in the first)")
    mode: str = opt("train", "train: the training ladder; infer: the generation ladder", choices=("train", "infer"))
    rungs: str = opt("default", "comma-separated rungs, 'default' or 'all'; `--rungs list` prints them")
    loss_tolerance: float = opt(0.02, "a rung whose loss departs from the baseline's by more than this share fails")
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    data_dir: str = opt("data/stdlib", "token shards; the default corpus is prepared on first use")
    output_dir: str = opt("bench_out", "report.md, results.json, results.csv, plots and best.toml go here")
    overwrite: bool = opt(False, "replace the report an earlier bench wrote in output_dir (other files there are kept)")
    seed: int = opt(1337, "seed for weights and data: every rung trains on identical batches")
    json: bool = opt(False, "print the results JSON as the last line of stdout")

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if self.steps < 10:
            raise ValueError(f"--steps must be >= 10 for a median with p10/p90, got {self.steps}")
        if self.warmup < 1:
            raise ValueError(f"--warmup must be >= 1 (the first step compiles and warms caches), got {self.warmup}")
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.loss_tolerance < 1:
            raise ValueError(f"--loss_tolerance must be in (0, 1), got {self.loss_tolerance}")


TUNE_AXES = ("attention", "amp", "fused", "loader", "batch", "checkpointing", "compile")


@dataclass(kw_only=True)
class TuneConfig:
    preset: str | None = opt(None, "model size; default: tiny on a CPU, gpt2 on a GPU")
    seq_len: int | None = opt(None, "sequence length; default: 256 on a CPU, 1024 on a GPU")
    # bench's micro-batch (16) on a CPU, so the winner compares with bench's rungs; room to grow on a GPU
    global_batch_tokens: int | None = opt(
        None, "tokens per optimizer step, a multiple of seq_len, kept fixed by gradient accumulation; "
        "default: 16 sequences on a CPU, 64 on a GPU")
    time_budget: str = opt("10m", "wall time for the whole search, e.g. 90s, 10m, 1h; it always ends with a winner")
    memory_budget: float = opt(0.9, "share of device memory a candidate may use (GPU: its memory; CPU: RAM free at start + this process's)")
    axes: str = opt("all", "comma-separated axes to search: " + ", ".join(TUNE_AXES) + "; or all")
    steps: int = opt(5, "timed steps per candidate (after warm-up); its median step time ranks it")
    warmup: int = opt(2, "untimed steps per candidate before timing (compile happens in the first)")
    loss_tolerance: float = opt(0.02, "a candidate whose loss departs from the fp32 reference's by more than this share is rejected")
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    data_dir: str = opt("data/stdlib", "token shards; the default corpus is prepared on first use")
    output_dir: str = opt("tune_out", "tune.toml, tune_report.md, tune_results.json / .csv and tune.png go here")
    overwrite: bool = opt(False, "replace the files an earlier tune wrote in output_dir (other files there are kept)")
    seed: int = opt(1337, "seed for weights and data: every candidate trains on identical batches")
    json: bool = opt(False, "print the summary JSON as the last line of stdout")

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        for name in ("seq_len", "global_batch_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 3:
            raise ValueError(f"--steps must be >= 3 (a median, and two steps before a slow candidate is pruned), got {self.steps}")
        if self.warmup < 1:
            raise ValueError(f"--warmup must be >= 1 (the first step compiles and warms caches), got {self.warmup}")
        if not 0 < self.memory_budget <= 1:
            raise ValueError(f"--memory_budget is a share of device memory in (0, 1], got {self.memory_budget}")
        if not 0 < self.loss_tolerance < 1:
            raise ValueError(f"--loss_tolerance must be in (0, 1), got {self.loss_tolerance}")
        if parse_duration(self.time_budget) <= 0:
            raise ValueError(f"--time_budget must be positive, got {self.time_budget!r}")
        unknown = set(self.axis_set) - set(TUNE_AXES)
        if unknown:
            raise ValueError(f"unknown tune axes {sorted(unknown)}; choose from: {', '.join(TUNE_AXES)}, all")

    @property
    def axis_set(self) -> set[str]:
        names = {a.strip() for a in self.axes.split(",") if a.strip()}
        return set(TUNE_AXES) if "all" in names else names

    @property
    def time_budget_s(self) -> float:
        return parse_duration(self.time_budget)


@dataclass(kw_only=True)
class ProfileConfig:
    preset: str = opt("tiny", "model size: " + ", ".join(PRESETS))
    mode: str = opt("train", "what to profile: training steps or generation steps", choices=("train", "generate"))
    batch_size: int = opt(8, "micro-batch")
    seq_len: int | None = opt(None, "sequence length; default: the model's context")
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    use_amp: bool = opt(False, "profile under autocast")
    amp_dtype: str = opt("auto", "autocast dtype: auto picks by device", choices=("auto", "bf16", "fp16"))
    use_compile: bool = opt(False, "profile the compiled model (graph breaks are counted and explained)")
    compile_mode: str = opt("default", "torch.compile mode", choices=("default", "reduce-overhead", "max-autotune"))
    attention: str = opt("auto", "attention kernel; auto: sdpa on GPUs, eager on CPUs", choices=("auto", "sdpa", "eager"))
    gradient_checkpointing: bool = opt(False, "recompute activations in backward")
    num_workers: int | None = opt(None, "DataLoader workers feeding the profiled steps; default: as `gptopt train` picks")
    pin_memory: bool | None = opt(None, "page-locked host batches; default: on with CUDA, as `gptopt train` picks")
    data_dir: str = opt("data/stdlib", "token shards; the default corpus is prepared on first use")
    wait: int = opt(2, "steps skipped before profiling (compile, caches)")
    warmup: int = opt(2, "profiled-but-discarded steps (profiler warm-up)")
    active: int = opt(4, "recorded steps")
    row_limit: int = opt(15, "rows of the operator table")
    output_dir: str = opt("profile_out", "TensorBoard traces, Chrome trace, memory snapshot, diagnosis.json")
    overwrite: bool = opt(False, "replace the traces an earlier profile wrote in output_dir (other files there are kept)")
    json: bool = opt(False, "print the diagnosis JSON as the last line of stdout")

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        for name in ("batch_size", "active", "row_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("wait", "warmup", "num_workers"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"--seq_len must be >= 1, got {self.seq_len}")


@dataclass(kw_only=True)
class SamplingConfig:
    """Sampling options shared by generate and serve (serve takes them per request)."""

    max_new_tokens: int = opt(128, "tokens to generate per prompt")
    temperature: float = opt(0.8, "softmax temperature; 0 = greedy")
    top_k: int | None = opt(50, "sample from the k most likely tokens (none = all)")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches p")
    repetition_penalty: float = opt(1.0, "divide the logits of tokens already present by this (> 1 discourages repeats)")
    seed: int | None = opt(None, "seed: the same seed and prompt give the same sample")
    stop: str | None = opt(None, "stop when this text appears (\\n escapes allowed); it is not included")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top_k must be >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"--repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass(kw_only=True)
class GenerateConfig(SamplingConfig):
    prompt: str | None = field(default=None, metadata={"help": "the prompt; '-' or none reads stdin", "positional": True})
    model: str = opt("out", "a training output dir (its latest checkpoint), a checkpoint, a HF GPT-2 dir, or gpt2")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the checkpoint was trained with")
    input: str | None = opt(None, "batch mode: a file of prompts, one per line (or .jsonl with a 'prompt' field)")
    output: str | None = opt(None, "batch mode: write one JSON object per prompt here (.jsonl)")
    overwrite: bool = opt(False, "replace an existing --output file (written whole: a failed run keeps the old one)")
    batch_size: int = opt(8, "batch mode: prompts decoded together")
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs, fp32 on CPUs), bf16, fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    compile: bool = opt(False, "compile the decode step (reduce-overhead: CUDA graphs on GPUs)")
    quantize: str = opt("none", "int8-weight: torchao int8 weight-only (quant extra)", choices=("none", "int8-weight"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {self.batch_size}")
        if self.output and not self.input:
            raise ValueError("--output needs --input (batch mode)")


@dataclass(kw_only=True)
class ServeConfig:
    model: str = opt("out", "a training output dir, a checkpoint, a HF GPT-2 dir, or gpt2")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the checkpoint was trained with")
    model_name: str | None = opt(None, "the model id /v1/models reports and requests may name; default: the dir name")
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = opt(8000, "port (0 picks a free one)")
    max_batch_size: int = opt(8, "KV-cache slots: requests decoded together (1 = one request at a time)")
    max_queue: int = opt(64, "requests waiting beyond the running ones; more get 429 with Retry-After")
    max_tokens_limit: int = opt(1024, "the largest max_tokens a request may ask for")
    request_timeout: float = opt(120.0, "seconds a request may take before it is ended")
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs, fp32 on CPUs), bf16, fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    compile: bool = opt(False, "compile the decode step")
    quantize: str = opt("none", "int8-weight: torchao int8 weight-only (quant extra)", choices=("none", "int8-weight"))
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' (or set GPTOPT_API_KEY)")
    cors_origin: str | None = opt(None, "allow browser requests from this origin (CORS is off otherwise)")
    blocklist: str | None = opt(None, "file of terms or regular expressions (one a line) refused in prompts and cut from output")

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_tokens_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0 or not 0 <= self.port <= 65535 or self.request_timeout <= 0:
            raise ValueError("--max_queue must be >= 0, --port in 0..65535 and --request_timeout > 0")


MIN_OPSET = 18  # torch.onnx's dynamo exporter writes opset 18 and converts to others; 17 came out invalid


@dataclass(kw_only=True)
class ExportConfig:
    model: str = opt("out", "a training output dir (its latest checkpoint), a checkpoint, a HF GPT-2 dir, or gpt2")
    format: str = opt("onnx", "onnx: model.onnx with KV-cache inputs/outputs for onnxruntime; "
                      "hf: a directory transformers' GPT2LMHeadModel.from_pretrained loads", choices=("onnx", "hf"))
    output_dir: str | None = opt(None, "the directory to write; default: export_onnx or export_hf (by --format)")
    tokenizer: str | None = opt(None, "tokenizer.json or dir to ship beside the model; default: the model's own, if any")
    opset: int = opt(18, "ONNX opset version, 18 or newer (18 is the exporter's own; older ones come out invalid)")
    # Relative, because logits of trained GPT-2s reach |100|: fp32 rounding grows with them.
    tolerance: float = opt(1e-4, "the export fails if a logit differs from PyTorch's by more than this "
                           "times the largest |logit| (at least 1)")
    overwrite: bool = opt(False, "replace an output_dir that holds an earlier export")

    def __post_init__(self) -> None:
        if self.opset < MIN_OPSET:
            raise ValueError(f"--opset must be >= {MIN_OPSET}: torch's exporter converts to older ones wrongly "
                             f"(opset 17 gives a Split that onnxruntime refuses), got {self.opset}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"--tolerance must be in (0, 1), got {self.tolerance}")


@dataclass(kw_only=True)
class LoadtestConfig:
    url: str = opt("http://127.0.0.1:8000", "server base URL (its /v1/completions is driven)")
    requests: int = opt(100, "requests to send in all")
    concurrency: int = opt(16, "requests in flight at once (closed loop); ignored with --rate")
    rate: float | None = opt(None, "open loop: Poisson arrivals at this many requests per second")
    prompt_tokens: int = opt(32, "approximate prompt length in tokens (words of a fixed text)")
    max_tokens: int = opt(64, "max_tokens of each request")
    temperature: float = opt(0.0, "temperature of each request")
    model: str | None = opt(None, "the model field of each request")
    api_key: str | None = opt(None, "Bearer key, if the server needs one")
    timeout: float = opt(300.0, "seconds before a request counts as an error")
    seed: int = opt(0, "seed of arrivals and prompt choice")
    json: bool = opt(False, "print the summary JSON as the last line of stdout")

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.max_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError("--requests, --concurrency, --max_tokens and --prompt_tokens must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")


QUANTIZE_METHODS = ("int8-weight", "int8-dynamic", "int4-weight")


def parse_prune(spec: str | None) -> float | str | None:
    """--prune: None, a fraction in (0, 1), or "2:4"."""
    if spec is None:
        return None
    text = str(spec).strip()
    if text == "2:4":
        return text
    try:
        fraction = float(text)
    except ValueError:
        fraction = float("nan")
    if not 0.0 < fraction < 1.0:  # NaN fails this too
        raise ValueError(f"--prune must be a fraction in (0, 1) such as 0.5, or 2:4; got {spec!r}")
    return fraction


@dataclass(kw_only=True)
class CompressConfig:
    model: str = opt("out", "the model to compress: a training output dir (its latest checkpoint), a checkpoint, "
                     "a HF GPT-2 dir, or gpt2")
    output: str | None = opt(None, "the directory to write the compressed checkpoint and its results.json to "
                             "(new, or empty)")
    quantize: str = opt("none", "int8-weight: torchao int8 weight-only; int8-dynamic: int8 weights and activations "
                        "(the CPU path); int4-weight: torchao int4 (NVIDIA GPUs, compute capability 8.0+)",
                        choices=("none", *QUANTIZE_METHODS))
    prune: str | None = opt(None, "FRACTION in (0, 1): zero that share of each block Linear's weights by magnitude; "
                            "2:4: semi-structured sparsity (NVIDIA GPUs, compute capability 8.0+)")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the model was trained with")
    data_dir: str | None = opt(None, "token shards whose val split scores perplexity and KL; default: the data the "
                               "model was trained on (its checkpoint records it), else data/stdlib")
    eval_tokens: int = opt(16384, "val tokens scored for perplexity and KL, in windows of the model's context")
    repeats: int = opt(5, "timed runs behind each speed figure (the median counts), after one warm-up run")
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    compile: bool = opt(False, "measure with the decode step compiled, as generate and serve run it with --compile")
    json: bool = opt(False, "print results.json as the last line of stdout")
    overwrite: bool = opt(False, "replace an earlier compress output at --output (only one gptopt wrote, holding "
                          "nothing else)")

    def __post_init__(self) -> None:
        if not self.output:
            raise ValueError("--output is required: the new directory the compressed checkpoint goes to")
        if self.quantize not in ("none", *QUANTIZE_METHODS):
            raise ValueError(f"unknown --quantize {self.quantize!r}; choose one of: none, {', '.join(QUANTIZE_METHODS)}")
        parse_prune(self.prune)
        if self.quantize == "none" and self.prune is None:
            raise ValueError("nothing to do: give --quantize METHOD and/or --prune FRACTION|2:4")
        if self.eval_tokens < 1 or self.repeats < 1:
            raise ValueError(f"--eval_tokens and --repeats must be >= 1, got {self.eval_tokens} and {self.repeats}")
