"""Timing and sizing what inference runs: shared by `gptopt bench --mode infer` and `gptopt compress`.

    python -c "from gptopt.infer.measure import timed, GptoptRunner; help(GptoptRunner)"
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn as nn

from gptopt.config.sampling import describe
from gptopt.infer.generator import Generator, Stepper
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.runtime.torch_private import inner_tensors


@dataclass(frozen=True)
class Sampling:
    """How a bench's timed generations choose their tokens: greedily (temperature 0), or sampled at a temperature
    with top_k and top_p (OpenAI's clients send neither: no top_k, top_p 1)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def params(self, n: int) -> SamplingParams:
        """gptopt's SamplingParams for n new tokens (no stop id: n fixes every length)."""
        return SamplingParams(max_new_tokens=n, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def __str__(self) -> str:
        return describe(self.temperature, self.top_k, self.top_p)


GREEDY = Sampling()
# The note of a rung that a stopped bench (Ctrl-C, SIGINT) did not finish: the rest are still reported.
STOPPED = "not measured: bench was stopped (Ctrl-C) before this rung finished"


def free_memory(plan: DevicePlan) -> None:
    gc.collect()  # a rung's model and caches hold device memory the next one needs
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor occupies; quantised subclasses (torchao) are summed over their inner tensors."""
    inner = inner_tensors(t)
    if inner is not None:
        return sum(map(tensor_bytes, inner))
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


def interleaved(fns: dict[str, Callable[[], object]], plan: DevicePlan, warmup: int, rounds: int, *,
                drop: Callable[[str, Exception], Collection[str]] | None = None) -> dict[str, float]:
    """Median seconds of each fn, timed side by side: `warmup` untimed calls of each first, then `rounds`
    rounds of one timed call each (timed, device-synchronised), the order reversed every other round.
    On a shared machine a slow minute then falls on every fn alike, not on whichever ran in it alone,
    and no fn always goes first or last.

    drop: when a fn raises, it gets the name and the error and returns the names that leave the
    remaining rounds and the result (an out-of-memory fn and those that share its state); without
    it, or when it returns none, the error propagates.
    """
    live = list(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}

    def run(name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:
            gone = drop(name, e) if drop else ()
            if not gone:
                raise
            live[:] = [k for k in live if k not in gone]
            for k in gone:
                times.pop(k, None)

    for _ in range(warmup):
        for k in list(live):
            if k in live:
                run(k, fns[k])
    for r in range(rounds):
        for k in live[::-1] if r % 2 else list(live):
            if k in live:  # a fn dropped earlier in this round
                run(k, lambda k=k: times[k].append(timed(fns[k], plan, 0, 1)))
    return {k: statistics.median(v) for k, v in times.items() if v}


class GptoptRunner:
    """A rung on gptopt's Generator: one Generator per batch size, since a static cache has one shape."""

    def __init__(self, model: GPT, plan: DevicePlan, max_len: int, *, compile: bool, cuda_graphs: bool = False,
                 speculate: Callable[[Generator], Stepper] | None = None,
                 build: Callable[..., Generator] = Generator) -> None:
        """speculate: the speculative decoding of a Generator (speculative.Speculator), built with each one.
        build: what makes each Generator, from Generator's arguments (a lever rung's Generator: bench/levers.py)."""
        self.model, self.plan, self.max_len, self.compile, self.cuda_graphs = model, plan, max_len, compile, cuda_graphs
        self.speculate, self.build = speculate, build
        self.gen: Generator | None = None
        self.stepper: Stepper | None = None

    def _for(self, batch: int) -> Generator:
        if self.gen is None or self.gen.max_batch_size != batch:
            self.release()  # the last cache goes before the next is allocated
            self.gen = self.build(self.model, self.plan, max_batch_size=batch, max_len=self.max_len,
                                  compile=self.compile, cuda_graphs=self.cuda_graphs)
            self.stepper = None if self.speculate is None else self.speculate(self.gen)
        return self.gen

    def release(self) -> None:
        """Drop this batch size's Generator (its caches, its compiled or recorded step), before another is built."""
        self.gen = self.stepper = None
        free_memory(self.plan)

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = GREEDY) -> list[list[int]]:
        """n new tokens a prompt, chosen as `sampling` says."""
        return generate(self._for(len(prompts)), prompts, sampling.params(n), self.stepper)

    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        gen = self.gen or self._for(1)
        try:
            return gen.prefill(0, prompt)
        finally:
            gen.free(0)
