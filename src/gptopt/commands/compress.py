"""gptopt compress: quantise and/or prune a model into a checkpoint every verb loads, and measure, in
the same run, what that bought against the original on this device.

    gptopt compress --model out --output_dir out-int8 --quantize int8-dynamic
    gptopt compress --model out --output_dir out-p50 --prune 0.5 --json
    gptopt compress --model gpt2 --output_dir gpt2-int8 --quantize int8-weight --compile --data_dir data/gpt2

Perplexity and KL are scored on the val split of the data the model was trained on (its checkpoint
records it) unless --data_dir names other shards, which must come from the model's own tokenizer.

The report, a table on stdout and OUTPUT/results.json: size on disk and in memory, prefill latency,
decode tokens/s at batch 1 and 8, perplexity and bits per byte (bpb.py) on the val split and the mean
KL divergence of the next-token distribution from the original's on the same tokens. Both models are
loaded the way generate and serve load them (the compressed one from the directory just written), so these are
the figures a user of the output gets. The output directory appears whole, report included, or not at all.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from gptopt.config import CompressConfig, parse_prune
from gptopt.data.bpb import bits_per_byte, bytes_per_token
from gptopt.data.loader import DEFAULT_DATA, BatchDataset, TokenData, open_data
from gptopt.data.tokenizer import TOKENIZER
from gptopt.infer.load import load_for_inference, model_source, weights_dtype
from gptopt.infer.measure import GptoptRunner, interleaved, tensor_bytes
from gptopt.infer.quantize import check_supported, compress_model
from gptopt.models import checkpoint
from gptopt.models.compressed import describe, pack_state
from gptopt.outputs import check_output, lock_output, staged_dir
from gptopt.runtime import process
from gptopt.runtime.device import DevicePlan, environment, resolve
from gptopt.runtime.process import DECODE_GRAPHS
from gptopt.runtime.torch_private import recompile_limit_for
from gptopt.utils.errors import UserError
from gptopt.utils.tables import text_table, to_json

__all__ = ["main", "mean_kl", "memory_bytes", "perplexity_and_kl"]

log = logging.getLogger("gptopt")

DECODE_BATCHES = (1, 8)
EVAL_BATCH = 4  # val windows per forward: (4, context, vocab) fp32 logits stay small even for GPT-2's vocabulary
NO_GAIN = 1.05  # a speed ratio below this counts as no gain: timings on a shared machine vary by more


# ----------------------------------------------------------------------------------------------
# Measures


def memory_bytes(model: nn.Module) -> int:
    """Bytes the weights occupy on their device: parameters and buffers (a tied tensor once, quantised
    subclasses by their inner tensors) plus the packed weights of torch.ao's dynamic int8 Linear."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    total = sum(tensor_bytes(t) for t in tensors.values())
    for m in model.modules():
        if hasattr(m, "_packed_params") and callable(getattr(m, "weight", None)):
            w, b = m.weight(), m.bias()  # int8 values + fp64 scales + int64 zero points per channel, fp32 bias
            total += w.numel() * w.element_size() + 16 * w.shape[0] + (0 if b is None else b.numel() * b.element_size())
    return total


def mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(P_reference || P) between next-token distributions, in nats; logits (..., V)."""
    ref, got = reference.float().log_softmax(-1), logits.float().log_softmax(-1)
    return F.kl_div(got, ref, log_target=True, reduction="none").sum(-1).mean()


@torch.no_grad()
def perplexity_and_kl(reference: nn.Module, candidate: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                      device: torch.device, on_batch: Any = None) -> dict[str, float]:
    """Both models' perplexity on the same (x, y) windows and the candidate's mean KL from the reference."""
    ce_ref = ce = kl = 0.0
    n = 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        ref, got = reference(x).float(), candidate(x).float()  # (B, T, V)
        ce_ref += F.cross_entropy(ref.flatten(0, 1), y.flatten(), reduction="sum").item()
        ce += F.cross_entropy(got.flatten(0, 1), y.flatten(), reduction="sum").item()
        kl += mean_kl(ref, got).item() * y.numel()
        n += y.numel()
        if on_batch is not None:
            on_batch()
    if not n:
        raise UserError("no val tokens to score")
    return {"perplexity_reference": math.exp(ce_ref / n), "perplexity": math.exp(ce / n), "kl": kl / n, "tokens": n}


def _speed(models: dict[str, nn.Module], plan: DevicePlan, prompts: list[list[int]], new_tokens: int,
           cfg: CompressConfig, bar: tqdm) -> dict[str, dict[str, Any]]:
    """Prefill seconds (batch 1) and decode tokens/s per batch: B * (N - 1) tokens over T(N) - T(1), as bench."""
    # One runner per model and batch size: each keeps its Generator (and compiled step) across the turns.
    runners = {(k, b): GptoptRunner(m, plan, len(prompts[0]) + new_tokens, compile=cfg.compile)
               for k, m in models.items() for b in DECODE_BATCHES}
    out: dict[str, dict[str, Any]] = {k: {"decode_tokens_per_s": {}} for k in models}
    for b in DECODE_BATCHES:
        batch = prompts[:b]
        fns: dict[str, Callable[[], object]] = {}
        for k in models:
            r = runners[k, b]
            fns[f"{k} 1"] = lambda r=r, p=batch: r.generate(p, 1)
            fns[f"{k} all"] = lambda r=r, p=batch: r.generate(p, new_tokens)
            if b == 1:
                fns[f"{k} prefill"] = lambda r=r: r.last_logits(prompts[0])
        t = interleaved(fns, plan, 1, cfg.repeats)
        for k in models:
            decode = t[f"{k} all"] - t[f"{k} 1"]
            decode = decode if decode > 0 else t[f"{k} all"]  # noise guard: never a negative time
            out[k]["decode_tokens_per_s"][str(b)] = b * (new_tokens - 1) / decode
            if b == 1:
                out[k]["prefill_s"] = t[f"{k} prefill"]
        for r in (runners[k, b] for k in models):
            r.gen = None  # this batch's caches go before the next batch's are allocated
        bar.update(2)
    return out


# ----------------------------------------------------------------------------------------------
# Checks of the input, all before anything is written


KIND = "compressed"  # the outputs mark of a compress output: the only kind its --overwrite replaces


def _check_output(out: Path, overwrite: bool) -> None:
    # A file, an unwritable folder, or one holding anything but an earlier compress output: refused here,
    # before any model is loaded.
    check_output(out, kind=KIND, overwrite=overwrite, whole=True, flag="--output_dir")


def _check_source(source: Path | str) -> None:
    if isinstance(source, Path) and checkpoint.is_gptopt_dir(source):
        meta = checkpoint.read_meta(source)
        if meta.get("compression"):
            raise UserError(f"--model {source} is already compressed ({describe(meta['compression'])}); compress "
                             f"the original instead: {meta.get('compressed_from', 'the model it was made from')}")


def _open_eval_data(cfg: CompressConfig, source: Path | str, tok: Tokenizer, model_vocab: int) -> TokenData:
    """--data_dir, else the data the model was trained on; refused unless the model's tokenizer wrote it."""
    trained_on = checkpoint.training_data(source) if isinstance(source, Path) else None
    data = open_data(cfg.data_dir or trained_on or DEFAULT_DATA)
    if data.tokenized_by(tok) is False:
        fix = f"--data_dir {trained_on}" if trained_on else "--data_dir <the data the model was trained on>"
        raise UserError(f"{data.directory} was tokenized by another tokenizer than the model's, so perplexity and "
                         f"KL would score the wrong tokens; pass {fix}, or prepare shards with the model's tokenizer: "
                         "gptopt prepare --tokenizer <its tokenizer.json, or gpt2> --output_dir DIR")
    data.check_vocab(model_vocab)  # nanoGPT data stores no tokenizer: its ids must at least fit
    return data


# ----------------------------------------------------------------------------------------------
# The run


def _prompts(data: TokenData, length: int, n: int) -> list[list[int]]:
    """n windows of `length` real tokens spread over the val split (train if val is too short)."""
    tokens = data.tokens("val")
    if len(tokens) < length + n:
        tokens = data.tokens("train")
    starts = torch.linspace(0, len(tokens) - length, n).long().tolist()
    return [tokens[s : s + length].astype("int64").tolist() for s in starts]


def _disk_bytes(source: Path | str, model: nn.Module) -> int:
    """The original's weight file; for a hub name or another layout, the fp32 payload gptopt would write."""
    if isinstance(source, Path) and (source / checkpoint.WEIGHTS).is_file():
        return (source / checkpoint.WEIGHTS).stat().st_size
    return sum(t.numel() * 4 for k, t in model.state_dict().items()
               if k != "lm_head.weight" or not model.config.tie_embeddings)


