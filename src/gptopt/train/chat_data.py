"""Conversations -> packed token rows with a loss mask: the data of supervised fine-tuning, which `gptopt prepare`
writes when its --input holds conversations (commands/prepare.py), and `gptopt train` reads (data/loader.py).

    gptopt prepare --input chats.jsonl --tokenizer runs/base --output_dir data/chat --seq_len 512

A line of the JSONL is one conversation, in either of the forms fine-tuning tools take:

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   one turn or many
    {"prompt": "..." | [messages], "completion": "..." | [messages]}               a user turn and the reply

Each is rendered with the model's chat template (infer.chat: a Hugging Face folder's own; for a tokenizer gptopt
trained, DEFAULT_TEMPLATE, whose markers are added to the tokenizer as special tokens) and tokenized. The loss
covers the assistant's content and the end-of-turn token after it, nothing else: not the system or user text, not
the template's role headers. Conversations are packed whole into rows of --seq_len tokens at prepare time (best
fit), each row's positions restarting at every conversation, so that a row is a pure function of the files and a
resumed run sees exactly its batches. A conversation longer than a row is refused with its line, or with
--overlong split cut into rows of its own; nothing is cut silently.

On disk, beside corpus.py's layout (meta.json's "chat" says the rows' shape and what was read):

    {split}.bin        token ids, rows x seq_len
    {split}.mask.bin   uint8, 1 where the token is a target the loss counts
    {split}.pos.bin    each token's position in its conversation (0 starts one); the rest of a row after its last
                       conversation is padding, a segment of its own that nothing attends to or learns from
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer
from tqdm import tqdm

from gptopt.config import PrepareConfig
from gptopt.data import corpus
from gptopt.data.loader import TokenData
from gptopt.data.tokenizer import TOKENIZER, eot_id, tokenizer_digest
from gptopt.infer import chat
from gptopt.infer.load import find_tokenizer, model_source
from gptopt.models.hf_files import GENERATION_CONFIG, TEMPLATE_FILE, TOKENIZER_CONFIG, chat_files
from gptopt.outputs import check_output, lock_output, staged_files
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")

READINGS = ("messages", "prompt_completion")  # the two forms of a conversation line


@dataclass
class Conversation:
    """One line's conversation, tokenized: ids and, per token, whether the loss counts it."""

    ids: list[int]
    mask: list[int]


@dataclass
class Packed:
    """A split's rows: token ids, mask and positions, each rows x seq_len."""

    ids: np.ndarray
    mask: np.ndarray
    pos: np.ndarray
    conversations: int = 0
    pieces: int = 0  # rows of --overlong split conversations beyond their first
    counts: dict[str, int] = field(default_factory=dict)


def detect(path: Path) -> str | None:
    """What a .jsonl (or a folder of them) holds, by its first line: "messages", "prompt_completion", or None
    (text, or anything else: corpus.py's reading)."""
    files = _files(path)
    for f in files[:1]:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    first = json.loads(line)
                except ValueError:
                    return None
                if isinstance(first, dict) and "messages" in first:
                    return "messages"
                if isinstance(first, dict) and "prompt" in first and "completion" in first:
                    return "prompt_completion"
                return None
    return None


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*" + corpus.JSONL) if p.is_file())
    return [path] if path.is_file() and path.suffix == corpus.JSONL else []


