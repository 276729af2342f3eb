"""The model as an ONNX graph with the past-key-values signature decoders use, onnxruntime running it, and the
export directory `gptopt export` and bench's onnxruntime rung write, checked against PyTorch before it is moved
into place.

    python -c "from gptopt.infer.onnx_decoder import OrtDecoder; help(OrtDecoder)"

The graph: input_ids (B, T), attention_mask (B, P + T) (1 = a real token; prompts are left-padded), position_ids
(B, T) and past_key_i / past_value_i (B, nkv, P, hs) per layer in; logits (B, T, V) and present_key_i /
present_value_i (B, nkv, P + T, hs) out: nkv is the model's key/value heads (fewer than its query heads under
grouped-query attention) and hs its head_dim, which Qwen3 sizes apart from the width. Rotary positions are
computed in the graph from position_ids. Batch, sequence and past length are dynamic; a prefill passes P = 0
(empty past tensors). The check: onnxruntime against PyTorch on a padded batch of two prompts, a prefill and then
one decode step; a mismatch writes nothing (ExportCheckError).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from tokenizers import Tokenizer

from gptopt.config import MIN_OPSET
from gptopt.data.tokenizer import TOKENIZER, eot_id
from gptopt.models.gpt import GPT
from gptopt.outputs import check_output, mark, marked_kind, staged_dir
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

__all__ = ["ONNX_FILE", "ONNX_KIND", "ExportCheckError", "OnnxDecoder", "OrtDecoder", "check_onnx",
           "check_onnx_output", "check_prompts", "export_onnx", "staged", "to_onnx", "verdict"]

log = logging.getLogger("gptopt")

ONNX_FILE = "model.onnx"
ONNX_META = "gptopt_onnx.json"
ONNX_KIND = "export-onnx"  # the outputs mark of an ONNX export directory


class ExportCheckError(RuntimeError):
    """The exported model does not load, or its logits differ from PyTorch's by more than the tolerance."""


# ----------------------------------------------------------------------------------------------
# The graph


class _ConcatLayer:
    """One layer's cache in the ONNX signature: the past comes in as tensors, past + new goes out.

    The same update() the model calls on infer/kv_cache.py's paged cache, so models/gpt.py needs no
    export branch.
    """

    def __init__(self, past_k: torch.Tensor, past_v: torch.Tensor) -> None:
        self.k, self.v = past_k, past_v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = torch.cat([self.k, k], dim=2)  # (B, nkv, P + T, hs)
        self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v


