"""measure.interleaved: fns timed side by side, in rounds of alternating order, a median per name.

    pytest -q tests/test_measure.py

Fake callables record the order they ran in; no timing is asserted.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gptopt.infer.measure import interleaved
from gptopt.runtime.device import resolve

CPU = resolve("cpu", quiet=True)


def recorder(calls: list[str], *names: str) -> dict[str, Callable[[], object]]:
    return {n: (lambda n=n: calls.append(n)) for n in names}


def test_the_rounds_alternate_the_order_after_every_warm_up_and_each_name_gets_its_median() -> None:
    calls: list[str] = []
    t = interleaved(recorder(calls, "a", "b", "c"), CPU, warmup=1, rounds=3)
    assert calls == ["a", "b", "c",  # warm-up, untimed
                     "a", "b", "c", "c", "b", "a", "a", "b", "c"]  # no fn always first or last
    assert set(t) == {"a", "b", "c"} and all(v >= 0 for v in t.values())


def test_a_dropped_fn_leaves_the_rounds_and_the_result_and_the_rest_go_on() -> None:
    calls: list[str] = []
    fns = recorder(calls, "a 1", "a n", "b 1", "b n")

    def b_out_of_memory() -> None:
        calls.append("b n")
        if calls.count("b n") == 2:  # its first timed run
            raise torch.OutOfMemoryError("CUDA out of memory")

    fns["b n"] = b_out_of_memory
    dropped: list[tuple[str, str]] = []

    def drop(name: str, e: Exception) -> set[str]:
        dropped.append((name, type(e).__name__))
        return {"b 1", "b n"}  # b's two fns share its state: both go

    t = interleaved(fns, CPU, warmup=1, rounds=2, drop=drop)
    assert dropped == [("b n", "OutOfMemoryError")]
    assert set(t) == {"a 1", "a n"}
    assert calls[8:] == ["a n", "a 1"]  # the second round, reversed, without b
    with pytest.raises(ValueError):  # without drop (or when it drops nothing) the error propagates
        interleaved({"x": lambda: int("x")}, CPU, warmup=0, rounds=1)
    with pytest.raises(ValueError):
        interleaved({"x": lambda: int("x")}, CPU, warmup=0, rounds=1, drop=lambda name, e: ())
