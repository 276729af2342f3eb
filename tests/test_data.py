"""Corpus -> tokenizer -> shards (corpus.py, `gptopt prepare`), and reading them back as resumable batches (data.py).

    pytest -q tests/test_data.py
    pytest -q tests/test_data.py -m slow     # the real stdlib corpus with the default vocabulary
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import gptopt.data.corpus as prep
import gptopt.data.loader as data
import gptopt.data.tokenizer as tokenizer
from gptopt.cli import main
from gptopt.config import PrepareConfig
from gptopt.data.corpus import token_dtype, tokenize_corpus
from gptopt.data.loader import BatchDataset, TokenData, make_loader
from gptopt.data.tokenizer import load_tokenizer

# A few documents of code and prose, with non-ASCII text, so the byte-level round trip is tested.
DOCS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\n" * 40,
    "b.md": "# Notes\n\nCafé, naïve, Straße, 東京, emoji 🙂 and tabs\tend.\n" * 30,
    "c.py": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n" * 30 + 'EOT = "<|endoftext|>"\n',
    "sub/d.rst": "Section\n=======\n\nSome *restructured* text with ``code``.\n" * 30,
    "sub/deeper/e.txt": "\n".join(f"line {i}: value = {i * i}" for i in range(300)) + "\n",
    "f.txt": "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n" * 40,
    "g.py": "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n" * 30,
    "h.md": "- item one\n- item two\n- item three\n" * 50,
}


def write_corpus(root: Path) -> Path:
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "empty.txt").write_text("")  # no document
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")  # not a text suffix: ignored
    return root


def config(src: Path, out: Path, **kw) -> PrepareConfig:
    return PrepareConfig(**{"input": str(src), "output_dir": str(out), "vocab_size": 300, "val_fraction": 0.2, **kw})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenize_corpus(config(corpus, tmp_path_factory.mktemp("prep") / "data"))


def split_documents(d: TokenData, split: str) -> list[str]:
    """The documents of a split, decoded: the text between end-of-text tokens."""
    tok = d.tokenizer()
    ids = d.tokens(split).tolist()
    assert ids[-1] == d.eot_id
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == d.eot_id:
            docs.append(tok.decode(ids[start:i]))
            start = i + 1
    return docs


# ----------------------------------------------------------------------------------------------
# prepare


def test_prepare_writes_complete_shards(prepared: Path, tmp_path: Path) -> None:
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["format"] == "gptopt-tokens" and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 300 and meta["documents"] == len(DOCS)  # empty.txt and image.png are no documents
    for split in ("train", "val"):
        size = (prepared / f"{split}.bin").stat().st_size
        assert size // 2 == meta[f"{split}_tokens"] > 0 and size % 2 == 0
    d = TokenData(prepared)
    assert d.vocab_size == 300 and d.eot_id == meta["tokenizer"]["eot_id"]
    # Every document is in exactly one split, whole, and decodes back to the file's text.
    train, val = split_documents(d, "train"), split_documents(d, "val")
    assert len(val) == meta["val_documents"] == round(len(DOCS) * 0.2)
    assert sorted(train + val) == sorted(DOCS.values())
    assert [p.name for p in prepared.parent.iterdir()] == ["data"]  # no temp dir left beside it
    (tmp_path / "plain").mkdir()
    assert prepared.stat().st_mode == (tmp_path / "plain").stat().st_mode  # as open as the umask allows


def test_tokenizer_round_trips_text(prepared: Path) -> None:
    tok = TokenData(prepared).tokenizer()
    for s in ["def f(x):\n\treturn x ** 2  # ok", "Grüße aus 東京 🙂\r\n", "   leading spaces", ""]:
        assert tok.decode(tok.encode(s).ids) == s
    assert max(tok.encode("unseen: Ωμέγα ÿ 🚀").ids) < 300  # bytes never seen in training still encode


def test_split_is_seeded(corpus: Path, prepared: Path, tmp_path: Path) -> None:
    same = TokenData(tokenize_corpus(config(corpus, tmp_path / "same")))
    other = TokenData(tokenize_corpus(config(corpus, tmp_path / "other", seed=7)))
    val = sorted(split_documents(TokenData(prepared), "val"))
    assert sorted(split_documents(same, "val")) == val
    assert sorted(split_documents(other, "val")) != val


def test_thread_count_changes_nothing_but_speed(corpus: Path, prepared: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    serial = tokenize_corpus(config(corpus, tmp_path / "serial", num_workers=1))
    assert dict(os.environ) == env  # the thread settings are put back
    for name in ("train.bin", "val.bin"):
        assert (serial / name).read_bytes() == (prepared / name).read_bytes()


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def nanogpt_folder(root: Path, corpus: Path) -> Path:
    """nanoGPT's data layout: the corpus and the script that prepares it, in the folder the shards go to."""
    root.mkdir()
    (root / "input.txt").write_text("".join(DOCS.values()))
    (root / "prepare.py").write_text("# nanoGPT's own preparation script\n")
    return root


