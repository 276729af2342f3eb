"""gptopt eval: a model's accuracy on a multiple-choice benchmark (HellaSwag), scored completion-style, or its
bits per byte on held-out text.

    gptopt eval --model out --data hellaswag_val.jsonl --limit 500
    gptopt eval --model gpt2 --json          # online: HellaSwag's val set is downloaded once
    gptopt eval --model out --task bpb --data held_out.txt

Each example is a context and 4 endings, one of them right (HellaSwag's published jsonl: ctx, or
ctx_a + ctx_b; endings; label). Each ending is scored by the log-likelihood the model gives its tokens
after the context's, the ending written after a space (as llm.c renders HellaSwag; the context is
cut from the left where context and ending outgrow the model's context window):

  acc       the ending with the highest summed log-likelihood is the model's choice
  acc_norm  the ending with the highest log-likelihood per byte of its text (UTF-8, without the space)

acc is llm.c's (dev/data/hellaswag.py). acc_norm is lm-eval's length normalisation (it divides by the
ending's characters: the same as its bytes for HellaSwag's ASCII text), not llm.c's, which divides by the
ending's token count: per byte, a tokenizer that cuts text into fewer tokens gains nothing. lm-eval's own
scores also rewrite the context (the activity label first), which this does not; the published GPT-2
scores of each way are in docs/commands.md (eval).

The examples are read and checked before the model loads: a bad line is one error naming its number.

The bpb task scores held-out text (--data): a data dir from `gptopt prepare` (its val split, whose bytes
bpb.py counts by decoding it with the data's tokenizer, which must be the model's), or a text file or a
folder of them, tokenized here with the model's tokenizer, each file a document after an end-of-text
token, its UTF-8 bytes counted. Without --data it is the val split of the data the model was trained on.
The tokens go through the model in windows of its context that do not overlap, every token after the
first predicted once: bits/byte = summed loss / ln 2 / bytes (bpb.bits_per_byte), end-of-text tokens
counting no bytes. Any family and tokenizer: the unit does not depend on how the text was cut.

The chat task scores a fine-tuned chat model on held-out conversations (--data, a .jsonl as `gptopt prepare`
reads conversations): each line's last assistant message is the answer, the model's greedy reply to everything
before it (rendered with its chat template) is its answer, and exact_match is the share that equal the answer,
whitespace around either left out.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from gptopt.config import EvalConfig
from gptopt.data.bpb import bits_per_byte, bytes_per_token
from gptopt.data.loader import META, TokenData
from gptopt.data.tokenizer import eot_id
from gptopt.infer import chat
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference, model_source
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.outputs import check_output, lock_output, staged_dir, staged_file
from gptopt.runtime import process
from gptopt.runtime.device import DevicePlan, environment, resolve
from gptopt.train import chat_data
from gptopt.utils.errors import UserError
from gptopt.utils.tables import text_table, to_json

__all__ = ["HELLASWAG_URL", "Example", "HeldOut", "bits_per_byte_of", "cache_dir", "encode", "ending_logliks",
           "evaluate", "hellaswag_file", "main", "read_held_out", "read_hellaswag", "score"]

log = logging.getLogger("gptopt")

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DOWNLOAD_TIMEOUT = 60.0  # seconds the server may stay silent before the download counts as failed
ENDINGS = 4  # HellaSwag's: every example has exactly 4
KIND = "eval"  # the outputs mark of an eval output: the only kind its --overwrite replaces
FORMAT_HINT = 'each line must be one HellaSwag example: {"ctx": "...", "endings": [4 strings], "label": 0-3}'


@dataclass(frozen=True)
class Example:
    line: int  # in the file, from 1: what an error about it names
    context: str
    endings: tuple[str, ...]
    label: int


# ----------------------------------------------------------------------------------------------
# The examples


def cache_dir() -> Path:
    """Where downloaded benchmark files are kept: $XDG_CACHE_HOME/gptopt, else ~/.cache/gptopt."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "gptopt"


