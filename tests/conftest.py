"""Shared fixtures for the test suite: the debug preset, seeded RNGs, temporary model dirs.

    pytest -q                 # the default suite (no slow, no cuda)
    pytest -q -m slow         # the slow tests
    pytest -q -m cuda         # GPU tests (scripts/gpu_check.sh runs these)
"""

from __future__ import annotations

import pytest
import torch

from gptopt.config import GPTConfig, preset
from gptopt.model import GPT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def debug_config() -> GPTConfig:
    return preset("debug")


@pytest.fixture
def debug_model(debug_config: GPTConfig) -> GPT:
    return GPT(debug_config).eval()