def read_lines(path: Path, reading: str) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(where: 'FILE:LINE', the checked messages) of every conversation; a bad line is a UserError naming it and
    what is wrong, before anything is written."""
    files = _files(path)
    if not files:
        raise UserError(f"--input {path}: no .jsonl file of conversations; give a .jsonl file or a folder of them")
    for f in files:
        with open(f, "rb") as fh:  # decoded line by line: a bad byte is told with its line
            for n, raw in enumerate(fh, 1):
                where = f"{f}:{n}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(f"{where}: not UTF-8 text ({e.reason}); fix the file's encoding") from None
                if not line.strip():
                    continue
                try:
                    messages = conversation(json.loads(line), reading)
                except ValueError as e:  # json's errors and UserError (a ValueError) alike
                    what = e if isinstance(e, UserError) else f"not JSON ({e})"
                    raise UserError(f"{where}: {what}; fix or remove the line") from None
                yield where, messages


def conversation(row: Any, reading: str) -> list[dict[str, str]]:
    """A line's messages, checked as a chat request's are (chat.check_messages), with one assistant turn at least."""
    if not isinstance(row, dict):
        raise UserError(f"expected a JSON object, got {type(row).__name__}")
    if reading == "messages":
        if "messages" not in row:
            raise UserError("no \"messages\" (every line of this file is read as {\"messages\": [...]})")
        messages = chat.check_messages(row["messages"])
    else:
        if "prompt" not in row or "completion" not in row:
            raise UserError("expected \"prompt\" and \"completion\" (every line of this file is read as such a pair)")
        messages = _side(row["prompt"], "user", "prompt") + _side(row["completion"], "assistant", "completion")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError("no assistant message: nothing to learn from it")
    return messages


def _side(value: Any, role: str, name: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return chat.check_messages(value)
    raise UserError(f"\"{name}\" must be a string or a list of messages, got {type(value).__name__}")


def spans(template: chat.ChatTemplate, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """The character spans of `text` (the whole conversation rendered) that the loss covers: each assistant turn's
    content and the end-of-turn token after it (the template's eos_token), not the newline a template may write
    after that token. A turn is looked for after the prompt that precedes it (the conversation up to it, rendered
    with the opening of a reply) where that prompt starts the text, else after the turn before: a template that
    renders earlier turns otherwise once later ones follow (Qwen3's) is still read right."""
    out: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], generation_prompt=True) if i else ""
        start = max(cursor, len(before) if text.startswith(before) else cursor)
        at = text.find(m["content"], start)
        if at < 0:
            raise UserError(f"the chat template ({template.kind}) does not write assistant message {i} as it is")
        end = at + len(m["content"])
        eos = template.eos_token
        if eos and (k := text.find(eos, end)) >= 0 and not text[end:k].strip():
            end = k + len(eos)  # the turn's end-of-turn token, where the template writes it right after the content
        out.append((at, end))
        cursor = end
    return out


def tokenize(template: chat.ChatTemplate, tokenizer: Tokenizer, messages: list[dict[str, str]]) -> Conversation:
    """The conversation's token ids and its loss mask: 1 on each token that overlaps an assistant span (spans)."""
    text = template.render(messages, generation_prompt=False)
    enc = tokenizer.encode(text, add_special_tokens=template.add_special_tokens)
    marks = spans(template, messages, text)
    starts = [s for s, _ in marks]
    mask = []
    for s, e in enc.offsets:
        j = bisect.bisect_right(starts, max(s, e - 1)) - 1  # the last span starting at or before the token's end
        mask.append(int(j >= 0 and e > marks[j][0] and s < marks[j][1]))
    return Conversation(list(enc.ids), mask)


# ----------------------------------------------------------------------------------------------
# Template and tokenizer


def resolve(option: str, chat_template: str | None) -> tuple[Tokenizer, chat.ChatTemplate, dict[str, bytes], dict]:
    """The tokenizer and template --tokenizer (a run folder, a checkpoint, or a Hugging Face folder, as --model
    elsewhere) and --chat_template give; the files the data folder keeps of them (the template and the model's
    special tokens, which training carries into its checkpoints); and what meta.json records. A model with no
    template of its own gets DEFAULT_TEMPLATE, its markers added to the tokenizer as special tokens."""
    if option in ("bpe", "gpt2"):
        raise UserError(f"--tokenizer {option}: conversations are tokenized with the tokenizer and chat template of "
                         "the model to fine-tune: give --tokenizer MODEL (a run folder, a checkpoint or a Hugging "
                         "Face folder)")
    source = model_source(option, "--tokenizer")
    tok = find_tokenizer(source, "--tokenizer")
    base = tokenizer_digest(tok)
    folders = chat.template_folders(option)
    template = None if chat_template == "default" else chat.load_template(chat_template, folders, tok)
    if template is None:  # asked for, or the model has none of its own (a named file that is missing was refused)
        template, files, added = _default(tok)
    else:
        if template.text is None:
            raise UserError("--chat_template plain has no end-of-turn token to learn; give a Jinja template, or "
                             "leave --chat_template out for the model's own (or gptopt's default)")
        files = {f.name: f.read_bytes() for f in chat_files(folders)}
        if chat_template is not None:
            files[TEMPLATE_FILE] = template.text.encode()
        added = []
    record = {"source": str(source), "template": template.source, "base_tokenizer": base, "added_tokens": added,
              "template_sha256": hashlib.sha256((template.text or "").encode()).hexdigest()[:16]}
    return tok, template, files, record


