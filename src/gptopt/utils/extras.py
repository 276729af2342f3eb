"""Optional dependencies: import them only where a feature needs them, with the install line on failure.

    python -c "from gptopt.utils.extras import installed_extras; print(installed_extras())"
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> the modules it provides (import names), mirrored from pyproject.toml
EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers", "huggingface_hub"),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "jinja2", "aiohttp", "llguidance"),
    "chat": ("jinja2",),
    "plot": ("matplotlib",),
    "stats": ("scipy",),
    "gpu": ("pynvml",),
    "quant": ("torchao",),
    "data": ("datasets",),
    "tensorboard": ("tensorboard",),
    "onnx": ("onnx", "onnxruntime", "onnxscript"),
}


class MissingExtra(ImportError):
    """A feature needs an optional dependency that is not installed; the message is the fix."""


def require(module: str, extra: str, feature: str | None = None) -> ModuleType:
    """Import `module`, or raise MissingExtra naming the `pip install 'gptopt[extra]'` to run."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        what = feature or module
        raise MissingExtra(f"{what} needs the '{extra}' extra: pip install 'gptopt[{extra}]'") from e


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def installed_extras() -> dict[str, bool]:
    return {extra: all(has(m) for m in mods) for extra, mods in EXTRAS.items()}