def test_prepare_writes_beside_the_users_files_and_overwrite_keeps_them(corpus: Path, tmp_path: Path) -> None:
    d = nanogpt_folder(tmp_path / "shakespeare", corpus)
    users = listing(d)
    # --input D/input.txt --output_dir D: nothing there is prepare's, so nothing is overwritten.
    tokenize_corpus(config(d / "input.txt", d))
    assert TokenData(d).vocab_size == 300
    (d / "notes.txt").write_text("mine")
    users = {**users, "notes.txt": b"mine"}
    with pytest.raises(ValueError, match="already holds output .*pass --overwrite"):
        tokenize_corpus(config(d / "input.txt", d, vocab_size=320))
    tokenize_corpus(config(d / "input.txt", d, vocab_size=320, overwrite=True))
    assert TokenData(d).vocab_size == 320
    assert {k: v for k, v in listing(d).items() if k in users} == users  # the corpus it read, the script, the notes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shakespeare"]  # no staging folder left


def test_shards_gptopt_did_not_write_are_never_replaced_and_the_advice_is_not_overwrite(
    corpus: Path, tmp_path: Path
) -> None:
    d = nanogpt_folder(tmp_path / "shakespeare", corpus)
    np.arange(100, dtype=np.uint16).tofile(d / "train.bin")  # nanoGPT's own shards
    np.arange(10, dtype=np.uint16).tofile(d / "val.bin")
    before = listing(d)
    for overwrite in (False, True):  # the first refusal never names a flag that would refuse in turn
        with pytest.raises(ValueError) as e:
            tokenize_corpus(config(d / "input.txt", d, overwrite=overwrite))
        assert "holds train.bin, val.bin and is not marked as gptopt's" in str(e.value)
        assert "pass --overwrite" not in str(e.value)
        assert str(e.value).endswith("move them out, or choose another --output_dir")
    assert listing(d) == before and sorted(p.name for p in tmp_path.iterdir()) == ["shakespeare"]
    for name in ("train.bin", "val.bin"):  # the advice works: moved out, prepare writes beside input.txt
        (d / name).rename(tmp_path / name)
    tokenize_corpus(config(d / "input.txt", d))
    assert TokenData(d).vocab_size == 300


def test_data_prepared_before_marks_existed_can_be_overwritten(corpus: Path, tmp_path: Path) -> None:
    out = tokenize_corpus(config(corpus, tmp_path / "out"))
    (out / ".gptopt-output.json").unlink()  # as every earlier version left data/stdlib
    (out / "notes.txt").write_text("mine")
    tokenize_corpus(config(corpus, out, vocab_size=320, overwrite=True))
    assert TokenData(out).vocab_size == 320 and (out / "notes.txt").read_text() == "mine"


def test_an_output_dir_inside_the_input_folder_is_refused(corpus: Path, tmp_path: Path) -> None:
    (tmp_path / "texts").mkdir()
    texts = write_corpus(tmp_path / "texts")
    for out in (texts, texts / "data"):
        with pytest.raises(ValueError, match="lies inside --input"):
            tokenize_corpus(config(texts, out))
    assert not (texts / "data").exists() and not (texts / "train.bin").exists()