def hellaswag_file() -> Path:
    """HellaSwag's val set: the cached copy, else downloaded from its GitHub repository (online only)."""
    target = cache_dir() / "hellaswag" / "hellaswag_val.jsonl"
    if target.is_file():
        return target
    fix = ("; offline, pass --data FILE.jsonl: a copy of hellaswag_val.jsonl (from github.com/rowanz/hellaswag) or "
           "any file in its format")
    try:
        response = urlopen(HELLASWAG_URL, timeout=DOWNLOAD_TIMEOUT)
    except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
        raise UserError(f"could not download HellaSwag from {HELLASWAG_URL} ({_reason(e)}){fix}") from None
    log.info("downloading HellaSwag's val set from %s into %s (once)", HELLASWAG_URL, target)
    # Written beside and renamed: a download that breaks off leaves no half file to be read as the val set.
    with response, staged_file(target) as tmp, open(tmp, "wb") as fh:
        try:
            shutil.copyfileobj(response, fh)
        except (URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
            raise UserError(f"the download of HellaSwag from {HELLASWAG_URL} broke off ({_reason(e)}){fix}") from None
    return target


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or e
    return str(reason).splitlines()[0] if str(reason) else type(reason).__name__


def read_hellaswag(path: Path, limit: int | None = None, *, name: str = "--data") -> list[Example]:
    """The first `limit` examples of a HellaSwag jsonl (blank lines skipped), each checked: a line that is
    not an example is a ValueError naming `name`, the file and the line number."""
    where = f"{name} {path}"
    try:
        fh = open(path, "rb")  # bytes: a line that is not UTF-8 is named by its number, as any other bad line
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; give HellaSwag's hellaswag_val.jsonl or a file in its format "
                         "(or leave --data out to download it)") from None
    except IsADirectoryError:
        raise UserError(f"{where} is a folder; give the .jsonl file in it") from None
    examples: list[Example] = []
    with fh:
        for n, raw in enumerate(fh, 1):
            if limit is not None and len(examples) >= limit:
                break
            if raw.strip():
                examples.append(_example(raw, n, where))
    if not examples:
        raise UserError(f"{where} holds no examples; {FORMAT_HINT}")
    return examples


def _example(raw: bytes, n: int, where: str) -> Example:
    def bad(what: str) -> UserError:
        return UserError(f"{where} line {n}: {what}; {FORMAT_HINT}")

    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise bad("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    context = obj.get("ctx")
    if context is None and isinstance(obj.get("ctx_a"), str):
        # HellaSwag's ctx is ctx_a, then a space and ctx_b where ctx_b is not empty
        b = obj.get("ctx_b") or ""
        context = obj["ctx_a"] + (" " + b if isinstance(b, str) and b else "")
    if not isinstance(context, str):
        raise bad("no context: give ctx (or ctx_a and ctx_b) as a string")
    endings = obj.get("endings")
    if not isinstance(endings, list) or not all(isinstance(e, str) for e in endings):
        raise bad(f"endings must be a list of {ENDINGS} strings, got {json.dumps(endings)[:60]}")
    if len(endings) != ENDINGS:
        raise bad(f"{len(endings)} endings; HellaSwag has {ENDINGS} per example")
    for i, e in enumerate(endings):
        if not e.strip():
            raise bad(f"ending {i} is empty")  # it has no bytes to normalise by, and nothing to score
    for text in (context, *endings):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a \udXXX escape: no text a tokenizer takes
            raise bad("a lone surrogate (\\udXXX) in the text") from None
    label = obj.get("label")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)  # HellaSwag's files write the label as a number, some copies as a string
    if label is None or label == "":
        raise bad("no label (HellaSwag's test set has none: use the val set)")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < ENDINGS:
        raise bad(f"label {label!r} is out of range: give the index of the right ending, 0 to {ENDINGS - 1}")
    return Example(line=n, context=context, endings=tuple(endings), label=label)


# ----------------------------------------------------------------------------------------------
# Scoring


def encode(tok: Tokenizer, ex: Example, eot: int | None, block_size: int,
           where: str) -> list[tuple[list[int], list[int]]]:
    """(context tokens, ending tokens) per ending: context and " " + ending encoded apart, as llm.c does."""
    context = tok.encode(ex.context).ids
    if not context:  # the first ending token needs something to follow: a fresh document (as lm-eval)
        if eot is None:
            raise UserError(f"{where} line {ex.line}: the context is empty and the tokenizer has no end-of-text "
                             "token to start from; give the example a context")
        context = [eot]
    rows = []
    for i, ending in enumerate(ex.endings):
        ids = tok.encode(" " + ending).ids
        if len(ids) > block_size:
            raise UserError(f"{where} line {ex.line}: ending {i} is {len(ids)} tokens, longer than the model's "
                             f"context of {block_size}; score it with a model of a longer context, or drop the line")
        rows.append((context, ids))
    return rows


