"""The process-wide switches a command sets where it starts.

    pytest -q tests/test_process.py
"""

from __future__ import annotations

import torch

from gptopt.runtime import process
from gptopt.runtime.torch_private import recompile_limit


def test_allow_recompiles_raises_dynamos_limit_and_never_lowers_it() -> None:
    # dynamo's own patch, not monkeypatch: undoing a monkeypatch deletes the setting from torch's config module,
    # which then hides it from every later compile
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{name: 8}):
        process.allow_recompiles(64)
        assert recompile_limit() == 64
        process.allow_recompiles(16)  # a command that needs fewer leaves a larger limit as it is
        assert recompile_limit() == 64
    assert hasattr(torch._dynamo.config, name)