class OnnxDecoder(nn.Module):
    """GPT behind the past-key-values signature: the module torch.onnx.export traces."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        T, S = input_ids.shape[1], attention_mask.shape[1]  # S = P + T keys: the past and the new tokens
        keys = torch.arange(S, device=input_ids.device)
        query = keys[S - T :]  # (T,) each new token's place among the keys
        # A padded query may see itself: a row with no visible key makes softmax NaN, and that NaN would reach
        # the real rows through the next layer's values. Real queries never see padded keys.
        visible = (attention_mask[:, None, None, :] > 0) | (keys == query[:, None])
        mask = (keys <= query[:, None]) & visible  # (B, 1, T, S)
        layers = [_ConcatLayer(past[2 * i], past[2 * i + 1]) for i in range(self.model.config.n_layer)]
        logits = self.model(input_ids, pos=position_ids, kv_cache=layers, attn_mask=mask)
        return (logits, *[t for layer in layers for t in (layer.k, layer.v)])


def io_names(n_layer: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kv}_{i}" for i in range(n_layer) for kv in ("key", "value")]
    present = [f"present_{kv}_{i}" for i in range(n_layer) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    # The exporter warns about each axis name shared by several inputs and each torchvision op it skips;
    # none of it concerns this graph, and it would bury the one line that does.
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        registration.setLevel(level)


def to_onnx(model: GPT, path: Path, *, opset: int = 18) -> str:
    """Write the model to path (weights in path.data beside it past 2 GB); returns the exporter that worked."""
    cfg = model.config
    inputs, outputs = io_names(cfg.n_layer)
    B, T, P = 2, 3, 4  # distinct and > 1: torch.export fixes sizes 0 and 1, and may tie equal ones together
    sample = (torch.randint(0, cfg.vocab_size, (B, T)), torch.ones(B, P + T, dtype=torch.long),
              (torch.arange(P, P + T) % cfg.block_size).expand(B, T).contiguous(),
              [torch.zeros(B, cfg.kv_heads, P, cfg.head_dim) for _ in range(2 * cfg.n_layer)])
    decoder = OnnxDecoder(model).eval()
    seq = {0: "batch", 1: "sequence"}
    with _quiet_exporter(), torch.no_grad():
        try:
            shapes = {"input_ids": seq, "attention_mask": {0: "batch", 1: "total_sequence"}, "position_ids": seq,
                      "past": [{0: "batch", 2: "past_sequence"}] * len(sample[3])}
            program = torch.onnx.export(decoder, sample, None, dynamo=True, input_names=inputs, output_names=outputs,
                                        dynamic_shapes=shapes, opset_version=opset, verbose=False)
        except Exception as e:  # the TorchScript exporter is deprecated, but exports this graph where dynamo fails
            log.warning("the dynamo ONNX exporter failed (%s: %s); trying the TorchScript exporter",
                        type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
            axes: dict[str, dict[int, str]] = {"input_ids": seq, "position_ids": seq, "logits": seq,
                                               "attention_mask": {0: "batch", 1: "total_sequence"}}
            axes |= {n: {0: "batch", 2: "past_sequence"} for n in inputs[3:]}
            axes |= {n: {0: "batch", 2: "total_sequence"} for n in outputs[1:]}
            torch.onnx.export(decoder, sample, str(path), dynamo=False, input_names=inputs, output_names=outputs,
                              dynamic_axes=axes, opset_version=opset)
            return "torchscript"
    ir = require("onnx_ir", "onnx", "ONNX export")
    for value in program.model.graph.outputs[1:]:  # "past_sequence + sequence" -> the attention_mask's name
        dims = list(value.shape)
        dims[2] = ir.SymbolicDim("total_sequence")
        value.shape = ir.Shape(dims)
    program.save(str(path))
    return "dynamo"


# ----------------------------------------------------------------------------------------------
# onnxruntime


class OrtDecoder:
    """An exported model.onnx in onnxruntime: one forward over the past-key-values signature, greedy decoding."""

    def __init__(self, path: str | Path, *, block_size: int | None = None, threads: int | None = None) -> None:
        ort = require("onnxruntime", "onnx", "running the ONNX model")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()  # PyTorch's count: a like-for-like race
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        past = [i for i in self.session.get_inputs() if i.name.startswith("past_")]
        self.past_names = [i.name for i in past]
        self.kv_heads, self.head_dim = past[0].shape[1], past[0].shape[3]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.block_size = block_size

    def forward(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray,
                past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                **dict(zip(self.past_names, past, strict=True))}
        logits, *present = self.session.run(self.output_names, feed)
        return logits, present

    def prefill(self, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
        """Logits (B, L, V) of the prompts left-padded to the longest (L), with the mask, positions and cache."""
        if not prompts or not all(prompts):
            raise UserError("every prompt needs at least one token")
        B, L = len(prompts), max(map(len, prompts))
        ids, mask = np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)
        for r, p in enumerate(prompts):
            ids[r, L - len(p) :], mask[r, L - len(p) :] = p, 1  # left-padded: each row's last token is at -1
        pos = np.maximum(mask.cumsum(axis=1) - 1, 0)
        empty = [np.zeros((B, self.kv_heads, 0, self.head_dim), np.float32) for _ in self.past_names]
        logits, present = self.forward(ids, mask, pos, empty)
        return logits, mask, pos, present

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """n new tokens per prompt by argmax, as the gptopt Generator picks them at temperature 0."""
        longest = max(map(len, prompts), default=0)
        if self.block_size is not None and longest + n - 1 > self.block_size:
            raise UserError(f"{longest} prompt tokens + {n} new ones exceed the model's context {self.block_size}")
        logits, mask, pos, past = self.prefill(prompts)
        tokens = [logits[:, -1].argmax(-1)]
        for _ in range(n - 1):
            mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
            pos = pos[:, -1:] + 1
            logits, past = self.forward(tokens[-1][:, None], mask, pos, past)
            tokens.append(logits[:, -1].argmax(-1))
        return np.stack(tokens, axis=1).tolist()


def check_prompts(cfg: Any) -> tuple[list[list[int]], list[int]]:
    """Every export check's input: two prompts of different lengths (the shorter is padded) and one next token
    each, from a fixed seed."""
    if cfg.block_size < 2:
        raise UserError(f"the model's context is {cfg.block_size} token: nothing to decode after a prompt")
    g = torch.Generator().manual_seed(0)
    n = min(7, cfg.block_size - 1)
    prompts = [torch.randint(0, cfg.vocab_size, (k,), generator=g).tolist() for k in (n, max(1, n - 3))]
    return prompts, torch.randint(0, cfg.vocab_size, (2,), generator=g).tolist()


def verdict(what: str, diffs: dict[str, float], scale: float, tolerance: float) -> dict[str, float]:
    """The check's report, or ExportCheckError when the largest difference exceeds tolerance x the logits' scale."""
    allowed = tolerance * max(1.0, scale)
    report = {**diffs, "logit_scale": scale, "tolerance": tolerance, "allowed_abs_diff": allowed}
    worst = max(diffs.values())
    if not worst <= allowed:  # NaN fails too
        raise ExportCheckError(f"{what} logits differ from PyTorch's by {worst:.3g} (allowed {allowed:.3g}: "
                             f"tolerance {tolerance:g} x max |logit| {scale:.3g}); nothing was written")
    return report


@torch.no_grad()
def check_onnx(model: GPT, decoder: OrtDecoder, tolerance: float) -> dict[str, float]:
    """Max |onnxruntime - PyTorch| logit of a padded batch of two prompts: the prefill, then one decode step
    fed the prefill's present tensors. PyTorch runs each sequence whole, without a cache."""
    prompts, nxt = check_prompts(model.config)
    logits, mask, pos, past = decoder.prefill(prompts)
    step, _ = decoder.forward(np.array(nxt)[:, None], np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1),
                              pos[:, -1:] + 1, past)
    L, diffs, scale = logits.shape[1], {"prefill_max_abs_diff": 0.0, "decode_max_abs_diff": 0.0}, 0.0
    for r, p in enumerate(prompts):
        ref = model(torch.tensor([[*p, nxt[r]]]))[0].numpy()  # (len + 1, V)
        diffs["prefill_max_abs_diff"] = max(diffs["prefill_max_abs_diff"],
                                            float(np.abs(logits[r, L - len(p) :] - ref[:-1]).max()))
        diffs["decode_max_abs_diff"] = max(diffs["decode_max_abs_diff"], float(np.abs(step[r, 0] - ref[-1]).max()))
        scale = max(scale, float(np.abs(ref).max()))
    return verdict("onnxruntime", diffs, scale, tolerance)


