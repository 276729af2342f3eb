"""Token data: a corpus -> a tokenizer -> train.bin / val.bin shards, and the resumable batch sampler.

    gptopt prepare                                       # stdlib corpus, byte-level BPE of 8192 -> data/stdlib
    gptopt prepare --input my_texts/ --output_dir data/mine --vocab_size 4096
    gptopt prepare --dataset openwebtext --tokenizer gpt2 --output_dir data/owt   # online, 'data' extra
    python -c "from gptopt.data import TokenData; d = TokenData('data/stdlib'); print(d.num_tokens('train'))"

A data directory is nanoGPT's layout plus two files:

    train.bin, val.bin   raw little-endian token ids, uint16 (uint32 when the vocabulary needs it);
                         every document is followed by the end-of-text token
    tokenizer.json       the Hugging Face tokenizer that wrote them
    meta.json            {"format": "gptopt-tokens", ...}: written last, so its presence means complete

nanoGPT's own train.bin/val.bin directories (uint16, no meta.json) are read as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from gptopt.checkpoint import replace_dir
from gptopt.config import PrepareConfig
from gptopt.extras import require

log = logging.getLogger("gptopt")

FORMAT = "gptopt-tokens"
VERSION = 1
META = "meta.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")
EOT = "<|endoftext|>"  # GPT-2's document separator; a trained BPE gets it as its one special token
# End-of-text spellings of other tokenizers, looked up before adding EOT to a given tokenizer.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>")

# What a folder given to --input contributes: text-like suffixes only, so binaries, images and
# archives lying beside the texts are skipped. A .jsonl holds one document per line (its text_field).
# A single file named by --input is read whatever its suffix.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cpp", ".js", ".ts", ".html", ".css",
                 ".json", ".toml", ".yaml", ".yml", ".csv", ".tex")
JSONL = ".jsonl"
# Folders never descended into. For the stdlib corpus the test suites are left out too: they are more
# than half of the tree (17 of 31 MB on CPython 3.11), mostly assertions, and some distributions ship
# them apart (Debian), so without them the corpus is the same on every installation.
SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})
STDLIB_SKIP_DIRS = SKIP_DIRS | {"test", "tests", "idle_test"}

# Encoding goes in chunks of about this many characters: big enough to keep every core busy inside
# one encode_batch call, small enough that the Encoding objects (ids, tokens, offsets) stay ~100 MB.
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
                raise ValueError(f"--input {path}: not UTF-8 text; convert it (e.g. iconv -t utf-8)") from None
            self.unreadable.add(path)


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e}); a .jsonl holds one JSON object a line") from None
            if not isinstance(row, dict) or text_field not in row:
                keys = sorted(row) if isinstance(row, dict) else []
                raise ValueError(f"{path}:{lineno}: no {text_field!r} field; pass --text_field, one of {keys}")
            if isinstance(row[text_field], str):
                yield row[text_field]


def _walk(root: Path, suffixes: tuple[str, ...], skip: frozenset[str]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted, so the same folder always gives the same documents in the same order (the split is seeded).
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        found += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(suffixes) and not f.startswith(".")]
    return found


def stdlib_corpus(max_documents: int | None = None) -> Corpus:
    """The Python standard library's own .py sources without its tests: ~12 MB of real text on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, (".py",), STDLIB_SKIP_DIRS)
    if not files:
        raise ValueError(f"no standard-library sources found under {root} (a zipped stdlib?); pass --input DIR")
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(f"stdlib (Python {version}, {root})", files, max_documents=max_documents)


def files_corpus(path: str, text_field: str = "text", max_documents: int | None = None) -> Corpus:
    p = Path(path).expanduser()
    kinds = ", ".join(TEXT_SUFFIXES + (JSONL,))
    if not p.exists():
        raise ValueError(f"--input {p}: no such file or folder; give a text file or a folder of text files ({kinds})")
    if p.is_file():
        files = [p]
    else:
        files = _walk(p, TEXT_SUFFIXES + (JSONL,), SKIP_DIRS)
        if not files:
            raise ValueError(f"--input {p}: no text files in this folder (looked for {kinds}); add some or name a file")
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
            raise ValueError(f"--dataset {local}: unknown data file type; use one of {', '.join(builders)}")
        return datasets.load_dataset(builders[local.suffix], data_files=str(local), split=config.dataset_split, streaming=True)
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
                    raise ValueError(f"{what} has no {config.text_field!r} column; pass --text_field, one of {sorted(row)}")
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
        raise ValueError(
            f"could not read {what}: {type(e).__name__}: {e}. Check the name, --dataset_config and --dataset_split, "
            "that this machine is online, or give local files with --input"
        ) from e
    if count == 0:
        raise ValueError(f"{what} has no documents with text in {config.text_field!r}; check --text_field and --dataset_split")
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
    tok.train_from_iterator((p for t in texts for p in _pieces(t)), trainer)
    return tok


