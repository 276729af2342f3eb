"""torch.compile as gptopt calls it, for training (every mode) and inference (frozen weights, fewer guards):
the one place its options are set, so train, bench, tune, profile and the compiled decode compile alike.

    python -c "from gptopt.runtime.compile import compile_model; help(compile_model)"
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gptopt.runtime.torch_private import is_unspecialized_module_guard
from gptopt.utils.errors import UserError


def compile_model(model: nn.Module, *, mode: str = "default", fullgraph: bool = False,
                  inference: bool = False, dynamic: bool | None = None) -> nn.Module:
    """torch.compile. inference (default mode only): inductor's freezing, which folds a compiled
    module's weights into the graph as constants (a method that reaches the model through an
    attribute, like Generator's decode step, gets them as inputs still), and fewer guards on the
    modules' attributes (_inference_guards). dynamic: torch.compile's (False: one graph per shape)."""
    if inference:
        if mode != "default":
            raise UserError(f"an inference compile uses the default compile mode only, not {mode!r}")
        return torch.compile(model, fullgraph=fullgraph, dynamic=dynamic,
                             options={"freezing": True, "guard_filter_fn": _inference_guards})
    # "default" is passed as None: torch.compile's own default, without the mode lookup
    return torch.compile(model, mode=None if mode == "default" else mode, fullgraph=fullgraph, dynamic=dynamic)


# The guards on modules' attributes that an inference graph keeps: their tensors (shape, dtype,
# subclass: another model, or a quantised one, is compiled anew) and their types (swapped modules).
_KEPT_MODULE_GUARDS = frozenset({"TENSOR_MATCH", "TYPE_MATCH", "DUPLICATE_INPUT", "SEQUENCE_LENGTH"})


def _inference_guards(entries: list) -> list[bool]:
    # Dropped: the per-call checks of every module's hooks, attribute dict and constants, which an
    # inference model does not change, and which made a small model's decode step slow to look its
    # graph up (benchmarks/2026-12-02-inference-ladder.md, "After the fused multiply-and-sum decode").
    # Dropping every module guard would be quicker still, but would also run one model's graph on
    # another model's tensors of a different dtype or kind.
    return [not is_unspecialized_module_guard(e) or e.guard_type in _KEPT_MODULE_GUARDS
            for e in entries]
