"""The decode step made fast for its device, once per Generator (it needs the KV cache, which the Generator
owns): compile_decode (torch.compile: CUDA graphs on GPUs, on CPUs the multiply-and-sum or packed products of
cpu_layout), or, on CUDA without a compiler, GraphedDecode (the eager step recorded as one CUDA graph per bucket).

    python -c "from gptopt.infer.decode_graphs import compile_decode; help(compile_decode)"
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from gptopt.infer.cpu_layout import GEMV_MAX_ROWS, gemv_linears, inference_layout, packed_products
from gptopt.models.gpt import GPT
from gptopt.runtime.compile import compile_model
from gptopt.runtime.memory_check import is_oom
from gptopt.runtime.process import DECODE_GRAPHS
from gptopt.runtime.torch_private import mark_static_address, recompile_limit
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")


F = TypeVar("F", bound=Callable[..., Any])


def compile_decode(step: F, model: GPT, cache: Sequence[torch.Tensor], device: torch.device, rows: int) -> F:
    """Step 5: `step`, the decode of the first B of `rows` cache rows over `model` and its KV `cache`
    (B: Generator.buckets), compiled: on CPUs one graph for one row and one for every B of 2 and more.

    CUDA: reduce-overhead (CUDA graphs), with the cache at static addresses so the graphs update it in place,
    one static graph and CUDA graph per bucket. Elsewhere no graphs to capture: an inference compile (frozen
    weights) whose attention length is symbolic too, and for a step of at most GEMV_MAX_ROWS rows the decode's
    matrix-vector products as fused multiply-sums on row-major weights (gemv_linears): also the 1-row bucket
    of a Generator of more slots when the products of several rows run on oneDNN-packed copies
    (packed_products), which the row-major layout leaves alone. There the 1-row step runs faster than
    as a GEMM on column-major weights, and the steps of more rows no slower
    (benchmarks/2026-12-04-serving-vs-transformers.md, "The one-row step of a many-slot engine").
    Without packed copies (bf16 weights, no oneDNN) a step of more rows gets inference_layout's
    column-major weights back: on row-major ones its compiled GEMMs ran slower than the eager decode
    (benchmarks/2026-12-02-inference-ladder.md, "The compiled decode at every batch size"), and its
    1-row bucket is a GEMM too (the layout is the model's; `rows` is the largest bucket).
    """
    # One graph per bucket: more than dynamo keeps per function by default once buckets reach 4096 rows (or
    # several generators, as bench --mode infer builds, share the decode's code). The limit is process-wide, so
    # the command raises it where it starts (process.allow_recompiles); a library caller is told here.
    if recompile_limit() < DECODE_GRAPHS:
        log.warning("dynamo keeps %d graphs per function, fewer than a compiled decode's buckets may take: call "
                    "gptopt.runtime.process.allow_recompiles() once first, or past the limit steps run eagerly",
                    recompile_limit())
    if device.type == "cuda":
        for t in cache:
            mark_static_address(t)
        # One static graph and CUDA graph per bucket. A symbolic row count (dynamic=True) failed on an H200
        # with torch 2.11 (inductor's code named an undefined size, "NameError: name 's51' is not defined").
        return compile_model(step, mode="reduce-overhead", dynamic=False)  # type: ignore[arg-type,return-value]
    if rows > GEMV_MAX_ROWS and not packed_products(model):
        # the packed copies if the model has none yet (one not loaded by load_for_inference), else
        # column-major again after a smaller step's gemv_linears on this model (bench's batch sweep)
        inference_layout(model, device.type)
    if rows <= GEMV_MAX_ROWS or packed_products(model):
        gemv_linears(model)
    # Sizes dynamo sees change become symbolic: the attention's length (marked so) and, from the second
    # bucket on, the row count, so every bucket of 2 rows and more shares one graph.
    return compile_model(step, inference=True)  # type: ignore[arg-type,return-value]


class GraphedDecode:
    """Step 5 without a compiler, CUDA only: `step` (the Generator's decode of the first B cache rows)
    recorded as one CUDA graph per row count B on its first call, and replayed after that.

    A GPT-2-class decode step is hundreds of small kernels whose launches, not their arithmetic, set
    its time on a GPU; a replay launches them all at once. Recording a bucket is far quicker than
    torch.compile's reduce-overhead compile of it (docs/gpu-results.md): this is what makes a server
    ready in seconds. The graphs read their tokens and positions from static buffers, and the KV
    cache and `keys` (the attended length, the whole cache) must keep their addresses and shapes: the
    Generator's do. The returned logits are the graph's own buffer in the memory pool the buckets
    share, so the next replay of any bucket may overwrite them: copy what is kept before the next call
    (Generator._decode_static does).
    """

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], rows: int,
                 device: torch.device) -> None:
        if device.type != "cuda":
            raise UserError(f"CUDA graphs need a CUDA device, not {device}")
        self.step = step
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros_like(self.tok)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}  # None: runs eagerly
        self.pool = torch.cuda.graph_pool_handle()  # the buckets' graphs share one memory pool
        self.record_s = 0.0  # seconds spent recording, every bucket so far

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        rows = tok.shape[0]
        self.tok[:rows].copy_(tok, non_blocking=True)
        self.pos[:rows].copy_(pos, non_blocking=True)
        if rows not in self.graphs:
            self.graphs[rows] = self._record(rows, keys)
        recorded = self.graphs[rows]
        if recorded is None:
            return self.step(self.tok[:rows], self.pos[:rows], keys)
        graph, logits = recorded
        graph.replay()
        return logits

    def _record(self, rows: int, keys: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The bucket's graph and its output buffer; None, with a warning, where a kernel cannot be
        recorded (a quantised layer's, say): that bucket then runs eagerly, slower but right. Running
        out of memory is raised: it is the caller's to report."""
        t0 = time.perf_counter()
        try:
            return self._capture(rows, keys)
        except RuntimeError as e:
            if is_oom(e):
                raise
            log.warning("could not record the decode of %d rows as a CUDA graph (%s: %s); it runs eagerly. "
                        "--no-cuda_graphs runs every batch eagerly", rows, type(e).__name__,
                        (str(e).splitlines() or [""])[0])
            return None
        finally:
            self.record_s += time.perf_counter() - t0

    def _capture(self, rows: int, keys: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.tok[:rows], self.pos[:rows], keys)
        # One eager run first, on a side stream as recording wants: cuBLAS's handles and workspaces and
        # every other lazy initialisation happen outside the graph. It writes the same keys and values
        # at the same positions as the replay that follows, so the cache is no different for it.
        side = torch.cuda.Stream(device=self.tok.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (the server's /metrics reading device memory) do not
        # break this thread's recording
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.step(*args)
        return graph, logits
