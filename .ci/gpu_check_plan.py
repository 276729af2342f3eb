"""The GPU check's plan: every step, its command and its time limit, at the GPU's sizes or the CPU rehearsal's.

    python3 .ci/gpu_check.py dry-run DIR            # the plan, and DIR/results.json of it
    pytest -q tests/test_gpu_check.py -k plan       # every gptopt command of it parses

What differs between the GPU run and its CPU rehearsal is the sizes (SIZES), never the flags, so a command
that parses on a CPU is the one the GPU runs. A command names what only the run knows as MODEL (the first
training output with a checkpoint) and PORT; resolve() fills them in.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # this file is .ci/gpu_check_plan.py
BUDGET_S = 540  # nine minutes, the install included: a lease is 15 minutes, start-up and one rerun included
# per step on a CPU: generous, since compiling alone is slow there (docs/benchmarks.md), and the CPU run checks
# commands, not speed
CPU_LIMIT_S = 420
RANDOM_WEIGHTS = "random weights and the stdlib corpus (no network): speed figures are real, text and loss are not"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What differs between the GPU run and its CPU rehearsal: sizes only, never flags."""

    model: str  # the model of every step but the large-model decode
    large: str  # the large-model decode
    seq: int
    batch: int
    train_steps: int  # the measured training run
    few_steps: int  # the path checks
    bench_warmup: int
    infer_batches: str  # bench --mode infer's sweep (each compiled rung compiles once per size)
    infer_seq: int
    new_tokens: int
    eval_tokens: int
    clients: tuple[int, ...]  # serve's loadtests; the decode beside them runs at the same batch sizes
    prompt_tokens: int  # serve's prompts, exactly this many tokens of the model's tokenizer
    serve_tokens: int  # new tokens of each request, and of the decode beside them
    peer_clients: tuple[int, ...]  # transformers serve's loadtests: some of `clients`, so the ratios pair up
    # The bench rung whose decode stands beside serve's: on a GPU, graphs is serve's own (the eager decode
    # recorded as CUDA graphs); a CPU has no CUDA graphs, and kv is the same decode without them.
    decode_rung: str
    larger: tuple[str, ...]  # the larger models each trained once (issue 36's sizes)
    # issue 37's Llama-shaped models, trained and decoded: a grouped-query rotary model, and the larger one with
    # QK-norm (on a CPU llama-tiny stands in for both)
    llama: str
    qwen: str
    # serve_preempt: a KV cache too small for its clients' sequences (GiB; gpt2 in bf16 keeps 36 KiB a token, so
    # 0.045 GiB is 80 blocks of 16, five of its 16 clients' 256 tokens; the debug preset in fp32 1 KiB, so 3.5e-5
    # GiB is 8 blocks of 4, two of its 4 clients' 16 tokens), its blocks' tokens and the clients of its loadtests
    preempt_kv_gib: float
    preempt_block: int
    preempt_clients: int


SIZES = {
    "gpu": Sizes(model="gpt2", large="gpt2-xl", seq=1024, batch=16, train_steps=40, few_steps=4,
                 bench_warmup=2, infer_batches="1,64", infer_seq=256, new_tokens=128, eval_tokens=16384,
                 clients=(1, 16, 64, 256), prompt_tokens=128, serve_tokens=128, peer_clients=(16, 64),
                 decode_rung="graphs", larger=("gpt2-medium", "gpt2-large", "gpt2-xl"), llama="smollm2-135m",
                 qwen="qwen3-0.6b", preempt_kv_gib=0.045, preempt_block=16, preempt_clients=16),
    "cpu": Sizes(model="debug", large="debug", seq=64, batch=4, train_steps=4, few_steps=2,
                 bench_warmup=1, infer_batches="1,2", infer_seq=64, new_tokens=16, eval_tokens=1024,
                 clients=(1, 2, 4), prompt_tokens=8, serve_tokens=8, peer_clients=(1, 2), decode_rung="kv",
                 larger=("debug",), llama="llama-tiny", qwen="llama-tiny", preempt_kv_gib=3.5e-5,
                 preempt_block=4, preempt_clients=4),
}