@torch.no_grad()
def ending_logliks(model: GPT, rows: Sequence[tuple[list[int], list[int]]], device: torch.device) -> list[float]:
    """The summed log-likelihood of each row's ending tokens after its context tokens, all rows in one
    forward (right-padded: causal attention keeps the padding out of every scored position).

    A row longer than the model's context window keeps its ending whole and loses the start of its context."""
    window = model.config.block_size + 1  # inputs are a sequence less its last token
    seqs = [(ctx + end)[-window:] for ctx, end in rows]
    T = max(map(len, seqs)) - 1
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.full((len(seqs), T), -100, dtype=torch.long)  # -100: not scored (context, padding)
    for i, (seq, (_, end)) in enumerate(zip(seqs, rows, strict=True)):
        x[i, : len(seq) - 1] = torch.tensor(seq[:-1])
        first = len(seq) - len(end)  # the position of the ending's first token in seq
        y[i, first - 1 : len(seq) - 1] = torch.tensor(end)  # position t predicts token t + 1
    logits = model(x.to(device)).float()  # (B, T, V)
    nll = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), ignore_index=-100, reduction="none")
    return (-nll.view(len(seqs), T).sum(1)).tolist()


def score(logliks: Sequence[float], ending_bytes: Sequence[int]) -> tuple[int, int]:
    """(the choice by summed log-likelihood, the choice by log-likelihood per byte); ties go to the first."""
    n = range(len(logliks))
    return max(n, key=lambda i: logliks[i]), max(n, key=lambda i: logliks[i] / ending_bytes[i])


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def evaluate(model: GPT, tok: Tokenizer, examples: Sequence[Example], plan: DevicePlan, batch_size: int,
             where: str) -> dict[str, Any]:
    """acc and acc_norm of the model on the examples, batch_size examples (ENDINGS rows each) per forward."""
    eot = eot_id(tok)
    block = model.config.block_size
    encoded = [encode(tok, ex, eot, block, where) for ex in examples]  # every line checked before the first forward
    truncated = sum(len(c) + len(e) > block + 1 for rows in encoded for c, e in rows)
    correct = correct_norm = 0
    with tqdm(total=len(examples), desc="eval: hellaswag", unit="example", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for batch in _batches(list(zip(examples, encoded, strict=True)), batch_size):
            lls = ending_logliks(model, [row for _, rows in batch for row in rows], plan.device)
            for k, (ex, _) in enumerate(batch):
                pred, pred_norm = score(lls[k * ENDINGS : (k + 1) * ENDINGS],
                                        [len(e.encode("utf-8")) for e in ex.endings])
                correct += pred == ex.label
                correct_norm += pred_norm == ex.label
            bar.update(len(batch))
    n = len(examples)
    return {"examples": n, "acc": correct / n, "acc_norm": correct_norm / n, "correct": correct,
            "correct_norm": correct_norm, "truncated_rows": truncated}


# ----------------------------------------------------------------------------------------------
# Bits per byte of held-out text


HELD_OUT_HINT = "give a text file, a folder of text files, or a data dir from gptopt prepare (its val split)"


@dataclass(frozen=True)
class HeldOut:
    """The bpb task's text: a prepared data dir (data), or the documents of a text file or folder (texts)."""
    path: Path
    data: TokenData | None
    texts: tuple[str, ...] = ()


def read_held_out(path: Path, where: str) -> HeldOut:
    """The held-out text at path, checked (a ValueError naming `where` and the fix) before any model loads."""
    if not path.exists():
        raise UserError(f"{where} {path}: no such file or folder; {HELD_OUT_HINT}")
    if path.is_dir() and ((path / META).is_file() or (path / "train.bin").is_file()):
        data = TokenData(path)
        if data.chat is not None:  # a fine-tuned model's default: its rows are conversations and padding
            raise UserError(f"{where} {path} holds conversations packed for fine-tuning, not text; give held-out "
                             "text with --data (a text file, a folder of them, or a text data dir), or score the "
                             "replies with --task chat")
        if data.tokenizer() is None:
            raise UserError(f"{where} {path} stores no tokenizer (nanoGPT's train.bin/val.bin), so its bytes cannot "
                             "be counted; give the text itself: a text file or a folder of text files")
        if data.num_tokens("val") < 2:
            raise UserError(f"{where} {path}: its val split is empty; prepare it with --val_fraction above 0, or "
                             "give a text file")
        return HeldOut(path, data)
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and not any(n.startswith(".") for n in p.relative_to(path).parts))
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{where} {f}: not UTF-8 text; convert it (e.g. iconv -t utf-8) or leave it out") from None
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"{where} {path} holds no text; {HELD_OUT_HINT}")
    return HeldOut(path, None, tuple(texts))


