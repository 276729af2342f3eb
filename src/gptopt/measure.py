"""Timing and sizing what inference runs: shared by `gptopt bench --mode infer` and `gptopt compress`.

    python -c "from gptopt.measure import timed, GptoptRunner; help(GptoptRunner)"
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from gptopt.device import DevicePlan
from gptopt.generate import Generator, SamplingParams, generate
from gptopt.model import GPT

GREEDY = dict(temperature=0.0, top_k=None)
# The note of a rung that a stopped bench (Ctrl-C, SIGINT) did not finish: the rest are still reported.
STOPPED = "not measured: bench was stopped (Ctrl-C) before this rung finished"


def free_memory(plan: DevicePlan) -> None:
    gc.collect()  # a rung's model and caches hold device memory the next one needs
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor occupies; quantised subclasses (torchao) are summed over their inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: embedding tables are skipped (one row per token is read),
    the tied lm_head is counted through its Linear (the full matrix is read)."""
    params = {id(p): p for m in model.modules() if not isinstance(m, nn.Embedding)
              for p in m.parameters(recurse=False)}
    return sum(tensor_bytes(p) for p in params.values())


def timed(fn: Callable[[], object], plan: DevicePlan, warmup: int, repeats: int) -> float:
    """Median wall time of fn, device-synchronised, after warm-up calls (compile, capture, caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        plan.synchronize()
        t0 = time.perf_counter()
        fn()
        plan.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class GptoptRunner:
    """A rung on gptopt's Generator: one Generator per batch size, since a static cache has one shape."""

    def __init__(self, model: GPT, plan: DevicePlan, max_len: int, *, compile: bool, cuda_graphs: bool = False) -> None:
        self.model, self.plan, self.max_len, self.compile, self.cuda_graphs = model, plan, max_len, compile, cuda_graphs
        self.gen: Generator | None = None

    def _for(self, batch: int) -> Generator:
        if self.gen is None or self.gen.max_batch_size != batch:
            self.gen = None  # the last cache goes before the next is allocated
            free_memory(self.plan)
            self.gen = Generator(self.model, self.plan, max_batch_size=batch, max_len=self.max_len,
                                 compile=self.compile, cuda_graphs=self.cuda_graphs)
        return self.gen

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        return generate(self._for(len(prompts)), prompts, SamplingParams(max_new_tokens=n, **GREEDY))

    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        gen = self.gen or self._for(1)
        try:
            return gen.prefill(0, prompt)
        finally:
            gen.free(0)
