"""Configuration dataclasses: the single source of truth for every option, default and help text.

The CLI builds its flags from these fields (``cli.py``), ``--config FILE.toml`` fills them, and
checkpoints and benchmark results store them. Derived values live in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# ----------------------------------------------------------------------------------------------
# Validation. Every field is checked when a config is made (from flags, TOML, JSON or code), so a
# bad value stops a command before it reads or writes anything. A field's range lives in its
# metadata (ge / gt / le / lt); the upper limits below are far beyond any GPT-2-class use: they
# catch a typo (three zeros too many) that would otherwise fail minutes later, out of memory or
# deep inside a library, after the work done so far is lost.

MAX_BATCH = 1 << 16  # sequences in a batch: GPT-2's 0.5M-token batch is 512 x 1024, this is 128x that
MAX_SEQ_LEN = 1 << 20  # tokens in a sequence: 1024x GPT-2's context
MAX_VOCAB = 1 << 24  # 64x the largest tokenizers in use (~256k)
MAX_LAYERS = 1024  # GPT-2 XL has 48 blocks
MAX_WIDTH = 1 << 16  # n_embd / n_head: GPT-3 175B is 12288 wide with 96 heads
MAX_PAD_MULTIPLE = 4096  # tensor cores want 64 or 128
MAX_STEPS = 10**9  # optimizer or timed steps: GPT-2 trained for ~0.8M
MAX_TOKENS = 10**15  # training tokens: 1000x GPT-3's 300B
MAX_NEW_TOKENS = 1 << 20  # generated tokens per request or prompt: as long as the longest context
MAX_THREADS = 4096  # torch threads of one process: past the cores of the largest servers sold
MAX_SLOTS = 4096  # KV-cache slots of a server: far past where one GPU's decode step stops gaining throughput
# Worker processes or threads: beyond 4 per core they only contend for the cores and each costs memory.
MAX_WORKERS = max(8, 4 * (os.cpu_count() or 1))
MAX_SEED = 2**63 - 1  # numpy's and torch's generators accept seeds in [0, 2**63)
MAX_SECONDS = 7 * 86400.0  # a timeout of a week: larger values overflow event-loop timers


def opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, cli: bool = True,
        ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
        hint: str | None = None, verbatim: bool = False, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with the help text and allowed values (choices, or a range: >= ge, > gt,
    <= le, < lt) that the CLI shows and check_fields enforces; hint: the fix an out-of-range value
    is told, where the range alone does not say it; verbatim: the CLI keeps '' and 'none' as text
    rather than reading them as None (a secret given as an unset "$VAR" must not vanish); aliases:
    other names the CLI accepts for it, as flags and as --config keys (old spellings that command
    lines and files already written still use; --help names the field first)."""
    extra = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, hint=hint).items() if v is not None}
    if verbatim:
        extra["verbatim"] = True
    if aliases:
        extra["aliases"] = tuple(aliases)
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli, **extra})


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as `int`, `str | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported option type {tp}")
        return args[0], True
    return tp, False


@functools.cache
def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's (scalar type, optional?) of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: _base_type(hints[f.name]) for f in dataclasses.fields(cls)}


def _range_text(meta: Any) -> str:
    def num(x: float) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)

    lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    hi = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if lo and hi:
        return f"in {lo[0]}{num(lo[1])}, {num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {num(lo[1])}"
    assert hi is not None
    return f"{'<=' if hi[0] == ']' else '<'} {num(hi[1])}"


def type_ok(value: Any, kind: type) -> bool:
    """Whether value is an option of type kind: bool is an int to Python, never to a user; an int is a fine float."""
    if isinstance(value, bool) and kind is not bool:
        return False
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def check_fields(obj: Any, prefix: str = "--") -> None:
    """Raise ValueError naming the first field whose value has the wrong type, is not finite (floats:
    NaN and infinities are never a setting) or lies outside its range or choices. prefix: how the
    message names a field (--flag for command options, bare for stored model configs)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kind, optional = field_types(type(obj))[f.name]
        name = f"{prefix}{f.name}"
        if value is None and optional:
            continue
        if not type_ok(value, kind):
            raise ValueError(f"{name} must be {kind.__name__}{' or none' if optional else ''}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        meta = f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            raise ValueError(f"{name} must be one of {', '.join(meta['choices'])}; got {value!r}")
        if kind in (int, float) and not (
            ("ge" not in meta or value >= meta["ge"]) and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"]) and ("lt" not in meta or value < meta["lt"])
        ):
            hint = f"; {meta['hint']}" if "hint" in meta else ""
            raise ValueError(f"{name} must be {_range_text(meta)}, got {value}{hint}")


# ----------------------------------------------------------------------------------------------
# Model


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
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")

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
            raise ValueError(f"the model config must be a table of settings, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        # A missing size would silently take GPT-2's default and fail later as a shape mismatch;
        # the other fields came later and default to what older files meant.
        missing = [k for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
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
DATA_VOCAB_PRESETS = ("debug", "tiny", "llama-tiny")
DEFAULT_PRESET = "tiny"  # what a new training run is without --preset


def preset(name: str, **overrides: Any) -> GPTConfig:
    """The named preset as a config; overrides replace single fields (e.g. vocab_size from the data)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


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
            raise ValueError(f"--arch: {item!r} is not FIELD=VALUE of a block field; fields: {', '.join(ARCH_FIELDS)}")
        kind, optional = kinds[name]
        if optional and text.lower() == "none":
            out[name] = None
        elif kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"--arch: {name} takes true or false, got {text!r}")
            out[name] = text.lower() in _TRUE
        else:
            try:
                out[name] = kind(text)
            except ValueError:
                raise ValueError(f"--arch: {name} must be {kind.__name__}, got {text!r}") from None
    return out


# ----------------------------------------------------------------------------------------------
# Commands


@dataclass(kw_only=True)
class DoctorConfig:
    device: str = opt("auto", "device to check: auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    preset: str = opt("tiny", "model preset used to size the memory/disk checks and the smoke test")
    smoke: bool = opt(False, "also run a tiny forward+backward under autocast on the device")
    json: bool = opt(False, "print one JSON document instead of the table")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")


@dataclass(kw_only=True)
class PrepareConfig:
    input: str | None = opt(None, "text file or folder to tokenize (*.txt, *.md, *.py, ...); default: the stdlib "
                                  "corpus")
    dataset: str | None = opt(None, "Hugging Face dataset name instead of --input (needs the 'data' extra, online)")
    dataset_config: str | None = opt(None, "the dataset's configuration name, if it has several")
    dataset_split: str = opt("train", "which split of the dataset to read")
    text_field: str = opt("text", "the dataset column that holds the text")
    max_documents: int | None = opt(None, "stop after this many documents (quick experiments on big datasets)",
                                     ge=1, le=10**12)  # a trillion: more than any corpus holds
    tokenizer: str = opt(
        "bpe", "bpe (train a byte-level BPE on the corpus), gpt2 (GPT-2's own), or a tokenizer.json / directory"
    )
    # > 256: a byte-level BPE starts from the 256 bytes and needs at least one token more
    vocab_size: int = opt(8192, "vocabulary size of the trained BPE (ignored for gpt2 or a given tokenizer)",
                          ge=257, le=MAX_VOCAB)
    val_fraction: float = opt(0.005, "share of documents held out for validation", gt=0.0, lt=0.5)
    output_dir: str = opt("data/stdlib", "where train.bin, val.bin, meta.json and tokenizer.json go")
    num_workers: int = opt(0, "tokenizer threads; 0 = every core", ge=0, le=MAX_WORKERS)
    seed: int = opt(1337, "seed of the document shuffle that makes the train/val split", ge=0, le=MAX_SEED)
    overwrite: bool = opt(False, "replace the train.bin, val.bin, meta.json and tokenizer.json an earlier prepare "
                                 "wrote in output_dir (other files there are never touched)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.input and self.dataset:
            raise ValueError("give either --input or --dataset, not both")


def parse_duration(text: str) -> float:
    """--time_budget: '90', '90s', '10m', '1.5h' -> seconds (positive and finite)."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    try:
        seconds = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:  # NaN fails this too
        raise ValueError(f"--time_budget {text!r} is not a duration: give a positive number of seconds or a suffix, "
                         "e.g. 90s, 10m, 1.5h")
    return seconds


def check_loader(num_workers: int | None, prefetch_factor: int | None, persistent_workers: bool | None) -> None:
    """DataLoader's own rule, checked before any work: prefetching and persistence need worker processes.
    num_workers None (the device's default) is settled later; data.make_loader drops both without workers."""
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError("--prefetch_factor needs worker processes: give --num_workers 1 or more, or drop "
                         "--prefetch_factor")
    if num_workers == 0 and persistent_workers:
        raise ValueError("--persistent_workers needs worker processes: give --num_workers 1 or more, "
                         "or --no-persistent_workers")


# torch.compile's modes: one list for train, profile, and bench's and tune's rungs (each a TrainConfig), so
# a mode that tune.toml or best.toml names is one that train and profile take. reduce-overhead records CUDA
# graphs (GPUs); max-autotune searches kernel configurations and, on GPUs, records CUDA graphs too;
# max-autotune-no-cudagraphs searches without recording them.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# --optimizer muon's default peak learning rate, as a multiple of --learning_rate (Muon's update is
# scaled to AdamW's RMS, optim.MUON_ADJUST_LR, so the two share a scale): the multiple that trained tiny
# furthest among those tried (benchmarks/2026-12-04-muon.md, "Muon: `gptopt train --optimizer muon` against
# AdamW"); the GPT-2 sizes take the same multiple, untried.
MUON_LR_SCALE = 3.0


@dataclass(kw_only=True)
class TrainConfig:
    # what to train
    # None: tiny for a new run; a resumed run keeps its checkpoint's size, and a --preset given for one must match it
    preset: str | None = opt(None, f"model size when training from scratch (default: {DEFAULT_PRESET}): "
                                 + ", ".join(PRESETS))
    arch: str | None = opt(None, "a new run's block changed over its preset's, field by field: e.g. "
                           "positions=rope,qk_norm=true,mlp=relu2,tie_embeddings=false,zero_init=true (fields: "
                           + ", ".join(ARCH_FIELDS) + ")")
    init_from: str = opt("scratch", "scratch (random --preset), a GPT-2 name (gpt2, gpt2-medium, ... from the hub), "
                         "or a Hugging Face / gptopt model directory to fine-tune",
                         aliases=("model_name",))  # the playbook's spelling
    data_dir: str = opt("data/stdlib", "token shards written by `gptopt prepare` (or nanoGPT train.bin/val.bin)")
    output_dir: str = opt("out", "checkpoints, metrics.jsonl, TensorBoard logs and traces go here")
    seq_len: int | None = opt(None, "tokens per sequence; default: the model's context", ge=1, le=MAX_SEQ_LEN)
    dropout: float = opt(0.0, "dropout (0 for pretraining; 0.1 is common when fine-tuning small data)", ge=0.0, lt=1.0)
    vocab_pad_multiple: int = opt(64, "pad the vocabulary to a multiple of this (tensor-core friendly shapes)",
                                  ge=1, le=MAX_PAD_MULTIPLE)
    # batch and length of the run
    batch_size: int = opt(16, "micro-batch: sequences per forward/backward on each device", ge=1, le=MAX_BATCH)
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step (global batch = this x batch x ranks)",
                                           ge=1, le=MAX_BATCH)
    auto_batch_size: bool = opt(False, "find the largest micro-batch that fits and raise accumulation to keep the "
                                "global batch")
    align_documents: bool = opt(False, "start every training window at a document's start (an end-of-text "
                                "boundary) instead of anywhere")
    max_steps: int = opt(600, "optimizer steps to run", ge=1, le=MAX_STEPS)
    max_tokens: int | None = opt(None, "stop after this many training tokens (all ranks together)", ge=1, le=MAX_TOKENS)
    time_budget: str | None = opt(None, "stop (and save) after this wall time, e.g. 10m, 2h")
    target_loss: float | None = opt(None, "stop (and save) once the val loss is at or below this; run.json reports "
                                    "the time, tokens and steps it took", gt=0.0)
    # optimizer
    # AdamW above 1 only diverges; the bound catches a misplaced exponent (1e3 for 1e-3)
    learning_rate: float = opt(1e-3, "peak learning rate", gt=0.0, le=1.0)
    min_lr: float | None = opt(None, "final learning rate of the cosine decay, <= learning_rate; "
                               "default: learning_rate / 10", ge=0.0, le=1.0)
    warmup_steps: int = opt(100, "linear warmup steps", ge=0, le=MAX_STEPS)
    lr_decay_steps: int | None = opt(None, "the step where the cosine decay reaches min_lr (flat after it); "
                                     "default: max_steps", ge=1, le=MAX_STEPS)
    weight_decay: float = opt(0.1, "AdamW weight decay on matrices (not biases or LayerNorm)", ge=0.0)
    beta1: float = opt(0.9, "AdamW beta1", ge=0.0, lt=1.0)  # torch.optim.AdamW's own range
    beta2: float = opt(0.95, "AdamW beta2", ge=0.0, lt=1.0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 disables)", ge=0.0)
    fused_optimizer: bool = opt(True, "the fused AdamW kernel where torch has it")
    optimizer: str = opt("adamw", "adamw; or muon: Muon for the blocks' weight matrices, AdamW for embeddings, the "
                         "tied head, biases and LayerNorm (one process or DDP; not --fsdp)", choices=("adamw", "muon"))
    muon_lr: float | None = opt(None, "--optimizer muon: Muon's peak learning rate (same warmup + cosine, on AdamW's "
                                f"scale); default: learning_rate x {MUON_LR_SCALE:g} (chosen on tiny)", gt=0.0, le=1.0)
    muon_momentum: float = opt(0.95, "--optimizer muon: Muon's (Nesterov) momentum", ge=0.0, lt=1.0)
    # speed
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    use_amp: bool = opt(False, "mixed precision autocast (bf16, or fp16 with GradScaler on older GPUs)")
    amp_dtype: str = opt("auto", "autocast dtype: auto picks by device", choices=("auto", "bf16", "fp16"))
    compile: bool = opt(False, "torch.compile the model (compile time is reported apart from step time)",
                        aliases=("use_compile",))  # the playbook's spelling
    compile_mode: str = opt("default", "torch.compile mode (with --compile)", choices=COMPILE_MODES)
    compile_fullgraph: bool = opt(False, "fail on graph breaks instead of splitting the graph (reports the reason)")
    attention: str = opt("auto", "attention kernel; auto: sdpa, but eager on CPUs under bf16 autocast (measured "
                         "faster there)",
                         choices=("auto", "sdpa", "eager"))
    gradient_checkpointing: bool = opt(False, "recompute activations in backward: less memory, more compute")
    sdpa_backend: str = opt("auto", "the one SDPA kernel the step may use (CUDA, compute capability 8.0+): flash, "
                            "efficient, or cudnn (cuDNN's fused attention, often the fastest on Hopper); auto: "
                            "torch's choice", choices=("auto", "flash", "efficient", "cudnn"))
    fp8: bool = opt(False, "float8 matmuls in the blocks' Linear layers (torchao float8 training, the quant extra): "
                    "NVIDIA GPUs of compute capability 8.9+ (Ada, Hopper, Blackwell) only")
    loss: str = opt("auto", "chunked: the lm_head and cross-entropy a chunk of positions at a time, so the full "
                    "logits (batch x length x vocabulary) never exist; full: the plain loss; auto: full, or chunked "
                    "where only it lets the micro-batch fit", choices=("auto", *LOSSES))
    # data loading
    num_workers: int | None = opt(None, "DataLoader worker processes; default chosen for the device",
                                  ge=0, le=MAX_WORKERS)
    pin_memory: bool | None = opt(None, "page-locked host batches for async copies; default: on with CUDA")
    # >= 1: a worker with nothing to prepare ahead deadlocks, so DataLoader refuses 0
    prefetch_factor: int | None = opt(None, "batches each worker prepares ahead (needs workers); default 2 with "
                                      "workers", ge=1, le=1024)
    persistent_workers: bool | None = opt(None, "keep workers alive between epochs/evals (needs workers); "
                                          "default: on with workers")
    # several devices
    fsdp: bool = opt(False, "shard parameters, gradients and optimizer state with FSDP2 (under torchrun)")
    cpu_offload: bool = opt(False, "with --fsdp: keep parameters, gradients and optimizer state in host memory")
    # evaluation, logging, checkpoints
    # An interval of 0 turns the periodic action off (what is always done at step 1 or at the end stays).
    eval_interval: int | None = opt(None, "evaluate (val loss, perplexity, a sample) every N steps; 0: never; "
                                    "default: 250, or with --target_loss max_steps / 100 (10 to 100)", ge=0,
                                    le=MAX_STEPS)
    eval_iters: int = opt(20, "val batches per evaluation (--eval_interval 0 turns evaluation off)", ge=1, le=100_000,
                          hint="--eval_interval 0 turns evaluation off")
    sample_tokens: int = opt(48, "tokens of generated sample shown at each evaluation; 0: no sample",
                             ge=0, le=MAX_NEW_TOKENS)
    log_interval: int = opt(10, "write a metrics.jsonl record every N steps (and at step 1); 0: step 1 only",
                            ge=0, le=MAX_STEPS)
    save_interval: int = opt(500, "checkpoint every N steps (and always at the end); 0: only at the end",
                             ge=0, le=MAX_STEPS)
    save_total_limit: int = opt(3, "keep the last K checkpoints", ge=1, le=100_000)
    resume: str | None = opt(None, "auto (latest checkpoint in output_dir, if any) or a checkpoint directory")
    max_bad_steps: int = opt(5, "stop after this many consecutive NaN/Inf steps (each one is skipped)",
                             ge=1, le=MAX_STEPS)
    profile: bool = opt(False, "write torch.profiler traces of a few steady-state steps (TensorBoard opens them)")
    tensorboard: bool = opt(True, "TensorBoard event files under output_dir/logs (if tensorboard is installed)")
    seed: int = opt(1337, "seed for init, data order and dropout", ge=0, le=MAX_SEED)
    overwrite: bool = opt(False, "start afresh even if output_dir holds checkpoints of another run")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if self.min_lr is not None and self.min_lr > self.learning_rate:
            raise ValueError(f"--min_lr ({self.min_lr}) must not exceed --learning_rate ({self.learning_rate}): "
                             "it is where the cosine decay ends")
        check_loader(self.num_workers, self.prefetch_factor, self.persistent_workers)
        if self.cpu_offload and not self.fsdp:
            raise ValueError("--cpu_offload needs --fsdp (it is FSDP2's offload policy)")
        if self.sdpa_backend != "auto" and self.attention == "eager":
            raise ValueError(f"--sdpa_backend {self.sdpa_backend} picks an SDPA kernel, and --attention eager does "
                             "not use SDPA: use --attention sdpa, or drop --sdpa_backend")
        if self.optimizer == "muon" and self.fsdp:
            # Newton-Schulz works on whole matrices. torch.optim.Muon does step FSDP2's shards (DTensor), but
            # only by an all-reduce inside every iteration (11 per matrix per step, torch 2.13), and the
            # sharded checkpoint path (distributed.full_state_dicts) covers one torch optimizer.
            raise ValueError("--optimizer muon is not supported with --fsdp (Muon orthogonalises whole weight "
                             "matrices; FSDP2 shards them): drop --fsdp (DDP), or use --optimizer adamw")
        if self.optimizer == "muon":
            import torch  # here, not at the top: building options and help needs no torch

            if not hasattr(torch.optim, "Muon"):
                raise ValueError(f"--optimizer muon needs torch.optim.Muon (torch >= 2.9), this is torch "
                                 f"{torch.__version__}: upgrade torch, or use --optimizer adamw")
        if self.arch:  # a bad field or value is named before any data or model is read
            try:
                preset(self.preset or DEFAULT_PRESET, **arch_overrides(self.arch))
            except ValueError as e:
                raise ValueError(str(e) if str(e).startswith("--arch") else f"--arch: {e}") from None
        if self.muon_lr is not None and self.optimizer != "muon":
            raise ValueError("--muon_lr is Muon's learning rate: add --optimizer muon, or drop --muon_lr")
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        if self.min_lr is None:
            self.min_lr = self.learning_rate / 10
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            raise ValueError(f"--lr_decay_steps ({self.lr_decay_steps}) must come after the warmup "
                             f"(--warmup_steps {self.warmup_steps}): the cosine decay starts where the warmup ends")
        if self.target_loss is not None and self.eval_interval == 0:
            raise ValueError("--target_loss needs evaluations to notice the target: drop --eval_interval 0 "
                             "(the default evaluates about 100 times over max_steps)")
        if self.optimizer == "muon" and self.muon_lr is None:
            self.muon_lr = self.learning_rate * MUON_LR_SCALE

    @property
    def time_budget_s(self) -> float | None:
        return None if self.time_budget is None else parse_duration(self.time_budget)

    @property
    def eval_every(self) -> int:
        """--eval_interval, or its default: 250 steps; with a target often enough that a run stops within
        about 1% of max_steps after reaching it."""
        if self.eval_interval is not None:
            return self.eval_interval
        return 250 if self.target_loss is None else max(10, min(100, self.max_steps // 100))

    @property
    def decay_steps(self) -> int:
        return self.max_steps if self.lr_decay_steps is None else self.lr_decay_steps


@dataclass(kw_only=True)
class BenchConfig:
    preset: str | None = opt(None, "model size; default: tiny on a CPU, gpt2 on a GPU")
    batch_size: int | None = opt(None, "micro-batch of every rung (default: 16); --mode infer: the largest batch of "
                                 "the decode sweep (default: 64 on a GPU, 16 on a CPU)", ge=1, le=MAX_BATCH)
    seq_len: int | None = opt(None, "sequence length; default: 256 on a CPU, 1024 on a GPU", ge=1, le=MAX_SEQ_LEN)
    # >= 10: fewer give no p10/p90
    steps: int = opt(10, "timed steps per rung (after warm-up); the median and p10/p90 come from these",
                     ge=10, le=100_000)
    # >= 1: the first step compiles and warms caches
    warmup: int = opt(3, "untimed steps per rung before timing (compile happens in the first)", ge=1, le=100_000)
    mode: str = opt("train", "train: the training ladder; infer: the generation ladder; quality: the recipe ladder "
                    "(minutes of training to a target val loss)", choices=("train", "infer", "quality"))
    rungs: str = opt("default", "comma-separated rungs, 'default' or 'all'; `--rungs list` prints them")
    batch_sizes: str | None = opt(None, "--mode infer: the batch sizes of the decode sweep, comma-separated (e.g. "
                                  "1,16,64; each compiled rung compiles once per size; batch 1 is always measured: "
                                  "the decode, TTFT and bandwidth figures are its); default: 1, 2, 4, ... up to "
                                  "--batch_size")
    target_loss: float | None = opt(None, "--mode quality: the val loss every run trains to; default: the "
                                    "preset's embedded target (tiny: what AdamW at its tuned settings reaches in "
                                    "about five minutes of a 2-core CPU)", gt=0.0)
    seeds: int = opt(3, "--mode quality: runs of each recipe, seeds --seed, --seed + 1, ...", ge=1, le=100)
    recipes: str = opt("default", "--mode quality: comma-separated recipes of adamw, muon, modern (the speedrun "
                       "block with Muon), its ablations no-muon, no-rope, no-qk_norm, no-relu2, no-untied, "
                       "no-zero_init (modern without that change), aligned, schedule, best; 'default': adamw and "
                       "modern; 'all': every one; adamw is always run")
    max_steps: int | None = opt(None, "--mode quality: the most steps of a run (the cosine horizon of a recipe "
                                "without its own); a run that has not reached the target by then counts as not "
                                "reaching it, and a recipe other than AdamW stops sooner, at 1.5x AdamW's steps on "
                                "its seed (default: 1000)",
                                ge=1, le=MAX_STEPS)
    loss_tolerance: float = opt(0.02, "a rung whose loss departs from the baseline's by more than this share fails",
                                gt=0.0, lt=1.0)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    data_dir: str = opt("data/stdlib", "token shards; the default corpus is prepared on first use")
    output_dir: str = opt("bench_out", "report.md, results.json, results.csv, plots and best.toml go here")
    overwrite: bool = opt(False, "replace the report an earlier bench wrote in output_dir (other files there are kept)")
    seed: int = opt(1337, "seed for weights and data: every rung trains on identical batches", ge=0, le=MAX_SEED)
    json: bool = opt(False, "print the results JSON as the last line of stdout")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if self.batch_sizes is not None:
            if self.mode != "infer":
                raise ValueError("--batch_sizes is the decode sweep of --mode infer; the training ladder takes "
                                 "--batch_size")
            if self.batch_size is not None:
                raise ValueError("give --batch_sizes (the sweep's sizes) or --batch_size (its largest), not both")
            self.sweep()  # refused here, before any work, if malformed
        if self.mode != "quality" and (self.target_loss is not None or self.max_steps is not None
                                       or self.recipes != "default" or self.seeds != 3):
            raise ValueError("--target_loss, --max_steps, --recipes and --seeds belong to the recipe ladder: "
                             "add --mode quality")
        if self.mode == "quality" and self.rungs != "default":
            raise ValueError("--rungs chooses the rungs of the train and infer ladders; --mode quality takes "
                             "--recipes (adamw, muon, modern, ...: see --help)")

    def sweep(self) -> list[int] | None:
        """--batch_sizes as sorted distinct integers, or None (the doubling sweep)."""
        if self.batch_sizes is None:
            return None
        parts = [p.strip() for p in self.batch_sizes.split(",") if p.strip()]
        if not parts or not all(p.isascii() and p.isdigit() and 1 <= int(p) <= MAX_BATCH for p in parts):
            raise ValueError(f"--batch_sizes {self.batch_sizes!r}: give comma-separated integers in 1..{MAX_BATCH}, "
                             "e.g. 1,16,64")
        return sorted({1, *(int(p) for p in parts)})


TUNE_AXES = ("attention", "amp", "fused", "loader", "loss", "batch", "checkpointing", "compile")


@dataclass(kw_only=True)
class TuneConfig:
    preset: str | None = opt(None, "model size; default: tiny on a CPU, gpt2 on a GPU")
    seq_len: int | None = opt(None, "sequence length; default: 256 on a CPU, 1024 on a GPU", ge=1, le=MAX_SEQ_LEN)
    # bench's micro-batch (16) on a CPU, so the winner compares with bench's rungs; room to grow on a GPU
    global_batch_tokens: int | None = opt(
        None, "tokens per optimizer step, a multiple of seq_len, kept fixed by gradient accumulation; "
        "default: 16 sequences on a CPU, 64 on a GPU", ge=1, le=MAX_BATCH * MAX_SEQ_LEN)
    time_budget: str = opt("10m", "wall time for the whole search, e.g. 90s, 10m, 1h; it always ends with a winner")
    memory_budget: float = opt(0.9, "share of device memory a candidate may use (GPU: its memory; CPU: RAM free at "
                               "start + this process's)", gt=0.0, le=1.0)
    axes: str = opt("all", "comma-separated axes to search: " + ", ".join(TUNE_AXES) + "; or all")
    # >= 3: a median, and two steps before a slow candidate is pruned
    steps: int = opt(5, "timed steps per candidate (after warm-up); its median step time ranks it", ge=3, le=100_000)
    warmup: int = opt(2, "untimed steps per candidate before timing (compile happens in the first)", ge=1, le=100_000)
    loss_tolerance: float = opt(0.02, "a candidate whose loss departs from the fp32 reference's by more than this "
                                "share is rejected", gt=0.0, lt=1.0)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    data_dir: str = opt("data/stdlib", "token shards; the default corpus is prepared on first use")
    output_dir: str = opt("tune_out", "tune.toml, tune_report.md, tune_results.json / .csv and tune.png go here")
    overwrite: bool = opt(False, "replace the files an earlier tune wrote in output_dir (other files there are kept)")
    seed: int = opt(1337, "seed for weights and data: every candidate trains on identical batches", ge=0, le=MAX_SEED)
    json: bool = opt(False, "print the summary JSON as the last line of stdout")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        parse_duration(self.time_budget)
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
    batch_size: int = opt(8, "micro-batch", ge=1, le=MAX_BATCH)
    seq_len: int | None = opt(None, "sequence length; default: the model's context", ge=1, le=MAX_SEQ_LEN)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    use_amp: bool = opt(False, "profile under autocast")
    amp_dtype: str = opt("auto", "autocast dtype: auto picks by device", choices=("auto", "bf16", "fp16"))
    compile: bool = opt(False, "profile the compiled model (graph breaks are counted and explained)",
                        aliases=("use_compile",))  # train's old spelling
    compile_mode: str = opt("default", "torch.compile mode (with --compile)", choices=COMPILE_MODES)
    attention: str = opt("auto", "attention kernel; auto: sdpa, but eager on CPUs under bf16 autocast",
                         choices=("auto", "sdpa", "eager"))
    gradient_checkpointing: bool = opt(False, "recompute activations in backward")
    num_workers: int | None = opt(None, "DataLoader workers feeding the profiled steps; default: as `gptopt train` "
                                  "picks", ge=0, le=MAX_WORKERS)
    pin_memory: bool | None = opt(None, "page-locked host batches; default: on with CUDA, as `gptopt train` picks")
    data_dir: str = opt("data/stdlib", "token shards; the default corpus is prepared on first use")
    # a trace of more than 1000 steps is gigabytes that no viewer opens
    wait: int = opt(2, "steps skipped before profiling (compile, caches)", ge=0, le=1000)
    warmup: int = opt(2, "profiled-but-discarded steps (profiler warm-up)", ge=0, le=1000)
    active: int = opt(4, "recorded steps", ge=1, le=1000)
    row_limit: int = opt(15, "rows of the operator table", ge=1, le=100_000)
    output_dir: str = opt("profile_out", "TensorBoard traces, Chrome trace, memory snapshot, diagnosis.json")
    overwrite: bool = opt(False, "replace the traces an earlier profile wrote in output_dir (other files there are "
                          "kept)")
    json: bool = opt(False, "print the diagnosis JSON as the last line of stdout")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")


@dataclass(kw_only=True)
class SamplingConfig:
    """Sampling options shared by generate and serve (serve takes them per request)."""

    max_new_tokens: int = opt(128, "tokens to generate per prompt", ge=1, le=MAX_NEW_TOKENS)
    temperature: float = opt(0.8, "softmax temperature; 0 = greedy", ge=0.0)
    top_k: int | None = opt(50, "sample from the k most likely tokens (none = all)", ge=1, le=MAX_VOCAB)
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches p", gt=0.0, le=1.0)
    repetition_penalty: float = opt(1.0, "divide the logits of tokens already present by this (> 1 discourages "
                                    "repeats)", gt=0.0)
    seed: int | None = opt(None, "seed: the same seed and prompt give the same sample", ge=0, le=MAX_SEED)
    stop: str | None = opt(None, "stop when this text appears (\\n escapes allowed); it is not included")

    def __post_init__(self) -> None:
        check_fields(self)  # every field, a subclass's too


# --quantize of generate and serve: the names gptopt compress gives the same torchao methods
INFER_QUANTIZE = ("none", "int8-weight", "int4-weight")


@dataclass(kw_only=True)
class GenerateConfig(SamplingConfig):
    prompt: str | None = field(default=None, metadata={"help": "the prompt; '-' or none reads stdin",
                                                       "positional": True})
    model: str = opt("out", "a training output dir (its latest checkpoint), a checkpoint, a HF GPT-2 dir, or gpt2")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the checkpoint was trained with")
    input: str | None = opt(None, "batch mode: a file of prompts, one per line (or .jsonl with a 'prompt' field)")
    output: str | None = opt(None, "batch mode: write one JSON object per prompt here (.jsonl)")
    overwrite: bool = opt(False, "replace an existing --output file (written whole: a failed run keeps the old one)")
    batch_size: int = opt(8, "batch mode: prompts decoded together", ge=1, le=MAX_SLOTS)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs, fp32 on CPUs), bf16, fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    compile: bool = opt(False, "compile the decode step (reduce-overhead: CUDA graphs on GPUs)")
    cuda_graphs: bool = opt(True, "GPUs, without --compile: record the eager decode step as a CUDA graph per "
                            "batch size, replayed after that")
    quantize: str = opt("none", "weights quantised on load (quant extra): int8-weight, torchao int8 weight-only; "
                        "int4-weight, torchao int4 weight-only (NVIDIA GPUs, compute capability 8.0+, bf16)",
                        choices=INFER_QUANTIZE)
    chat: bool = opt(False, "an interactive chat: turns are read from stdin (/reset clears, /exit or end of "
                     "input ends), the prompt, if given, is the system message")
    chat_template: str | None = opt(None, "with --chat: a Jinja chat template file, or plain (System/User/"
                                    "Assistant: lines); default: the model's own (tokenizer_config.json)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output and not self.input:
            raise ValueError("--output needs --input (batch mode)")
        if self.chat and self.input:
            raise ValueError("--chat is interactive (turns from stdin) and --input is batch mode; drop one of them")
        if self.chat_template is not None and not self.chat:
            raise ValueError("--chat_template needs --chat")


@dataclass(kw_only=True)
class ServeConfig:
    model: str = opt("out", "a training output dir, a checkpoint, a HF GPT-2 dir, or gpt2")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the checkpoint was trained with")
    model_name: str | None = opt(None, "the model id /v1/models reports and requests may name; default: the dir name")
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = opt(8000, "port (0 picks a free one)", ge=0, le=65535)
    max_batch_size: int | None = opt(None, "KV-cache slots: requests decoded together (1 = one request at a time); "
                                     "default: as many as fit in half the free memory, up to 64 on CPUs, 256 on GPUs",
                                     ge=1, le=MAX_SLOTS)
    prefill_chunk: int = opt(512, "prompt tokens one prefill forward takes: prompts that arrive together share "
                             "it, a longer prompt is prefilled in chunks between decode steps", ge=1, le=MAX_SEQ_LEN)
    # a queue of a million waiting requests is a client bug, not a workload
    max_queue: int = opt(64, "requests waiting beyond the running ones; more get 429 with Retry-After",
                         ge=0, le=1 << 20)
    max_tokens_limit: int = opt(1024, "the largest max_tokens a request may ask for", ge=1, le=MAX_NEW_TOKENS)
    # vLLM's default too: lm-evaluation-harness asks for 1, OpenAI's legacy API allowed 5
    max_logprobs: int = opt(20, "the most alternatives per token a request's logprobs may ask for", ge=0,
                            le=MAX_VOCAB)
    request_timeout: float = opt(120.0, "seconds a request may take before it is ended", gt=0.0, le=MAX_SECONDS)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs, fp32 on CPUs), bf16, fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    compile: bool = opt(False, "compile the decode step (reduce-overhead: CUDA graphs on GPUs), once per batch "
                        "bucket at start-up: a slower start for faster steps (docs/benchmarks.md, GPU)")
    cuda_graphs: bool = opt(True, "GPUs, without --compile: record the eager decode step as a CUDA graph per "
                            "batch bucket at start-up (seconds), replayed after that")
    quantize: str = opt("none", "weights quantised on load (quant extra): int8-weight, torchao int8 weight-only; "
                        "int4-weight, torchao int4 weight-only (NVIDIA GPUs, compute capability 8.0+, bf16)",
                        choices=INFER_QUANTIZE)
    solo_threads: int | None = opt(None, "CPUs: torch threads of a decode step that runs one request alone (and "
                                   "of every forward of a model too small to gain from more); default: every "
                                   "core but one, left to the HTTP server and tokenizer (prefill and batches of "
                                   "requests use every core)", ge=1, le=MAX_THREADS)
    engine_process: bool = opt(True, "run the model in a process of its own, apart from the HTTP server, so the "
                               "two never wait for each other's Python "
                               "(benchmarks/2026-12-04-serving-vs-transformers.md)")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' (or set GPTOPT_API_KEY)", verbatim=True)
    cors_origin: str | None = opt(None, "allow browser requests from this origin (CORS is off otherwise)")
    blocklist: str | None = opt(None, "file of rules, one a line, refused in prompts and cut from output: a plain term "
                                "(matched as text, ignoring case), or re:REGEX (a regular expression, time-limited)")
    chat_template: str | None = opt(None, "/v1/chat/completions' template: a Jinja file, or plain (System/User/"
                                    "Assistant: lines); default: the model's own (tokenizer_config.json), else "
                                    "the chat route answers 400")

    def __post_init__(self) -> None:
        check_fields(self)


MIN_OPSET = 18  # torch.onnx's dynamo exporter writes opset 18 and converts to others; 17 came out invalid


@dataclass(kw_only=True)
class ExportConfig:
    model: str = opt("out", "a training output dir (its latest checkpoint), a checkpoint, a HF GPT-2 dir, or gpt2")
    format: str = opt("onnx", "onnx: model.onnx with KV-cache inputs/outputs for onnxruntime; "
                      "hf: a directory transformers' AutoModelForCausalLM.from_pretrained loads (GPT-2, Llama or "
                      "Qwen3)", choices=("onnx", "hf"))
    output_dir: str | None = opt(None, "the directory to write; default: export_onnx or export_hf (by --format)")
    tokenizer: str | None = opt(None, "tokenizer.json or dir to ship beside the model; default: the model's own, "
                                "if any")
    # opsets count ONNX releases (23 in 2025): a three-digit one is a typo
    opset: int = opt(18, "ONNX opset version, 18 or newer (18 is the exporter's own; older ones come out invalid)",
                     le=99)
    # Relative, because a trained GPT-2's logits grow large, and fp32 rounding grows with them.
    tolerance: float = opt(1e-4, "the export fails if a logit differs from PyTorch's by more than this "
                           "times the largest |logit| (at least 1)", gt=0.0, lt=1.0)
    overwrite: bool = opt(False, "replace an output_dir that holds an earlier export")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.opset < MIN_OPSET:
            raise ValueError(f"--opset must be >= {MIN_OPSET}: torch's exporter converts to older ones wrongly "
                             f"(opset 17 gives a Split that onnxruntime refuses), got {self.opset}")


@dataclass(kw_only=True)
class LoadtestConfig:
    url: str = opt("http://127.0.0.1:8000", "server base URL (its /v1/completions is driven)")
    requests: int = opt(100, "requests to send in all", ge=1, le=10**7)
    # one socket each: a client machine runs out of ports (~28k) long before 10000
    concurrency: int = opt(16, "requests in flight at once (closed loop); ignored with --rate", ge=1, le=10_000)
    rate: float | None = opt(None, "open loop: Poisson arrivals at this many requests per second", gt=0.0, le=1e6)
    prompt_tokens: int = opt(32, "prompt length: exactly this many tokens of --tokenizer; without it, this many words "
                             "of a fixed text, which is only approximately as many tokens", ge=1, le=MAX_SEQ_LEN)
    tokenizer: str | None = opt(None, "the served model's tokenizer.json, or its model directory: each prompt is "
                                "then random tokens of it (as vLLM's random data set), exactly --prompt_tokens long")
    max_tokens: int = opt(64, "max_tokens of each request", ge=1, le=MAX_NEW_TOKENS)
    temperature: float = opt(0.0, "temperature of each request", ge=0.0)
    model: str | None = opt(None, "the model field of each request")
    api_key: str | None = opt(None, "Bearer key, if the server needs one")
    timeout: float = opt(300.0, "seconds before a request counts as an error", gt=0.0, le=MAX_SECONDS)
    seed: int = opt(0, "seed of arrivals and prompt choice", ge=0, le=MAX_SEED)
    json: bool = opt(False, "print the summary JSON as the last line of stdout")

    def __post_init__(self) -> None:
        check_fields(self)


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
    output_dir: str | None = opt(None, "the directory to write the compressed checkpoint and its results.json to "
                                 "(new, or empty)", aliases=("output",))  # the name it had before
    quantize: str = opt("none", "int8-weight: torchao int8 weight-only; int8-dynamic: int8 weights and activations "
                        "(the CPU path); int4-weight: torchao int4 (NVIDIA GPUs, compute capability 8.0+)",
                        choices=("none", *QUANTIZE_METHODS))
    prune: str | None = opt(None, "FRACTION in (0, 1): zero that share of each block Linear's weights by magnitude; "
                            "2:4: semi-structured sparsity (NVIDIA GPUs, compute capability 8.0+)")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the model was trained with")
    data_dir: str | None = opt(None, "token shards whose val split scores perplexity and KL; default: the data the "
                               "model was trained on (its checkpoint records it), else data/stdlib")
    eval_tokens: int = opt(16384, "val tokens scored for perplexity and KL, in windows of the model's context",
                           ge=1, le=1 << 30)  # a billion tokens: hours of scoring on any GPU
    repeats: int = opt(5, "timed runs behind each speed figure (the median counts), after one warm-up run",
                       ge=1, le=10_000)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    compile: bool = opt(False, "measure with the decode step compiled, as generate and serve run it with --compile")
    json: bool = opt(False, "print results.json as the last line of stdout")
    overwrite: bool = opt(False, "replace an earlier compress output at --output_dir (only one gptopt wrote, "
                          "holding nothing else)")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.output_dir:
            raise ValueError("--output_dir is required: the new directory the compressed checkpoint goes to")
        parse_prune(self.prune)
        if self.quantize == "none" and self.prune is None:
            raise ValueError("nothing to do: give --quantize METHOD and/or --prune FRACTION|2:4")


EVAL_TASKS = ("hellaswag", "bpb")
MAX_EXAMPLES = 10**8  # HellaSwag's val set has 10,042; a limit beyond this is a typo


@dataclass(kw_only=True)
class EvalConfig:
    model: str = opt("out", "the model to score: a training output dir (its latest checkpoint), a checkpoint, "
                     "a HF GPT-2, Llama or Qwen3 dir, or gpt2")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the model was trained with")
    task: str = opt("hellaswag", "hellaswag: pick the right one of 4 endings, completion-style; acc by the summed "
                    "log-likelihood of each ending, acc_norm by its log-likelihood per byte of the ending's "
                    "text (lm-eval's length normalisation, not llm.c's per token); bpb: bits per byte of held-out "
                    "text (comparable across tokenizers), in windows of the model's context that do not overlap",
                    choices=EVAL_TASKS)
    data: str | None = opt(None, "hellaswag: a .jsonl in HellaSwag's published format (ctx or ctx_a + ctx_b, 4 "
                           "endings, label); default: HellaSwag's val set, downloaded once into ~/.cache/gptopt "
                           "(online only). bpb: a text file or a folder of them (tokenized with the model's "
                           "tokenizer), or a data dir from gptopt prepare (its val split); default: the val split "
                           "of the data the model was trained on")
    limit: int | None = opt(None, "score only the first N examples (bpb: windows)", ge=1, le=MAX_EXAMPLES)
    batch_size: int = opt(4, "examples per forward, each one row per ending (bpb: windows); memory grows with rows "
                          "x length x vocabulary", ge=1, le=MAX_BATCH)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs, fp32 on CPUs), bf16, fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    output_dir: str | None = opt(None, "a directory to write results.json to (new, or empty)",
                                 aliases=("output",))  # the name it had before
    overwrite: bool = opt(False, "replace an earlier eval output at --output_dir (only one gptopt wrote, holding "
                          "nothing else)")
    json: bool = opt(False, "print the results as JSON, the last line of stdout")

    def __post_init__(self) -> None:
        check_fields(self)
