"""Optional dependencies: import them only where a feature needs them, with the install line on failure.

    python -c "from gptopt.utils.extras import installed_extras; print(installed_extras())"
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
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


# Modules that import torchao, which says two things on import that read like errors and are none: that its
# optional compiled kernels (mxfp8, CUTLASS) do not load on this machine (gptopt uses none of them), and, through
# torch's pytree logger, that registering its enums is deprecated. torchao imports transformers' quantizers too.
TORCHAO_IMPORTERS = ("torchao", "transformers")


class TorchaoNoise(logging.Filter):
    """Drops exactly those two kinds of record: torchao's "Failed to load <its .so>", and torch's deprecation of
    register_constant for an Enum that torchao defines. Any other record of those loggers passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            message = record.getMessage()
            return not (message.startswith("Failed to load ") and ".so" in message.split(":")[0])
        enum = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (isinstance(record.msg, str) and "is an Enum subclass" in record.msg
                    and getattr(enum, "__module__", "").startswith("torchao"))


def quiet_torchao() -> None:
    """Install TorchaoNoise on torchao's logger and torch's pytree logger (once): before torchao is imported,
    by gptopt or by transformers, whenever that happens."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, TorchaoNoise) for f in logger.filters):
            logger.addFilter(TorchaoNoise())


def require(module: str, extra: str, feature: str | None = None) -> ModuleType:
    """Import `module`, or raise MissingExtra naming the `pip install 'gptopt[extra]'` to run."""
    if module.split(".")[0] in TORCHAO_IMPORTERS:
        quiet_torchao()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        what = feature or module
        raise MissingExtra(f"{what} needs the '{extra}' extra: pip install 'gptopt[{extra}]'") from e


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def installed_extras() -> dict[str, bool]:
    return {extra: all(has(m) for m in mods) for extra, mods in EXTRAS.items()}
