"""Tokenizer files and the end-of-text token: how every reader and writer finds them.

    python -c "from gptopt.data.tokenizer import load_tokenizer, eot_id; print(eot_id(load_tokenizer('data/stdlib')))"
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from gptopt.utils.errors import UserError
from gptopt.utils.paths import looks_local

TOKENIZER = "tokenizer.json"  # the file name beside shards, checkpoints and exports
EOT = "<|endoftext|>"  # GPT-2's document separator; a trained BPE gets it as its one special token
# End-of-text spellings of other tokenizers, looked up before adding EOT to a given tokenizer.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>")


def eot_id(tok: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token (any of EOT_CANDIDATES), or None; never changes the tokenizer."""
    return next((i for i in map(tok.token_to_id, EOT_CANDIDATES) if i is not None), None)


def tokenizer_digest(tok: Tokenizer) -> str:
    """The identity of the ids a tokenizer writes: a hash of its model (vocabulary and merges) and its added
    tokens, not of how its file is formatted or what it adds around a text. Two tokenizers with one digest turn
    every text into the same ids; a checkpoint records its own, so training refuses data of another."""
    data = json.loads(tok.to_str())
    ids = {"model": data.get("model"),
           "added": sorted((t["id"], t["content"]) for t in data.get("added_tokens") or [])}
    return hashlib.sha256(json.dumps(ids, sort_keys=True).encode()).hexdigest()[:16]


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
        raise UserError(f"tokenizer folder {p} has neither {TOKENIZER} nor vocab.json + merges.txt")
    if looks_local(str(path_or_name)):  # a typo'd path: said at once, not after the Hub's retries offline
        raise UserError(f"tokenizer {path_or_name}: no such file or folder; give a tokenizer.json or a folder "
                         "holding one")
    try:
        return _from_hub(str(path_or_name))
    except Exception as e:  # offline, unknown name: hub errors are many types
        raise UserError(
            f"tokenizer {str(path_or_name)!r} is no local file or folder, and the hub did not provide it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Offline, give a tokenizer.json "
            "or a folder with vocab.json + merges.txt, or use --tokenizer bpe"
        ) from None


def _tokenizer_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON or an unknown model type
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: not a Hugging Face tokenizer.json ({first})") from None
