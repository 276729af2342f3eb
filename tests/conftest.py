"""Shared fixtures for the test suite: the debug preset, seeded RNGs, temporary model dirs.

    pytest -q                 # the default suite (no slow, no cuda)
    pytest -q -m slow         # the slow tests
    pytest -q -m cuda         # GPU tests (scripts/gpu_check.sh runs these)
"""

from __future__ import annotations

from pathlib import Path

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


@pytest.fixture(scope="session")
def train_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prepared token shards (BPE vocab 320) of a few stdlib modules: real text, ~40k tokens, ~1 s."""
    import sysconfig

    from gptopt.config import PrepareConfig
    from gptopt.data import prepare

    src = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py"):
        (src / f"{name}.txt").write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(PrepareConfig(input=str(src), output_dir=str(out), vocab_size=320, val_fraction=0.3))
    return out
