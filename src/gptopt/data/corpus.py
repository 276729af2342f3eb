"""Corpus preparation: a corpus -> a tokenizer -> train.bin / val.bin shards (tokenize_corpus, which
`gptopt prepare` runs: commands/prepare.py).

    gptopt prepare                                       # stdlib corpus, byte-level BPE of 8192 -> data/stdlib
    gptopt prepare --input my_texts/ --output_dir data/mine --vocab_size 4096
    gptopt prepare --dataset openwebtext --tokenizer gpt2 --output_dir data/owt   # online, 'data' extra

A data directory is nanoGPT's layout plus two files:

    train.bin, val.bin   raw little-endian token ids, uint16 (uint32 when the vocabulary needs it);
                         every document is followed by the end-of-text token
    tokenizer.json       the Hugging Face tokenizer that wrote them
    meta.json            {"format": "gptopt-tokens", ...}

The files are written beside the folder and moved in, meta.json last (outputs.staged_files), so one
with meta.json is complete; the user's other files in the folder are never touched. Reading it,
and the batches training draws from it, are loader.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from gptopt.config import PrepareConfig
from gptopt.data.tokenizer import EOT, TOKENIZER, eot_id, load_tokenizer
from gptopt.outputs import check_output, lock_output, mark, marked_kind, staged_files
from gptopt.runtime.signals import interruptible
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

log = logging.getLogger("gptopt")

FORMAT = "gptopt-tokens"
VERSION = 1  # what a text prepare writes
CHAT_VERSION = 2  # chat data's rows (train/chat_data.py): a reader of version 1 refuses it rather than misread it
META = "meta.json"
SPLITS = ("train", "val")
KIND = "prepared-data"  # the outputs mark of a folder prepare wrote into
# What prepare writes there; nothing else is touched. Chat data (train/chat_data.py) adds each split's mask and
# positions, and the chat template and special tokens of the model it was tokenized for.
OURS = ("train.bin", "val.bin", META, TOKENIZER, "train.mask.bin", "val.mask.bin", "train.pos.bin", "val.pos.bin",
        "chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


# What a folder given to --input contributes: text-like suffixes only, so binaries, images and
# archives lying beside the texts are skipped. A .jsonl holds one document per line (its text_field).
# A single file named by --input is read whatever its suffix.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cpp", ".js", ".ts", ".html", ".css",
                 ".json", ".toml", ".yaml", ".yml", ".csv", ".tex")
JSONL = ".jsonl"
# Folders never descended into. For the stdlib corpus the test suites are left out too: they are the
# larger part of the tree, mostly assertions, and some distributions ship them apart (Debian), so
# without them the corpus is the same on every installation.
SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})
STDLIB_SKIP_DIRS = SKIP_DIRS | {"test", "tests", "idle_test"}

# Encoding goes in chunks of about this many characters: big enough to keep every core busy inside
# one encode_batch call, small enough that the Encoding objects (ids, tokens, offsets) of one call
# stay a modest share of memory.
CHUNK_CHARS = 4 << 20
# A longer document is cut into pieces of about this size, so one huge file still encodes in parallel.
PIECE_CHARS = 1 << 20
# Cut only at a newline with a non-space on both sides: byte-level BPE's pre-tokenizer makes that
# newline a token of its own anyway, so the pieces encode to exactly the tokens of the whole text.
_CUT = re.compile(r"(?<=\S)\n(?=\S)")


# ----------------------------------------------------------------------------------------------
# Corpora


@dataclass
class Corpus:
    """Documents from text files, read lazily and in the same order on every pass (BPE training, encoding)."""

    source: str  # what meta.json records
    files: list[Path]
    text_field: str = "text"
    max_documents: int | None = None
    unreadable: set[Path] = field(default_factory=set)  # files skipped as not UTF-8

    def __iter__(self) -> Iterator[str]:
        count = 0
        for path in self.files:
            for text in self._read(path):
                if not text.strip():
                    continue  # an empty document would only add a lone end-of-text token
                yield text
                count += 1
                if self.max_documents is not None and count >= self.max_documents:
                    return

    def _read(self, path: Path) -> Iterator[str]:
        if path.suffix == JSONL:
            yield from _jsonl_texts(path, self.text_field)
            return
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            if len(self.files) == 1:
                raise UserError(f"--input {path}: not UTF-8 text; convert it (e.g. iconv -t utf-8)") from None
            self.unreadable.add(path)


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e}); "
                                 "a .jsonl holds one JSON object a line") from None
            if not isinstance(row, dict) or text_field not in row:
                keys = sorted(row) if isinstance(row, dict) else []
                raise UserError(f"{path}:{lineno}: no {text_field!r} field; pass --text_field, one of {keys}")
            if isinstance(row[text_field], str):
                yield row[text_field]


def _walk(root: Path, suffixes: tuple[str, ...], skip: frozenset[str],
          passed_over: list[Path] | None = None) -> list[Path]:
    """The files under root with one of the suffixes, in a fixed order; passed_over, where given, receives the
    other (not hidden) files, so that the caller can say what it left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted, so the same folder always gives the same documents in the same order (the split is seeded).
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            if f.endswith(suffixes):
                found.append(Path(dirpath, f))
            elif passed_over is not None:
                passed_over.append(Path(dirpath, f))
    return found