# ----------------------------------------------------------------------------------------------
# The export directory


def _adopt_legacy(target: Path) -> None:
    """Mark an ONNX export gptopt wrote before it marked its outputs, so --overwrite may replace it.

    Its gptopt_onnx.json in gptopt's format lists every file of the export; only a directory that holds
    exactly those counts as gptopt's. (A Hugging Face directory has no such record of gptopt's: a
    downloaded model looks the same, so an unmarked one is never replaced.)
    """
    if marked_kind(target) is not None or not os.access(target, os.W_OK | os.X_OK):
        return
    try:
        meta = json.loads((target / ONNX_META).read_text())
        present = {p.name for p in target.iterdir()}
    except (OSError, ValueError):
        return
    if isinstance(meta, dict) and meta.get("format") == "gptopt-onnx" and present == set(meta.get("files") or ()):
        mark(target, ONNX_KIND, files=present)


def check_onnx_output(target: Path, overwrite: bool) -> None:
    """Refuse before any work: a file, a folder that cannot be written, a non-empty directory without
    --overwrite, and with it any directory gptopt did not mark as an ONNX export or that holds other files."""
    if overwrite and target.is_dir():
        _adopt_legacy(target)
    check_output(target, kind=ONNX_KIND, overwrite=overwrite, whole=True)


