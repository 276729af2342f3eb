"""The configs of the commands that run a trained model: generate, serve, loadtest, export, compress and eval.

    python -c "from gptopt.config import ServeConfig; print(ServeConfig())"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gptopt.config.fields import (
    MAX_BATCH,
    MAX_NEW_TOKENS,
    MAX_SECONDS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_SLOTS,
    MAX_THREADS,
    MAX_VOCAB,
    check_fields,
    opt,
)
from gptopt.config.sampling import TEMPERATURE, SamplingConfig
from gptopt.utils.errors import UserError

# --quantize of generate and serve: the names gptopt compress gives the same torchao methods
INFER_QUANTIZE = ("none", "int8-weight", "int4-weight")


# --kv_cache_memory: 64 TiB, past any one machine's memory (a larger figure is a typo of units)
MAX_KV_GIB = float(1 << 16)
# --block_size: vLLM takes 1 to 256 tokens; a larger block wastes most of a short request's last one
MAX_BLOCK_SIZE = 256

# Speculative decoding's options, the same for generate and serve (each config declares them with these)
SPECULATE = ("none", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 64  # a step's drafts: beyond a few the chance that all are kept is nil


def _speculate() -> Any:
    return opt("none", "speculative decoding: ngram (prompt lookup: drafts copied from what followed the text's "
               "last few tokens earlier in it; for output that repeats its input), draft (--draft_model proposes); "
               "greedy output is unchanged, sampled output keeps its distribution", choices=SPECULATE)


def _draft_model() -> Any:
    return opt(None, "a smaller model of the same tokenizer that drafts for speculative decoding (a training output "
               "dir, a checkpoint or a HF dir, as --model); implies --speculate draft")


def _num_speculative_tokens() -> Any:
    return opt(4, "tokens drafted a speculative step: the model checks them all in one forward",
               ge=1, le=MAX_SPECULATIVE_TOKENS)


def check_speculation(cfg: Any) -> None:
    """--speculate and --draft_model agree (a config that declares _speculate's fields)."""
    if cfg.draft_model is not None and cfg.speculate == "none":
        cfg.speculate = "draft"
    if cfg.speculate == "draft" and cfg.draft_model is None:
        raise UserError("--speculate draft needs --draft_model DIR: the smaller model that drafts")
    if cfg.speculate == "ngram" and cfg.draft_model is not None:
        raise UserError("--speculate ngram drafts from the text itself; drop --draft_model, or use --speculate draft")


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
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs and on CPUs with native bf16, else fp32), bf16, "
                     "fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    compile: bool = opt(False, "compile the decode step (reduce-overhead: CUDA graphs on GPUs)")
    cuda_graphs: bool = opt(True, "GPUs, without --compile: record the eager decode step as a CUDA graph per "
                            "batch size, replayed after that")
    quantize: str = opt("none", "weights quantised on load (quant extra): int8-weight, torchao int8 weight-only; "
                        "int4-weight, torchao int4 weight-only (NVIDIA GPUs, compute capability 8.0+, bf16)",
                        choices=INFER_QUANTIZE)
    prefix_cache: bool = opt(True, "a prompt prefills only what follows the longest beginning of it the KV cache "
                             "still holds from an earlier prompt or chat turn")
    speculate: str = _speculate()
    draft_model: str | None = _draft_model()
    num_speculative_tokens: int = _num_speculative_tokens()
    chat: bool = opt(False, "an interactive chat: turns are read from stdin (/reset clears, /exit or end of "
                     "input ends), the prompt, if given, is the system message")
    chat_template: str | None = opt(None, "with --chat: a Jinja chat template file, or plain (System/User/"
                                    "Assistant: lines); default: the model's own (tokenizer_config.json)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_speculation(self)
        if self.output and not self.input:
            raise UserError("--output needs --input (batch mode)")
        if self.chat and self.input:
            raise UserError("--chat is interactive (turns from stdin) and --input is batch mode; drop one of them")
        if self.chat_template is not None and not self.chat:
            raise UserError("--chat_template needs --chat")


@dataclass(kw_only=True)
class ServeConfig:
    model: str = opt("out", "a training output dir, a checkpoint, a HF GPT-2 dir, or gpt2")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the checkpoint was trained with")
    model_name: str | None = opt(None, "the model id /v1/models reports and requests may name; default: the dir name")
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = opt(8000, "port (0 picks a free one)", ge=0, le=65535)
    max_batch_size: int | None = opt(None, "the most requests decoded together (vLLM's max_num_seqs): more wait in "
                                     "the queue; memory does not limit it, the KV cache's blocks do (a request holds "
                                     "only the blocks its tokens fill); default: 64 on CPUs, 256 on GPUs, fewer where "
                                     "a step of that many long requests would not fit the memory (the log says so)",
                                     ge=1, le=MAX_SLOTS)
    max_len: int | None = opt(None, "the longest sequence a request may have, prompt and completion together; it "
                              "reserves nothing, but the KV cache must hold at least one sequence this long; "
                              "default: the model's context", ge=2, le=MAX_SEQ_LEN)
    kv_cache_memory: float | None = opt(None, "GiB of the KV cache, shared by all requests in blocks of "
                                        "--block_size tokens; default: on CPUs the least of 4 GiB and half the RAM "
                                        "free after the weights load, raised to one --max_len sequence where that "
                                        "fits; on GPUs what is left of 0.9 of the device's memory after the weights "
                                        "and a measured warm-up forward; never more than --max_batch_size sequences "
                                        "of --max_len fill (docs/troubleshooting.md)",
                                        gt=0.0, le=MAX_KV_GIB)
    block_size: int = opt(16, "tokens one KV-cache block holds: a request takes a block at a time, and a cached "
                          "prefix is shared in whole blocks (vLLM's default too)", ge=1, le=MAX_BLOCK_SIZE)
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
    stall_timeout: float = opt(60.0, "seconds without any progress, with requests waiting, after which the engine "
                               "counts as stalled: /health answers 503 and its waiting requests 503 engine_stalled",
                               gt=0.0, le=MAX_SECONDS)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs and on CPUs with native bf16, else fp32), bf16, "
                     "fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    compile: bool = opt(False, "compile the decode step (reduce-overhead: CUDA graphs on GPUs), once per batch "
                        "bucket at start-up: a slower start for faster steps (docs/benchmarks.md, GPU)")
    cuda_graphs: bool = opt(True, "GPUs, without --compile: record the eager decode step as a CUDA graph per "
                            "batch bucket at start-up (seconds), replayed after that")
    quantize: str = opt("none", "weights quantised on load (quant extra): int8-weight, torchao int8 weight-only; "
                        "int4-weight, torchao int4 weight-only (NVIDIA GPUs, compute capability 8.0+, bf16)",
                        choices=INFER_QUANTIZE)
    prefix_cache: bool = opt(True, "a prompt prefills only what follows the longest beginning of it the KV cache "
                             "still holds (a shared system prompt, earlier chat turns, other samples of one prompt), "
                             "shared by reference: the full blocks of finished requests stay cached until the pool "
                             "needs them, the least recently used first")
    speculate: str = _speculate()
    draft_model: str | None = _draft_model()
    num_speculative_tokens: int = _num_speculative_tokens()
    speculate_max_batch: int = opt(4, "speculative decoding runs while at most this many requests decode; a larger "
                                   "batch keeps the arithmetic busy without it, and decodes plainly", ge=1,
                                   le=MAX_SLOTS)
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
        check_speculation(self)


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
            raise UserError(f"--opset must be >= {MIN_OPSET}: torch's exporter converts to older ones wrongly "
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
    shared_prefix: int = opt(0, "a beginning every prompt shares, this many tokens (words without --tokenizer) "
                             "long, before its own --prompt_tokens: a system prompt all requests send (vLLM's bench "
                             "serve --random-prefix-len), what a server's prefix cache saves", ge=0, le=MAX_SEQ_LEN)
    max_tokens: int = opt(64, "max_tokens of each request", ge=1, le=MAX_NEW_TOKENS)
    temperature: float = opt(0.0, "temperature of each request", **TEMPERATURE.limits)
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
        raise UserError(f"--prune must be a fraction in (0, 1) such as 0.5, or 2:4; got {spec!r}")
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
            raise UserError("--output_dir is required: the new directory the compressed checkpoint goes to")
        parse_prune(self.prune)
        if self.quantize == "none" and self.prune is None:
            raise UserError("nothing to do: give --quantize METHOD and/or --prune FRACTION|2:4")


EVAL_TASKS = ("hellaswag", "bpb", "chat")
MAX_EXAMPLES = 10**8  # HellaSwag's val set has 10,042; a limit beyond this is a typo


@dataclass(kw_only=True)
class EvalConfig:
    model: str = opt("out", "the model to score: a training output dir (its latest checkpoint), a checkpoint, "
                     "a HF GPT-2, Llama or Qwen3 dir, or gpt2")
    tokenizer: str | None = opt(None, "tokenizer.json or dir; default: the one the model was trained with")
    task: str = opt("hellaswag", "hellaswag: pick the right one of 4 endings, completion-style; acc by the summed "
                    "log-likelihood of each ending, acc_norm by its log-likelihood per byte of the ending's "
                    "text (lm-eval's length normalisation, not llm.c's per token); bpb: bits per byte of held-out "
                    "text (comparable across tokenizers), in windows of the model's context that do not overlap; "
                    "chat: exact-match accuracy of the greedy reply to held-out conversations",
                    choices=EVAL_TASKS)
    data: str | None = opt(None, "hellaswag: a .jsonl in HellaSwag's published format (ctx or ctx_a + ctx_b, 4 "
                           "endings, label); default: HellaSwag's val set, downloaded once into ~/.cache/gptopt "
                           "(online only). bpb: a text file or a folder of them (tokenized with the model's "
                           "tokenizer), or a data dir from gptopt prepare (its val split); default: the val split "
                           "of the data the model was trained on. chat: a .jsonl of conversations ({messages} or "
                           "{prompt, completion}), the last assistant turn of each the answer")
    limit: int | None = opt(None, "score only the first N examples (bpb: windows)", ge=1, le=MAX_EXAMPLES)
    batch_size: int = opt(4, "examples per forward, each one row per ending (bpb: windows); memory grows with rows "
                          "x length x vocabulary", ge=1, le=MAX_BATCH)
    device: str = opt("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPUs and on CPUs with native bf16, else fp32), bf16, "
                     "fp16, fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    output_dir: str | None = opt(None, "a directory to write results.json to (new, or empty)",
                                 aliases=("output",))  # the name it had before
    overwrite: bool = opt(False, "replace an earlier eval output at --output_dir (only one gptopt wrote, holding "
                          "nothing else)")
    json: bool = opt(False, "print the results as JSON, the last line of stdout")

    def __post_init__(self) -> None:
        check_fields(self)