@dataclasses.dataclass
class Step:
    name: str
    limit: int  # seconds, on the GPU
    what: str  # the path it proves, and the figures it reports
    argv: list[str]
    cpu: bool = True  # the command means something on a CPU too (the rehearsal runs it)
    group: str | None = None  # steps of one group start together (path checks only: nothing timed)
    stdout: str | None = None  # keep stdout in DIR/<this> (a JSON document), the log gets stderr
    model: bool = False  # runs on the model the training steps saved (the first of MODEL_FROM that has one)
    serve: bool = False  # argv is the server's; the runner drives it with loadtest
    decode: list[str] | None = None  # serve: the bench run first, whose decode rates stand beside serve's
    peer: list[str] | None = None  # serve: another server run after it (never beside it), driven alike
    # False: runs only when --only names it (a study's steps, beyond the nine minutes of the default run)
    default: bool = True
    # its training checkpoints (DIR/<name>/ckpt-*) are deleted once its figures are read: the larger models' weights
    # and AdamW state would fill the machine's disk
    drop_checkpoints: bool = False
    # serve: its own loadtests (the name of each one's figures, its argv with URL and MODEL to fill in) instead of
    # loadtests() at the sizes' client counts
    loads: list[tuple[str, list[str]]] | None = None
    # serve: what its figures must show, else the step fails: the reason, or None
    check: Callable[[dict[str, Any]], str | None] | None = None


@dataclasses.dataclass
class Ctx:
    out: Path
    target: str
    sizes: Sizes
    python: str = sys.executable
    wheels: tuple[str, ...] = ()  # carried wheels the install step installs with gptopt (offline)

    def gptopt(self, *args: object) -> list[str]:
        return [self.python, "-m", "gptopt", *map(str, args)]

    def path(self, name: str) -> str:
        return str(self.out / name)


MODEL_FROM = ("train", "train_fp16", "train_ckpt")  # training outputs, in the order the model is taken from
# issue 46's steps: each family's decode, greedy and sampled (their names, for the figures and the docs)
INFER_FAMILY_STEPS = tuple(f"infer_{family}_{how}" for family in ("llama", "qwen3") for how in ("greedy", "sampled"))


# the modern block (issue 37's train_modern): rotary positions, QK-norm, relu^2, an untied head, zero-init projections
MODERN_ARCH = "positions=rope,qk_norm=true,mlp=relu2,tie_embeddings=false,zero_init=true"


def larger_step(model: str) -> str:
    """The step (and output folder) that trains one of the sizes' larger models."""
    return f"train_{model}".replace("-", "_")