@contextlib.contextmanager
def staged(target: Path, kind: str, replace: bool) -> Iterator[Path]:
    """staged_dir, with a failure to create the staging folder (the place changed since check_output
    probed it) told as one line naming --output_dir."""
    with contextlib.ExitStack() as stack:
        try:
            tmp = stack.enter_context(staged_dir(target, replace=replace, kind=kind))
        except OSError as e:
            raise UserError(f"--output_dir {target}: cannot create a folder there ({e.strerror or e}); nothing was "
                             "written: choose a folder you can write with --output_dir") from None
        yield tmp


def _io(values: list[Any]) -> list[dict[str, Any]]:
    return [{"name": v.name, "dtype": v.type.removeprefix("tensor(").removesuffix(")"), "shape": v.shape}
            for v in values]


def export_onnx(model: GPT, directory: str | Path, *, tokenizer: Tokenizer | None = None, opset: int = 18,
                tolerance: float = 1e-4, overwrite: bool = False) -> dict[str, Any]:
    """Write model.onnx, gptopt_onnx.json (what goes in and out, the check) and tokenizer.json (if given)
    into directory, checked against PyTorch first; returns the JSON's contents."""
    target = Path(directory)
    check_onnx_output(target, overwrite)
    for module in ("onnx", "onnxscript", "onnxruntime"):
        require(module, "onnx", "ONNX export")
    if opset < MIN_OPSET:
        raise UserError(f"opset must be >= {MIN_OPSET}, got {opset}")
    weight = model.transformer.wte.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise UserError(f"the ONNX export starts from an fp32 model on the CPU, got {weight.dtype} on {weight.device} "
                         "(load_pretrained gives one)")
    model = model.eval()
    if model.config.attention != "eager":  # SDPA traces into the same math plus NaN guards: a longer graph
        eager = GPT(dataclasses.replace(model.config, attention="eager"))
        eager.load_state_dict(model.state_dict())
        model = eager.eval()
    with staged(target, ONNX_KIND, overwrite) as tmp:
        t0 = time.perf_counter()
        exporter = to_onnx(model, tmp / ONNX_FILE, opset=opset)
        export_s = time.perf_counter() - t0
        try:
            decoder = OrtDecoder(tmp / ONNX_FILE, block_size=model.config.block_size)
        except Exception as e:  # onnxruntime raises its own types for graphs it refuses
            raise ExportCheckError(f"onnxruntime cannot load the exported graph ({type(e).__name__}: "
                                   f"{str(e).strip()[:300]}); nothing was written") from None
        check = check_onnx(model, decoder, tolerance)
        if tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER))
        meta = {
            "format": "gptopt-onnx", "files": sorted(p.name for p in tmp.iterdir()) + [ONNX_META],
            "exporter": exporter, "opset": opset, "export_s": round(export_s, 2), "torch": torch.__version__,
            "model": model.config.to_dict(), "tokenizer": TOKENIZER if tokenizer is not None else None,
            "eot_token_id": None if tokenizer is None else eot_id(tokenizer),
            "inputs": _io(decoder.session.get_inputs()), "outputs": _io(decoder.session.get_outputs()),
            "usage": "prefill: past_* empty (batch, kv_heads, 0, head_dim); attention_mask 1 for real tokens, prompts "
                     "left-padded; position_ids = cumsum(attention_mask) - 1, at least 0. Decode: present_* back as "
                     "past_*, a 1 appended to attention_mask, position_ids + 1.",
            "check": check,
        }
        del decoder  # its session holds a copy of every weight
        (tmp / ONNX_META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