def _default(tok: Tokenizer) -> tuple[chat.ChatTemplate, dict[str, bytes], list[str]]:
    """DEFAULT_TEMPLATE over `tok`, its markers added as special tokens (ids after the vocabulary: train grows the
    model's embeddings to match), and the files that make every reader use it and stop at <|im_end|>."""
    markers = [chat.DEFAULT_START, chat.DEFAULT_END]
    added = [m for m in markers if tok.token_to_id(m) is None]
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in added])
    eot = chat.EOT if eot_id(tok) is not None else ""
    config = {**({"bos_token": eot} if eot else {}), "eos_token": chat.DEFAULT_END,
              "chat_template": chat.DEFAULT_TEMPLATE}
    # a reply ends at <|im_end|> or the end of text, in transformers' generate too (an export carries this file)
    ends = [i for i in (tok.token_to_id(chat.DEFAULT_END), eot_id(tok)) if i is not None]
    files = {TEMPLATE_FILE: chat.DEFAULT_TEMPLATE.encode(),
             TOKENIZER_CONFIG: (json.dumps(config, indent=2) + "\n").encode(),
             GENERATION_CONFIG: (json.dumps({"eos_token_id": ends}, indent=2) + "\n").encode()}
    template = chat.ChatTemplate("gptopt's default chat template (ChatML)", chat.DEFAULT_TEMPLATE,
                                 kind="the default chat template", bos_token=eot, eos_token=chat.DEFAULT_END)
    return template, files, added


# ----------------------------------------------------------------------------------------------
# Packing


def split_pieces(conv: Conversation, seq_len: int, overlong: str, where: str) -> list[Conversation]:
    """The conversation whole, or (--overlong split) cut into pieces of seq_len tokens; refused otherwise."""
    n = len(conv.ids)
    if n <= seq_len:
        return [conv]
    if overlong != "split":
        raise UserError(f"{where}: the conversation takes {n:,} tokens, more than a row's --seq_len {seq_len}; "
                         "give --overlong split to cut it into rows of its own, a larger --seq_len, or shorten it")
    return [Conversation(conv.ids[i:i + seq_len], conv.mask[i:i + seq_len]) for i in range(0, n, seq_len)]


def pack(convs: Sequence[Conversation], seq_len: int, pad_id: int, dtype: np.dtype) -> Packed:
    """Best-fit decreasing: each conversation, longest first, into the fullest row it still fits (a new row where
    none has room); ties in the files' order, so the rows are a pure function of the input."""
    order = sorted(range(len(convs)), key=lambda i: (-len(convs[i].ids), i))
    rows: list[list[int]] = []  # the conversations of each row
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = len(convs[i].ids)
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            rows.append([i])
            room, r = seq_len - n, len(rows) - 1
        else:
            room, r = free.pop(j)
            rows[r].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, r))
    ids = np.full((len(rows), seq_len), pad_id, dtype=dtype)
    mask = np.zeros((len(rows), seq_len), dtype=np.uint8)
    pos = np.zeros((len(rows), seq_len), dtype=position_dtype(seq_len))
    for r, members in enumerate(rows):
        at = 0
        for i in sorted(members):
            c = convs[i]
            ids[r, at:at + len(c.ids)] = c.ids
            mask[r, at:at + len(c.ids)] = c.mask
            pos[r, at:at + len(c.ids)] = np.arange(len(c.ids))
            at += len(c.ids)
        pos[r, at:] = np.arange(seq_len - at)  # the padding: a segment of its own
    return Packed(ids, mask, pos)


def position_dtype(seq_len: int) -> np.dtype:
    return np.dtype("<u2") if seq_len <= 1 << 16 else np.dtype("<u4")


def with_text(packed: Packed, config: PrepareConfig, base_digest: str) -> Packed:
    """The train rows and, appended, windows of --text_data's train split, every token a target, so that they
    make --text_share of the rows: what the model learns of the conversations' replies alone would otherwise pull
    all its predictions towards them, and its text is lost. Windows spread evenly over the split, one document
    segment each (as pretraining's windows run across documents): a pure function of the files."""
    text = TokenData(config.text_data or "")
    tok = text.tokenizer()
    if tok is None or tokenizer_digest(tok) != base_digest or text.chat is not None:
        raise UserError(f"--text_data {config.text_data}: not text tokenized with the model's tokenizer; prepare it "
                         f"with `gptopt prepare --input TEXT --tokenizer {config.tokenizer} --output_dir DIR`")
    L = config.seq_len
    tokens = text.tokens("train")
    n = round(len(packed.ids) * config.text_share / (1 - config.text_share))
    if len(tokens) < L or n == 0:
        raise UserError(f"--text_data {config.text_data}: its train split holds {len(tokens):,} tokens for {n} rows "
                         f"of {L}; give more text or a larger --text_share")
    starts = np.linspace(0, len(tokens) - L, num=n).astype(np.int64)
    ids = np.stack([np.asarray(tokens[s:s + L]) for s in starts]).astype(packed.ids.dtype)
    mask = np.ones_like(ids, dtype=np.uint8)
    mask[:, 0] = 0  # a row's first token has nothing before it to be predicted from
    pos = np.broadcast_to(np.arange(L, dtype=packed.pos.dtype), ids.shape)
    out = Packed(np.concatenate([packed.ids, ids]), np.concatenate([packed.mask, mask]),
                 np.concatenate([packed.pos, pos]), packed.conversations, packed.pieces, dict(packed.counts))
    out.counts.update(rows=len(out.ids), text_rows=n, tokens=packed.counts["tokens"] + ids.size,
                      supervised=int(out.mask.sum()))
    return out


