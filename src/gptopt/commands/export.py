"""`gptopt export`: the model as ONNX with KV-cache inputs and outputs (for onnxruntime), or as a Hugging Face dir.

    gptopt export --model out/ --output_dir out_onnx              # model.onnx, gptopt_onnx.json, tokenizer.json
    gptopt export --model out/ --format hf --output_dir out_hf    # GPT2LMHeadModel.from_pretrained("out_hf")

The ONNX graph (the "past key values" signature decoders use), onnxruntime's decoder and the ONNX directory are
the library's: infer/onnx_decoder.py, which bench's onnxruntime rung uses too. Each export is checked before it is moved
into place: onnxruntime (or transformers) against PyTorch on a padded batch of two prompts, a prefill and then one
decode step. A mismatch writes nothing and exits 1.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from gptopt.config import ExportConfig
from gptopt.data.tokenizer import TOKENIZER, eot_id, load_tokenizer
from gptopt.infer import chat
from gptopt.infer.load import check_vocab, find_tokenizer, has_tokenizer, model_source, own_tokenizer
from gptopt.infer.onnx_decoder import (
    ONNX_FILE,
    ExportCheckError,
    check_onnx_output,
    check_prompts,
    export_onnx,
    staged,
    verdict,
)
from gptopt.models import checkpoint, hf, hf_files
from gptopt.models.gpt import GPT
from gptopt.outputs import check_output, lock_output
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

__all__ = ["export_hf_checked", "main"]

log = logging.getLogger("gptopt")


# ----------------------------------------------------------------------------------------------
# The Hugging Face export


def _check_output_dir(target: Path, fmt: str, overwrite: bool) -> None:
    """Refuse before any work: a file, a folder that cannot be written, a non-empty directory without
    --overwrite, and with it any directory gptopt did not mark as this export or that holds other files."""
    if fmt == "onnx":
        check_onnx_output(target, overwrite)
    else:
        check_output(target, kind=hf.EXPORT_KIND, overwrite=overwrite, whole=True)


@torch.no_grad()
def export_hf_checked(model: GPT, directory: str | Path, *, tokenizer: Tokenizer | None = None,
                      tolerance: float = 1e-4, overwrite: bool = False, bos: int | None = None,
                      eos: int | list[int] | None = None, files: Sequence[Path] = ()) -> dict[str, float]:
    """hf.export_hf plus tokenizer.json and `files` (copied as they are: the model's tokenizer_config.json and
    chat template), moved into place only once transformers' logits match PyTorch's.

    The tokenizer's end-of-text id becomes the export's bos and eos ids where the model has none of its own
    (bos, eos: hf.export_hf says why)."""
    target = Path(directory)
    _check_output_dir(target, "hf", overwrite)
    transformers = require("transformers", "hf", "Hugging Face export")
    if model.transformer.wte.weight.device.type != "cpu":
        raise UserError("the Hugging Face export is checked on the CPU: pass the model there")
    model = model.eval()
    with staged(target, hf.EXPORT_KIND, overwrite) as tmp:
        # into the empty staging dir: export_hf writes its own files atomically
        hf.export_hf(model, tmp, eot=None if tokenizer is None else eot_id(tokenizer), bos=bos, eos=eos)
        if tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER))
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp)).eval()  # the class config.json names
        diffs, scale = {"max_abs_diff": 0.0}, 0.0
        for p in check_prompts(model.config)[0]:
            ids = torch.tensor([p])
            ref = model(ids).float()
            got = loaded(input_ids=ids).logits.float()
            diffs["max_abs_diff"] = max(diffs["max_abs_diff"], (got - ref).abs().max().item())
            scale = max(scale, ref.abs().max().item())
        check = verdict("transformers", diffs, scale, tolerance)
        del loaded
    return check


# ----------------------------------------------------------------------------------------------
# CLI


def _tokenizer(source: Path | str, given: str | None, own: Tokenizer | None) -> Tokenizer | None:
    """--tokenizer, else the model's own (own: the one in its folder): recorded in a gptopt checkpoint or lying
    beside the model (never a download for a local directory); a hub model's from the hub. None when there is none."""
    if given is not None:
        return load_tokenizer(given)
    if own is not None:
        return own
    if isinstance(source, Path) and not checkpoint.is_gptopt_dir(source):
        local = [d for d in (source, source.parent) if has_tokenizer(d)]
        return load_tokenizer(local[0]) if local else None
    with contextlib.suppress(ValueError):
        return find_tokenizer(source)
    return None


def main(cfg: ExportConfig) -> int:
    target = Path(cfg.output_dir or f"export_{cfg.format}")
    with lock_output(target, whole=True):  # one writer, from the checks to the publish
        return _export(cfg, target)


def _export(cfg: ExportConfig, target: Path) -> int:
    onnx = cfg.format == "onnx"
    _check_output_dir(target, cfg.format, cfg.overwrite)  # before any loading
    for module, extra in ([("onnx", "onnx"), ("onnxscript", "onnx"), ("onnxruntime", "onnx")] if onnx
                          else [("transformers", "hf")]):
        require(module, extra, f"gptopt export --format {cfg.format}")
    source = model_source(cfg.model)
    own = own_tokenizer(source)
    tok = _tokenizer(source, cfg.tokenizer, own)
    # Eager attention: SDPA traces into the same math plus NaN guards that only lengthen the graph.
    model = hf.load_pretrained(source, **({"attention": "eager"} if onnx else {})).eval()
    if tok is not None:
        check_vocab(tok, model.config.vocab_size, own=own)
    if tok is None:
        log.info("no tokenizer found beside %s: the export has none (pass --tokenizer to ship one)", source)
    log.info("exporting %s (%.1fM parameters) as %s to %s", source, model.num_params() / 1e6, cfg.format, target)
    t0 = time.perf_counter()
    try:
        if onnx:
            meta = export_onnx(model, target, tokenizer=tok, opset=cfg.opset, tolerance=cfg.tolerance,
                               overwrite=cfg.overwrite)
            check = meta["check"]
            what = (f"{target / ONNX_FILE} ({meta['exporter']} exporter, opset {cfg.opset}); onnxruntime matches "
                    f"PyTorch: max |logit diff| prefill {check['prefill_max_abs_diff']:.2g}, decode "
                    f"{check['decode_max_abs_diff']:.2g}")
        else:
            folders = chat.template_folders(cfg.model, cfg.tokenizer)
            bos, eos = hf_files.special_ids(folders)  # the model's own; none: the tokenizer's end-of-text
            kept = hf_files.chat_files(folders) if tok is not None else []
            check = export_hf_checked(model, target, tokenizer=tok, tolerance=cfg.tolerance, overwrite=cfg.overwrite,
                                      bos=bos, eos=(eos[0] if len(eos) == 1 else eos) or None,
                                      files=kept)
            files = [hf.HF_CONFIG, *([hf.GENERATION_CONFIG] if (target / hf.GENERATION_CONFIG).is_file() else []),
                     hf.SAFETENSORS, *(f.name for f in kept)]
            what = (f"{target} ({', '.join(files)}); transformers matches: max |logit diff| "
                    f"{check['max_abs_diff']:.2g}")
    except ExportCheckError as e:
        print(f"gptopt export: error: {e}", file=sys.stderr)
        return 1
    print(f"gptopt export: wrote {what} (allowed {check['allowed_abs_diff']:.2g}); "
          f"{'with' if tok is not None else 'no'} tokenizer.json; {time.perf_counter() - t0:.1f} s")
    return 0