def stdlib_corpus(max_documents: int | None = None) -> Corpus:
    """The Python standard library's own .py sources without its tests: megabytes of real text on every
    machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, (".py",), STDLIB_SKIP_DIRS)
    if not files:
        raise UserError(f"no standard-library sources found under {root} (a zipped stdlib?); pass --input DIR")
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(f"stdlib (Python {version}, {root})", files, max_documents=max_documents)


def files_corpus(path: str, text_field: str = "text", max_documents: int | None = None) -> Corpus:
    p = Path(path).expanduser()
    kinds = ", ".join(TEXT_SUFFIXES + (JSONL,))
    if not p.exists():
        raise UserError(f"--input {p}: no such file or folder; give a text file or a folder of text files ({kinds})")
    if p.is_file():
        files = [p]
    else:
        other: list[Path] = []
        files = _walk(p, TEXT_SUFFIXES + (JSONL,), SKIP_DIRS, other)
        if not files:
            raise UserError(f"--input {p}: no text files in this folder (looked for {kinds}); add some or name a file")
        if other:
            suffixes = sorted({f.suffix or "(no suffix)" for f in other})
            log.info("skipped %d files of other kinds (%s), e.g. %s; a file named by --input is read whatever its "
                     "suffix", len(other), ", ".join(suffixes[:8]) + (", ..." if len(suffixes) > 8 else ""), other[0])
    return Corpus(f"files ({p.resolve()})", files, text_field=text_field, max_documents=max_documents)


def _load_dataset(config: PrepareConfig) -> Iterable[dict[str, Any]]:
    """A streaming Hugging Face dataset; a local data file or folder works too (offline tests, local data)."""
    datasets = require("datasets", "data", "--dataset")
    name = config.dataset
    assert name is not None
    local = Path(name).expanduser()
    builders = {".json": "json", JSONL: "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}
    # streaming=True reads rows as they arrive: no full download or Arrow cache before the first token.
    if local.is_file():
        if local.suffix not in builders:
            raise UserError(f"--dataset {local}: unknown data file type; use one of {', '.join(builders)}")
        return datasets.load_dataset(builders[local.suffix], data_files=str(local), split=config.dataset_split,
                                     streaming=True)
    if local.is_dir():
        return datasets.load_dataset(str(local), split=config.dataset_split, streaming=True)
    return datasets.load_dataset(name, config.dataset_config, split=config.dataset_split, streaming=True)


def dataset_corpus(config: PrepareConfig, spool_dir: Path) -> Corpus:
    """Stream the dataset once into a .jsonl spool beside the shards, so BPE training and encoding
    (two passes) do not download it twice; the spool is deleted before the output is published."""
    what = f"dataset {config.dataset!r} (config {config.dataset_config}, split {config.dataset_split!r})"
    spool = spool_dir / "documents.jsonl"
    count = 0
    try:
        rows = _load_dataset(config)
        with open(spool, "w", encoding="utf-8") as fh, tqdm(desc="download", unit=" doc", file=sys.stderr) as bar:
            for row in rows:
                if config.text_field not in row:
                    raise UserError(f"{what} has no {config.text_field!r} column; "
                                     f"pass --text_field, one of {sorted(row)}")
                text = row[config.text_field]
                if isinstance(text, str) and text.strip():
                    fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    count += 1
                    bar.update()
                    if config.max_documents is not None and count >= config.max_documents:
                        break
    except (ValueError, ImportError):  # ours (with the fix), and MissingExtra
        raise
    except Exception as e:  # datasets and the hub raise many types: not found, offline, bad config, bad split
        raise UserError(
            f"could not read {what}: {type(e).__name__}: {e}. Check the name, --dataset_config and --dataset_split, "
            "that this machine is online, or give local files with --input"
        ) from e
    if count == 0:
        raise UserError(f"{what} has no documents with text in {config.text_field!r}; "
                         "check --text_field and --dataset_split")
    return Corpus(f"dataset {config.dataset}:{config.dataset_split}", [spool])


# ----------------------------------------------------------------------------------------------
# Tokenizers


def _pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    start = 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size)
        if m is None:
            break
        yield text[start : m.end()]
        start = m.end()
    yield text[start:]


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte has a token, so any text round-trips) trained on texts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    interruptible(tok.train_from_iterator, (p for t in texts for p in _pieces(t)), trainer)
    return tok


def _shard_eot(tok: Tokenizer) -> int:
    """The end-of-text id the shards are written with: the tokenizer's own, else GPT-2's, added as a special token."""
    eot = eot_id(tok)
    if eot is None:
        tok.add_special_tokens([EOT])  # saved with the tokenizer, so every reader finds the same id
        eot = tok.token_to_id(EOT)
        log.info("the tokenizer has no end-of-text token; added %s as id %d", EOT, eot)
    return eot


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id (< vocab_size) fits, as nanoGPT writes; uint32 beyond 65,536 tokens."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@contextlib.contextmanager
def _tokenizer_threads(num_workers: int) -> Iterator[None]:
    """Size the Rust thread pool that BPE training and encode_batch run on (0 = every core).

    RAYON_NUM_THREADS is read once, when the pool starts at the first parallel call of the process
    (the CLI's case); TOKENIZERS_PARALLELISM=false makes tokenizers serial, which is what 1 asks for.
    """
    saved = {k: os.environ.get(k) for k in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    if num_workers == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    elif num_workers > 1:
        os.environ["RAYON_NUM_THREADS"] = str(num_workers)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    # encode_batch_fast (tokenizers >= 0.20) skips the offsets we never use; a chunk takes seconds in Rust, so it
    # runs interruptible (Ctrl-C at once)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in interruptible(encode, texts, add_special_tokens=False)]


# ----------------------------------------------------------------------------------------------
# prepare


@dataclass
class _Counts:
    documents: int = 0
    chars: int = 0


def _count(texts: Iterable[str], counts: _Counts) -> Iterator[str]:
    for t in texts:
        counts.documents += 1
        counts.chars += len(t)
        yield t


def _split_one(text: str, val_fraction: float) -> int:
    """Where to cut a one-document corpus: after the first newline past (1 - val_fraction) of it."""
    pos = max(1, int(len(text) * (1 - val_fraction)))
    nl = text.find("\n", pos)
    return nl + 1 if 0 <= nl < len(text) - 1 else pos


def _parts(corpus: Corpus, val_docs: set[int], val_fraction: float) -> Iterator[tuple[str, str, bool]]:
    """(text, split, whether it ends a document) for every piece of every document, in corpus order.

    An empty val_docs means a one-document corpus (a single big text file): its tail is the val split.
    """
    for i, text in enumerate(corpus):
        if val_docs:
            parts = [(text, "val" if i in val_docs else "train", True)]
        else:
            cut = _split_one(text, val_fraction)
            parts = [(text[:cut], "train", False), (text[cut:], "val", True)]
        for part, split, ends in parts:
            pieces = list(_pieces(part))
            for j, piece in enumerate(pieces):
                yield piece, split, ends and j == len(pieces) - 1


def _chunks(parts: Iterable[tuple[str, str, bool]], max_chars: int) -> Iterator[list[tuple[str, str, bool]]]:
    chunk: list[tuple[str, str, bool]] = []
    size = 0
    for part in parts:
        chunk.append(part)
        size += len(part[0])
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write_shards(corpus: Corpus, tok: Tokenizer, eot: int, dtype: np.dtype, val_docs: set[int],
                  total_chars: int, out: Path, val_fraction: float) -> dict[str, int]:
    """Encode every document into train.bin or val.bin, each followed by eot; returns the token counts."""
    counts = dict.fromkeys(SPLITS, 0)
    # Text that spells "<|endoftext|>" is encoded as the characters it is (nanoGPT's encode_ordinary):
    # only the separators written here are end-of-text tokens. (A run-time switch: not saved with it.)
    tok.encode_special_tokens = True
    with (
        open(out / "train.bin", "wb") as train,
        open(out / "val.bin", "wb") as val,
        tqdm(total=total_chars, desc="tokenize", unit="char", unit_scale=True, file=sys.stderr) as bar,
    ):
        files = {"train": train, "val": val}
        for chunk in _chunks(_parts(corpus, val_docs, val_fraction), CHUNK_CHARS):
            ids = _encode(tok, [text for text, _, _ in chunk])
            for split, fh in files.items():
                flat: list[int] = []
                for piece_ids, (_, s, ends) in zip(ids, chunk, strict=True):
                    if s == split:
                        flat += piece_ids
                        if ends:
                            flat.append(eot)
                np.asarray(flat, dtype=dtype).tofile(fh)
                counts[split] += len(flat)
            bar.update(sum(len(text) for text, _, _ in chunk))
    return counts


def write_meta(out: Path, meta: dict[str, Any]) -> None:
    with open(out / META, "w") as fh:
        json.dump(meta, fh, indent=2)


def _adopt_legacy(out: Path) -> None:
    """Mark a data folder that gptopt prepared before it marked its outputs, so --overwrite may replace it.

    A meta.json in gptopt's own format counts as gptopt's: prepare wrote it last, into a folder it
    published whole, so its train.bin, val.bin and tokenizer.json are gptopt's too (the default
    data/stdlib of every earlier version). nanoGPT's shards have no such meta.json and stay unmarked.
    """
    if marked_kind(out) is None and os.access(out, os.W_OK | os.X_OK) and _legacy(out):
        mark(out, KIND, files=[name for name in OURS if (out / name).exists()])


def _legacy(out: Path) -> bool:
    """out holds a meta.json in gptopt's format (_adopt_legacy says why that makes its files gptopt's)."""
    try:
        meta = json.loads((out / META).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def check_input(config: PrepareConfig, out: Path) -> None:
    """The corpus is read while the new files are written: it must not be among them, nor hold them."""
    if not config.input:
        return
    src, dst = Path(config.input).expanduser().resolve(), out.resolve()
    if src.is_dir() and (src == dst or src in dst.parents):
        # The shards, meta.json and tokenizer.json would be read as text by the next prepare of that folder.
        raise UserError(f"--output_dir {out} lies inside --input {config.input}; choose an --output_dir outside "
                         "the folder of texts")
    if src.is_file() and src.parent == dst and src.name in OURS:
        raise UserError(f"--input {config.input} is a file prepare writes into --output_dir {out}; rename it or "
                         "choose another --output_dir")


def tokenize_corpus(config: PrepareConfig) -> Path:
    """Tokenize the configured corpus into config.output_dir; returns that directory.

    Every file is written into a hidden temporary sibling and moved in at the end, meta.json last, so an
    interrupted run leaves no folder that looks complete, gptopt's old files in place, and the user's
    own files there untouched. Arguments and the output folder are checked before anything is written,
    under the folder's one-writer lock (a second prepare there is refused while this one runs).
    """
    out = Path(config.output_dir).expanduser()  # the options themselves: PrepareConfig checked them
    with lock_output(out):
        return _prepare(config, out)


def _prepare(config: PrepareConfig, out: Path) -> Path:
    check_input(config, out)
    if config.overwrite and out.is_dir():
        _adopt_legacy(out)  # writes a mark: only once nothing else can refuse
    old = check_output(out, kind=KIND, overwrite=config.overwrite, ours=OURS)
    # Local corpora are checked before anything is written; a dataset is streamed into the temp dir.
    corpus: Corpus | None = None
    if config.input:
        corpus = files_corpus(config.input, config.text_field, config.max_documents)
    elif not config.dataset:
        corpus = stdlib_corpus(config.max_documents)

    # Written beside the folder, then moved in (meta.json last): the user's files there (nanoGPT keeps
    # input.txt and prepare.py beside the shards) are never touched, and gptopt's old files stay until
    # the new ones are complete.
    with staged_files(out, kind=KIND, replace=old, ours=OURS, last=META) as tmp:
        if corpus is None:
            corpus = dataset_corpus(config, tmp)
        with _tokenizer_threads(config.num_workers):
            counts = _Counts()
            if config.tokenizer == "bpe":
                log.info("training a byte-level BPE of %d tokens on %s", config.vocab_size, corpus.source)
                tok, kind = train_bpe(_count(corpus, counts), config.vocab_size), "bpe"
            else:
                tok = load_tokenizer(config.tokenizer)
                local = Path(config.tokenizer).expanduser().exists()
                kind = "file" if local else "gpt2" if config.tokenizer == "gpt2" else "hub"
                for _ in _count(corpus, counts):  # the split needs the number of documents
                    pass
            if corpus.unreadable:
                log.info("skipped %d files that are not UTF-8 text, e.g. %s", len(corpus.unreadable),
                         min(corpus.unreadable))
            if counts.documents == 0:
                raise UserError(f"no text in {corpus.source}: every file is empty or not UTF-8; "
                                 "give --input with text")
            eot = _shard_eot(tok)
            vocab_size = tok.get_vocab_size(with_added_tokens=True)
            if kind == "bpe" and vocab_size < config.vocab_size:
                log.info("the corpus supports only %d of the %d tokens asked for", vocab_size, config.vocab_size)
            dtype = token_dtype(vocab_size)

            # Split by document, so no validation text is also trained on (the seeded permutation picks
            # which). A one-document corpus has no second document: _parts splits it inside instead.
            n_val = max(1, round(counts.documents * config.val_fraction)) if counts.documents > 1 else 0
            order = np.random.default_rng(config.seed).permutation(counts.documents)
            val_docs = set(order[:n_val].tolist())
            tokens = _write_shards(corpus, tok, eot, dtype, val_docs, counts.chars, tmp, config.val_fraction)
        if not tokens["train"] or not tokens["val"]:
            raise UserError(f"{corpus.source} is too small to split into train and val; give more text")
        (tmp / "documents.jsonl").unlink(missing_ok=True)  # the dataset spool
        tok.save(str(tmp / TOKENIZER))
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "train_tokens": tokens["train"],
            "val_tokens": tokens["val"],
            "tokenizer": {"kind": kind, "name": config.tokenizer, "path": TOKENIZER, "eot_id": eot},
            "source": corpus.source,
            "documents": counts.documents,
            "val_documents": n_val,  # 0: a one-document corpus, whose tail is the val split
            "characters": counts.chars,
            "val_fraction": config.val_fraction,
            "seed": config.seed,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        write_meta(tmp, meta)
    return out