def _held_out_tokens(held: HeldOut, tok: Tokenizer, vocab_size: int, where: str) -> tuple[np.ndarray, float | None]:
    """The token stream to score (every token after the first is predicted) and its UTF-8 bytes per scored
    token (None where none can be counted)."""
    if held.data is not None:
        if held.data.tokenized_by(tok) is False:
            raise UserError(f"{where} {held.path} was tokenized by another tokenizer than the model's; give the text "
                             "itself (a text file or folder), or data prepared with the model's tokenizer: gptopt "
                             "prepare --tokenizer <its tokenizer.json> --output_dir DIR")
        held.data.check_vocab(vocab_size)
        return held.data.tokens("val"), bytes_per_token(held.data, "val")
    tok.encode_special_tokens = True  # text that spells a special token is that text, as prepare reads it
    encoded = tok.encode_batch(list(held.texts), add_special_tokens=False)
    eot, nbytes = eot_id(tok), sum(len(t.encode("utf-8")) for t in held.texts)
    if eot is None:  # nothing to start from: the first token is context only, and its text counts no bytes
        first = encoded[0].offsets[1][0] if len(encoded[0].ids) > 1 else len(held.texts[0])
        nbytes -= len(held.texts[0][:first].encode("utf-8"))
    stream = np.array([t for e in encoded for t in ([] if eot is None else [eot]) + e.ids], dtype=np.int64)
    if len(stream) < 2:
        raise UserError(f"{where} {held.path}: too little text to score (one token); {HELD_OUT_HINT}")
    return stream, nbytes / (len(stream) - 1)


@torch.no_grad()
def bits_per_byte_of(model: GPT, stream: np.ndarray, per_token: float | None, plan: DevicePlan, batch_size: int,
                     limit: int | None = None) -> dict[str, Any]:
    """The summed loss of every token of `stream` after its first, in windows of the model's context that do not
    overlap (batch_size per forward; the first `limit` windows only), as loss (nats/token) and bits per byte."""
    T = model.config.block_size
    starts = list(range(0, len(stream) - 1, T))[:limit]
    nll, tokens = 0.0, 0
    with tqdm(total=len(starts), desc="eval: bpb", unit="window", file=sys.stderr, dynamic_ncols=True) as bar:
        for batch in _batches(starts, batch_size):
            x = torch.zeros(len(batch), T, dtype=torch.long)
            y = torch.full((len(batch), T), -100, dtype=torch.long)  # -100: padding of the last window
            for i, s in enumerate(batch):
                window = torch.from_numpy(np.asarray(stream[s : s + T + 1], dtype=np.int64))
                x[i, : len(window) - 1], y[i, : len(window) - 1] = window[:-1], window[1:]
            logits = model(x.to(plan.device)).float()  # (B, T, V)
            nll += F.cross_entropy(logits.flatten(0, 1), y.to(plan.device).flatten(), ignore_index=-100,
                                   reduction="sum").item()
            tokens += int((y != -100).sum())
            bar.update(len(batch))
    loss = nll / tokens
    return {"bits_per_byte": bits_per_byte(loss, per_token), "loss": loss, "tokens": tokens,
            "bytes": None if per_token is None else round(per_token * tokens), "windows": len(starts), "window": T}


# ----------------------------------------------------------------------------------------------
# The command


def table(results: dict[str, Any]) -> str:
    if results["task"] == "bpb":
        return bpb_table(results)
    if results["task"] == "chat":
        return chat_table(results)
    n = results["examples"]
    rows = [["acc", f"{results['acc']:.4f}", f"{results['correct']}/{n}"],
            ["acc_norm", f"{results['acc_norm']:.4f}", f"{results['correct_norm']}/{n}"]]
    title = (f"gptopt eval: {results['task']}, {n:,} examples of {results['data']}, {results['model']} on "
             f"{results['device']} ({results['dtype']})")
    note = ("  acc: the ending of highest log-likelihood; acc_norm: of highest log-likelihood per byte of the "
            "ending (lm-eval's normalisation; llm.c divides by tokens)")
    return "\n".join([title, text_table(["", "score", "correct"], rows), note])


