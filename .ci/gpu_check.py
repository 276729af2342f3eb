#!/usr/bin/env python3
"""Every GPU path of gptopt, run and measured in one call: the plan, the runner and the record.

    bash .ci/gpu_check.sh DIR                       # the GPU machine: install, then every step
    python3 .ci/gpu_check.py run DIR --only bench   # again, some steps only (after a fix)
    python3 .ci/gpu_check.py dry-run DIR            # any machine: the plan, and DIR/results.json of it
    python3 .ci/gpu_check.py record DIR             # results.json -> the rows of docs/gpu-results.md

Standard library only: the runner starts before gptopt is installed (its first step installs it),
and every step is a separate process, so one that crashes, hangs or runs out of memory costs only
its own time limit. A GPU machine is lent rarely and briefly, so the run never stops early: a
failed step keeps the tail of its log, the next step starts, and results.json plus summary.txt
are rewritten after every step (a run cut off from outside still leaves what it had).

The plan is one list of steps in one place; the same steps run on a CPU with the debug preset
(`run DIR --target cpu`, what tests/test_gpu_check.py does) so that a typo in a command is found
here, not on the GPU. Steps that start together (`group`) only check that a path works: nothing
timed runs beside anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # this file is .ci/gpu_check.py
BUDGET_S = 540  # nine minutes, the install included: a lease is 15 minutes, start-up and one rerun included
# per step on a CPU: generous, since compiling alone is slow there (docs/benchmarks.md), and the CPU run checks
# commands, not speed
CPU_LIMIT_S = 420
RANDOM_WEIGHTS = "random weights and the stdlib corpus (no network): speed figures are real, text and loss are not"

# What a GPU image may lack, by import name -> the wheels to carry (pip names); see .ci/gpu_check.sh.
NEEDED = {"fastapi": "fastapi starlette pydantic pydantic-core annotated-types typing-inspection",
          "uvicorn": "uvicorn", "torchao": "torchao", "prometheus_client": "prometheus-client",
          "regex": "regex", "httpx": "httpx", "transformers": "transformers", "pynvml": "nvidia-ml-py",
          "aiohttp": "aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna",
          "psutil": "psutil", "tqdm": "tqdm", "pytest": "pytest",
          # transformers serve, the serve step's peer: its serving extra's client types import openai's client
          "openai": "openai httpx2 httpcore2 truststore jiter sniffio"}


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


SIZES = {
    "gpu": Sizes(model="gpt2", large="gpt2-xl", seq=1024, batch=16, train_steps=40, few_steps=4,
                 bench_warmup=2, infer_batches="1,64", infer_seq=256, new_tokens=128, eval_tokens=16384,
                 clients=(1, 16, 64, 256), prompt_tokens=128, serve_tokens=128, peer_clients=(16, 64),
                 decode_rung="graphs", larger=("gpt2-medium", "gpt2-large", "gpt2-xl"), llama="smollm2-135m",
                 qwen="qwen3-0.6b"),
    "cpu": Sizes(model="debug", large="debug", seq=64, batch=4, train_steps=4, few_steps=2,
                 bench_warmup=1, infer_batches="1,2", infer_seq=64, new_tokens=16, eval_tokens=1024,
                 clients=(1, 2, 4), prompt_tokens=8, serve_tokens=8, peer_clients=(1, 2), decode_rung="kv",
                 larger=("debug",), llama="llama-tiny", qwen="llama-tiny"),
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


# the modern block (issue 37's train_modern): rotary positions, QK-norm, relu^2, an untied head, zero-init projections
MODERN_ARCH = "positions=rope,qk_norm=true,mlp=relu2,tie_embeddings=false,zero_init=true"


def larger_step(model: str) -> str:
    """The step (and output folder) that trains one of the sizes' larger models."""
    return f"train_{model}".replace("-", "_")


