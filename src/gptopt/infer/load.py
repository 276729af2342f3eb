"""Loading a model for inference, and the inference transforms, in one fixed order.

    python -c "from gptopt.infer.load import load_for_inference; help(load_for_inference)"

What train.wrap.wrap_for_training is for training, this is for generate, serve, bench --mode infer,
compress and export. The order, and why it is this one:

  1. model_source: `--model` -> a directory (a training output dir means its latest checkpoint)
     or a hub name.
  2. find_tokenizer: the model folder's own tokenizer (checkpoints carry a copy), else the one the
     checkpoint recorded, else one in the folder above, else a hub model's own (never another model's).
  3. weights: hf.load_pretrained (a compressed checkpoint comes back dequantised, in fp32); check_vocab
     refuses a tokenizer that is not the model's.
  4. optimize_for_inference, once per model:
     a. dtype and device (weights_dtype), or a compressed checkpoint rebuilt for this device
        (quantize.restore, which needs the fp32 weights of step 3 to recover the stored integers);
     b. int8 or int4 weight-only (quantize_int8, quantize_int4): swaps weights for torchao tensors, so
        after the cast (int4 runs bf16 on sm_80+ CUDA only: refused before step 1 elsewhere);
     c. weight layout (cpu_layout.inference_layout: CpuLinear, packed fp32 or bf16 products;
        cpu_fused.fuse_blocks: the Llama/Qwen3 blocks' norms and rotary as fused kernels): float weights only, so
        after int8.
  5. decode_graphs.compile_decode, once per Generator (it needs the KV cache, which the Generator owns):
     static cache addresses for CUDA graphs, or on CPUs the gemv Linears (cpu_layout.gemv_linears,
     which undo step c's layout: they read row-major weights), then torch.compile. Or, on CUDA without
     a compiler, decode_graphs.GraphedDecode: the eager decode recorded as one CUDA graph per batch bucket.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from gptopt.config import INFER_QUANTIZE
from gptopt.data.tokenizer import TOKENIZER, load_tokenizer
from gptopt.infer.cpu_layout import inference_layout
from gptopt.infer.quantize import int4_unsupported, quantize_int4, quantize_int8, restore
from gptopt.models import checkpoint, hf, hub
from gptopt.models.compressed import describe, int4_group_size
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require
from gptopt.utils.paths import looks_local, missing_model, model_advice

__all__ = ["check_vocab", "find_tokenizer", "load_for_inference", "model_source", "optimize_for_inference",
           "own_tokenizer", "weights_dtype"]

log = logging.getLogger("gptopt")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Names that are hub models rather than missing directories: GPT-2's own, or anything "org/name".
_HUB_NAME = re.compile(r"(openai-community/)?(distil)?gpt2(-medium|-large|-xl)?|[\w.-]+/[\w.-]+")
# nanoGPT's padding of a vocabulary: GPT-2's 50,257 tokens in 50,304 embedding rows. A model this much larger
# than its tokenizer is still that tokenizer's model; gptopt's own padding (vocab_pad_multiple) is not counted
# in vocab_size at all.
VOCAB_PAD = 64


def model_source(model: str, option: str = "--model") -> Path | str:
    """The directory (or hub name) to load: a training output dir means its latest checkpoint. A hub name the
    Hub cannot provide is refused at once (hub.check_name). option: the flag that named it, for the errors."""
    p = Path(model).expanduser()
    if p.is_dir():
        latest = checkpoint.latest_checkpoint(p)
        if latest is not None:
            return latest
        if not checkpoint.is_gptopt_dir(p) and not (p / hf.HF_CONFIG).is_file():
            raise UserError(f"{option} {p}: no checkpoint or model files in this directory; "
                             + model_advice(str(p), option))
        return p
    if p.exists():
        raise UserError(f"{option} {p} is a file; give the model's directory")
    if _HUB_NAME.fullmatch(model) and not looks_local(model):
        hub.check_name(model, option)
        return model
    raise UserError(missing_model(model, option))


def has_tokenizer(d: Path) -> bool:
    """tokenizer.json, or GPT-2's vocab.json + merges.txt."""
    return (d / TOKENIZER).is_file() or (d / "vocab.json").is_file() and (d / "merges.txt").is_file()