def bpb_table(results: dict[str, Any]) -> str:
    bpb = results["bits_per_byte"]
    nbytes = results["bytes"]
    rows = [["bits per byte", "n/a" if bpb is None else f"{bpb:.4f}"], ["loss (nats/token)", f"{results['loss']:.4f}"],
            ["tokens", f"{results['tokens']:,}"], ["bytes", "n/a" if nbytes is None else f"{nbytes:,}"]]
    title = (f"gptopt eval: bpb, {results['data']}, {results['model']} on {results['device']} ({results['dtype']})")
    note = (f"  {results['windows']:,} windows of the model's context ({results['window']} tokens), not overlapping; "
            f"bytes: {results['bytes_from']}")
    return "\n".join([title, text_table(["", "value"], rows), note])


def main(cfg: EvalConfig) -> int:
    out = Path(cfg.output_dir).expanduser() if cfg.output_dir else None
    with lock_output(out, flag="--output_dir", whole=True) if out is not None else contextlib.nullcontext():
        return _evaluate(cfg, out)


def _evaluate(cfg: EvalConfig, out: Path | None) -> int:
    if out is not None:  # refused before the download or the model: nothing read or written
        check_output(out, kind=KIND, overwrite=cfg.overwrite, whole=True, flag="--output_dir")
    if cfg.task == "bpb":
        return _bits_per_byte(cfg, out)
    if cfg.task == "chat":
        return _chat(cfg, out)
    if cfg.data:
        path, where = Path(cfg.data).expanduser(), "--data"
    else:
        path, where = hellaswag_file(), "the downloaded HellaSwag file"
    examples = read_hellaswag(path, cfg.limit, name=where)
    plan = resolve(cfg.device, quiet=True)
    process.set_matmul_precision(plan)
    model, tok = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=plan, dtype=cfg.dtype)
    scores = evaluate(model, tok, examples, plan, cfg.batch_size, f"{where} {path}")
    results = {"task": cfg.task, "model": str(model_source(cfg.model)), "data": str(path.resolve()),
               **scores, "acc_norm_by": "log-likelihood per UTF-8 byte of the ending (lm-eval's normalisation)",
               "device": str(plan.device), "dtype": str(model.transformer.wte.weight.dtype).removeprefix("torch."),
               "environment": environment(plan)}
    return _report(cfg, out, results)


def _bits_per_byte(cfg: EvalConfig, out: Path | None) -> int:
    source = model_source(cfg.model)
    trained_on = checkpoint.training_data(source) if isinstance(source, Path) else None
    if cfg.data:
        path, where = Path(cfg.data).expanduser(), "--data"
    elif trained_on:
        path, where = Path(trained_on), "the data the model was trained on"
    else:
        raise UserError(f"the bpb task needs held-out text and {source} records no training data: pass --data, a "
                         "text file, a folder of text files or a data dir from gptopt prepare (its val split)")
    held = read_held_out(path, where)  # before the model loads
    plan = resolve(cfg.device, quiet=True)
    process.set_matmul_precision(plan)
    model, tok = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=plan, dtype=cfg.dtype)
    stream, per_token = _held_out_tokens(held, tok, model.config.vocab_size, where)
    scores = bits_per_byte_of(model, stream, per_token, plan, cfg.batch_size, cfg.limit)
    bytes_from = ("the val split decoded with the data's tokenizer (bpb.py)" if held.data is not None
                  else "the text's UTF-8 bytes")
    results = {"task": cfg.task, "model": str(source), "data": str(path.resolve()), **scores, "bytes_from": bytes_from,
               "device": str(plan.device), "dtype": str(model.transformer.wte.weight.dtype).removeprefix("torch."),
               "environment": environment(plan)}
    return _report(cfg, out, results)


def read_chat_answers(path: Path, limit: int | None) -> list[tuple[str, list[dict[str, str]], str]]:
    """(where, the prompt's messages, the answer) of each held-out conversation of a .jsonl ({messages} or
    {prompt, completion} lines): the answer is the last assistant message, the prompt everything before it. Read
    and checked before the model loads; a bad line is one error naming it."""
    reading = chat_data.detect(path)
    if reading is None:
        raise UserError(f"--data {path}: not a .jsonl of conversations; each line must be {{\"messages\": [...]}} or "
                         "{\"prompt\": ..., \"completion\": ...}")
    out = []
    for where, messages in chat_data.read_lines(path, reading):
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append((where, messages[:last], messages[last]["content"]))
        if limit is not None and len(out) >= limit:
            break
    return out