def measure(cfg: CompressConfig, plan: DevicePlan, data: TokenData, source: Path | str,
            directory: Path) -> dict[str, Any]:
    """Load the original and the compressed checkpoint as generate does, and measure both. The original runs in the
    compressed model's dtype (fp32 for quantised weights on a CPU, load.weights_dtype), so that the ratios are the
    compression's and not a dtype's."""
    runs_fp32 = weights_dtype("auto", plan, quantized=cfg.quantize != "none") == torch.float32
    dtype = "fp32" if runs_fp32 else "auto"
    original, _ = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=plan, dtype=dtype)
    compressed, _ = load_for_inference(str(directory), tokenizer=None, plan=plan)
    c = original.config
    prompt_len = min(c.block_size // 2, 128)
    new_tokens = min(256 if plan.device.type == "cuda" else 64, c.block_size - prompt_len)
    seq_len = min(c.block_size, data.num_tokens("val") - 1)
    batches = max(1, math.ceil(cfg.eval_tokens / (seq_len * EVAL_BATCH)))
    windows = BatchDataset(data, "val", EVAL_BATCH, seq_len, seed=0).eval_batches("val", batches)
    models = {"original": original, "compressed": compressed}
    with tqdm(total=2 * len(DECODE_BATCHES) + batches, desc="compress: measuring", file=sys.stderr,
              dynamic_ncols=True) as bar, recompile_limit_for(DECODE_GRAPHS):
        quality = perplexity_and_kl(original, compressed, windows, plan.device, on_batch=lambda: bar.update(1))
        speed = _speed(models, plan, _prompts(data, prompt_len, max(DECODE_BATCHES)), new_tokens, cfg, bar)
    sizes = {"original": (_disk_bytes(source, original), memory_bytes(original)),
             "compressed": ((directory / checkpoint.WEIGHTS).stat().st_size, memory_bytes(compressed))}
    per_token = bytes_per_token(data, "val")  # None for nanoGPT data: no tokenizer to count bytes with
    res: dict[str, Any] = {"prompt_len": prompt_len, "new_tokens": new_tokens,
                           "eval": {"split": "val", "data_dir": str(data.directory.resolve()),
                                    "tokens": quality["tokens"], "window": seq_len, "bytes_per_token": per_token},
                           "dtype": str(original.transformer.wte.weight.dtype).removeprefix("torch.")}
    for name in models:
        res[name] = {"disk_bytes": sizes[name][0], "memory_bytes": sizes[name][1], **speed[name]}
    res["original"]["perplexity"] = quality["perplexity_reference"]
    res["compressed"]["perplexity"], res["compressed"]["kl_divergence"] = quality["perplexity"], quality["kl"]
    for name in models:
        res[name]["bits_per_byte"] = bits_per_byte(math.log(res[name]["perplexity"]), per_token)
    return res


def _ratios(res: dict[str, Any]) -> dict[str, float]:
    o, c = res["original"], res["compressed"]
    out = {k: c[f"{k}_bytes"] / o[f"{k}_bytes"] for k in ("disk", "memory")}
    out["prefill"] = c["prefill_s"] / o["prefill_s"]
    for b in DECODE_BATCHES:
        out[f"decode_{b}"] = c["decode_tokens_per_s"][str(b)] / o["decode_tokens_per_s"][str(b)]
    out["perplexity_increase"] = c["perplexity"] / o["perplexity"] - 1
    return out


def _notes(record: dict[str, Any], ratios: dict[str, float], plan: DevicePlan) -> list[str]:
    """What a user must not miss, said plainly: above all, where a method buys no speed here."""
    notes = []
    if isinstance(record.get("prune"), float):
        notes.append("unstructured pruning brings no speed or memory gain on any device: the zeros run through the "
                     "same dense kernels (PyTorch has no fast kernel for scattered zeros), and safetensors stores them"
                     + ("" if record.get("quantize") else "; add --quantize to shrink the model"))
    for b in DECODE_BATCHES:
        if ratios[f"decode_{b}"] < NO_GAIN:
            notes.append(f"no decode speed-up at batch {b} on {plan.device}: {ratios[f'decode_{b}']:.2f}x the "
                         "original's tokens/s")
    if ratios["prefill"] > 1 / NO_GAIN:
        notes.append(f"no prefill speed-up on {plan.device}: {ratios['prefill']:.2f}x the original's latency")
    return notes


def _size(n: int) -> str:
    return next(f"{n / d:,.1f} {u}" for d, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B")) if n >= d or d == 1)


def table(results: dict[str, Any]) -> str:
    """The report for the terminal: one row per measure, original against compressed."""
    o, c, r = results["original"], results["compressed"], results["ratios"]
    rows = [["size on disk", _size(o["disk_bytes"]), _size(c["disk_bytes"]), f"{r['disk']:.2f}x"],
            ["weights in memory", _size(o["memory_bytes"]), _size(c["memory_bytes"]), f"{r['memory']:.2f}x"],
            [f"prefill, {results['prompt_len']} tokens (ms)", f"{o['prefill_s'] * 1e3:,.1f}",
             f"{c['prefill_s'] * 1e3:,.1f}", f"{r['prefill']:.2f}x"]]
    rows += [[f"decode tokens/s, batch {b}", f"{o['decode_tokens_per_s'][str(b)]:,.0f}",
              f"{c['decode_tokens_per_s'][str(b)]:,.0f}", f"{r[f'decode_{b}']:.2f}x"] for b in DECODE_BATCHES]
    rows += [[f"perplexity (val, {results['eval']['tokens']:,} tokens)", f"{o['perplexity']:.3f}",
              f"{c['perplexity']:.3f}", f"{r['perplexity_increase']:+.2%}"],
             ["mean KL from the original (nats)", "0", f"{c['kl_divergence']:.5f}", ""]]
    if o.get("bits_per_byte") is not None:  # the data's tokenizer counts the bytes; nanoGPT data has none
        rows.insert(-1, ["bits per byte (val)", f"{o['bits_per_byte']:.4f}", f"{c['bits_per_byte']:.4f}",
                         f"{c['bits_per_byte'] - o['bits_per_byte']:+.4f}"])
    title = (f"gptopt compress: {results['method']} of {results['model']} on {results['device']} "
             f"({results['dtype']} original, {'compiled' if results['compile'] else 'eager'} decode; "
             f"{results['new_tokens']} new tokens, greedy; medians of {results['repeats']})")
    notes = [f"  note: {n}" for n in results["notes"]]
    return "\n".join([title, text_table(["", "original", "compressed", "change"], rows), *notes])


def main(cfg: CompressConfig) -> int:
    assert cfg.output_dir is not None  # CompressConfig refuses a missing --output_dir
    out = Path(cfg.output_dir).expanduser()
    with lock_output(out, flag="--output_dir", whole=True):  # one writer, from the checks to the publish
        return _compress(cfg, out)


def _compress(cfg: CompressConfig, out: Path) -> int:
    _check_output(out, cfg.overwrite)
    plan = resolve(cfg.device, quiet=True)
    process.set_matmul_precision(plan)
    quantize, prune = (None if cfg.quantize == "none" else cfg.quantize), parse_prune(cfg.prune)
    check_supported(quantize, prune, plan)
    source = model_source(cfg.model)
    _check_source(source)
    # Compressed from fp32 on the CPU: the same integers whichever device runs the report.
    model, tok = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=resolve("cpu", quiet=True), dtype="fp32",
                                    layout=False)
    data = _open_eval_data(cfg, source, tok, model.config.vocab_size)
    record = compress_model(model, quantize, prune)
    # Without --overwrite, an --output_dir that something else filled meanwhile makes the publish fail: it is
    # never replaced. With it, the earlier output stays until the new one is complete.
    with staged_dir(out, replace=cfg.overwrite, kind=KIND) as tmp:
        meta = {"compression": record, "compressed_from": str(source), "environment": environment(plan)}
        checkpoint.write_model_files(model.config, pack_state(model, record), tmp, meta)
        tok.save(str(tmp / TOKENIZER))  # beside the weights: generate and serve find it there
        del model
        log.info("compress: %s written; measuring it against %s on %s", describe(record), source, plan.device)
        results = {"model": str(source), "output_dir": str(out), "method": describe(record), "compression": record,
                   "device": str(plan.device), "device_policy": plan.reason, "compile": cfg.compile,
                   "repeats": cfg.repeats, **measure(cfg, plan, data, source, tmp)}
        results["ratios"] = _ratios(results)
        results["notes"] = _notes(record, results["ratios"], plan)
        results["environment"] = environment(plan)
        (tmp / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))
    print(f"\ncheckpoint: {out} (gptopt generate --model {out}); report: {out / 'results.json'}")
    if cfg.json:
        print(to_json(results))
    return 0