def test_a_failed_move_puts_the_old_files_back(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tokenize_corpus(config(corpus, tmp_path / "out"))
    (out / "notes.txt").write_text("mine")
    before = listing(out)
    real = os.replace

    def full_disk(src: object, dst: object) -> None:
        if Path(str(dst)).name == "meta.json" and ".tmp-" in str(src):  # meta.json goes in last: it fails last
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        tokenize_corpus(config(corpus, out, vocab_size=320, overwrite=True))
    monkeypatch.undo()
    assert listing(out) == before and TokenData(out).vocab_size == 300
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gptopt-output.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_replaces_prepared_data(corpus: Path, tmp_path: Path) -> None:
    out = tokenize_corpus(config(corpus, tmp_path / "out"))
    with pytest.raises(ValueError, match="--overwrite"):
        tokenize_corpus(config(corpus, out, vocab_size=320))
    assert TokenData(out).vocab_size == 300
    tokenize_corpus(config(corpus, out, vocab_size=320, overwrite=True))
    assert TokenData(out).vocab_size == 320
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old dir left behind


@pytest.mark.parametrize("where", ["_encode", "write_meta"])
def test_interrupted_prepare_leaves_nothing(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            where: str) -> None:
    old = tokenize_corpus(config(corpus, tmp_path / "old"))
    old_meta = (old / "meta.json").read_text()

    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, where, interrupt)
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus(config(corpus, tmp_path / "new"))
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus(config(corpus, old, overwrite=True, vocab_size=320))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no new dir, no temp dir
    assert (old / "meta.json").read_text() == old_meta and TokenData(old).num_tokens("train") > 0


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or folder"):
        tokenize_corpus(config(tmp_path / "missing", tmp_path / "o1"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        tokenize_corpus(config(tmp_path / "empty", tmp_path / "o2"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text(" \n\n")
    with pytest.raises(ValueError, match="no text"):
        tokenize_corpus(config(tmp_path / "blank", tmp_path / "o3"))
    (tmp_path / "bad.jsonl").write_text('{"body": "hello"}\n')
    with pytest.raises(ValueError, match="--text_field"):
        tokenize_corpus(config(tmp_path / "bad.jsonl", tmp_path / "o4"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "blank", "empty"]


def test_single_file_is_split_inside(tmp_path: Path) -> None:
    text = "".join(f"To be or not to be, line {i}.\n" for i in range(400))
    (tmp_path / "play.txt").write_text(text)
    d = TokenData(tokenize_corpus(config(tmp_path / "play.txt", tmp_path / "out", val_fraction=0.1)))
    assert d.meta["documents"] == 1
    tok = d.tokenizer()
    train, val = tok.decode(d.tokens("train").tolist()), tok.decode(d.tokens("val").tolist())
    assert train + val == text  # the tail is held out, nothing lost or repeated
    assert 0.05 < len(val) / len(text) < 0.15


def test_files_of_other_kinds_in_the_folder_are_skipped_and_counted(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    folder = write_corpus(tmp_path / "texts")  # it holds image.png
    (folder / "sub" / "LICENSE").write_text("not read: no suffix")
    (folder / ".hidden.bin").write_bytes(b"\x00")  # hidden: passed over without a word, as hidden folders are
    with caplog.at_level("INFO", logger="gptopt"):
        d = TokenData(tokenize_corpus(config(folder, tmp_path / "out")))
    assert d.meta["documents"] == len(DOCS)
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 1 and "skipped 2 files of other kinds ((no suffix), .png)" in said[0]


def test_jsonl_documents_and_max_documents(tmp_path: Path) -> None:
    rows = [{"content": f"document number {i}\n" * 20} for i in range(10)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tmp_path / "docs.jsonl", tmp_path / "out", text_field="content", max_documents=6)
    d = TokenData(tokenize_corpus(cfg))
    docs = split_documents(d, "train") + split_documents(d, "val")
    assert sorted(docs) == sorted(r["content"] for r in rows[:6])


def test_given_tokenizer_folder_in_gpt2_layout(prepared: Path, corpus: Path, tmp_path: Path) -> None:
    # vocab.json + merges.txt is how GPT-2's own tokenizer ships; make one from the trained BPE.
    source = TokenData(prepared).tokenizer()
    (tmp_path / "tok").mkdir()
    source.model.save(str(tmp_path / "tok"))
    tok = load_tokenizer(tmp_path / "tok")
    s = "def fib(n): return 'Café'"
    assert tok.encode(s).ids == source.encode(s).ids and tok.decode(tok.encode(s).ids) == s
    d = TokenData(tokenize_corpus(config(corpus, tmp_path / "out", tokenizer=str(tmp_path / "tok"))))
    assert d.meta["tokenizer"]["kind"] == "file"
    assert d.eot_id == source.token_to_id("<|endoftext|>")
    same = TokenData(prepared)  # same corpus, same tokenizer, same seed: the same shards
    assert np.array_equal(d.tokens("train"), same.tokens("train"))
    assert np.array_equal(d.tokens("val"), same.tokens("val"))


def test_unknown_tokenizer_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(name: str) -> None:
        raise OSError("Name or service not known")

    monkeypatch.setattr(tokenizer, "_from_hub", offline)  # the real call would wait for network retries
    with pytest.raises(ValueError, match="tokenizer 'gpt2' is no local file.*--tokenizer bpe"):
        load_tokenizer("gpt2")


def test_dataset_source_streams_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The --dataset path against a stand-in for the `datasets` package (the real one is tested below)."""
    calls = []

    def load_dataset(name, config=None, *, split, streaming):
        calls.append((name, config, split, streaming))
        if name == "empty":
            return iter([])
        return iter([{"text": f"row {i} " * 50, "id": i} for i in range(20)] + [{"text": "", "id": 99}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = dict(input=None, dataset="some/corpus", dataset_config="en", max_documents=12)
    d = TokenData(tokenize_corpus(config(tmp_path, tmp_path / "out", **cfg)))
    assert calls == [("some/corpus", "en", "train", True)]
    assert d.meta["documents"] == 12 and d.meta["source"] == "dataset some/corpus:train"
    assert not (tmp_path / "out" / "documents.jsonl").exists()  # the spool is not part of the output
    with pytest.raises(ValueError, match="'body' column.*--text_field"):
        tokenize_corpus(config(tmp_path, tmp_path / "o2", **cfg, text_field="body"))
    with pytest.raises(ValueError, match="no documents"):
        tokenize_corpus(config(tmp_path, tmp_path / "o3", input=None, dataset="empty"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_dataset_with_real_datasets_library(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    rows = [{"text": f"record {i}: " + "words " * 30} for i in range(15)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = TokenData(tokenize_corpus(config(tmp_path, tmp_path / "out", input=None, dataset=str(tmp_path / "rows.jsonl"))))
    assert sorted(split_documents(d, "train") + split_documents(d, "val")) == sorted(r["text"] for r in rows)


def test_cli_prepare(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["prepare", "--input", str(corpus), "--output_dir", str(out), "--vocab_size", "300"]) == 0
    summary = capsys.readouterr().out
    assert f"{len(DOCS)} documents" in summary and str(out) in summary and "vocab 300" in summary
    assert main(["prepare", "--input", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o2")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["prepare", "--input", str(corpus), "--output_dir", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.slow
def test_stdlib_corpus_default_vocab(tmp_path: Path) -> None:
    d = TokenData(tokenize_corpus(PrepareConfig(output_dir=str(tmp_path / "stdlib"))))
    assert d.meta["source"].startswith("stdlib") and d.vocab_size == 8192
    assert d.meta["documents"] > 500 and d.meta["val_documents"] >= 1
    # the stdlib's sources are millions of tokens; the bound leaves room for a smaller installation
    assert d.num_tokens("train") > 2_500_000 and d.num_tokens("val") > 1000
    for source in split_documents(d, "val"):  # whole stdlib modules come back, still valid Python
        compile(source, "<val document>", "exec")


# ----------------------------------------------------------------------------------------------
# reading


def test_token_dtype_fits_the_vocabulary() -> None:
    assert token_dtype(50257) == np.uint16 and token_dtype(1 << 16) == np.uint16  # ids up to 65535
    assert token_dtype((1 << 16) + 1) == np.uint32 and token_dtype(128_256) == np.uint32


def test_nanogpt_directory_is_readable(tmp_path: Path) -> None:
    train = np.arange(1000, dtype=np.uint16) % 777
    train.tofile(tmp_path / "train.bin")
    np.full(100, 5, dtype=np.uint16).tofile(tmp_path / "val.bin")
    d = TokenData(tmp_path)
    assert d.vocab_size is None and d.tokenizer() is None and d.max_token_id() == 776
    assert np.array_equal(d.tokens("train"), train)
    d.check_vocab(777)
    with pytest.raises(ValueError, match="exceed the model's vocabulary"):
        d.check_vocab(776)


def test_missing_or_incomplete_data_is_a_clear_error(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gptopt prepare"):
        TokenData(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="gptopt prepare"):
        TokenData(tmp_path / "empty")
    # A shard shorter than meta.json says (a copy cut off, a full disk) is refused, not read short.
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("meta.json", "tokenizer.json", "val.bin"):
        (cut / name).write_bytes((prepared / name).read_bytes())
    (cut / "train.bin").write_bytes((prepared / "train.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        TokenData(cut).tokens("train")


def _copy(prepared: Path, target: Path) -> Path:
    target.mkdir()
    for f in prepared.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: [m], "expected a JSON object, got list"),
        (lambda m: {**m, "vocab_size": "big"}, "vocab_size must be a positive integer, got 'big'"),
        (lambda m: {**m, "dtype": "float64"}, "dtype must be one of uint16, uint32, got 'float64'"),
        (lambda m: {**m, "dtype": "uint16", "vocab_size": 70000}, "does not fit dtype uint16"),
        (lambda m: {**m, "train_tokens": -5}, "train_tokens must be a count of tokens"),
        (lambda m: {k: v for k, v in m.items() if k != "val_tokens"}, "val_tokens must be a count"),
        (lambda m: {**m, "tokenizer": []}, "tokenizer must be an object"),
        (lambda m: {**m, "tokenizer": {**m["tokenizer"], "eot_id": 10**6}}, "tokenizer.eot_id must be a token id"),
        (lambda m: {**m, "version": "1"}, "not gptopt token data"),
    ],
)
def test_meta_json_of_the_wrong_shape_names_the_field(edit, needle: str, prepared: Path, tmp_path: Path) -> None:
    d = _copy(prepared, tmp_path / "d")
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps(edit(meta)))
    with pytest.raises(ValueError) as e:
        TokenData(d)
    assert needle in str(e.value) and str(d / "meta.json") in str(e.value)
    assert "gptopt prepare --overwrite" in str(e.value)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda t: t[: len(t) // 2], "not a Hugging Face tokenizer.json"),  # truncated
        (lambda t: '{"hello": "world"}', "not a Hugging Face tokenizer.json"),
    ],
)
def test_a_damaged_tokenizer_is_found_when_the_data_is_opened(damage, needle: str, prepared: Path,
                                                               tmp_path: Path) -> None:
    # not at the first evaluation, hundreds of steps into a run
    d = _copy(prepared, tmp_path / "d")
    (d / "tokenizer.json").write_text(damage((d / "tokenizer.json").read_text()))
    with pytest.raises(ValueError) as e:
        TokenData(d)
    assert needle in str(e.value) and str(d / "tokenizer.json") in str(e.value)
    assert f"gptopt prepare --overwrite --output_dir {d}" in str(e.value)


def test_a_tokenizer_of_another_size_is_refused_when_the_data_is_opened(prepared: Path, tmp_path: Path) -> None:
    from gptopt.data.corpus import train_bpe

    d = _copy(prepared, tmp_path / "d")
    train_bpe(["some other text entirely, " * 50], 280).save(str(d / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer.json has \d+ tokens, meta.json says 300"):
        TokenData(d)


def test_train_with_a_damaged_tokenizer_stops_before_the_first_step(prepared: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(prepared, tmp_path / "d")
    (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text()[:100])
    rc = main(["train", "--data_dir", str(d), "--preset", "debug", "--device", "cpu", "--seq_len", "16",
               "--eval_interval", "2", "--output_dir", str(tmp_path / "out"), "--no-tensorboard"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer.json" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_check_vocab(prepared: Path) -> None:
    d = TokenData(prepared)
    d.check_vocab(300)
    d.check_vocab(512)
    with pytest.raises(ValueError, match="shard token ids exceed the model's vocabulary"):
        d.check_vocab(256)


def test_token_data_pickles_without_the_shards(prepared: Path) -> None:
    d = TokenData(prepared)
    d.tokens("train"), d.tokens("val"), d.tokenizer()
    blob = pickle.dumps(d)
    assert len(blob) < 4096  # not the mapped arrays
    assert np.array_equal(pickle.loads(blob).tokens("train"), d.tokens("train"))


def windows(d: TokenData, split: str, T: int) -> set[bytes]:
    tokens = np.asarray(d.tokens(split), dtype=np.int64)
    return {w.tobytes() for w in np.lib.stride_tricks.sliding_window_view(tokens, T + 1)}


def test_batches_are_a_function_of_seed_rank_and_step(prepared: Path) -> None:
    d = TokenData(prepared)
    ds = BatchDataset(d, "train", batch_size=4, seq_len=16, seed=1)
    x, y = ds[5]
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    rows = torch.cat([x, y[:, -1:]], dim=1).numpy()
    assert all(r.tobytes() in windows(d, "train", 16) for r in rows)  # real windows of the shard
    again = BatchDataset(TokenData(prepared), "train", batch_size=4, seq_len=16, seed=1)[5]
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    for other in (ds[6], BatchDataset(d, "train", 4, 16, seed=1, rank=1, world_size=2)[5],
                  BatchDataset(d, "train", 4, 16, seed=2)[5]):
        assert not torch.equal(other[0], x)


def test_ranks_split_the_global_batch_of_one_process(prepared: Path) -> None:
    # DDP at micro-batch B on N ranks must see exactly the batch one process sees at N * B.
    d = TokenData(prepared)
    whole = BatchDataset(d, "train", batch_size=6, seq_len=16, seed=4)[7]
    parts = [BatchDataset(d, "train", 3, 16, seed=4, rank=r, world_size=2)[7] for r in (0, 1)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_loader_continues_exactly(prepared: Path, num_workers: int) -> None:
    ds = BatchDataset(TokenData(prepared), "train", batch_size=2, seq_len=8, seed=3)
    settings = dict(num_workers=num_workers, prefetch_factor=2, persistent_workers=num_workers > 0)
    fresh = [x for (x, _), _ in zip(make_loader(ds, 0, **settings), range(7), strict=False)]
    resumed = [x for (x, _), _ in zip(make_loader(ds, 4, **settings), range(3), strict=False)]
    assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(fresh[4:], resumed, strict=True))
    assert not torch.equal(fresh[0], fresh[1])


def test_default_loader_settings_build_loaders(prepared: Path) -> None:
    ds = BatchDataset(TokenData(prepared), "train", batch_size=2, seq_len=8, seed=0)
    cpu = data.default_loader_settings("cpu")
    assert cpu["num_workers"] == 0 and not cpu["pin_memory"]
    x, _ = next(iter(make_loader(ds, 0, **cpu)))
    assert torch.equal(x, ds[0][0])
    cuda = data.default_loader_settings("cuda")
    assert cuda["pin_memory"] and (cuda["num_workers"] > 0) == cuda["persistent_workers"]
    make_loader(ds, 0, **cuda)  # DataLoader validates the combination when built


def test_eval_batches_are_fixed_and_cover_the_split(prepared: Path) -> None:
    d = TokenData(prepared)
    ds = BatchDataset(d, "train", batch_size=2, seq_len=8, seed=0)
    first, second = list(ds.eval_batches("val", 3)), list(ds.eval_batches("val", 3))
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
    val = d.tokens("val")
    assert torch.equal(first[0][0][0], torch.from_numpy(val[:8].astype(np.int64)))  # from the start...
    assert torch.equal(first[-1][1][-1], torch.from_numpy(val[-8:].astype(np.int64)))  # ...to the end
    own = list(BatchDataset(d, "val", batch_size=2, seq_len=8, seed=5).eval_batches(3))  # its own split
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, own, strict=True))
    ranks = [list(BatchDataset(d, "train", 2, 8, seed=0, rank=r, world_size=2).eval_batches("val", 2)) for r in (0, 1)]
    assert not torch.equal(ranks[0][0][0], ranks[1][0][0])


def test_split_shorter_than_a_window_is_refused(prepared: Path) -> None:
    d = TokenData(prepared)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        BatchDataset(d, "val", batch_size=2, seq_len=d.num_tokens("val"), seed=0)


def test_a_damaged_shard_is_found_when_the_data_is_opened(train_data: Path, tmp_path: Path) -> None:
    import shutil

    damaged = tmp_path / "d"
    shutil.copytree(train_data, damaged)
    (damaged / "val.bin").write_bytes(b"")  # found at the first evaluation otherwise, after the steps before it
    with pytest.raises(ValueError, match="val.bin holds 0 bytes"):
        TokenData(damaged)