def _from_hub(name: str) -> Tokenizer:
    return Tokenizer.from_pretrained(name)


def load_tokenizer(path_or_name: str | os.PathLike[str]) -> Tokenizer:
    """A tokenizers.Tokenizer from a tokenizer.json, a folder holding one (or GPT-2's vocab.json + merges.txt),
    or else a Hugging Face hub name such as gpt2 (online only)."""
    p = Path(path_or_name).expanduser()
    if p.is_file():
        return _tokenizer_file(p)
    if p.is_dir():
        if (p / TOKENIZER).is_file():
            return _tokenizer_file(p / TOKENIZER)
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            # GPT-2's original files (as in a transformers GPT2Tokenizer folder): a byte-level BPE.
            tok = Tokenizer(models.BPE.from_file(str(p / "vocab.json"), str(p / "merges.txt")))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            if tok.token_to_id(EOT) is not None:
                tok.add_special_tokens([EOT])  # in the vocab already; this makes it special (never split, skippable)
            return tok
        raise ValueError(f"tokenizer folder {p} has neither {TOKENIZER} nor vocab.json + merges.txt")
    try:
        return _from_hub(str(path_or_name))
    except Exception as e:  # offline, unknown name: hub errors are many types
        raise ValueError(
            f"tokenizer {str(path_or_name)!r} is no local file or folder, and the hub did not provide it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Offline, give a tokenizer.json "
            "or a folder with vocab.json + merges.txt, or use --tokenizer bpe"
        ) from None


def _tokenizer_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON or an unknown model type
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None