def own_tokenizer(source: Path | str) -> Tokenizer | None:
    """The tokenizer files in the model's own folder (a training checkpoint and an export carry a copy of
    the one the model was trained with), or None."""
    return load_tokenizer(source) if isinstance(source, Path) and has_tokenizer(source) else None


def find_tokenizer(source: Path | str, option: str = "--model") -> Tokenizer:
    """The model folder's own tokenizer files (a training checkpoint carries a copy), else meta["tokenizer"]
    of a gptopt checkpoint, else tokenizer files in the folder above; a hub model's own from the Hub.

    The folder's own copy comes first: a recorded path may be relative to wherever training ran, and
    from another working directory it would name nothing, or another corpus's tokenizer. Never another
    model's (GPT-2's, say): its ids would be other text to this model. option: the flag that named the model."""
    ours = isinstance(source, Path) and checkpoint.is_gptopt_dir(source)
    recorded = checkpoint.read_meta(source).get("tokenizer") if ours else None
    candidates = [str(source)] if isinstance(source, Path) and has_tokenizer(source) else []
    candidates += [recorded] if recorded else []
    if isinstance(source, Path) and has_tokenizer(source.parent):
        candidates.append(str(source.parent))
    for c in candidates:
        if Path(c).exists():
            return load_tokenizer(c)
    if isinstance(source, str):  # a hub name: its own tokenizer.json, from the Hub
        with contextlib.suppress(ValueError):
            return load_tokenizer(source)
    where = f"{recorded} (recorded in the checkpoint), " if recorded else ""
    looked = f"{where}tokenizer.json beside the model" if isinstance(source, Path) else "its tokenizer.json on the Hub"
    fix = ("pass --tokenizer with the tokenizer.json the model was trained with (or a folder holding it)"
           if option == "--model" else
           f"{option} takes no --tokenizer (that one is --model's): put the tokenizer.json the model was trained "
           f"with into {source}")
    raise UserError(f"no tokenizer found for {option} {source} (looked for {looked}); {fix}")


