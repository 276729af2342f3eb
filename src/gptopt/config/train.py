"""The configs of the commands that prepare data, train and measure training: doctor, prepare, train, bench,
tune and profile.

    python -c "from gptopt.config import TrainConfig; print(TrainConfig())"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptopt.config.fields import (
    MAX_BATCH,
    MAX_NEW_TOKENS,
    MAX_PAD_MULTIPLE,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WORKERS,
    check_fields,
    opt,
)
from gptopt.config.infer import MAX_SPECULATIVE_TOKENS
from gptopt.config.model import ARCH_FIELDS, DEFAULT_PRESET, LOSSES, PRESETS, arch_overrides, check_seq_len, preset
from gptopt.config.sampling import TEMPERATURE, TOP_K, TOP_P
from gptopt.utils.errors import UserError

# The sequence length doctor sizes a training step at when --seq_len is not given, where a preset's context is
# longer: a long-context model (Qwen3's 40,960 tokens) is first fine-tuned at lengths like this, and a step at its
# full context needs many times the memory; --seq_len asks for any other.
DOCTOR_SEQ_LEN = 2048


@dataclass(kw_only=True)
class DoctorConfig:
    device: str = opt("auto", "device to check: auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    preset: str = opt("tiny", "model preset used to size the memory/disk checks and the smoke test")
    seq_len: int | None = opt(None, "tokens per sequence the memory checks size a training step at (batch 1); "
                                    f"default: the preset's context, at most {DOCTOR_SEQ_LEN}", ge=1, le=MAX_SEQ_LEN)
    smoke: bool = opt(False, "also run a tiny forward+backward under autocast on the device")
    json: bool = opt(False, "print one JSON document instead of the table")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.preset not in PRESETS:
            raise UserError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        context = preset(self.preset).block_size
        if self.seq_len is not None and self.seq_len > context:
            raise UserError(f"--seq_len {self.seq_len} exceeds --preset {self.preset}'s context of {context} tokens; "
                            f"give --seq_len {context} or less")


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
    # conversations (supervised fine-tuning): train/chat_data.py
    format: str = opt("auto", "how --input is read: auto (a .jsonl of {messages} or {prompt, completion} lines is "
                              "conversations, anything else text), text, messages, prompt_completion",
                      choices=("auto", "text", "messages", "prompt_completion"))
    seq_len: int = opt(1024, "conversations: the tokens of a packed row, the context train uses (at most the "
                             "model's)", ge=8, le=1 << 20)
    overlong: str = opt("refuse", "conversations: one longer than --seq_len is refused with its line (refuse) or cut "
                                  "into rows of its own (split)", choices=("refuse", "split"))
    chat_template: str | None = opt(None, "conversations: a Jinja template file, or 'default' (gptopt's ChatML, its "
                                          "markers added to the tokenizer); default: the model's own, else 'default'")
    text_data: str | None = opt(None, "conversations: a data dir `gptopt prepare` made of text with the model's "
                                      "tokenizer, whose windows are mixed into the train rows (--text_share)")
    text_share: float = opt(0.0, "conversations: the share of train rows that are --text_data windows, every token "
                                 "learned, so that fine-tuning keeps the model's text; 0: none", ge=0.0, lt=0.95)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.input and self.dataset:
            raise UserError("give either --input or --dataset, not both")
        if self.text_share and not self.text_data:
            raise UserError("--text_share mixes windows of --text_data into the rows: give --text_data DATA_DIR")
        if self.format in ("messages", "prompt_completion") and not self.input:
            raise UserError(f"--format {self.format} reads conversations from --input FILE.jsonl: give --input")


def check_cpu_amp(device: str, use_amp: bool, amp_dtype: str) -> None:
    """Refuse fp16 autocast on a device given as the CPU as the options are read (device.resolve refuses it on a
    CPU that auto picked)."""
    if use_amp and amp_dtype == "fp16" and device == "cpu":
        raise UserError("fp16 autocast on a CPU is slow and needs loss scaling: use --amp_dtype bf16 or fp32")


def parse_duration(text: str) -> float:
    """--time_budget: '90', '90s', '10m', '1.5h' -> seconds (positive and finite)."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    try:
        seconds = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:  # NaN fails this too
        raise UserError(f"--time_budget {text!r} is not a duration: give a positive number of seconds or a suffix, "
                         "e.g. 90s, 10m, 1.5h")
    return seconds