def eot_id(tok: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token (any of EOT_CANDIDATES), or None; never changes the tokenizer."""
    return next((i for i in map(tok.token_to_id, EOT_CANDIDATES) if i is not None), None)


def _add_eot(tok: Tokenizer) -> int:
    """prepare: the end-of-text id that separates documents, adding GPT-2's `<|endoftext|>` to a tokenizer
    without one (the tokenizer is saved with the data, so training and generation see the same ids)."""
    eot = eot_id(tok)
    if eot is None:
        tok.add_special_tokens([EOT])
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
    # encode_batch_fast (tokenizers >= 0.20) skips the offsets we never use.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


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
        for fh in files.values():
            fh.flush()
            os.fsync(fh.fileno())
    return counts


def _write_meta(out: Path, meta: dict[str, Any]) -> None:
    with open(out / META, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())


def _check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out} is a file; choose a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ValueError(
            f"--output_dir {out} already exists and is not empty; pass --overwrite to replace it "
            "(the old data stays until the new is complete), or choose another --output_dir"
        )
    if not (out / META).is_file() and not (out / "train.bin").is_file():
        # A typo such as --output_dir ~ must never delete a home directory.
        raise ValueError(
            f"--output_dir {out} is not a token-data folder (no {META} or train.bin), so --overwrite will not "
            "delete it; choose another --output_dir"
        )


def prepare(config: PrepareConfig) -> Path:
    """Tokenize the configured corpus into config.output_dir; returns that directory.

    Everything is written into a hidden temporary sibling, meta.json last, and renamed into place at
    the end, so an interrupted run leaves no directory that looks complete (and an old one untouched).
    """
    if config.num_workers < 0:
        raise ValueError(f"--num_workers must be >= 0 (0 = every core), got {config.num_workers}")
    if config.max_documents is not None and config.max_documents < 1:
        raise ValueError(f"--max_documents must be >= 1, got {config.max_documents}")
    out = Path(config.output_dir).expanduser()
    _check_output_dir(out, config.overwrite)
    # Local corpora are checked before anything is written; a dataset is streamed into the temp dir.
    corpus: Corpus | None = None
    if config.input:
        corpus = files_corpus(config.input, config.text_field, config.max_documents)
    elif not config.dataset:
        corpus = stdlib_corpus(config.max_documents)

    out.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would stay on the published directory; mkdir applies the umask.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
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
                raise ValueError(f"no text in {corpus.source}: every file is empty or not UTF-8; give --input with text")
            eot = _add_eot(tok)
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
            raise ValueError(f"{corpus.source} is too small to split into train and val; give more text")
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
        _write_meta(tmp, meta)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def prepare_main(config: PrepareConfig) -> int:
    start = time.perf_counter()
    out = prepare(config)
    meta = TokenData(out).meta
    assert meta is not None
    print(
        f"prepared {meta['documents']:,} documents -> {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
        f"tokens, vocab {meta['vocab_size']:,} ({meta['dtype']}), {time.perf_counter() - start:.1f} s -> {out}"
    )
    return 0


# ----------------------------------------------------------------------------------------------
# Reading


class TokenData:
    """A prepared data directory (or nanoGPT's train.bin/val.bin). The shards are memory-mapped on
    first use, never at construction, so an instance pickles into DataLoader workers as a few fields."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()
        hint = f"run `gptopt prepare --output_dir {self.directory}` first (or point at nanoGPT's train.bin/val.bin)"
        if not self.directory.is_dir():
            raise ValueError(f"no token data at {self.directory}: {hint}")
        self.meta: dict[str, Any] | None = None
        meta_path = self.directory / META
        if meta_path.is_file():
            try:
                self.meta = json.loads(meta_path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{meta_path}: corrupt JSON ({e}); re-run `gptopt prepare --overwrite`") from None
            if self.meta.get("format") != FORMAT or self.meta.get("version", 0) > VERSION:
                raise ValueError(f"{meta_path}: not gptopt token data of version <= {VERSION}; re-run `gptopt prepare`")
            self._dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        elif (self.directory / "train.bin").is_file():
            self._dtype = np.dtype("<u2")  # nanoGPT writes np.uint16
        else:
            raise ValueError(f"no token data at {self.directory} (neither {META} nor train.bin): {hint}")
        self._arrays: dict[str, np.ndarray] = {}
        self._max_id: int | None = None
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Each worker maps the files itself; a memmap would otherwise be pickled as its whole contents.
        return {**self.__dict__, "_arrays": {}, "_tokenizer": None}

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary; None for nanoGPT data (see max_token_id)."""
        return self.meta["vocab_size"] if self.meta else None

    @property
    def model_vocab_size(self) -> int:
        """The embedding size a model for this data needs: the tokenizer's, else the largest id + 1."""
        return self.vocab_size or self.max_token_id() + 1

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def eot_id(self) -> int | None:
        return self.meta["tokenizer"]["eot_id"] if self.meta else None

    def tokens(self, split: str) -> np.ndarray:
        """The split's token ids as a read-only memmap (an empty array for an empty file)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split not in self._arrays:
            path = self.directory / f"{split}.bin"
            if not path.is_file():
                raise ValueError(f"{path} is missing; re-run `gptopt prepare --overwrite --output_dir {self.directory}`")
            size = path.stat().st_size
            n, rest = divmod(size, self._dtype.itemsize)
            expected = self.meta[f"{split}_tokens"] if self.meta else n
            if rest or n != expected:
                raise ValueError(
                    f"{path} holds {size} bytes, not {expected} {self._dtype.name} tokens: it is truncated or "
                    f"changed; re-run `gptopt prepare --overwrite --output_dir {self.directory}`"
                )
            # np.memmap cannot map an empty file
            self._arrays[split] = np.memmap(path, self._dtype, mode="r", shape=(n,)) if n else np.zeros(0, self._dtype)
        return self._arrays[split]

    def num_tokens(self, split: str) -> int:
        return len(self.tokens(split))

    def max_token_id(self) -> int:
        """The largest id in either split (a full scan, cached): the vocabulary bound of nanoGPT data."""
        if self._max_id is None:
            highest = -1
            for split in SPLITS:
                tokens = self.tokens(split)
                for i in range(0, len(tokens), 1 << 24):  # in 32 MB slices: a scan, not a copy of the shard
                    highest = max(highest, int(tokens[i : i + (1 << 24)].max()))
            self._max_id = highest
        return self._max_id

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer that wrote the shards (loaded once); None for nanoGPT data (tiktoken or char maps)."""
        if self._tokenizer is None:
            name = self.meta["tokenizer"].get("path", TOKENIZER) if self.meta else TOKENIZER
            path = self.directory / name
            self._tokenizer = _tokenizer_file(path) if path.is_file() else None
        return self._tokenizer

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise ValueError if a token id could index past the model's embedding table."""
        if self.vocab_size is not None:
            need, what = self.vocab_size, f"the data's vocabulary is {self.vocab_size}"
        else:
            need = self.max_token_id() + 1
            what = f"the largest token id is {need - 1}"
        if need > model_vocab_size:
            raise ValueError(
                f"shard token ids exceed the model's vocabulary: {what}, the model has {model_vocab_size}; "
                f"use a model with vocab_size >= {need}, or prepare the data with --vocab_size <= {model_vocab_size}"
            )


# Items a BatchDataset claims to have: training runs for steps, not epochs, so it is effectively endless.
ENDLESS = 1 << 62


DEFAULT_DATA = "data/stdlib"


def open_data(data_dir: str | os.PathLike[str], *, is_main: bool = True, barrier: Any = None) -> TokenData:
    """TokenData of data_dir; the embedded default (data/stdlib) is prepared on first use, on rank 0.

    Everything else that is missing is an error naming `gptopt prepare`: only the default needs
    nothing from outside, so only it is made silently.
    """
    path = Path(data_dir)
    if str(data_dir) == DEFAULT_DATA and not (path / "meta.json").is_file():
        if is_main:
            log.info(f"{DEFAULT_DATA} not found: preparing the default stdlib corpus (once)")
            prepare(PrepareConfig(output_dir=DEFAULT_DATA))
        if barrier is not None:
            barrier()
    return TokenData(data_dir)


class BatchDataset(torch.utils.data.Dataset):
    """Item `step` is the whole micro-batch (x, y) of that step: int64 (B, T), y = x shifted by one token,
    from B random windows of T + 1 tokens. The windows are a pure function of (seed, step), so a resumed
    run at step s sees exactly the batches it would have. Under DDP the step's global batch has
    world_size * B windows and rank r takes rows r*B .. (r+1)*B: N ranks at micro-batch B train on
    exactly what one process at micro-batch N*B would."""

    def __init__(self, data: TokenData, split: str, batch_size: int, seq_len: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.data, self.split = data, split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self._check(split)

    def _check(self, split: str) -> int:
        n = self.data.num_tokens(split)
        if n < self.seq_len + 1:
            raise ValueError(
                f"the {split} split of {self.data.directory} has {n} tokens, fewer than seq_len + 1 = {self.seq_len + 1}; "
                "use a shorter --seq_len or more text (a larger --val_fraction for val)"
            )
        return n

    def __len__(self) -> int:
        return ENDLESS

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        buf = tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)  # (B, T+1)
        x = torch.from_numpy(np.ascontiguousarray(buf[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(buf[:, 1:]))
        return x, y

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step < 0:
            raise IndexError(f"step must be >= 0, got {step}")
        tokens = self.data.tokens(self.split)
        # A fresh generator per item: no state carried from one step to the next, in any worker.
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(tokens) - self.seq_len, size=self.batch_size * self.world_size)
        return self._windows(tokens, starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def eval_batches(self, split: str | int, n: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """n batches of windows spread evenly over a split: the same ones at every evaluation, so the
        losses are comparable, and covering the whole split; each rank takes every world_size-th window.

        eval_batches("val", n) reads the named split; eval_batches(n) this dataset's own.
        """
        if isinstance(split, int):
            split, n = self.split, split
        if n is None or n < 1:
            raise ValueError(f"eval_batches needs n >= 1 batches, got {n}")
        tokens = self.data.tokens(split)
        last = self._check(split) - self.seq_len - 1  # the last start that still has T + 1 tokens
        count = n * self.batch_size * self.world_size
        starts = np.linspace(0, last, num=count).astype(np.int64)[self.rank :: self.world_size]
        for i in range(n):
            yield self._windows(tokens, starts[i * self.batch_size : (i + 1) * self.batch_size])


def make_loader(dataset: BatchDataset, start_step: int = 0, *, num_workers: int = 0, pin_memory: bool = False,
                prefetch_factor: int | None = None, persistent_workers: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader yielding the batches of steps start_step, start_step + 1, ... (each item is a batch)."""
    extra: dict[str, Any] = {}
    if num_workers > 0:  # DataLoader refuses these two without worker processes
        extra = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=range(start_step, len(dataset)),
        num_workers=num_workers,
        pin_memory=pin_memory,
        # Its own generator: creating an iterator draws a worker base seed, and drawing it from the
        # global RNG would shift dropout's stream and break bitwise resume. Items do not use it.
        generator=torch.Generator().manual_seed(0),
        **extra,
    )


def _cores_per_process() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # torchrun starts one process per GPU on a machine; they share its cores.
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def default_loader_settings(device_type: str) -> dict[str, Any]:
    """make_loader's keyword arguments for this kind of device."""
    if device_type == "cuda":
        # The GPU runs ahead of the host; workers assemble and pin the next batches meanwhile and hide
        # page faults of a memmap bigger than the page cache. Half the cores at most: the main process
        # needs the rest to launch kernels.
        workers = min(4, _cores_per_process() // 2)
        return dict(num_workers=workers, pin_memory=True, prefetch_factor=2 if workers else None,
                    persistent_workers=workers > 0)
    # CPU (and MPS): a batch is B slices of a memmap, well under a millisecond, while a worker process
    # would take a core from the matmuls that are the real work; pinned memory only helps CUDA copies.
    return dict(num_workers=0, pin_memory=False, prefetch_factor=None, persistent_workers=False)