def check_vocab(tok: Tokenizer, vocab_size: int, *, own: Tokenizer | None = None) -> None:
    """Refuse a tokenizer that is not the model's (ValueError): where a model and a tokenizer meet, so that
    generate, eval, serve, compress and export never run a model on another vocabulary's ids.

    A model's vocabulary is its tokenizer's, or that rounded up to a multiple of VOCAB_PAD (a padded
    embedding). A smaller tokenizer is the model's only where the model's folder holds it (own): the GPT-2
    presets keep GPT-2's 50,257 rows whatever the tokenizer they were trained with (config.preset_for_data),
    and their checkpoints and exports carry that tokenizer."""
    n = tok.get_vocab_size()
    if own is not None and own.get_vocab_size() <= vocab_size:
        if n == own.get_vocab_size():
            return
        raise UserError(f"the tokenizer has {n} tokens, the model {vocab_size} and the {TOKENIZER} in its folder "
                         f"{own.get_vocab_size()}: they do not belong together; drop --tokenizer to use the model's "
                         "own, or pass the --tokenizer the model was trained with")
    if vocab_size in (n, -(-n // VOCAB_PAD) * VOCAB_PAD):
        return
    raise UserError(f"the tokenizer has {n} tokens, the model {vocab_size} (more apart than padding to a multiple of "
                     f"{VOCAB_PAD}): they do not belong together; pass the --tokenizer the model was trained with "
                     f"(its {TOKENIZER}, or a folder holding it)")


def weights_dtype(name: str, plan: DevicePlan, *, quantized: bool = False) -> torch.dtype:
    """auto: the plan's half precision: on GPUs bf16 from sm_80, else fp16; on CPUs bf16 where they have native
    bf16 (device.cpu_has_fast_bf16: oneDNN's bf16 products over packed weights run about twice as fast as fp32
    there), else fp32 (bf16 would be emulated). quantized (int8 or int4 weights, asked for or stored): fp32 on
    CPUs, where the int8 kernels take fp32 activations."""
    if name == "auto":
        if plan.device.type == "cpu" and quantized:
            return torch.float32
        return plan.amp_dtype or torch.float32
    if name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _check_quantize(quantize: str, plan: DevicePlan, dtype: torch.dtype) -> None:
    """Refuse what cannot run here before anything is loaded (a TOML config skips argparse's choices)."""
    if quantize not in INFER_QUANTIZE:
        raise UserError(f"unknown quantize {quantize!r}; "
                         f"choose {', '.join(INFER_QUANTIZE[:-1])} or {INFER_QUANTIZE[-1]}")
    if quantize == "int4-weight":
        problem = int4_unsupported(plan, dtype, "drop --quantize here, or use --quantize int8-weight")
        if problem:
            raise UserError(problem)
        require("torchao.quantization", "quant", "--quantize int4-weight")


def optimize_for_inference(model: GPT, plan: DevicePlan, *, dtype: torch.dtype, quantize: str = "none",
            compression: dict[str, Any] | None = None, layout: bool = True, stack: bool = False,
            fuse: bool = True) -> GPT:
    """Steps 4a-c of the module docstring, in place: the model in eval mode on plan.device, ready for a Generator.

    compression: a compressed checkpoint's record (it came back dequantised, in fp32), rebuilt for this
    device. layout: False for a caller that transforms the weights further (gptopt compress). stack, fuse:
    inference_layout's (the bench's lever rungs measure each)."""
    _check_quantize(quantize, plan, dtype)
    assert not (compression and quantize != "none"), "a compressed model is not quantised again"
    model = restore(model, compression, plan, dtype) if compression else model.to(device=plan.device, dtype=dtype)
    model = model.eval()
    if quantize == "int8-weight":
        quantize_int8(model, plan)
    elif quantize == "int4-weight":
        model = quantize_int4(model, plan, dtype, int4_group_size(model))
    if layout:
        inference_layout(model, plan.device.type, stack=stack, fuse=fuse)  # CPU: packed products, fused blocks
    return model


def load_for_inference(model: str, *, tokenizer: str | None, plan: DevicePlan, dtype: str = "auto",
                       quantize: str = "none", layout: bool = True, option: str = "--model") -> tuple[GPT, Tokenizer]:
    """The model (eval, on plan.device, in `dtype`) and its tokenizer, from a training output dir (its
    latest checkpoint), a checkpoint or model dir, a Hugging Face GPT-2 dir or a hub name: steps 1-4.

    layout: store fp weights in the layout that runs inference fastest (cpu_layout.inference_layout);
    False for a caller that transforms the weights further (gptopt compress). option: the flag that named
    the model (--draft_model for a draft), which the errors name."""
    dt = weights_dtype(dtype, plan, quantized=quantize != "none")
    _check_quantize(quantize, plan, dt)  # before any loading
    source = model_source(model, option)
    own = own_tokenizer(source)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else own or find_tokenizer(source, option)
    net = hf.load_pretrained(source)  # a compressed checkpoint comes back dequantised, in fp32
    check_vocab(tok, net.config.vocab_size, own=own)
    record = checkpoint.read_meta(source).get("compression") if isinstance(source, Path) and \
        checkpoint.is_gptopt_dir(source) else None
    if record and quantize != "none":
        raise UserError(f"--model {source} is already compressed ({describe(record)}, by gptopt compress); "
                         "drop --quantize")
    if record and record.get("quantize"):
        dt = weights_dtype(dtype, plan, quantized=True)
    log.info("model %s: %.1fM parameters, %s weights on %s (generation runs in the weights' dtype, no autocast)",
             source, net.num_params() / 1e6, describe(record) if record else str(dt).removeprefix("torch."),
             plan.device)
    return optimize_for_inference(net, plan, dtype=dt, quantize=quantize, compression=record, layout=layout), tok