def check_loader(num_workers: int | None, prefetch_factor: int | None, persistent_workers: bool | None) -> None:
    """DataLoader's own rule, checked before any work: prefetching and persistence need worker processes.
    num_workers None (the device's default) is settled later; data.make_loader drops both without workers."""
    if num_workers == 0 and prefetch_factor is not None:
        raise UserError("--prefetch_factor needs worker processes: give --num_workers 1 or more, or drop "
                         "--prefetch_factor")
    if num_workers == 0 and persistent_workers:
        raise UserError("--persistent_workers needs worker processes: give --num_workers 1 or more, "
                         "or --no-persistent_workers")


# torch.compile's modes: one list for train, profile, and bench's and tune's rungs (each a TrainConfig), so
# a mode that tune.toml or best.toml names is one that train and profile take. reduce-overhead records CUDA
# graphs (GPUs); max-autotune searches kernel configurations and, on GPUs, records CUDA graphs too;
# max-autotune-no-cudagraphs searches without recording them.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# --optimizer muon's default peak learning rate, Muon's own and not a multiple of --learning_rate: Muon's best
# rate does not move with the rate the rest of the model trains at under AdamW, so a multiple that suited
# train's default would overshoot it at a tuned AdamW rate (benchmarks/2026-12-04-muon.md, "Muon's
# rates racing to a loss"; the quality ladder's muon recipe, benchmarks/2026-12-06-time-to-quality.md). Muon's
# update is scaled to AdamW's RMS (optim.MUON_ADJUST_LR), so the figure reads on AdamW's scale. The GPT-2 sizes
# take the same rate, untried.
MUON_LR = 3e-3
# A new run's vocabulary is padded to a multiple of this: tensor cores take the embedding and the head in whole tiles
VOCAB_PAD_MULTIPLE = 64


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
    # None: 64 for a new run; a resumed run keeps its checkpoint's padding, and one given for it must match
    vocab_pad_multiple: int | None = opt(None, "pad the vocabulary to a multiple of this (tensor-core friendly "
                                         f"shapes); default: {VOCAB_PAD_MULTIPLE} for a new run, and a resumed run "
                                         "keeps its checkpoint's (one given for it must match)",
                                         ge=1, le=MAX_PAD_MULTIPLE)
    # LoRA (models/lora.py): adapters on the blocks' projections, the model's own weights frozen
    lora_rank: int = opt(0, "train low-rank adapters of this rank on the attention and MLP projections instead of "
                            "every weight (with --init_from); 0: full fine-tuning", ge=0, le=4096)
    lora_alpha: float = opt(16.0, "LoRA's scale numerator: the update is alpha / rank x B A", gt=0.0, le=1e6)
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
                                f"scale); default: {MUON_LR:g} whatever --learning_rate (chosen on tiny)",
                                gt=0.0, le=1.0)
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
    sample_tokens: int = opt(48, "tokens of generated sample shown at each evaluation (chat data: the greedy reply "
                                 "to a val conversation); 0: no sample", ge=0, le=MAX_NEW_TOKENS)
    sample_every: int = opt(0, "also show and log the sample every N steps, between evaluations; 0: at evaluations "
                               "only", ge=0, le=MAX_STEPS)
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
            raise UserError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if self.min_lr is not None and self.min_lr > self.learning_rate:
            raise UserError(f"--min_lr ({self.min_lr}) must not exceed --learning_rate ({self.learning_rate}): "
                             "it is where the cosine decay ends")
        check_loader(self.num_workers, self.prefetch_factor, self.persistent_workers)
        if self.lora_rank and self.init_from == "scratch" and self.resume is None:
            raise UserError("--lora_rank adapts a trained model: give --init_from MODEL, or drop --lora_rank to "
                            "train from scratch")
        if self.lora_rank and self.optimizer == "muon":
            raise UserError("--lora_rank trains small adapter matrices, which Muon is not for: use --optimizer adamw")
        if self.lora_rank and self.fp8:
            raise UserError("--lora_rank with --fp8 is not supported: float8 layers would replace the adapted ones; "
                            "drop --fp8")
        if self.lora_rank and self.fsdp:
            raise UserError("--lora_rank with --fsdp is not supported: LoRA's adapters are small, use DDP "
                            "(drop --fsdp)")
        if self.cpu_offload and not self.fsdp:
            raise UserError("--cpu_offload needs --fsdp (it is FSDP2's offload policy)")
        if self.sdpa_backend != "auto" and self.attention == "eager":
            raise UserError(f"--sdpa_backend {self.sdpa_backend} picks an SDPA kernel, and --attention eager does "
                             "not use SDPA: use --attention sdpa, or drop --sdpa_backend")
        if self.optimizer == "muon" and self.fsdp:
            # Newton-Schulz works on whole matrices. torch.optim.Muon does step FSDP2's shards (DTensor), but
            # only by an all-reduce inside every iteration (11 per matrix per step, torch 2.13), and the
            # sharded checkpoint path (distributed.full_state_dicts) covers one torch optimizer.
            raise UserError("--optimizer muon is not supported with --fsdp (Muon orthogonalises whole weight "
                             "matrices; FSDP2 shards them): drop --fsdp (DDP), or use --optimizer adamw")
        if self.optimizer == "muon":
            import torch  # here, not at the top: building options and help needs no torch

            if not hasattr(torch.optim, "Muon"):
                raise UserError(f"--optimizer muon needs torch.optim.Muon (torch >= 2.9), this is torch "
                                 f"{torch.__version__}: upgrade torch, or use --optimizer adamw")
        try:  # a bad --arch field or value is named before any data or model is read
            model = preset(self.preset or DEFAULT_PRESET, **arch_overrides(self.arch))
        except ValueError as e:
            raise UserError(str(e) if str(e).startswith("--arch") else f"--arch: {e}") from None
        if self.init_from == "scratch" and self.resume is None:  # else the context is the loaded model's
            check_seq_len(self.seq_len, model.block_size, self.preset or DEFAULT_PRESET)
        check_cpu_amp(self.device, self.use_amp, self.amp_dtype)
        if self.muon_lr is not None and self.optimizer != "muon":
            raise UserError("--muon_lr is Muon's learning rate: add --optimizer muon, or drop --muon_lr")
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        if self.min_lr is None:
            self.min_lr = self.learning_rate / 10
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            raise UserError(f"--lr_decay_steps ({self.lr_decay_steps}) must come after the warmup "
                             f"(--warmup_steps {self.warmup_steps}): the cosine decay starts where the warmup ends")
        if self.sample_every and not self.sample_tokens:
            raise UserError("--sample_every shows a sample of --sample_tokens tokens: give --sample_tokens N (> 0), "
                            "or drop --sample_every")
        if self.target_loss is not None and self.eval_interval == 0:
            raise UserError("--target_loss needs evaluations to notice the target: drop --eval_interval 0 "
                             "(the default evaluates about 100 times over max_steps)")
        if self.optimizer == "muon" and self.muon_lr is None:
            self.muon_lr = MUON_LR

    @property
    def vocab_padding(self) -> int:
        """The padding multiple of a new run's vocabulary: --vocab_pad_multiple, or its default."""
        return VOCAB_PAD_MULTIPLE if self.vocab_pad_multiple is None else self.vocab_pad_multiple

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
    rungs: str = opt("default", "comma-separated rungs, 'default' or 'all' (--mode infer: also 'levers'); "
                     "`--rungs list` prints them")
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
    model: str | None = opt(None, "--mode infer: a trained model to bench (a training output dir, a checkpoint, a HF "
                            "dir) instead of the preset's random weights, over --data_dir prepared with its "
                            "tokenizer: its greedy text then means something, which the speculative rung needs")
    draft_model: str | None = opt(None, "--mode infer: the speculative rung's draft, a smaller model of the same "
                                  "tokenizer; default: n-gram prompt lookup, no draft")
    num_speculative_tokens: int = opt(4, "--mode infer: tokens the speculative rung drafts a step", ge=1,
                                      le=MAX_SPECULATIVE_TOKENS)
    temperature: float = opt(0.0, "--mode infer: the timed generations sample at this temperature, top_p 1 and "
                             "no top_k (what OpenAI's clients send), so the sampler's cost is in every rung's "
                             "figures; 0: greedy. Each rung's tokens are still checked greedily",
                             **TEMPERATURE.limits)
    top_k: int | None = opt(None, "--mode infer, with --temperature: the timed generations keep each step's k most "
                            "likely tokens (default: all of them)", **TOP_K.limits)
    top_p: float = opt(1.0, "--mode infer, with --temperature: the timed generations keep each step's smallest set of "
                       "most likely tokens whose probability reaches this (1: all of them)", **TOP_P.limits)
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
            raise UserError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if self.batch_sizes is not None:
            if self.mode != "infer":
                raise UserError("--batch_sizes is the decode sweep of --mode infer; the training ladder takes "
                                 "--batch_size")
            if self.batch_size is not None:
                raise UserError("give --batch_sizes (the sweep's sizes) or --batch_size (its largest), not both")
            self.sweep()  # refused here, before any work, if malformed
        if self.mode != "quality" and (self.target_loss is not None or self.max_steps is not None
                                       or self.recipes != "default" or self.seeds != 3):
            raise UserError("--target_loss, --max_steps, --recipes and --seeds belong to the recipe ladder: "
                             "add --mode quality")
        if self.mode != "infer" and (self.model is not None or self.draft_model is not None or self.temperature
                                     or self.top_k is not None or self.top_p != 1.0):
            raise UserError("--model, --draft_model, --temperature, --top_k and --top_p belong to the generation "
                             "ladder: add --mode infer")
        if not self.temperature and (self.top_k is not None or self.top_p != 1.0):
            raise UserError("--top_k and --top_p choose among the tokens a sampled generation draws from: add "
                             "--temperature (e.g. 1), or leave them out for greedy decoding")
        if self.model is not None and self.preset is not None:
            raise UserError("--model benches that model, --preset a preset's random weights: give one of them")
        if self.preset is not None:  # the default preset is the device's (bench.setup checks it)
            check_seq_len(self.seq_len, preset(self.preset).block_size, self.preset)
        if self.mode == "quality" and self.rungs != "default":
            raise UserError("--rungs chooses the rungs of the train and infer ladders; --mode quality takes "
                             "--recipes (adamw, muon, modern, ...: see --help)")

    def sweep(self) -> list[int] | None:
        """--batch_sizes as sorted distinct integers, or None (the doubling sweep)."""
        if self.batch_sizes is None:
            return None
        parts = [p.strip() for p in self.batch_sizes.split(",") if p.strip()]
        if not parts or not all(p.isascii() and p.isdigit() and 1 <= int(p) <= MAX_BATCH for p in parts):
            raise UserError(f"--batch_sizes {self.batch_sizes!r}: give comma-separated integers in 1..{MAX_BATCH}, "
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
            raise UserError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if self.preset is not None:  # the default preset is the device's (bench.setup checks it)
            check_seq_len(self.seq_len, preset(self.preset).block_size, self.preset)
        parse_duration(self.time_budget)
        unknown = set(self.axis_set) - set(TUNE_AXES)
        if unknown:
            raise UserError(f"unknown tune axes {sorted(unknown)}; choose from: {', '.join(TUNE_AXES)}, all")

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
            raise UserError(f"unknown preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        context = preset(self.preset).block_size
        check_seq_len(self.seq_len, context, self.preset)
        steps, seq_len = self.wait + self.warmup + self.active, self.seq_len or context
        if self.mode == "generate" and seq_len - steps < 1:  # the prompts are the sequences less the decode steps
            raise UserError(f"--seq_len {seq_len} leaves no prompt for {steps} decode steps (--wait, --warmup and "
                            f"--active): use --seq_len {steps + 1} or more, or fewer steps")
        check_cpu_amp(self.device, self.use_amp, self.amp_dtype)