def chat_accuracy(model: GPT, tok: Tokenizer, template: chat.ChatTemplate, ends: Sequence[int],
                  examples: Sequence[tuple[str, list[dict[str, str]], str]], plan: DevicePlan,
                  batch_size: int) -> dict[str, Any]:
    """Exact-match accuracy of greedy replies (the model's template, its end-of-turn tokens ending a reply; both
    sides' surrounding whitespace left out), batched through the Generator; the first wrong replies, to read."""
    block = model.config.block_size
    gen = Generator(model, plan, max_batch_size=batch_size, max_len=block)
    correct, too_long, wrong = 0, 0, []
    for batch in tqdm(list(_batches(examples, batch_size)), desc="chat", unit="batch", file=sys.stderr):
        prompts, answers = [], []
        for where, messages, answer in batch:
            ids = template.encode(tok, template.render(messages))
            if len(ids) >= block:
                too_long += 1
                continue
            prompts.append(ids)
            answers.append((where, answer))
        if not prompts:
            continue
        room = block - max(len(p) for p in prompts)
        new = min(room, max(len(tok.encode(a).ids) for _, a in answers) + CHAT_SLACK)
        params = SamplingParams(max_new_tokens=new, temperature=0.0, stop_token_ids=tuple(ends))
        with plan.autocast():
            replies = generate(gen, prompts, params)
        for (where, answer), ids in zip(answers, replies, strict=True):
            reply = tok.decode(ids)
            if reply.strip() == answer.strip():
                correct += 1
            elif len(wrong) < SHOWN_WRONG:
                wrong.append({"where": where, "answer": answer, "reply": reply})
    n = len(examples)
    return {"examples": n, "correct": correct, "exact_match": correct / n if n else 0.0, "too_long": too_long,
            "wrong": wrong}


CHAT_SLACK = 16  # new tokens past the longest answer of a batch: room to be wrong at length, and to end the turn
SHOWN_WRONG = 5  # wrong replies the results keep, to read


def _chat(cfg: EvalConfig, out: Path | None) -> int:
    if not cfg.data:
        raise UserError("the chat task scores held-out conversations: pass --data FILE.jsonl, whose last assistant "
                         "turn in each line is the answer")
    path = Path(cfg.data).expanduser()
    examples = read_chat_answers(path, cfg.limit)  # before the model loads
    folders = chat.template_folders(cfg.model, cfg.tokenizer)
    template = chat.load_template(None, folders)
    if template is None:
        raise UserError(chat.no_template(folders))
    plan = resolve(cfg.device, quiet=True)
    process.set_matmul_precision(plan)
    model, tok = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=plan, dtype=cfg.dtype)
    template = chat.load_template(None, folders, tok)
    assert template is not None
    scores = chat_accuracy(model, tok, template, chat.end_token_ids(folders, tok), examples, plan, cfg.batch_size)
    results = {"task": cfg.task, "model": str(model_source(cfg.model)), "data": str(path.resolve()),
               "template": template.source, **scores, "device": str(plan.device),
               "dtype": str(model.transformer.wte.weight.dtype).removeprefix("torch."),
               "environment": environment(plan)}
    return _report(cfg, out, results)


def chat_table(results: dict[str, Any]) -> str:
    n = results["examples"]
    rows = [["exact match", f"{results['exact_match']:.4f}", f"{results['correct']}/{n}"]]
    title = (f"gptopt eval: chat, {n:,} conversations of {results['data']}, {results['model']} on "
             f"{results['device']} ({results['dtype']})")
    lines = [title, text_table(["", "score", "correct"], rows),
             "  the greedy reply to each conversation up to its last assistant turn, against that turn (whitespace "
             "around either left out)"]
    if results["too_long"]:
        lines.append(f"  {results['too_long']} prompts do not fit the model's context: counted wrong")
    lines += [f"  wrong at {w['where']}: {w['reply']!r} (answer {w['answer']!r})" for w in results["wrong"]]
    return "\n".join(lines)


def _report(cfg: EvalConfig, out: Path | None, results: dict[str, Any]) -> int:
    if out is not None:
        with staged_dir(out, replace=cfg.overwrite, kind=KIND) as tmp:
            (tmp / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))
    if out is not None:
        print(f"\nreport: {out / 'results.json'}")
    if cfg.json:
        print(to_json(results))
    return 0