# ----------------------------------------------------------------------------------------------
# prepare


def prepare_chat(config: PrepareConfig, reading: str) -> Path:
    """Conversations of config.input -> the chat data folder config.output_dir (the module's docstring): written
    beside it and moved in whole, meta.json last, under its one-writer lock; every line is checked first."""
    out = Path(config.output_dir).expanduser()
    with lock_output(out):
        corpus.check_input(config, out)
        old = check_output(out, kind=corpus.KIND, overwrite=config.overwrite, ours=corpus.OURS)
        tok, template, files, record = resolve(config.tokenizer, config.chat_template)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        dtype = corpus.token_dtype(vocab)
        pad = eot_id(tok)
        pad = pad if pad is not None else tok.token_to_id(chat.DEFAULT_END) or 0
        path = Path(config.input or "")
        convs: list[tuple[str, Conversation]] = []
        with tqdm(desc="conversations", unit=" conv", file=sys.stderr) as bar:
            for where, messages in read_lines(path, reading):
                try:
                    conv = tokenize(template, tok, messages)
                except UserError as e:
                    raise UserError(f"{where}: {e}; fix or remove the line") from None
                convs.append((where, conv))
                bar.update(1)
        if len(convs) < 2:
            raise UserError(f"--input {path} holds {len(convs)} conversation(s); train and val need 2 at least")
        n_val = max(1, round(len(convs) * config.val_fraction))
        val = set(np.random.default_rng(config.seed).permutation(len(convs))[:n_val].tolist())
        split_rows: dict[str, Packed] = {}
        for split in corpus.SPLITS:
            chosen = [(w, c) for i, (w, c) in enumerate(convs) if (i in val) == (split == "val")]
            pieces = [p for w, c in chosen for p in split_pieces(c, config.seq_len, config.overlong, w)]
            packed = pack(pieces, config.seq_len, pad, dtype)
            packed.conversations, packed.pieces = len(chosen), len(pieces) - len(chosen)
            # a target where the mask says so inside its conversation (a split piece's first token is none)
            targets = int(((packed.mask == 1) & (packed.pos > 0)).sum())
            packed.counts = {"rows": len(packed.ids), "tokens": int(sum(len(p.ids) for p in pieces)),
                             "supervised": targets}
            split_rows[split] = packed
        if config.text_share:
            split_rows["train"] = with_text(split_rows["train"], config, record["base_tokenizer"])
        if not split_rows["train"].counts["supervised"]:
            raise UserError(f"--input {path}: no assistant token survives in the train split; check the data")
        with staged_files(out, kind=corpus.KIND, replace=old, ours=corpus.OURS, last=corpus.META) as tmp:
            for split, packed in split_rows.items():
                packed.ids.tofile(tmp / f"{split}.bin")
                packed.mask.tofile(tmp / f"{split}.mask.bin")
                packed.pos.tofile(tmp / f"{split}.pos.bin")
            tok.save(str(tmp / TOKENIZER))
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            tr, va = split_rows["train"], split_rows["val"]
            meta = {
                "format": corpus.FORMAT, "version": corpus.CHAT_VERSION, "vocab_size": vocab, "dtype": dtype.name,
                "train_tokens": int(tr.ids.size), "val_tokens": int(va.ids.size),
                "tokenizer": {"kind": "model", "name": config.tokenizer, "path": TOKENIZER, "eot_id": eot_id(tok)},
                "source": str(path), "documents": len(convs), "val_documents": n_val,
                "val_fraction": config.val_fraction, "seed": config.seed,
                "chat": {"reading": reading, "seq_len": config.seq_len,
                         "pos_dtype": position_dtype(config.seq_len).name,
                         "overlong": config.overlong, **record,
                         "splits": {s: {"conversations": p.conversations, "split_pieces": p.pieces, **p.counts}
                                    for s, p in split_rows.items()}},
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            corpus.write_meta(tmp, meta)
    return out
