"""Bits per byte (bpb.py): the conversion, the bytes of a split, and data without a tokenizer.

    pytest -q tests/test_bpb.py
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import split_bytes_per_token
from tokenizers import Tokenizer

from gptopt.data import bpb
from gptopt.data.loader import TokenData

# Multi-byte characters (2, 3 and 4 bytes in UTF-8) beside ASCII: bytes, not characters, are counted.
TEXT = "def café(n):\n    return '東京' * n  # 🙂\n"


def test_bits_per_byte_by_hand() -> None:
    # 2 bits per token (2 ln 2 nats) over 4 bytes per token: half a bit per byte
    assert bpb.bits_per_byte(2 * math.log(2), 4.0) == pytest.approx(0.5)
    assert bpb.bits_per_byte(math.log(2), 0.5) == pytest.approx(2.0)
    assert bpb.bits_per_byte(3.0, None) is None


def with_val_text(train_data: Path, root: Path, texts: list[str]) -> tuple[Path, int]:
    """A copy of train_data whose val split is the given texts, each followed by end-of-text; its token count."""
    d = root / "data"
    shutil.copytree(train_data, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    meta = json.loads((d / "meta.json").read_text())
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t).ids + [meta["tokenizer"]["eot_id"]]
    np.array(ids, dtype=np.uint16).tofile(d / "val.bin")
    meta["val_tokens"] = len(ids)
    (d / "meta.json").write_text(json.dumps(meta))
    return d, len(ids)


def test_bytes_per_token_counts_utf8_bytes_and_no_bytes_for_end_of_text(train_data: Path, tmp_path: Path) -> None:
    d, n = with_val_text(train_data, tmp_path, [TEXT, TEXT])
    assert bpb.bytes_per_token(TokenData(d), "val") == pytest.approx(2 * len(TEXT.encode("utf-8")) / n)
    assert len(TEXT.encode("utf-8")) == len(TEXT) + 1 + 4 + 3  # é: 2 bytes, 東 京: 3 each, 🙂: 4


def test_the_ratio_is_computed_once_per_data_and_split(train_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = TokenData(train_data)
    calls: list[str] = []
    real = bpb._ratio
    monkeypatch.setattr(bpb, "_ratio", lambda d, s: calls.append(s) or real(d, s))
    first = bpb.bytes_per_token(data, "val")
    assert bpb.bytes_per_token(data, "val") == first and calls == ["val"]
    assert first == pytest.approx(split_bytes_per_token(train_data), rel=1e-6)


def test_a_large_split_is_sampled_not_decoded_whole(train_data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The first evaluation of a run on a big corpus must not wait for its whole val split to be decoded.
    d, n = with_val_text(train_data, tmp_path, ["for i in range(10):\n    print(i, i * i)\n"] * 200)
    monkeypatch.setattr(bpb, "CHUNK", 64)
    monkeypatch.setattr(bpb, "SAMPLE_TOKENS", 512)
    assert n > 4 * 512
    data = TokenData(d)
    tok = data.tokenizer()
    assert tok is not None
    decoded: list[int] = []

    class Counting:  # the tokenizer, counting the tokens it decodes
        def decode(self, ids: list[int]) -> str:
            decoded.append(len(ids))
            return tok.decode(ids)

    monkeypatch.setattr(data, "tokenizer", Counting)
    ratio = bpb.bytes_per_token(data, "val")
    assert sum(decoded) == 512 and len(decoded) == 8
    assert ratio == pytest.approx(split_bytes_per_token(d), rel=0.1)


def test_nanogpt_data_has_no_ratio_and_no_error(tmp_path: Path) -> None:
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    assert bpb.bytes_per_token(TokenData(tmp_path), "val") is None