def plan(ctx: Ctx) -> list[Step]:
    """Every step, in order. The limits add up to under BUDGET_S (a test holds them to it)."""
    s, g, p = ctx.sizes, ctx.gptopt, ctx.path
    c = s.preempt_clients
    data = ("--data_dir", p("data"))
    # --overwrite everywhere: a rerun into the same DIR (after a fix) replaces what the last run wrote there
    def at(model: str) -> tuple[object, ...]:  # a training run of this preset, at the sizes' length
        return (*data, "--preset", model, "--seq_len", s.seq, "--eval_interval", 0, "--seed", 0, "--overwrite")

    train = at(s.model)
    measured = ("--batch_size", s.batch, "--use_amp", "--compile", "--max_steps", s.train_steps, "--log_interval", 10)
    few = (*train, "--max_steps", s.few_steps, "--batch_size", max(s.batch // 2, 1), "--use_amp")
    torchrun = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "gptopt"]
    # --steps 10: bench's least (its p10/p90); in --mode infer a full generation is repeated max(3, steps // 3) times
    infer = ("--mode", "infer", *data, "--seq_len", s.infer_seq, "--steps", 10, "--warmup", 1, "--json", "--overwrite")
    compress = ("--model", "MODEL", *data, "--eval_tokens", s.eval_tokens, "--repeats", 3, "--json", "--overwrite")
    pip = [ctx.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    install = [*pip, "--no-build-isolation", "-e", str(ROOT)]
    if ctx.wheels:  # apart, and each on its own: one wheel with the wrong tag must not keep the others out
        script = "; ".join(shlex.join([*pip, w]) + " || rc=1" for w in ctx.wheels)
        install = ["sh", "-c", f"rc=0; {script}; {shlex.join(install)} || rc=1; exit $rc"]
    return [
        Step("install", 20, "gptopt itself, offline, over the machine's CUDA torch (and the wheels carried, if any)",
             install, cpu=False),
        Step("doctor", 25, "doctor --smoke: the GPU, driver, CUDA, NCCL, flash attention, a bf16 step",
             g("doctor", "--smoke", "--json"), group="start", stdout="doctor.json"),
        Step("prepare", 25, "the stdlib corpus, tokenized (CPU work only)",
             g("prepare", "--output_dir", p("data"), "--overwrite"), group="start"),
        Step("cuda_tests", 60, "pytest -m cuda: each GPU path's own test", [
            # -v: a line per test in the log, kept even if the step is stopped at its limit
            ctx.python, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "--junitxml",
            p("cuda_tests.xml"), str(ROOT / "tests")], cpu=False, group="start"),
        # train runs at bench's model, batch and length: bench's compiled rungs then find inductor's cache warm,
        # so bench's budget goes to measuring rather than compiling
        Step("train", 60, f"train {s.model} at {s.seq} tokens, bf16 + compile, {s.train_steps} steps: tokens/s, "
             "MFU against the table peak", g("train", *train, "--batch_size", s.batch, "--use_amp", "--compile",
                                            "--max_steps", s.train_steps, "--log_interval", 10, "--output_dir",
                                            p("train"))),
        Step("train_fp16", 25, "fp16 autocast + GradScaler (loss_scale logged)",
             g("train", *few, "--amp_dtype", "fp16", "--output_dir", p("train_fp16"), "--log_interval", 1),
             cpu=False, group="paths"),
        Step("train_ckpt", 25, "--gradient_checkpointing",
             g("train", *few, "--gradient_checkpointing", "--output_dir", p("train_ckpt")), group="paths"),
        Step("train_auto_batch", 25, "--auto_batch_size: the largest micro-batch that fits, accumulation to match",
             g("train", *few, "--auto_batch_size", "--gradient_accumulation_steps", 4,
               "--output_dir", p("train_auto_batch")), group="paths"),
        Step("train_ddp", 25, "torchrun, one process: NCCL process group, distributed sampler, rank-0 saves",
             [*torchrun, "train", *map(str, few), "--output_dir", p("train_ddp")], group="paths"),
        Step("train_fsdp", 25, "torchrun --fsdp, one process: FSDP2 sharding, mixed-precision policy, sharded save",
             [*torchrun, "train", *map(str, few), "--fsdp", "--output_dir", p("train_fsdp")], group="paths"),
        # CPU work, so it starts with the path checks: the Hugging Face folder transformers serve needs
        Step("serve_export", 25, "export --format hf: the served checkpoint as a Hugging Face folder for the serve "
             "step's transformers serve, its logits checked against transformers'",
             g("export", "--model", "MODEL", "--format", "hf", "--output_dir", p("serve_hf"), "--overwrite"),
             model=True, group="paths"),
        Step("bench", 70, f"bench: the default ladder on {s.model} at {s.seq} tokens, each rung against the HF "
             "baseline",
             g("bench", "--preset", s.model, *data, "--batch_size", s.batch, "--seq_len", s.seq, "--steps",
               10, "--warmup", s.bench_warmup, "--output_dir", p("bench"), "--json", "--overwrite"),
             stdout="bench.json"),
        Step("bench_infer", 75, f"bench --mode infer on {s.model}: hf, kv, graphs (eager CUDA graphs), compiled "
             f"(inductor's CUDA graphs), int8, int4 at batch {s.infer_batches.replace(',', ' and ')}: decode tokens/s, "
             "bandwidth share", g(
                 "bench", "--preset", s.model, *infer, "--rungs", "hf,kv,graphs,compiled,int8,int4", "--batch_sizes",
                 s.infer_batches, "--output_dir", p("bench_infer")), stdout="bench_infer.json"),
        Step("decode_large", 50, f"{s.large} batch-1 decode in bf16, compiled: achieved memory bandwidth as a share "
             "of the table's", g("bench", "--preset", s.large, *infer, "--rungs", "compiled", "--batch_sizes", 1,
                                 "--output_dir", p("decode_large")), stdout="decode_large.json"),
        Step("generate", 25, "generate --compile: CUDA-graph decode from a checkpoint, tokens/s",
             g("generate", "--model", "MODEL", "--compile", "--max_new_tokens", s.new_tokens, "--temperature", 0,
               "def fib(n):"), model=True),
        Step("compress_int8", 15, "compress int8-weight (torchao): size, decode speed, perplexity and KL",
             g("compress", *compress, "--quantize", "int8-weight", "--output_dir", p("compress_int8")), model=True,
             stdout="compress_int8.json"),
        Step("compress_int4", 15, "compress int4-weight (torchao tinygemm): size, decode speed, quality",
             g("compress", *compress, "--quantize", "int4-weight", "--output_dir", p("compress_int4")), model=True,
             stdout="compress_int4.json", cpu=False),
        Step("compress_2_4", 15, "compress --prune 2:4 (semi-structured sparse kernels): size, speed, quality",
             g("compress", *compress, "--prune", "2:4", "--output_dir", p("compress_2_4")), model=True,
             stdout="compress_2_4.json", cpu=False),
        # The limit holds, in this order: bench's decode, serve's start and its loadtests, then transformers serve's
        # start and loadtests. The peer comes last and is what a short limit cuts: its figures are a comparison,
        # gptopt's are the step's. In the whole run the limits add up to the budget and the peer gets what the
        # steps before leave unused; a call of the serving steps alone (--only train,serve) leaves it the budget.
        Step("serve", 59, f"serve on a free port with its defaults but --max_batch_size {max(s.clients)} (on the GPU "
             "the eager decode recorded as a CUDA graph per batch bucket before /ready), loadtest at "
             f"{', '.join(map(str, s.clients))} clients, {s.prompt_tokens}-token prompts, {s.serve_tokens} new "
             f"tokens: start to /ready, TTFT, TPOT, output tokens/s, errors, memory; each beside bench's "
             f"{s.decode_rung} decode at that batch (share); then transformers serve --continuous-batching on the "
             f"same weights at {', '.join(map(str, s.peer_clients))} clients (vs_transformers)",
             g("serve", "--model", "MODEL", "--host", "127.0.0.1", "--port", "PORT", "--max_batch_size",
               max(s.clients)), model=True, serve=True,
             # bench's prompt is half of --seq_len (at most 128 tokens), its completion the rest: with
             # prompt_tokens == serve_tokens it decodes the shapes serve's requests do
             decode=g("bench", "--preset", s.model, "--mode", "infer", *data, "--seq_len",
                      s.prompt_tokens + s.serve_tokens, "--steps", 10, "--warmup", 1, "--rungs", s.decode_rung,
                      "--batch_sizes", ",".join(map(str, s.clients)), "--output_dir", p("serve_decode"), "--json",
                      "--overwrite"),
             peer=[ctx.python, "-m", "transformers.cli.transformers", "serve", "--continuous-batching", "--dtype",
                   "bfloat16", "--host", "127.0.0.1", "--port", "PORT", p("serve_hf")]),
        # issue 55's paged engine where its KV cache runs out: a budget of a few sequences, more clients than fit;
        # a path check (its figures say that it preempts and completes, not how fast)
        Step("serve_preempt", 25, f"serve with --kv_cache_memory {s.preempt_kv_gib:g} (blocks of "
             f"{s.preempt_block} tokens, fewer than its clients' sequences need), loadtest at {c} clients, then at "
             f"{c} with a {s.prompt_tokens}-token shared prefix: the start-up line, preemptions and prefix-cache "
             "hits from /metrics, KV usage at its peak, every request completed",
             g("serve", "--model", "MODEL", "--host", "127.0.0.1", "--port", "PORT", "--kv_cache_memory",
               s.preempt_kv_gib, "--block_size", s.preempt_block, "--max_len", 2 * s.prompt_tokens + s.serve_tokens,
               "--max_batch_size", c), model=True, serve=True, check=preempted_and_completed,
             loads=[(f"{key}_{c}", g("loadtest", "--url", "URL", "--concurrency", c, "--requests", 2 * c,
                                     "--tokenizer", "MODEL", "--prompt_tokens", s.prompt_tokens, *shared,
                                     "--max_tokens", s.serve_tokens, "--json"))
                    for key, shared in (("clients", ()), ("shared_prefix", ("--shared_prefix", s.prompt_tokens)))]),
        Step("profile", 25, f"profile --preset {s.model} --use_amp: where the time goes, and the fix",
             g("profile", "--preset", s.model, "--use_amp", *data, "--output_dir", p("profile"), "--json",
               "--overwrite"),
             stdout="profile.json"),
        # Issue 36, the training levers: run by name (--only train,bench_levers,train_fp8,...), after `train`,
        # whose run they stand beside
        Step("bench_levers", 180, f"bench: the default ladder, then 'all' with the chunked loss, with SDPA's cuDNN "
             f"kernel and with float8, on {s.model} at {s.seq} tokens: tokens/s, MFU, loss against the baseline "
             "(bench's step and more)",
             g("bench", "--preset", s.model, *data, "--batch_size", s.batch, "--seq_len", s.seq, "--steps", 10,
               "--warmup", s.bench_warmup, "--rungs", "default,chunked_loss,cudnn_attention,fp8", "--output_dir",
               p("bench_levers"), "--json", "--overwrite"),
             stdout="bench_levers.json", default=False),
        Step("train_fp8", 60, "train as `train` does, with --fp8: tokens/s against train's, and the loss curve "
             "beside its bf16 one", g("train", *train, "--batch_size", s.batch, "--use_amp", "--compile", "--fp8",
                                     "--max_steps", s.train_steps, "--log_interval", 10, "--output_dir",
                                     p("train_fp8")),
             cpu=False, default=False),
        # the limits grow with the model: compiling its layers, searching the micro-batch, saving weights and AdamW
        *[Step(larger_step(m), limit, f"train {m} at {s.seq} tokens, bf16 + compile, the largest micro-batch that "
               "fits a global batch of 32 sequences (--auto_batch_size; --loss auto): tokens/s, MFU, the memory "
               "plan", g("train", *data, "--preset", m, "--seq_len", s.seq, "--eval_interval", 0, "--seed", 0,
                         "--overwrite", "--batch_size", 32, "--auto_batch_size", "--use_amp", "--compile",
                         "--max_steps", s.few_steps * 3, "--log_interval", 2, "--output_dir", p(larger_step(m))),
               default=False, drop_checkpoints=True)
          for m, limit in zip(s.larger, (100, 120, 180), strict=False)],
        # Issue 37, the Llama/Qwen3 family and the modern block: run by name (--only train,train_modern,...), after
        # `train`, whose run train_modern stands beside
        Step("train_modern", 60, "train as `train` does, with the modern block (rotary positions, QK-norm, "
             "relu^2 MLP, an untied head, zero-initialised projections) and Muon: tokens/s against train's "
             "(the per-step cost of the recipe)",
             g("train", *train, *measured, "--arch", MODERN_ARCH, "--optimizer", "muon", "--muon_lr", "6e-3",
               "--learning_rate", "8e-3", "--warmup_steps", 10, "--output_dir", p("train_modern")),
             default=False),
        Step("train_smollm2", 90, f"train {s.llama} at {s.seq} tokens, bf16 + compile, {s.train_steps} steps: "
             "tokens/s, MFU against the table peak (its checkpoint is generate_llama's model)",
             g("train", *at(s.llama), *measured, "--output_dir", p("train_smollm2")), default=False),
        Step("generate_llama", 75, f"generate --compile from train_smollm2's {s.llama}: the decode of a grouped-query "
             "rotary model on CUDA graphs, tokens/s after the compile",
             g("generate", "--model", p("train_smollm2"), "--compile", "--max_new_tokens", s.new_tokens,
               "--temperature", 0, "def fib(n):"), default=False),
        # Issue 47: speculative decoding on the GPU, run by name (--only train,speculative), after `train`, whose
        # checkpoint drafts for the large model's random weights: the cost of a step whose drafts miss
        Step("speculative", 60, f"bench --mode infer on {s.large}: kv against speculative with train's {s.model} "
             "checkpoint as the draft, batch 1: what a speculative step costs over a decode step (random weights "
             "keep next to no draft; trained ones keep their acceptance rate times k more tokens a step)",
             g("bench", "--preset", s.large, *infer, "--rungs", "kv,speculative", "--draft_model", "MODEL",
               "--batch_sizes", 1, "--output_dir", p("speculative")), model=True, stdout="speculative.json",
             default=False),
        # Issue 46: the grouped-query models' decode on the GPU, greedy and sampled over the whole vocabulary
        # (OpenAI's default), eager and on CUDA graphs, against transformers, with the lever rungs a GPU runs (the
        # cache repeated to every head; transformers' sampler, sampled); run by name
        *[Step(f"infer_{family}_{how}", 100, f"bench --mode infer on {size}, {how}: hf, kv, its lever rungs and "
               f"graphs at batch {s.infer_batches.replace(',', ' and ')}: attention over the key/value heads as "
               "stored against repeated, the family's block on CUDA graphs"
               + (", gptopt's sampler against transformers' over the whole vocabulary" if how == "sampled" else ""),
               g("bench", "--preset", size, *infer, "--rungs", "hf,levers,graphs", "--batch_sizes", s.infer_batches,
                 *(("--temperature", 1) if how == "sampled" else ()), "--output_dir", p(f"infer_{family}_{how}")),
               stdout=f"infer_{family}_{how}.json", default=False)
          for family, size in (("llama", s.llama), ("qwen3", s.qwen)) for how in ("greedy", "sampled")],
        # last: the call's optional step, what a short budget cuts
        Step("train_qwen3", 100, f"train {s.qwen} at {s.seq} tokens, bf16 + compile, {s.train_steps} steps: "
             "tokens/s, MFU against the table peak",
             g("train", *at(s.qwen), *measured, "--output_dir", p("train_qwen3")), default=False,
             drop_checkpoints=True),
    ]


def loadtests(ctx: Ctx, url: str, clients: tuple[int, ...] | None = None,
              model: str = "MODEL") -> list[tuple[int, list[str]]]:
    """loadtest at each client count (the sizes' `clients` by default): prompts of exactly prompt_tokens tokens
    of the served model's tokenizer, so every server gets the same requests, token for token."""
    s = ctx.sizes
    return [(c, ctx.gptopt("loadtest", "--url", url, "--concurrency", c, "--requests", max(4 * c, 8),
                           "--tokenizer", model, "--prompt_tokens", s.prompt_tokens, "--max_tokens", s.serve_tokens,
                           "--json")) for c in (clients or s.clients)]


def step_loadtests(ctx: Ctx, step: Step, url: str, model: str = "MODEL") -> list[tuple[str, list[str]]]:
    """A serve step's loadtests, each with the name of its figures: the step's own (URL and MODEL filled in), or
    loadtests() at the sizes' client counts."""
    if step.loads is None:
        return [(f"clients_{c}", argv) for c, argv in loadtests(ctx, url, model=model)]
    return [(key, [url if a == "URL" else model if a == "MODEL" else a for a in argv]) for key, argv in step.loads]


def preempted_and_completed(figures: dict[str, Any]) -> str | None:
    """serve_preempt's check: every loadtest sent all its requests, none failed, and the server preempted."""
    rows = {k: v for k, v in figures.items() if isinstance(v, dict) and "requests" in v}
    if bad := [k for k, v in rows.items() if v.get("errors") or v.get("completed") != v.get("requests")]:
        return f"requests failed in {', '.join(bad)}"
    if not sum(v.get("preemptions") or 0 for v in rows.values()):
        return "no request was preempted: the KV cache held every client's sequence"
    return None


def phases(steps: list[Step]) -> list[list[Step]]:
    """Consecutive steps of one group form one phase; every other step is a phase of its own."""
    out: list[list[Step]] = []
    for step in steps:
        if out and step.group is not None and out[-1][0].group == step.group:
            out[-1].append(step)
        else:
            out.append([step])
    return out


def resolve(argv: list[str], model: str | None, port: int | None = None) -> list[str]:
    return [model if a == "MODEL" and model else str(port) if a == "PORT" and port else a for a in argv]


def planned(step: Step, ctx: Ctx) -> dict[str, Any]:
    limit = step.limit if ctx.target == "gpu" else CPU_LIMIT_S
    res: dict[str, Any] = {"name": step.name, "what": step.what, "limit_s": limit, "status": "planned",
                           "command": shlex.join(step.argv)}
    if step.group:
        res["group"] = step.group
    if step.model:
        res["model_from"] = list(MODEL_FROM)
    if step.decode:
        res["decode"] = shlex.join(step.decode)
    if step.serve:
        res["loadtests"] = [shlex.join(a) for _, a in step_loadtests(ctx, step, "http://127.0.0.1:PORT")]
    if step.peer:
        res["peer"] = shlex.join(step.peer)
        res["peer_loadtests"] = [shlex.join(a) for _, a in loadtests(ctx, "http://127.0.0.1:PORT",
                                                                     ctx.sizes.peer_clients)]
    return res