def plan(ctx: Ctx) -> list[Step]:
    """Every step, in order. The limits add up to under BUDGET_S (a test holds them to it)."""
    s, g, p = ctx.sizes, ctx.gptopt, ctx.path
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
        Step("train_fp16", 30, "fp16 autocast + GradScaler (loss_scale logged)",
             g("train", *few, "--amp_dtype", "fp16", "--output_dir", p("train_fp16"), "--log_interval", 1),
             cpu=False, group="paths"),
        Step("train_ckpt", 30, "--gradient_checkpointing",
             g("train", *few, "--gradient_checkpointing", "--output_dir", p("train_ckpt")), group="paths"),
        Step("train_auto_batch", 30, "--auto_batch_size: the largest micro-batch that fits, accumulation to match",
             g("train", *few, "--auto_batch_size", "--gradient_accumulation_steps", 4,
               "--output_dir", p("train_auto_batch")), group="paths"),
        Step("train_ddp", 30, "torchrun, one process: NCCL process group, distributed sampler, rank-0 saves",
             [*torchrun, "train", *map(str, few), "--output_dir", p("train_ddp")], group="paths"),
        Step("train_fsdp", 30, "torchrun --fsdp, one process: FSDP2 sharding, mixed-precision policy, sharded save",
             [*torchrun, "train", *map(str, few), "--fsdp", "--output_dir", p("train_fsdp")], group="paths"),
        # CPU work, so it starts with the path checks: the Hugging Face folder transformers serve needs
        Step("serve_export", 30, "export --format hf: the served checkpoint as a Hugging Face folder for the serve "
             "step's transformers serve, its logits checked against transformers'",
             g("export", "--model", "MODEL", "--format", "hf", "--output_dir", p("serve_hf"), "--overwrite"),
             model=True, group="paths"),
        Step("bench", 80, f"bench: the default ladder on {s.model} at {s.seq} tokens, each rung against the HF "
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
        Step("serve", 69, f"serve on a free port with its defaults but --max_batch_size {max(s.clients)} (on the GPU "
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


def phases(steps: list[Step]) -> list[list[Step]]:
    """Consecutive steps of one group form one phase; every other step is a phase of its own."""
    out: list[list[Step]] = []
    for step in steps:
        if out and step.group is not None and out[-1][0].group == step.group:
            out[-1].append(step)
        else:
            out.append([step])
    return out


# ---------------------------------------------------------------------------------------------
# Figures: each step's few numbers worth a row, read from what the command wrote


def _json(path: Path) -> Any:
    """A command's --json output: the whole file, or its last line (logs may precede it)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for candidate in (text, *text.strip().splitlines()[-1:]):
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


def _r(x: Any, nd: int = 1) -> Any:
    return round(x, nd) if isinstance(x, float) else x


def _gib(x: Any) -> Any:
    return round(x / 2**30, 2) if isinstance(x, (int, float)) else None


def fig_doctor(out: Path, _log: str) -> dict[str, Any]:
    d = _json(out / "doctor.json") or {}
    facts, gpus = d.get("facts", {}), d.get("facts", {}).get("gpus") or [{}]
    gpu = gpus[0] if isinstance(gpus[0], dict) else {}
    return {"gpu": gpu.get("name"), "gpu_memory_gib": _gib(gpu.get("memory_total")),
            "capability": gpu.get("capability"), "torch": facts.get("torch_version"), "cuda": facts.get("torch_cuda"),
            "driver": facts.get("driver"), "nccl": facts.get("nccl"), "device_policy": facts.get("device_reason"),
            "checks": d.get("summary"), "smoke": d.get("smoke")}


def fig_prepare(out: Path, _log: str) -> dict[str, Any]:
    meta = _json(out / "data" / "meta.json") or {}
    return {k: meta.get(k) for k in ("train_tokens", "val_tokens", "vocab_size") if k in meta}


def fig_pytest(out: Path, log: str) -> dict[str, Any]:
    try:
        root = ET.parse(out / "cuda_tests.xml").getroot()
    except (OSError, ET.ParseError):  # stopped before its report: the -v lines of the tests that ran
        seen = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", log, flags=re.M)
        started = re.findall(r"^(\S+::\S+)", log, flags=re.M)
        out: dict[str, Any] = {"ran": len(seen), "failed": [t for t, r in seen if r in ("FAILED", "ERROR")],
                               "passed": sum(r == "PASSED" for _, r in seen)} if seen else {}
        if started and started[-1] not in {t for t, _ in seen}:
            out["running_at_stop"] = started[-1]  # the test that hung, most likely
        return out
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    failed = [c.get("name") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = {c.get("name"): (c.find("skipped").get("message") or "")[:120] for c in suite.iter("testcase")
               if c.find("skipped") is not None}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed": failed, "skipped_why": skipped}


def _train(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        run = _json(out / name / "run.json") or {}
        summary, cfg = run.get("summary") or {}, run.get("config") or {}
        records = []
        try:
            records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
        except (OSError, ValueError):
            pass
        steps = [r for r in records if "loss" in r]
        median = summary.get("median_step_s")
        res = {"steps": summary.get("step"), "median_step_ms": _r(median * 1e3) if median else None,
               "tokens_per_s": _r(summary.get("tokens_per_s"), 0), "mfu": _r(summary.get("mfu"), 3),
               "peak": summary.get("peak_source"), "first_step_s": _r(summary.get("first_step_s")),
               "peak_memory_gib": _gib(summary.get("peak_memory_bytes")),
               "loss_first_last": [_r(steps[0]["loss"], 3), _r(steps[-1]["loss"], 3)] if steps else None,
               "micro_batch_x_accumulation": [cfg.get("batch_size"), cfg.get("gradient_accumulation_steps")],
               # the memory plan as it ran: the loss auto settled on, recomputation, FSDP, offload
               "plan": {"loss": (run.get("model") or {}).get("loss"), **{
                   k: cfg.get(k) for k in ("gradient_checkpointing", "fsdp", "cpu_offload", "fp8") if cfg.get(k)}},
               "amp": (run.get("environment") or {}).get("amp_dtype")}
        scales = [r["loss_scale"] for r in steps if "loss_scale" in r]
        if scales:
            res["loss_scale_first_last"] = [scales[0], scales[-1]]
        monitor = _json(out / name / "monitor.json") or {}  # NVML, sampled through the run
        if monitor.get("gpu_available"):
            res["nvml"] = {k.removeprefix("gpu0_"): _r(v.get("mean" if "pct" in k or "power" in k else "max"), 1)
                           for k, v in monitor.items() if k.startswith("gpu0_") and isinstance(v, dict)
                           and any(t in k for t in ("util_pct", "power_w", "sm_clock", "temp_c"))}
        elif monitor.get("gpu_reason"):
            res["nvml"] = monitor["gpu_reason"]
        return {k: v for k, v in res.items() if v not in (None, [None, None])}
    return figures


def _rung(r: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    out = {"status": r.get("status")}
    out.update({k: _r(r.get(k), 3) for k in keys if r.get(k) is not None})
    if r.get("note"):
        out["note"] = r["note"][:160]
    return out


def fig_bench_at(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        d = _json(out / name / "results.json") or _json(out / f"{name}.json") or {}
        rungs = {r["name"]: _rung(r, ("tokens_per_s", "mfu", "speedup_vs_baseline", "compile_s", "loss_ok"))
                 for r in d.get("rungs", [])}
        return {"best": d.get("best"), "peak": d.get("peak_source") or d.get("peak"), "rungs": rungs} if rungs else {}
    return figures


fig_bench = fig_bench_at("bench")


def _infer(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        d = _json(out / name / "infer_results.json") or _json(out / f"{name}.json") or {}
        rungs = {}
        for r in d.get("rungs", []):
            row = _rung(r, ("decode_tokens_per_s", "bandwidth_gbs", "bandwidth_util", "speedup_vs_baseline",
                            "ttft_s", "tokens_match"))
            sweep = r.get("batch_sweep") or []
            if sweep:
                row["top_batch"] = [sweep[-1]["batch_size"], _r(sweep[-1]["tokens_per_s"], 0)]
            rungs[r["name"]] = row
        if not rungs:
            return {}
        peak = d.get("peak_bandwidth")
        return {"weights": RANDOM_WEIGHTS, "peak_bandwidth_gbs": _r(peak / 1e9) if peak else None,
                "bandwidth_source": d.get("bandwidth_source"), "rungs": rungs}
    return figures


def fig_generate(_out: Path, log: str) -> dict[str, Any]:
    """generate --compile's decode rate after the compile; the whole-run rate (mostly compile) beside it."""
    whole = re.search(r"gptopt generate: (\d+) tokens in ([\d.]+) s: ([\d,.]+) tokens/s", log)
    after = re.search(r"compiled decode after the first \d+ tokens \(([\d.]+) s\): ([\d,.]+) tokens/s", log)
    out: dict[str, Any] = {}
    if whole:
        out.update(tokens=int(whole[1]), whole_run_s=float(whole[2]))
    if after:
        out.update(compile_and_warmup_s=float(after[1]), tokens_per_s=float(after[2].replace(",", "")))
    elif whole:
        out["note"] = "no compiled decode rate: too few tokens came after the compile (an early end of text?)"
    return out


def _compress(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        d = _json(out / name / "results.json") or _json(out / f"{name}.json") or {}
        if not d:
            return {}
        orig, comp = d.get("original") or {}, d.get("compressed") or {}
        res: dict[str, Any] = {"method": d.get("method")}
        for key in ("disk_bytes", "memory_bytes"):
            if orig.get(key) and comp.get(key):
                res[f"{key.split('_')[0]}_ratio"] = _r(comp[key] / orig[key], 3)
        res["decode_tokens_per_s"] = {name: {b: _r(v, 0) for b, v in (m.get("decode_tokens_per_s") or {}).items()}
                                      for name, m in (("original", orig), ("compressed", comp))}
        res["perplexity"] = [_r(orig.get("perplexity"), 3), _r(comp.get("perplexity"), 3)]
        res["kl"] = _r(comp.get("kl_divergence"), 5)
        return res
    return figures


def fig_profile(out: Path, _log: str) -> dict[str, Any]:
    d = _json(out / "profile.json") or {}
    if not d:
        return {}
    figures = {k: _r(v, 3) for k, v in (d.get("figures") or {}).items() if isinstance(v, (int, float))}
    return {"figures": figures, "findings": [f"{f.get('name')}: {f.get('figure')} -> {f.get('fix')}"
                                             for f in d.get("findings") or []][:4]}


# serve's log line after its warm-up (serve/engine.py): "compiled the decode for batches of 1, 2, 4 in S s",
# or without --compile on a GPU "recorded CUDA graphs of the decode for batches of ..."
DECODE_GRAPHS = re.compile(r"(?:compiled|recorded CUDA graphs of) the decode for batches of ([\d, ]+) in ([\d.]+) s")


def decode_rates(doc: Any, rung: str) -> dict[str, Any]:
    """bench --mode infer's JSON -> the rung's status and its decode tokens/s at each batch size of its sweep."""
    if not isinstance(doc, dict):
        return {"status": "failed", "note": "bench wrote no results"}
    r = next((r for r in doc.get("rungs") or [] if r.get("name") == rung), None)
    if r is None:
        return {"status": "failed", "note": f"bench's results hold no rung {rung}"}
    out: dict[str, Any] = {"rung": rung, "status": r.get("status"), "prompt_tokens": doc.get("prompt_len"),
                           "new_tokens": doc.get("max_new_tokens"),
                           "tokens_per_s": {str(b["batch_size"]): _r(b["tokens_per_s"], 1)
                                            for b in r.get("batch_sweep") or []}}
    if r.get("note"):
        out["note"] = r["note"][:160]
    return out


def compared(figures: dict[str, Any]) -> dict[str, Any]:
    """The serve step's figures with issue 35's comparisons added (a new dict; `figures` is left as it was):
    beside each client count C, bench's decode tokens/s at batch C and the share (serve's output tokens/s over
    it); and at each client count the peer ran, gptopt's output tokens/s over transformers serve's
    (vs_transformers). A comparison whose either side is missing is left out."""
    out = dict(figures)
    decode = (figures.get("decode") or {}).get("tokens_per_s") or {}
    peer = figures.get("peer_transformers") or {}
    ratios = {}
    for key, row in figures.items():
        if not key.startswith("clients_") or not isinstance(row, dict):
            continue
        ours = row.get("output_tokens_per_s")
        if not isinstance(ours, (int, float)):
            continue
        rate = decode.get(key.removeprefix("clients_"))
        if isinstance(rate, (int, float)) and rate > 0:
            out[key] = {**row, "decode_tokens_per_s": rate, "share": round(ours / rate, 3)}
        theirs = (peer.get(key) or {}).get("output_tokens_per_s")
        if isinstance(theirs, (int, float)) and theirs > 0:
            ratios[key] = round(ours / theirs, 2)
    if ratios:
        out["vs_transformers"] = ratios
    return out


def fig_train_fp8(out: Path, log: str) -> dict[str, Any]:
    """train_fp8's own figures, and beside train's bf16 run of the same steps: the tokens/s ratio and the
    largest relative gap between the two loss curves at the steps both logged."""
    res = _train("train_fp8")(out, log)

    def curve(name: str) -> dict[int, float]:
        try:
            lines = (out / name / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return {}
        return {r["step"]: r["loss"] for r in map(json.loads, filter(None, lines)) if "loss" in r}

    fp8, bf16 = curve("train_fp8"), curve("train")
    both = sorted(set(fp8) & set(bf16))
    if both:
        res["vs_bf16_loss_max_rel_gap"] = _r(max(abs(fp8[k] - bf16[k]) / abs(bf16[k]) for k in both), 4)
    theirs = _train("train")(out, log).get("tokens_per_s")
    if res.get("tokens_per_s") and theirs:
        res["vs_bf16_tokens_per_s"] = _r(res["tokens_per_s"] / theirs, 3)
    return res


def fig_train_modern(out: Path, log: str) -> dict[str, Any]:
    """train_modern's own figures, and its tokens/s over train's of the same model, batch and steps: what the
    modern block and Muon cost per step (their losses differ by design, so no curve is set beside train's)."""
    res = _train("train_modern")(out, log)
    theirs = _train("train")(out, log).get("tokens_per_s")
    if res.get("tokens_per_s") and theirs:
        res["vs_train_tokens_per_s"] = _r(res["tokens_per_s"] / theirs, 3)
    return res


FIGURES: dict[str, Callable[[Path, str], dict[str, Any]]] = {
    "doctor": fig_doctor, "prepare": fig_prepare, "cuda_tests": fig_pytest, "bench": fig_bench,
    "bench_levers": fig_bench_at("bench_levers"), "train_fp8": fig_train_fp8, "train_modern": fig_train_modern,
    "train_smollm2": _train("train_smollm2"), "train_qwen3": _train("train_qwen3"), "generate_llama": fig_generate,
    **{larger_step(m): _train(larger_step(m)) for size in SIZES.values() for m in size.larger},
    "bench_infer": _infer("bench_infer"), "decode_large": _infer("decode_large"), "generate": fig_generate,
    "profile": fig_profile,
    **{n: _train(n) for n in ("train", "train_fp16", "train_ckpt", "train_auto_batch", "train_ddp", "train_fsdp")},
    **{n: _compress(n) for n in ("compress_int8", "compress_int4", "compress_2_4")},
}


# ---------------------------------------------------------------------------------------------
# Running


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


GRACE_S = (5, 5)  # after a step's limit: SIGINT to its leader, then SIGTERM and SIGKILL to its group this long apart


class CutOff(BaseException):
    """The runner itself was told to stop (SIGTERM, or Ctrl-C at a terminal). A BaseException, like
    KeyboardInterrupt: the runner's own `except Exception` (polling /ready, reading figures) must not
    swallow it."""


def _cut_off(signum: int, _frame: object) -> None:
    raise CutOff(signal.Signals(signum).name)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _start(argv: list[str], log: Path, stdout: Path | None = None) -> subprocess.Popen[bytes]:
    """The step in a process group of its own (its torchrun ranks, compile workers and DataLoader
    workers join it), so it can be stopped whole; in this session, so whatever stops the runner's
    session stops it too."""
    group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with open(log, "ab") as err, open(stdout or os.devnull, "wb") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=out if stdout else err, stderr=err, **group)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Blocking: SIGINT to the leader (pytest then writes its report, gptopt what it has), SIGTERM and
    SIGKILL to the group; and the group's leftovers always."""
    for sig, wait in ((signal.SIGINT, GRACE_S[0]), (signal.SIGTERM, GRACE_S[1]), (signal.SIGKILL, 5)):
        if sig == signal.SIGINT:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
        else:
            _killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _model_dir(out: Path) -> Path | None:
    for name in MODEL_FROM:
        if (out / name / "latest").is_file():
            return out / name
    return None


@dataclasses.dataclass
class Live:
    step: Step
    proc: subprocess.Popen[bytes]
    start: float
    limit: float
    stage: int = 0  # 0 running; 1 SIGINT sent; 2 SIGTERM; 3 SIGKILL
    since: float = 0.0


class Runner:
    def __init__(self, ctx: Ctx, steps: list[Step], budget_s: int, order: list[str] | None = None,
                 report: Path | None = None) -> None:
        self.ctx, self.steps, self.budget_s, self.report = ctx, steps, budget_s, report
        self.order = order or [s.name for s in steps]  # the whole plan's: results.json lists steps in it
        self.t0 = time.monotonic()
        self.results: dict[str, dict[str, Any]] = {s.name: planned(s, ctx) for s in steps}
        self.header: dict[str, Any] = {"started": _now(), "target": ctx.target, "budget_s": budget_s,
                                       "planned_s": sum(max(self.own(s) for s in p) for p in phases(steps)),
                                       "python": ctx.python, "repo": str(ROOT),
                                       "commit": _git_commit(), "weights": RANDOM_WEIGHTS}
        self.earlier: dict[str, dict[str, Any]] = {}  # steps an earlier run into DIR ran and this one does not
        self.live: list[Live] = []

    def keep_earlier(self) -> None:
        """A rerun of some steps (--only) into the same DIR keeps the other steps' results."""
        old = _json(self.ctx.out / "results.json")
        if not isinstance(old, dict) or old.get("target") != self.ctx.target:
            return
        self.earlier = {r["name"]: r for r in old.get("steps", []) if r.get("status") != "planned"
                        and r["name"] not in self.results}
        self.header["earlier_run"] = {k: old.get(k) for k in ("started", "commit", "seconds")}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def own(self, step: Step) -> int:
        return step.limit if self.ctx.target == "gpu" else CPU_LIMIT_S

    def run(self) -> dict[str, Any]:
        self.keep_earlier()
        self.header.update(_machine(self.ctx))
        self.save()
        old = {sig: signal.signal(sig, _cut_off) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            todo = phases(self.steps)
            for i, phase in enumerate(todo):
                # Time a step leaves unused goes to the later ones: each may use its own limit plus what the
                # budget holds beyond the limits of the steps still to come (this phase's included).
                rest = sum(max(self.own(s) for s in p) for p in todo[i:])
                self.run_phase(phase, extra=max(0.0, self.left() - rest))
                if phase[0].name == "install":  # what is still missing once gptopt and the wheels are in
                    self.header.update(missing_after_install=_missing(self.ctx.python))
                self.save()
        except CutOff as e:
            for live in self.live:
                _killpg(live.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    live.proc.wait(5)
                self.finish(live.step, "cut off", live.proc.returncode, time.monotonic() - live.start,
                            f"the run was stopped from outside ({e})")
            self.header["cut_off"] = str(e)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        self.header["finished"] = _now()
        self.header["seconds"] = round(time.monotonic() - self.t0, 1)
        return self.save()

    def run_phase(self, phase: list[Step], extra: float = 0.0) -> None:
        for step in phase:
            own = self.own(step)
            limit = min(own + extra, self.left())
            res = self.results[step.name]
            if limit < min(own, 15):  # too little left even to import torch and start
                res.update(status="skipped", note="out of time: the run's budget is spent")
                _say(f"-- {step.name}: skipped, out of time")
                continue
            if step.model:
                model = _model_dir(self.ctx.out)
                if model is None:
                    res.update(status="skipped", note=f"no model: none of {', '.join(MODEL_FROM)} saved a checkpoint")
                    _say(f"-- {step.name}: skipped, no model")
                    continue
                res["model"] = str(model)
            res["limit_s"] = round(limit)
            if step.serve:
                self.run_serve(step, limit)
                continue
            argv = resolve(step.argv, res.get("model"))
            _say(f"== {step.name} (limit {limit:.0f}s): {shlex.join(argv)}")
            log = self.ctx.out / f"{step.name}.log"
            log.unlink(missing_ok=True)
            try:
                proc = _start(argv, log, self.ctx.out / step.stdout if step.stdout else None)
            except OSError as e:
                self.finish(step, "failed", None, 0.0, f"could not start: {e}")
                continue
            self.live.append(Live(step, proc, time.monotonic(), limit))
        while self.live:
            now = time.monotonic()
            for live in list(self.live):
                rc = live.proc.poll()
                if rc is not None:
                    _killpg(live.proc.pid, signal.SIGKILL)  # its leftovers: workers, ranks, compile pools
                    self.live.remove(live)
                    if live.stage:
                        self.finish(live.step, "timeout", rc, now - live.start,
                                    f"stopped at its limit of {live.limit:.0f}s")
                    else:
                        self.finish(live.step, "ok" if rc == 0 else "failed", rc, now - live.start)
                elif live.stage == 0 and now - live.start >= live.limit:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(live.proc.pid, signal.SIGINT)
                    live.stage, live.since = 1, now
                elif 0 < live.stage < 3 and now - live.since >= GRACE_S[live.stage - 1]:
                    _killpg(live.proc.pid, signal.SIGTERM if live.stage == 1 else signal.SIGKILL)
                    live.stage, live.since = live.stage + 1, now
            time.sleep(0.2)

    def finish(self, step: Step, status: str, rc: int | None, seconds: float, note: str = "") -> None:
        res, log = self.results[step.name], self.ctx.out / f"{step.name}.log"
        res.update(status=status, rc=rc, seconds=round(seconds, 1))
        if note:
            res["note"] = note
        if step.name in FIGURES:
            try:
                text = log.read_text(errors="replace") if log.exists() else ""
                res["figures"] = FIGURES[step.name](self.ctx.out, text)
            except Exception as e:  # a figure that cannot be read must not cost the rest of the run
                res["figures"] = {"unreadable": f"{type(e).__name__}: {e}"}
        if step.drop_checkpoints:
            for ckpt in (self.ctx.out / step.name).glob("ckpt-*"):
                shutil.rmtree(ckpt, ignore_errors=True)
        if status != "ok":
            res["error_tail"] = _tail(log)
        _say(f"   {step.name}: {status} (rc {rc}) in {seconds:.1f}s {json.dumps(res.get('figures', {}))[:300]}")

    def run_serve(self, step: Step, limit: float) -> None:
        """bench's decode at the loadtests' batch sizes; the server in the background, /ready polled, loadtest at
        each client count, /metrics; stopped; then the peer server alike. One process of them at a time."""
        res = self.results[step.name]
        start = time.monotonic()
        deadline = start + limit
        figures: dict[str, Any] = {}
        res["figures"] = figures
        for name in ("serve.log", "serve_loadtest.log", "serve_decode.log", "serve_peer.log"):
            (self.ctx.out / name).unlink(missing_ok=True)
        _say(f"== {step.name} (limit {limit:.0f}s)")
        status, note, rc = "ok", "", None
        try:
            if step.decode:
                # at most half the limit: a bench that hangs must leave the server its time
                figures["decode"] = self._decode(step.decode, min(deadline, start + limit / 2))
            status, note, rc = self._serve(step, deadline, figures)
            if step.peer and status == "failed":
                figures["peer_transformers"] = {"status": "skipped", "note": "gptopt serve failed: nothing to compare"}
            elif step.peer:
                figures["peer_transformers"] = peer = self._peer(step, deadline)
                if peer["status"] not in ("ok", "skipped"):
                    note = "; ".join(filter(None, [note, f"transformers serve: {peer['status']}: {peer.get('note')}"]))
        except CutOff:  # run() stops the steps in self.live; the servers and the bench are this method's own
            res["figures"] = compared(figures)
            self.finish(step, "cut off", None, time.monotonic() - start, "the run was stopped from outside")
            raise
        res["figures"] = compared(figures)
        self.finish(step, status, rc, time.monotonic() - start, note)

    def _decode(self, argv: list[str], deadline: float) -> dict[str, Any]:
        """bench --mode infer, its JSON on DIR/serve_decode.json: the decode rung's tokens/s per batch size."""
        _say(f"   decode: {shlex.join(argv)}")
        t0 = time.monotonic()
        out = self.ctx.out / "serve_decode.json"
        try:
            proc = _start(argv, self.ctx.out / "serve_decode.log", out)
        except OSError as e:
            return {"status": "failed", "note": f"could not start: {e}"}
        try:
            proc.wait(max(deadline - t0, 1.0))
            stopped = False
        except subprocess.TimeoutExpired:
            _stop(proc)  # SIGINT first: bench writes the batch sizes it measured
            stopped = True
        except BaseException:
            _killpg(proc.pid, signal.SIGKILL)
            raise
        _killpg(proc.pid, signal.SIGKILL)  # its leftovers
        rung = self.ctx.sizes.decode_rung
        fig = decode_rates(_json(self.ctx.out / "serve_decode" / "infer_results.json") or _json(out), rung)
        fig["seconds"] = round(time.monotonic() - t0, 1)
        if stopped:
            fig["note"] = "; ".join(filter(None, [f"stopped at its limit of {deadline - t0:.0f}s", fig.get("note")]))
        elif proc.returncode != 0:
            fig.update(status="failed", rc=proc.returncode, tail=_tail(self.ctx.out / "serve_decode.log", 5)[-400:])
        return fig

    def _serve(self, step: Step, deadline: float, figures: dict[str, Any]) -> tuple[str, str, int | None]:
        """gptopt serve: start to /ready, the decode's warm-up line, memory, loadtest at each client count."""
        res, log = self.results[step.name], self.ctx.out / f"{step.name}.log"
        start = time.monotonic()
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = resolve(step.argv, res.get("model"), port)
        _say(f"   server: {shlex.join(argv)}")
        try:
            server = _start(argv, log)
        except OSError as e:
            return "failed", f"could not start: {e}", None
        status, note = "ok", ""
        try:
            while _get(f"{url}/ready") != 200:
                if server.poll() is not None:
                    status, note = "failed", f"the server exited with {server.returncode} before /ready"
                    break
                if time.monotonic() > deadline:
                    status, note = "timeout", f"not ready within {deadline - start:.0f}s"
                    break
                time.sleep(0.25)
            else:
                figures["ready_s"] = round(time.monotonic() - start, 1)
                graphs = DECODE_GRAPHS.search(log.read_text(errors="replace")) if log.exists() else None
                if graphs:  # the engine's warm-up line: the compiled decode's buckets and their build time
                    figures["decode_buckets"], figures["decode_graphs_s"] = graphs[1], float(graphs[2])
                figures["memory_at_ready"] = _server_memory(url)
                for clients, lt in loadtests(self.ctx, url, model=res.get("model") or "MODEL"):
                    left = deadline - time.monotonic()
                    if left < 3:
                        status, note = "timeout", f"no time left for {clients} clients"
                        break
                    figures[f"clients_{clients}"] = self._loadtest(lt, left, clients)
                    if figures[f"clients_{clients}"].get("status") != "ok":
                        status = "failed"
                figures["memory_at_end"] = _server_memory(url)
        except BaseException:
            _killpg(server.pid, signal.SIGKILL)
            raise
        _stop(server)
        _gone(server.pid)  # its device memory is the peer's next
        return status, note, server.returncode

    def _peer(self, step: Step, deadline: float) -> dict[str, Any]:
        """transformers serve on serve_export's folder: start to GET /v1/models, a warm-up loadtest (its engine
        and cache are made at the first request), then loadtest at each of peer_clients; stopped. Skipped, with
        the reason, where it cannot run here (its serving extra missing) or the folder is missing."""
        assert step.peer is not None
        folder = Path(step.peer[-1])
        if not (folder / "config.json").is_file():
            return {"status": "skipped", "note": f"no Hugging Face folder at {folder} (the serve_export step's)"}
        missing = _peer_missing(self.ctx.python)
        if missing:
            return {"status": "skipped", "note": missing}
        start = time.monotonic()
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = resolve(step.peer, None, port)
        log = self.ctx.out / "serve_peer.log"
        _say(f"   peer: {shlex.join(argv)}")
        out: dict[str, Any] = {"status": "ok", "command": shlex.join(argv)}
        if deadline - start < 10:
            return {**out, "status": "timeout", "note": "no time left in the step's limit"}
        try:
            server = _start(argv, log)
        except OSError as e:
            return {**out, "status": "failed", "note": f"could not start: {e}"}
        try:
            while _get(f"{url}/v1/models") != 200:
                if server.poll() is not None:
                    return {**out, **_peer_exit(server.returncode, _tail(log, 40))}
                if time.monotonic() > deadline:
                    return {**out, "status": "timeout", "note": f"no answer on /v1/models in {deadline - start:.0f}s"}
                time.sleep(0.25)
            out["ready_s"] = round(time.monotonic() - start, 1)
            model = self.results[step.name].get("model") or "MODEL"
            [(c, warm)] = loadtests(self.ctx, url, (min(self.ctx.sizes.peer_clients),), model)
            warm[warm.index("--requests") + 1] = str(c)  # one request per client: the engine made, not measured
            t0 = time.monotonic()
            row = self._loadtest(warm, max(deadline - t0, 1.0), c, "transformers serve warm-up")
            out["warmup_s"] = round(time.monotonic() - t0, 1)
            if row.get("status") != "ok":
                return {**out, "status": "failed", "note": f"the warm-up: {row}"[:300]}
            for clients, lt in loadtests(self.ctx, url, self.ctx.sizes.peer_clients, model):
                left = deadline - time.monotonic()
                if left < 3:
                    out.update(status="timeout", note=f"no time left for {clients} clients")
                    break
                out[f"clients_{clients}"] = row = self._loadtest(lt, left, clients, "transformers serve")
                if row.get("status") != "ok":
                    out["status"] = "failed"
            return out
        finally:  # nothing of it is needed after the loadtests: no graceful stop to wait for
            _killpg(server.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(10)
            _gone(server.pid)

    def _loadtest(self, argv: list[str], limit: float, clients: int, server: str = "gptopt serve") -> dict[str, Any]:
        _say(f"   loadtest {clients} clients ({server}): {shlex.join(argv)}")
        try:
            done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"status": "timeout"}
        with open(self.ctx.out / "serve_loadtest.log", "ab") as f:
            f.write(b"\n--- loadtest %d clients, %s\n" % (clients, server.encode()) + done.stderr + done.stdout)
        summary = None
        for line in reversed(done.stdout.decode(errors="replace").splitlines()):
            try:
                summary = json.loads(line)
                break
            except ValueError:
                continue
        if done.returncode != 0 or not isinstance(summary, dict):
            return {"status": "failed", "rc": done.returncode, "tail": done.stderr.decode(errors="replace")[-400:]}
        keep = ("requests", "errors", "output_tokens", "requests_per_s", "output_tokens_per_s", "ttft_s", "tpot_s",
                "server_memory", "server_device_memory")
        row: dict[str, Any] = {"status": "ok"}
        for k in keep:
            v = summary.get(k)
            if isinstance(v, dict) and k.startswith("server_"):  # bytes -> GiB
                v = {q.removesuffix("_bytes") + "_gib": _gib(x) for q, x in v.items() if q.endswith("_bytes")}
            elif isinstance(v, dict):
                v = {q: _r(x, 4) for q, x in v.items()
                     if q in ("p50", "p90", "p99", "mean") or not isinstance(x, float)}
            if v is not None:
                row[k] = _r(v, 1)
        return row

    def save(self) -> dict[str, Any]:
        both = {**self.earlier, **self.results}
        rank = {name: i for i, name in enumerate(self.order)}
        doc = {**self.header, "steps": sorted(both.values(), key=lambda r: rank.get(r["name"], len(rank)))}
        text = summary_text(doc)
        write_atomic(self.ctx.out / "results.json", json.dumps(doc, indent=2, default=str) + "\n")
        write_atomic(self.ctx.out / "summary.txt", text)
        if self.report is not None:  # a few small files, for a machine that returns only a few
            self.report.mkdir(parents=True, exist_ok=True)
            write_atomic(self.report / "results.json", json.dumps(doc, indent=2, default=str) + "\n")
            write_atomic(self.report / "summary.txt", text)
            tails = [f"===== {r['name']} ({r['status']})\n{_tail(self.ctx.out / (r['name'] + '.log'), 60)}\n"
                     for r in doc["steps"] if r["status"] != "planned"]
            write_atomic(self.report / "logs.txt", "\n".join(tails))
        return doc


def unfit_folder(folder: Path) -> str | None:
    """Why the run may not write into `folder`, or None: it writes results.json, summary.txt and a log per
    step there without asking, so only a new or empty folder, or one an earlier run of this script wrote."""
    if not folder.exists():
        return None
    if not folder.is_dir():
        return "is a file; give a folder"
    if not any(folder.iterdir()):
        return None
    earlier = _json(folder / "results.json")
    if isinstance(earlier, dict) and "steps" in earlier and "target" in earlier:
        return None
    return "holds files that an earlier GPU check did not write; choose a new or empty folder"


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
        res["loadtests"] = [shlex.join(a) for _, a in loadtests(ctx, "http://127.0.0.1:PORT")]
    if step.peer:
        res["peer"] = shlex.join(step.peer)
        res["peer_loadtests"] = [shlex.join(a) for _, a in loadtests(ctx, "http://127.0.0.1:PORT",
                                                                     ctx.sizes.peer_clients)]
    return res


def summary_text(doc: dict[str, Any]) -> str:
    lines = [f"gptopt GPU check, {doc.get('gpu') or doc['target']}: started {doc['started']}, "
             f"planned {doc['planned_s']}s of a {doc['budget_s']}s budget"
             + (f", took {doc['seconds']}s" if "seconds" in doc else ""), f"({doc['weights']})", ""]
    for r in doc["steps"]:
        took = f"{r['seconds']:>6.1f}s" if "seconds" in r else "      -"
        lines.append(f"{r['name']:<17} {r['status']:<8} {took} / {r['limit_s']}s  {r['what']}")
        if r.get("note"):
            lines.append(f"{'':<17} note: {r['note']}")
        if r.get("figures"):
            lines.append(f"{'':<17} {json.dumps(r['figures'], default=str)}")
        if r.get("error_tail"):
            lines += [f"{'':<17} | {line}" for line in r["error_tail"].splitlines()[-8:]]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _say(text: str) -> None:
    print(text, flush=True)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _missing(python: str) -> dict[str, str]:
    """The imports the steps need that `python` lacks, each with the wheels to carry."""
    try:
        probe = subprocess.run([python, "-c", "import importlib.util, json, sys; print(json.dumps("
                                "[m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))", *NEEDED],
                               capture_output=True, text=True, timeout=60)
        missing = json.loads(probe.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    if missing:
        _say(f"!! missing here: {', '.join(missing)}; carry these wheels: {' '.join(NEEDED[m] for m in missing)}")
    return {m: NEEDED[m] for m in missing}


def _machine(ctx: Ctx) -> dict[str, Any]:
    """The GPU (nvidia-smi), the CPU, and which imports the steps need are missing (with the wheels to carry)."""
    info: dict[str, Any] = {}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        (ctx.out / "nvidia-smi.txt").write_text(smi.stdout + smi.stderr)
        if smi.returncode == 0 and smi.stdout.strip():
            info["gpu"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)
        info["cpu"] = f"{cpu}, {os.cpu_count()} logical cores"
    except OSError:
        pass
    missing = _missing(ctx.python)
    if missing:
        info["missing"] = missing
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except Exception:  # not up yet: refused, reset, 503
        return None


def _group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a process that is not a zombie (a zombie holds no memory, and one
    whose parent is gone may wait long for init to reap it)."""
    try:
        stats = [f.read_text() for f in Path("/proc").glob("[0-9]*/stat")]
    except OSError:
        stats = []
    if not stats:  # no /proc: the group's existence, zombies included
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in stats:
        fields = stat.rsplit(")", 1)[-1].split()  # after the name, which may hold spaces: state, ppid, pgrp
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _gone(pgid: int, timeout: float = 10.0) -> None:
    """Wait until process group `pgid` has ended, so the next server finds its device memory free."""
    end = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.1)


# What transformers serve needs beyond transformers: its serving extra, and accelerate for its model loading
# (a device map). A GPU image may have transformers without them: the peer is then skipped, with the reason.
PEER_NEEDS = ("fastapi", "uvicorn", "pydantic", "openai", "accelerate")
# Lines of a peer's log that say it exited for something missing here, not for a fault of its own
PEER_MISSING = ("No module named", "Missing dependencies", "requires `accelerate`")
PEER_PROBE = """import importlib.util as u, json, sys
missing = [m for m in sys.argv[1:] if u.find_spec(m) is None]
if "transformers" not in missing and u.find_spec("transformers.cli.transformers") is None:
    missing.append("transformers.cli.transformers (a transformers with `transformers serve`)")
print(json.dumps(missing))"""


def _peer_missing(python: str) -> str | None:
    """Why transformers serve cannot run under `python`, or None (also where the probe itself fails: the
    server's start then says why)."""
    try:
        done = subprocess.run([python, "-c", PEER_PROBE, "transformers", *PEER_NEEDS], capture_output=True,
                              text=True, timeout=60, env=_env())
        missing = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if not missing:
        return None
    return (f"transformers serve cannot run here: {', '.join(missing)} missing "
            "(pip install 'transformers[serving]' accelerate)")


def _peer_exit(rc: int | None, tail: str) -> dict[str, Any]:
    """A peer that exited before it answered: skipped where its log names something missing here, else failed."""
    why = next((line.strip() for line in reversed(tail.splitlines()) if any(m in line for m in PEER_MISSING)), None)
    if why:
        return {"status": "skipped", "note": f"transformers serve cannot run here: {why}"[:300]}
    return {"status": "failed", "note": f"exited with {rc} before /v1/models answered", "tail": tail[-400:]}


def _server_memory(url: str) -> dict[str, Any]:
    """The server's resident memory and, on a GPU, its device memory, from /metrics. (loadtest reads the
    same figures with its own parser; this runner imports nothing of gptopt's: it runs before the install.)"""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except Exception as e:
        return {"unreadable": str(e)[:100]}
    out: dict[str, Any] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "process_resident_memory_bytes" or name.startswith("gptopt_device_memory"):
            try:
                out[name.removesuffix("_bytes") + "_gib"] = _gib(float(value))
            except ValueError:
                continue
    return out


# ---------------------------------------------------------------------------------------------
# Recording: results.json -> rows of docs/gpu-results.md


RECORD_START = "<!-- gpu-check rows: `python3 .ci/gpu_check.py record DIR` adds a run here -->"
# The marker is found by its opening words: a doc whose marker names this script where it used to live
# (scripts/) still takes a run's rows.
RECORD_MARK = re.compile(r"^<!-- gpu-check rows:.*-->$", re.MULTILINE)


def rows(doc: dict[str, Any]) -> list[str]:
    date = (doc.get("started") or "")[:10]
    gpu = (doc.get("gpu") or "?").split(",")[0]
    out = []
    for r in doc["steps"]:
        if r["status"] == "planned":
            continue
        took = f"{r.get('seconds', '-')} s of {r['limit_s']}"
        result = r["status"] + (f": {r['note']}" if r.get("note") else "")
        figures = json.dumps(r.get("figures") or {}, default=str, separators=(", ", ": "))
        cell = f"{result}; {figures}" if r.get("figures") else result
        out.append(f"| {date} | {gpu} | `{r['name']}` | {took} | {cell.replace('|', '/')} |")
    return out


def record(out: Path, doc_path: Path) -> list[str]:
    doc = json.loads((out / "results.json").read_text())
    if doc.get("target") != "gpu":
        raise SystemExit(f"{out}/results.json is a {doc.get('target')} run; only GPU runs are recorded")
    new = rows(doc)
    if not new:
        raise SystemExit(f"{out}/results.json holds no step that ran (a dry run?): nothing to record")
    text = doc_path.read_text()
    mark = RECORD_MARK.search(text)
    if mark is None:
        raise SystemExit(f"{doc_path} lacks the line {RECORD_START!r} that marks where runs go")
    head = (f"\n#### {doc['started']} — {doc.get('gpu', '?')}; {doc.get('cpu', '')}; commit {doc.get('commit')}, "
            f"{doc.get('seconds', '?')} s of a {doc['budget_s']} s budget\n\n"
            "| date | GPU | step | seconds | result and figures |\n|---|---|---|---|---|\n")
    write_atomic(doc_path, text[:mark.end()] + "\n" + head + "\n".join(new) + "\n" + text[mark.end():])
    return new


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    for verb, what in (("run", "run the steps"), ("dry-run", "print the plan and write DIR/results.json of it")):
        p = sub.add_parser(verb, help=what)
        p.add_argument("dir", type=Path, help="where logs, outputs, results.json and summary.txt go")
        p.add_argument("--target", choices=SIZES, default="gpu",
                       help="gpu: the real sizes; cpu: the debug preset, to rehearse every command (default: gpu)")
        p.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
        p.add_argument("--skip", default="", help="comma-separated steps to leave out")
        p.add_argument("--budget", type=int, default=None, help=f"seconds for the whole run (default: {BUDGET_S} on "
                       "a GPU; on a CPU the steps' limits)")
        p.add_argument("--report", type=Path, default=None, help="also keep results.json, summary.txt and logs.txt "
                       "(each step's log tail) here: three small files, for a machine that returns only a few")
    p = sub.add_parser("record", help="add DIR/results.json's rows to docs/gpu-results.md")
    p.add_argument("dir", type=Path)
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "gpu-results.md")
    args = ap.parse_args(argv)

    if args.verb == "record":
        for line in record(args.dir, args.doc):
            print(line)
        return 0
    wheels = Path(os.environ.get("GPTOPT_WHEELS", ROOT / ".whl"))
    ctx = Ctx(out=args.dir.resolve(), target=args.target, sizes=SIZES[args.target],
              wheels=tuple(sorted(str(w) for w in wheels.glob("*.whl"))) if wheels.is_dir() else ())
    steps = plan(ctx)
    order = [s.name for s in steps]
    names = set(order)
    only, skip = ({n for n in x.split(",") if n} for x in (args.only, args.skip))
    if unknown := (only | skip) - names:
        ap.error(f"unknown step(s) {', '.join(sorted(unknown))}; the steps: {', '.join(s.name for s in steps)}")
    if only and args.target == "gpu":
        # a rerun on a fresh machine (a lease's machine goes back when idle) needs gptopt and the data again
        only |= {"install"} | ({"prepare"} if not (ctx.out / "data" / "meta.json").is_file() else set())
    if "serve" in only:  # the Hugging Face folder its peer serves, made from this call's checkpoint
        only |= {"serve_export"}
    steps = [s for s in steps if (s.name in only if only else s.default) and s.name not in skip
             and (args.target == "gpu" or s.cpu or s.name in only)]
    for folder, flag in ((ctx.out, "DIR"), (args.report, "--report")):
        if folder is not None and (problem := unfit_folder(folder)):
            ap.error(f"{flag} {folder}: {problem}")
    ctx.out.mkdir(parents=True, exist_ok=True)
    budget_s = args.budget or (BUDGET_S if args.target == "gpu" else CPU_LIMIT_S * len(phases(steps)))
    runner = Runner(ctx, steps, budget_s, order, report=args.report.resolve() if args.report else None)
    if args.verb == "dry-run":
        for phase in phases(steps):
            for step in phase:
                others = ", ".join(s.name for s in phase if s is not step)
                together = f" [starts with: {others}]" if others else ""
                _say(f"{step.name:<17} {runner.results[step.name]['limit_s']:>4}s  {step.what}{together}")
                r = runner.results[step.name]
                for line in filter(None, [r.get("decode"), r["command"], *r.get("loadtests", []), r.get("peer"),
                                          *r.get("peer_loadtests", [])]):
                    _say(f"{'':<17}        $ {line}")
        _say(f"planned: {runner.header['planned_s']}s of a {budget_s}s budget, {len(steps)} steps -> "
             f"{ctx.out / 'results.json'}")
        runner.save()
        return 0
    doc = runner.run()
    if "cut_off" in doc:
        _say(f"cut off ({doc['cut_off']}) after {doc['seconds']}s; results: {ctx.out / 'results.json'}")
        return 130
    bad = [name for name, r in runner.results.items() if r["status"] != "ok"]  # this run's steps
    _say(f"done in {doc['seconds']}s: {len(runner.results) - len(bad)} ok"
         + (f", not ok: {', '.join(bad)}" if bad else ""))
    _say(f"results: {ctx.out / 'results.json'}, {ctx.out / 'summary.txt'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
