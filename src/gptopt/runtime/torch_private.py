"""Every private torch API gptopt uses, each wrapped once: what it does for us, why no public API does it,
and the torch versions it was checked on. A torch release that changes one breaks one function here.

    python -c "from gptopt.runtime import torch_private as tp; print(tp.recompile_limit())"

Checked on: torch 2.13.0 (CPU: the test suite) and 2.11.0 (CUDA, an H200: .ci/gpu_check.py) unless a
function says otherwise. The floor gptopt supports is torch 2.6 (pyproject.toml).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

# -- oneDNN's linear over a prepacked weight (the CPU inference layouts, infer/cpu_layout.py) ------------------
# torch has no public op that multiplies by a weight reordered once into oneDNN's blocked layout: F.linear
# repacks the weight on every call, which is what the packed layout saves.

def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in), fp32, reordered into oneDNN's blocked layout for onednn_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, post_op: str = "none",
                  algorithm: str = "") -> torch.Tensor:
    """x @ W.T + bias over onednn_pack(W); post_op "gelu" with algorithm "tanh" applies the tanh GELU to the
    output inside the same kernel (oneDNN's post-op)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, post_op, [], algorithm)


# -- dynamo's settings and marks (infer/decode_graphs.py, the commands that compile) --------------------------------
# torch.compiler has no public setter for the number of graphs dynamo keeps per function, nor for marking a
# tensor's address static (what CUDA graphs of a KV cache need) or a dimension dynamic where it may be.

# recompile_limit from torch 2.6 on (checked on 2.6 through 2.13), cache_size_limit before
_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def recompile_limit() -> int:
    """The graphs dynamo keeps per function before it falls back to eager."""
    return getattr(torch._dynamo.config, _LIMIT)


def raise_recompile_limit(at_least: int) -> None:
    """Process-wide: let dynamo keep at least `at_least` graphs per function. Called once, where a command
    starts (runtime/process.py), never by a library function behind its back."""
    setattr(torch._dynamo.config, _LIMIT, max(recompile_limit(), at_least))


@contextlib.contextmanager
def recompile_limit_for(graphs: int) -> Iterator[None]:
    """Within the block only: dynamo keeps `graphs` graphs per function (a measurement that compiles many)."""
    with torch._dynamo.config.patch(**{_LIMIT: graphs}):
        yield


def mark_static_address(t: torch.Tensor) -> None:
    """The tensor keeps its address across calls: a CUDA graph may read and write it in place."""
    torch._dynamo.mark_static_address(t)


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Compile `t`'s dimension `dim` as symbolic where dynamo can, without failing where it cannot."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def graph_break_reason(exc: BaseException) -> str | None:
    """The reason torch.compile gave up under fullgraph=True, or None if exc is something else: dynamo's
    exception types are not exported publicly."""
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover
        return None
    kinds = tuple(k for k in (getattr(dynamo_exc, "Unsupported", None), getattr(dynamo_exc, "UserError", None)) if k)
    if isinstance(exc, kinds):
        return str(exc).strip().splitlines()[0]
    return None


def graph_breaks() -> Counter[str]:
    """dynamo's count of graph breaks by reason, since the last clear (profile reports a model's breaks)."""
    from torch._dynamo.utils import counters

    return counters["graph_break"]


def is_unspecialized_module_guard(entry: Any) -> bool:
    """Whether a guard (an entry torch.compile's guard_filter_fn option receives) checks an attribute of a
    module dynamo traced as an unspecialized nn.Module. The entry's `orig_guard.source` is internal; the
    option itself is public from torch 2.8 on."""
    return entry.orig_guard.source.is_unspecialized_nn_module()


def reset_dynamo() -> None:
    """torch.compiler.reset(), where dynamo is fully imported. Not imported: nothing was compiled. Partly
    imported (a Ctrl-C landed during torch's first import of it): its reset is missing or half-made, and
    calling it would raise AttributeError in place of the interrupt."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or getattr(getattr(dynamo, "__spec__", None), "_initializing", False):
        return
    if callable(getattr(dynamo, "reset", None)):
        torch.compiler.reset()


# -- the fused AdamW's skip flag (train/step.py) ---------------------------------------------------------------
# The fused AdamW kernel reads an optimizer attribute `found_inf` (what GradScaler sets) and skips the update on
# the device when it is nonzero: the one way to skip a non-finite step without a host sync.

@contextlib.contextmanager
def skip_step_if(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> Iterator[None]:
    """Within the block, optimizer.step() of a fused AdamW is skipped on the device where `nonfinite` (a
    float tensor, 1.0 or 0.0) is 1."""
    optimizer.found_inf = nonfinite  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


# -- the CUDA caching allocator's history (commands/profile.py) ------------------------------------------------
# torch documents these for memory snapshots (pytorch.org/memory_viz) under their private names only.
# Checked on CUDA with torch 2.11.

def record_memory_history(max_entries: int) -> None:
    """Record every CUDA allocation with its stack, up to max_entries."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write what record_memory_history recorded to path (a pickle memory_viz draws), and stop recording."""
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


# -- tensor subclasses (infer/measure.py) ---------------------------------------------------------------------

def inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors a tensor subclass (torchao's quantised weights) is made of, or None for a plain tensor:
    the subclass protocol's __tensor_flatten__, which has no public accessor."""
    if not hasattr(t, "__tensor_flatten__"):
        return None
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]
