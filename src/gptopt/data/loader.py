"""Reading prepared token data (corpus.py writes it) and the resumable batch sampler training draws from.

    python -c "from gptopt.data.loader import TokenData; d = TokenData('data/stdlib'); print(d.num_tokens('train'))"

TokenData reads a `gptopt prepare` directory (layout: corpus.py) or nanoGPT's own train.bin/val.bin
(uint16, no meta.json) as they are. A batch is a pure function of (seed, step), so a resumed run
sees exactly the batches it would have.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from gptopt.config import PrepareConfig
from gptopt.data.corpus import CHAT_VERSION, FORMAT, META, SPLITS, tokenize_corpus
from gptopt.data.tokenizer import TOKENIZER, load_tokenizer
from gptopt.outputs import lock_output
from gptopt.runtime import signals
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")


# ----------------------------------------------------------------------------------------------
# Reading


class TokenData:
    """A prepared data directory (or nanoGPT's train.bin/val.bin). The shards are memory-mapped on
    first use, never at construction, so an instance pickles into DataLoader workers as a few fields."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()
        hint = f"run `gptopt prepare --output_dir {self.directory}` first (or point at nanoGPT's train.bin/val.bin)"
        if not self.directory.is_dir():
            raise UserError(f"no token data at {self.directory}: {hint}")
        self.meta: dict[str, Any] | None = None
        meta_path = self.directory / META
        if meta_path.is_file():
            self.meta = read_meta(meta_path)
            self._dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        elif (self.directory / "train.bin").is_file():
            self._dtype = np.dtype("<u2")  # nanoGPT writes np.uint16
        else:
            raise UserError(f"no token data at {self.directory} (neither {META} nor train.bin): {hint}")
        self._arrays: dict[str, np.ndarray] = {}
        self._max_id: int | None = None
        self._tokenizer: Tokenizer | None = None
        # Loaded and checked now: a damaged tokenizer found at the first evaluation would cost the steps before it.
        self._check_tokenizer(self.tokenizer())
        for split in SPLITS:  # a damaged shard too: found now, not at the first evaluation
            if self.meta is not None or (self.directory / f"{split}.bin").is_file():
                self._shard_tokens(split)
                if self.chat is not None:
                    self._shard_tokens(split, "mask")
                    self._shard_tokens(split, "pos")

    def _check_tokenizer(self, tok: Tokenizer | None) -> None:
        if tok is None or self.meta is None:
            return
        size = tok.get_vocab_size(with_added_tokens=True)
        if size != self.meta["vocab_size"]:
            raise UserError(
                f"{self._tokenizer_path()} has {size} tokens, {META} says {self.meta['vocab_size']}: it is not the "
                f"tokenizer that wrote the shards; re-run `gptopt prepare --overwrite --output_dir {self.directory}`"
            )

    def _tokenizer_path(self) -> Path:
        return self.directory / (self.meta["tokenizer"].get("path", TOKENIZER) if self.meta else TOKENIZER)

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

    @property
    def chat(self) -> dict[str, Any] | None:
        """meta.json's "chat" of conversation data (train/chat_data.py wrote it: rows, their length, the template);
        None for text."""
        return self.meta.get("chat") if self.meta else None

    def rows(self, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chat data's packed rows of a split: token ids, loss mask and positions, each (rows, seq_len) memmaps."""
        assert self.chat is not None, "rows() reads chat data"
        L = self.chat["seq_len"]
        return tuple(self._shard(split, part).reshape(-1, L) for part in (None, "mask", "pos"))  # type: ignore[return-value]

    def tokens(self, split: str) -> np.ndarray:
        """The split's token ids as a read-only memmap (an empty array for an empty file)."""
        return self._shard(split)

    def _shard(self, split: str, part: str | None = None) -> np.ndarray:
        """A split's token ids (part: chat data's "mask" or "pos" beside them) as a read-only memmap, mapped once."""
        if split not in SPLITS:
            raise UserError(f"split must be one of {SPLITS}, got {split!r}")
        key = split if part is None else f"{split}.{part}"
        if key not in self._arrays:
            path, n, dtype = self.directory / f"{key}.bin", self._shard_tokens(split, part), self._part_dtype(part)
            # np.memmap cannot map an empty file
            self._arrays[key] = np.memmap(path, dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
        return self._arrays[key]

    def _part_dtype(self, part: str | None) -> np.dtype:
        if part is None:
            return self._dtype
        assert self.chat is not None, "a mask or positions shard is chat data's"
        return np.dtype("<u1") if part == "mask" else np.dtype(self.chat["pos_dtype"]).newbyteorder("<")

    def _shard_tokens(self, split: str, part: str | None = None) -> int:
        """The token count of a split's shard (part: chat data's "mask" or "pos" beside it), checked against
        meta.json: one line with the fix if it is not."""
        path = self.directory / (f"{split}.bin" if part is None else f"{split}.{part}.bin")
        if not path.is_file():
            raise UserError(f"{path} is missing; re-run `gptopt prepare --overwrite --output_dir {self.directory}`")
        dtype = self._part_dtype(part)
        size = path.stat().st_size
        n, rest = divmod(size, dtype.itemsize)
        expected = self.meta[f"{split}_tokens"] if self.meta else n
        if rest or n != expected or self.chat is not None and n % self.chat["seq_len"]:
            raise UserError(
                f"{path} holds {size} bytes, not {expected} {dtype.name} tokens: it is truncated or "
                f"changed; re-run `gptopt prepare --overwrite --output_dir {self.directory}`"
            )
        return n

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
            path = self._tokenizer_path()
            if path.is_file():
                try:
                    self._tokenizer = load_tokenizer(path)
                except ValueError as e:
                    fix = f"re-run `gptopt prepare --overwrite --output_dir {self.directory}`"
                    raise UserError(f"{e}; {fix}") from None
        return self._tokenizer

    def tokenized_by(self, tok: Tokenizer) -> bool | None:
        """Whether tok is the tokenizer that wrote the shards: the same model (kind, vocabulary, merges) and
        the same added tokens, so text maps to the same ids. A vocabulary size alone says nothing: two BPEs
        of 8192 tokens trained on different text share it. None for nanoGPT data (no tokenizer stored)."""
        theirs = self.tokenizer()
        if theirs is None:
            return None
        return _token_map(theirs) == _token_map(tok)

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise ValueError if a token id could index past the model's embedding table."""
        if self.vocab_size is not None:
            need, what = self.vocab_size, f"the data's vocabulary is {self.vocab_size}"
        else:
            need = self.max_token_id() + 1
            what = f"the largest token id is {need - 1}"
        if need > model_vocab_size:
            raise UserError(
                f"shard token ids exceed the model's vocabulary: {what}, the model has {model_vocab_size}; "
                "a model trains only on data of its own tokenizer: tokenize the text with it (gptopt prepare "
                "--tokenizer with the tokenizer.json beside the model), or train a new model on this data"
            )


# dtype names meta.json may give, and the vocabulary each holds
_DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of a prepared directory, its shape checked: a damaged or hand-edited file is one line
    naming the field, never a KeyError later."""
    fix = f"re-run `gptopt prepare --overwrite --output_dir {path.parent}`"
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt JSON ({e}); {fix}") from None

    def bad(what: str) -> UserError:
        return UserError(f"{path}: {what}; {fix}")

    if not isinstance(meta, dict):
        raise bad(f"expected a JSON object, got {type(meta).__name__}")
    version = meta.get("version", 0)
    if meta.get("format") != FORMAT or not _is_count(version) or version > CHAT_VERSION:
        raise bad(f"not gptopt token data of version <= {CHAT_VERSION} (format {meta.get('format')!r}, "
                  f"version {version!r})")
    chat = meta.get("chat")
    if chat is not None and not (isinstance(chat, dict) and _is_count(chat.get("seq_len")) and chat["seq_len"] > 1
                                 and chat.get("pos_dtype") in _DTYPES):
        raise bad(f"chat must be an object with seq_len (> 1) and pos_dtype, got {chat!r}")
    if not _is_count(meta.get("vocab_size")) or meta["vocab_size"] < 1:
        raise bad(f"vocab_size must be a positive integer, got {meta.get('vocab_size')!r}")
    if meta.get("dtype") not in _DTYPES:
        raise bad(f"dtype must be one of {', '.join(_DTYPES)}, got {meta.get('dtype')!r}")
    if meta["vocab_size"] > _DTYPES[meta["dtype"]]:
        raise bad(f"vocab_size {meta['vocab_size']} does not fit dtype {meta['dtype']}")
    for key in ("train_tokens", "val_tokens"):
        if not _is_count(meta.get(key)):
            raise bad(f"{key} must be a count of tokens (an integer >= 0), got {meta.get(key)!r}")
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict):
        raise bad(f"tokenizer must be an object with eot_id and path, got {tok!r}")
    eot = tok.get("eot_id")
    if eot is not None and not (_is_count(eot) and eot < meta["vocab_size"]):
        raise bad(f"tokenizer.eot_id must be a token id below vocab_size {meta['vocab_size']} or null, got {eot!r}")
    if not isinstance(tok.get("path", TOKENIZER), str):
        raise bad(f"tokenizer.path must be a file name, got {tok.get('path')!r}")
    return meta


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _token_map(tok: Tokenizer) -> tuple[Any, dict[str, int]]:
    # The serialised model holds the type, vocabulary and merges; settings such as padding are left out.
    return json.loads(tok.to_str())["model"], tok.get_vocab(with_added_tokens=True)


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
            # Two commands started together in a new folder both need it: the second waits for the first.
            with lock_output(path, wait=True):
                if not (path / "meta.json").is_file():
                    log.info(f"{DEFAULT_DATA} not found: preparing the default stdlib corpus (once)")
                    tokenize_corpus(PrepareConfig(output_dir=DEFAULT_DATA))
        if barrier is not None:
            barrier()
    return TokenData(data_dir)


class BatchDataset(torch.utils.data.Dataset):
    """Item `step` is the whole micro-batch (x, y) of that step: int64 (B, T), y = x shifted by one token,
    from B random windows of T + 1 tokens. The windows are a pure function of (seed, step), so a resumed
    run at step s sees exactly the batches it would have. Under DDP the step's global batch has
    world_size * B windows and rank r takes rows r*B .. (r+1)*B: N ranks at micro-batch B train on
    exactly what one process at micro-batch N*B would.

    align: each window starts at a document's start, its first token the end-of-text token that ends
    the document before (or the split's first token), drawn at random among those starts; attention
    stays causal over the window, which runs on into the next documents."""

    def __init__(self, data: TokenData, split: str, batch_size: int, seq_len: int, seed: int,
                 rank: int = 0, world_size: int = 1, *, align: bool = False) -> None:
        if batch_size < 1 or seq_len < 1:
            raise UserError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if seed < 0:
            raise UserError(f"seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise UserError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if data.chat is not None:  # packed rows, padding and all, are no text stream
            raise UserError(f"{data.directory} holds conversations packed for fine-tuning (gptopt train reads them); "
                            "this reads text: give a data dir `gptopt prepare` made of text")
        self.data, self.split = data, split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self._check(split)
        self.align = align
        self._starts: np.ndarray | None = self.document_starts() if align else None

    def document_starts(self) -> np.ndarray:
        """The positions where a window of this split may start under align: 0 and every end-of-text
        token that leaves room for a whole window after it."""
        eot = self.data.eot_id
        if eot is None:
            raise UserError(f"--align_documents needs documents that end in an end-of-text token; the data in "
                             f"{self.data.directory} records none (nanoGPT shards): prepare it with `gptopt prepare`")
        tokens = self.data.tokens(self.split)
        last = len(tokens) - self.seq_len - 1  # the last start that still has T + 1 tokens
        chunk = 1 << 24  # scanned in slices: a whole split's comparison would be one byte per token at once
        ends = [np.flatnonzero(np.asarray(tokens[i : min(i + chunk, last + 1)]) == eot) + i
                for i in range(0, last + 1, chunk)]
        starts = np.unique(np.concatenate([[0], *ends])).astype(np.int64)
        if len(starts) < 2:
            raise UserError(f"--align_documents: the {self.split} split of {self.data.directory} has no end-of-text "
                             f"token {self.seq_len + 1} or more tokens before its end, so every window would start at "
                             "0: drop --align_documents or use a shorter --seq_len")
        return starts

    def _check(self, split: str) -> int:
        return check_split(self.data, split, self.seq_len)

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
        if self.align:
            if self._starts is None:
                self._starts = self.document_starts()
            starts = self._starts[rng.integers(0, len(self._starts), size=self.batch_size * self.world_size)]
        else:
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
            raise UserError(f"eval_batches needs n >= 1 batches, got {n}")
        tokens = self.data.tokens(split)
        last = self._check(split) - self.seq_len - 1  # the last start that still has T + 1 tokens
        count = n * self.batch_size * self.world_size
        starts = np.linspace(0, last, num=count).astype(np.int64)[self.rank :: self.world_size]
        for i in range(n):
            yield self._windows(tokens, starts[i * self.batch_size : (i + 1) * self.batch_size])


IGNORE_INDEX = -100  # a target the loss leaves out: F.cross_entropy's ignore_index, as models.loss's


class ChatRows(torch.utils.data.Dataset):
    """Chat data's micro-batches (train/chat_data.py packed the rows): item `step` is (x, y, pos), int64 (B, T)
    with T the rows' length. y is the next token where the loss counts it (the mask, inside one conversation),
    else IGNORE_INDEX, the row's last position included; pos restarts at every conversation, and a model attends
    within a conversation alone (models.gpt.document_mask).

    Rows are taken in epochs: epoch e is a permutation of the split's rows seeded by (seed, e), and global sample
    i is row i mod N of epoch i // N, so every row is seen once an epoch and item `step` is a pure function of
    (seed, step): a resumed run sees exactly its batches. Under DDP the step's global batch is world_size * B
    samples, rank r taking r*B .. (r+1)*B, as BatchDataset's."""

    def __init__(self, data: TokenData, split: str, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if data.chat is None:
            raise UserError(f"{data.directory} holds text, not conversations")
        self.data, self.split, self.batch_size, self.seed = data, split, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.seq_len = data.chat["seq_len"]
        self.n = check_rows(data, split)
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return ENDLESS

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
        return self._perm[1]

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if step < 0:
            raise IndexError(f"step must be >= 0, got {step}")
        B = self.batch_size
        first = (step * self.world_size + self.rank) * B
        picks = [int(self._order(i // self.n)[i % self.n]) for i in range(first, first + B)]
        return self._batch(np.asarray(picks), np.ones(B, dtype=bool))

    def _batch(self, picks: np.ndarray, real: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, mask, pos = (np.asarray(a[picks]).astype(np.int64) for a in self.data.rows(self.split))
        y = np.full_like(ids, IGNORE_INDEX)
        counted = (mask[:, 1:] == 1) & (pos[:, 1:] > 0) & real[:, None]
        y[:, :-1] = np.where(counted, ids[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(ids), torch.from_numpy(y), torch.from_numpy(pos)

    def eval_batches(self, n: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every row of the split once, in order, in batches of B (at most n batches): each rank every
        world_size-th row, and every rank as many batches (the last filled with rows that count nothing), so that
        sharded forwards stay in step."""
        per_step = self.batch_size * self.world_size
        steps = -(-self.n // per_step)
        if n is not None:
            steps = min(steps, n)
        for s in range(steps):
            idx = np.arange(s * per_step, (s + 1) * per_step)[self.rank :: self.world_size]
            yield self._batch(idx % self.n, idx < self.n)


def check_rows(data: TokenData, split: str) -> int:
    """Chat data's rows in a split; refused when it has none."""
    n = len(data.rows(split)[0])
    if n == 0:
        raise UserError(f"the {split} split of {data.directory} holds no conversation: prepare it with more "
                        "conversations (a larger --val_fraction for val)")
    return n


def check_split(data: TokenData, split: str, seq_len: int, *, other_fix: str | None = None) -> int:
    """The split's token count; refused (naming the split, its count, the context and the fixes: a shorter
    --seq_len, more text, or `other_fix`) when it holds no window of seq_len + 1 tokens. A command checks each split
    it reads before its first step: found at the first evaluation, the steps before it would be trained in vain."""
    n = data.num_tokens(split)
    if n < seq_len + 1:
        fixes = [f"use a --seq_len of at most {n - 1}" if n > 1 else "use a shorter --seq_len",
                 "prepare more text" + (" (a larger --val_fraction)" if split == "val" else ""),
                 *([other_fix] if other_fix else [])]
        raise UserError(f"the {split} split of {data.directory} has {n} tokens, fewer than seq_len + 1 = {seq_len + 1} "
                        f"(a window of the context {seq_len} and its next token): "
                        + ", ".join(fixes[:-1]) + f", or {fixes[-1]}")
    return n


def make_loader(dataset: BatchDataset, start_step: int = 0, *, num_workers: int = 0, pin_memory: bool = False,
                prefetch_factor: int | None = None, persistent_workers: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader yielding the batches of steps start_step, start_step + 1, ... (each item is a batch)."""
    extra: dict[str, Any] = {}
    if num_workers > 0:  # DataLoader refuses these two without worker processes
        extra = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                     worker_init_fn=_leave_stop_signals_to_the_main_process)
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


def _leave_stop_signals_to_the_main_process(worker_id: int) -> None:
    # A stop sent to the whole process group (a scheduler, torchrun, Ctrl-C) would otherwise kill the
    # workers, and the main process would die of a lost worker mid-step or mid-save instead of saving
    # at the step boundary; it shuts its workers down itself when it is done.
    signals.ignore()


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
    # CPU (and MPS): a batch is B slices of a memmap, cheap beside a step, while a worker process
    # would take a core from the matmuls that are the real work; pinned memory only helps CUDA copies.
    return dict(num_workers=0, pin_memory=False, prefetch_factor=None, persistent_workers=False)
