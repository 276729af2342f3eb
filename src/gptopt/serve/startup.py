"""How a serving process starts: the process-wide torch switches it sets first (set_process_switches), and the
engine it builds (build_engine: the model in a Generator whose KV cache's block pool fits the memory budget
(infer/generator_memory.plan_kv), in a warmed-up Engine, not started yet).

    python -c "from gptopt.config import ServeConfig; from gptopt.serve.startup import set_process_switches; \
set_process_switches(ServeConfig(device='cpu'))"

`gptopt serve` builds its engine here, in the process that runs it: the engine process (engine_child.py), or
with --no-engine_process the server's own (server.main, app.create_app). Each such process sets the switches
where it starts, before building; build_engine itself sets none, so a test or a notebook that builds an engine
keeps torch's settings as it had them (runtime/process.py holds the switches).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gptopt.config import ServeConfig
from gptopt.data.tokenizer import Tokenizer, eot_id
from gptopt.infer import generator_memory, paged_attention, speculative
from gptopt.infer.constrain import Grammars
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference
from gptopt.runtime import process
from gptopt.runtime.device import give_back_host_memory, resolve
from gptopt.serve.blocklist import load_blocklist
from gptopt.serve.engine import Engine
from gptopt.serve.metrics import ServeMetrics
from gptopt.utils.errors import UserError
from gptopt.utils.extras import has

log = logging.getLogger(__name__)


def set_process_switches(cfg: ServeConfig) -> None:
    """The process-wide torch settings of a process that runs a serving engine, set where it starts: TF32 for
    fp32 matmuls where the device plan chose it, and with --compile dynamo's room for a graph per batch bucket."""
    process.set_matmul_precision(resolve(cfg.device, quiet=True))
    if cfg.compile:
        process.allow_recompiles()


def build_engine(cfg: ServeConfig, model: Any = None, tokenizer: Any = None, *,
                 metrics: ServeMetrics | None = None) -> Engine:
    """The model (loaded now unless given) in a Generator, in a warmed-up engine that is not started yet. Sets no
    process-wide switch (set_process_switches does, where the process starts). On a CPU the engine's forwards run on
    torch's thread count as it is now (every core), a one-request decode step on --solo_threads (every core but one
    by default): the engine sets those around its own forwards and leaves the caller's count as it found it."""
    plan = resolve(cfg.device, quiet=True)
    if model is None:
        model, tokenizer = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=plan, dtype=cfg.dtype,
                                              quantize=cfg.quantize)
    if tokenizer is None:
        raise UserError("create_app: a model was given without its tokenizer")
    metrics = metrics or ServeMetrics()
    dtype, context = model.transformer.wte.weight.dtype, model.config.block_size
    if cfg.max_len is not None and cfg.max_len > context:
        raise UserError(f"--max_len {cfg.max_len} exceeds the model's context of {context} tokens: its position "
                        f"embeddings (or rotary training) end there; use --max_len {context} or less")
    context = cfg.max_len or context
    give_back_host_memory()  # loading's freed copies of the weights, so that what is free is counted right
    # the block pool within its budget, checked with the largest forward before it is allocated (the weights are)
    kv = generator_memory.plan_kv(model, plan.device, max_len=context, max_batch_size=cfg.max_batch_size,
                                  prefill_chunk=cfg.prefill_chunk, block_size=cfg.block_size,
                                  kv_cache_memory=cfg.kv_cache_memory, dtype=dtype,
                                  in_place=plan.device.type == "cpu" and not cfg.compile
                                  and paged_attention.kernel() is not None)
    log.info("%s", kv.line())
    generator = Generator(model, plan, max_batch_size=kv.max_batch_size, max_len=context, kv_blocks=kv.num_blocks,
                          block_size=kv.block_size, compile=cfg.compile, cuda_graphs=cfg.cuda_graphs,
                          grammars=_grammars(tokenizer, model.config.vocab_size), prefix_cache=cfg.prefix_cache)
    every_core = torch.get_num_threads()
    engine = Engine(generator, tokenizer, max_queue=cfg.max_queue, request_timeout=cfg.request_timeout,
                    prefill_chunk=cfg.prefill_chunk, blocklist=load_blocklist(cfg.blocklist), metrics=metrics,
                    threads=every_core, solo_threads=cfg.solo_threads or max(1, every_core - 1),
                    speculator=speculative.build(cfg, generator, tokenizer, plan),
                    speculate_max_batch=cfg.speculate_max_batch)
    try:
        engine.warmup()
    except RuntimeError as e:  # out of memory (torch.OutOfMemoryError is a RuntimeError) or a bad kernel
        raise UserError(f"the model does not run with these settings ({type(e).__name__}: {e}); "
                         "lower --kv_cache_memory, --max_batch_size or --prefill_chunk, or use --dtype bf16 or "
                         "--quantize int8-weight") from None
    metrics.bind_load(lambda: engine.stats()["running"], lambda: engine.stats()["waiting"])
    metrics.bind_engine_up(lambda: engine.alive)
    metrics.bind_kv_cache(generator.kv_usage, lambda: engine.preemptions)
    metrics.bind_device_memory(plan.device)  # CUDA only
    return engine


def _grammars(tokenizer: Tokenizer, vocab_size: int) -> Grammars | None:
    """response_format's grammars, or None where the model cannot be constrained (the server then answers
    such requests 400): a document ends with the end-of-text token, so the tokenizer needs one, and
    llguidance must read the tokenizer (it does not read every kind)."""
    eot = eot_id(tokenizer)
    if eot is None or not has("llguidance"):
        return None
    try:
        return Grammars(tokenizer, eot, vocab_size)
    except ValueError as e:
        log.warning("response_format cannot be served with this tokenizer (%s); such requests get a 400", e)
        return None
