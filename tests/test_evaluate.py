"""gptopt eval: HellaSwag scored completion-style (acc, acc_norm per byte) and bits per byte of held-out text,
for every model family, checked against scores computed here by other routes; the download for users who are
online; every bad input one line, exit 2.

    pytest -q tests/test_evaluate.py

No test touches the network: the download is given a fake response or an unreachable one.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any
from urllib.error import URLError

import numpy as np
import pytest
import torch
from conftest import last_json_line, make_varied_model, split_bytes_per_token
from tokenizers import Tokenizer

from gptopt import cli
from gptopt.commands import eval as evaluate
from gptopt.config import preset
from gptopt.models import hf
from gptopt.models.checkpoint import save_model
from gptopt.models.gpt import GPT

# Contexts and endings of several lengths: the rows of one forward are padded, and the first
# context is longer than the debug model's 64 tokens, so it is cut from the left.
LONG = "The quick brown fox jumps over the lazy dog. " * 12
EXAMPLES = [
    (LONG + "Then the fox",
     ["ran away into the woods.", "sat.", "jumped over the moon and back again twice.", "slept"]),
    ("def fib(n):\n    return", [" n if n < 2 else fib(n - 1)", "None", "fib", "the end of the function body"]),
    ("import os, sys", ["print('hello, world')", "os.path.join('a', 'b')", "x = 1", "sys.exit(0)"]),
]


def write_jsonl(path: Path, examples: list[tuple[str, list[str]]], labels: list[int]) -> Path:
    path.write_text("".join(json.dumps({"ind": i, "ctx": c, "endings": e, "label": y, "split": "val"}) + "\n"
                            for i, ((c, e), y) in enumerate(zip(examples, labels, strict=True))))
    return path


def eval_cli(model: Path, data: Path, *extra: str) -> list[str]:
    return ["eval", "--model", str(model), "--data", str(data), "--device", "cpu", "--json", *extra]


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert cli.main(argv) == 0, capsys.readouterr().err
    return last_json_line(capsys.readouterr().out)


def choices(lls: list[float], endings: list[str]) -> tuple[int, int]:
    """The two argmaxes, by summed log-likelihood and per byte, with a margin: a near tie would make the
    expected answer depend on rounding."""
    per_byte = [ll / len(e.encode()) for ll, e in zip(lls, endings, strict=True)]
    for values in (lls, per_byte):
        top = sorted(values, reverse=True)
        assert top[0] - top[1] > 1e-3, values
    return max(range(4), key=lls.__getitem__), max(range(4), key=per_byte.__getitem__)


# ----------------------------------------------------------------------------------------------
# Scores


def test_a_unigram_model_scores_as_computed_by_hand(debug_tokenizer: Tokenizer, train_data: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # A GPT whose every position predicts the same distribution: all weights zero, so ln_f puts out its
    # bias b = e_0 and the logits are column 0 of the (tied) embedding, u: 4 for the token " self", 0 for the
    # V - 1 others. An ending of n tokens, k of them " self", then has the log-likelihood 4k - n * L,
    # L = log(V - 1 + e^4) (about 5.92 for V = 320), whatever its context.
    V = debug_tokenizer.get_vocab_size()
    liked = debug_tokenizer.token_to_id("Ġself")
    assert debug_tokenizer.encode(" self").ids == [liked]
    model = GPT(preset("debug", vocab_size=V))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wte.weight[liked, 0] = 4.0
        model.transformer.ln_f.bias[0] = 1.0
    m = save_model(model, tmp_path / "unigram", {"tokenizer": str(train_data / "tokenizer.json")})
    L = math.log(V - 1 + math.exp(4.0))
    examples = [
        # "a": one token, -L in sum, the best; "self" x 4: 4 (4 - L), about -7.7 in sum, but -0.4 per byte
        # (19 bytes), the best per byte: the right one, so acc misses it and acc_norm finds it.
        ("A story about", ["a", "self self self self", "in the", "the self"]),
        # "self": 4 - L, about -1.9, the best both ways: both find it.
        ("Then it was", ["self", "the", "in a", "if the"]),
        # "self" again the best both ways, but the right one is "in the": both miss it.
        ("And finally", ["self", "a", "the", "in the"]),
        # Per byte, not per token: "self" is the best per token (4 - L, nothing better is possible) and in
        # sum; the right ending is 5 x " self" and a 12-byte indentation token, 6 tokens of 36 bytes:
        # (20 - 6 L) / 36, about -0.43 per byte against "self"'s (4 - L) / 4, about -0.48.
        ("def f(x):", ["self", "self self self self\n            self", "the", "in"]),
    ]
    labels = [1, 0, 3, 1]
    for (_, endings), (by_sum, by_byte) in zip(examples, [(0, 1), (0, 0), (0, 0), (0, 1)], strict=True):
        # the hand reasoning above, checked against the formula on the real tokens
        lls = [sum(4.0 if t == liked else 0.0 for t in ids) - len(ids) * L
               for ids in (debug_tokenizer.encode(" " + e).ids for e in endings)]
        assert choices(lls, endings) == (by_sum, by_byte)
    res = run_json(eval_cli(m, write_jsonl(tmp_path / "h.jsonl", examples, labels)), capsys)
    assert (res["correct"], res["correct_norm"], res["examples"]) == (1, 3, 4)
    assert res["acc"] == pytest.approx(1 / 4) and res["acc_norm"] == pytest.approx(3 / 4)


def family_source(kind: str, model_dir: Path, train_data: Path, root: Path) -> Path:
    """A model to evaluate, with its tokenizer: "gpt2" (model_dir); "llama" (a gptopt checkpoint of the Llama
    shape); "hf-llama" / "hf-qwen3" (a Hugging Face LlamaForCausalLM / Qwen3ForCausalLM directory, tokenizer.json
    beside its weights). Wide random weights, so the endings' scores stand apart."""
    if kind == "gpt2":
        return model_dir
    tokenizer = train_data / "tokenizer.json"
    model = make_varied_model(Tokenizer.from_file(str(tokenizer)).get_vocab_size(), kind.removeprefix("hf-"))
    if kind == "llama":
        return save_model(model, root / kind, {"tokenizer": str(tokenizer), "data_dir": str(train_data)})
    out = hf.export_hf(model, root / kind)
    (out / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama", "hf-llama", "hf-qwen3"])
def test_scores_equal_a_plain_forward_of_each_ending_alone(kind: str, model_dir: Path, train_data: Path,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The other route: one unpadded forward per (context, ending), log_softmax and gather, the context cut
    # to the model's window by hand. The command batches rows of different lengths (2 examples, 8 rows).
    model_dir = family_source(kind, model_dir, train_data, tmp_path)
    tok = Tokenizer.from_file(str(train_data / "tokenizer.json"))
    model = hf.load_pretrained(model_dir).eval()
    block = model.config.block_size
    preds = []
    for context, endings in EXAMPLES:
        lls = []
        for e in endings:
            c_ids, e_ids = tok.encode(context).ids, tok.encode(" " + e).ids
            seq = (c_ids + e_ids)[-(block + 1):]
            with torch.no_grad():
                logp = model(torch.tensor([seq[:-1]]))[0].float().log_softmax(-1)
            picked = logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            lls.append(picked[-len(e_ids):].sum().item())
        preds.append(choices(lls, endings))
    assert len(tok.encode(EXAMPLES[0][0]).ids) > block  # the first context really is cut
    # Labels that tell the two scores apart where the model allows: the first example right by acc,
    # the second right by acc_norm, the third wrong by both.
    labels = [preds[0][0], preds[1][1], next(i for i in range(4) if i not in preds[2])]
    expected_acc = sum(p == y for (p, _), y in zip(preds, labels, strict=True))
    expected_norm = sum(p == y for (_, p), y in zip(preds, labels, strict=True))
    data = write_jsonl(tmp_path / "h.jsonl", EXAMPLES, labels)
    res = run_json(eval_cli(model_dir, data, "--batch_size", "2"), capsys)
    assert (res["correct"], res["correct_norm"]) == (expected_acc, expected_norm)
    assert res["truncated_rows"] == 4 and res["task"] == "hellaswag" and res["data"] == str(data.resolve())
    one = run_json(eval_cli(model_dir, data, "--batch_size", "1", "--limit", "1"), capsys)
    assert one["examples"] == 1 and one["correct"] == int(preds[0][0] == labels[0])


# ----------------------------------------------------------------------------------------------
# Bits per byte


HELD_OUT = LONG + "def naïve(x):\n    return '😀' * x\n"  # several windows of 64 tokens, multi-byte characters


@pytest.mark.parametrize("kind", ["gpt2", "llama", "hf-qwen3"])
def test_bits_per_byte_of_a_text_file_equal_a_plain_forward_of_its_windows(
        kind: str, model_dir: Path, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The other route: the text's tokens after an end-of-text token, one forward per window of the model's
    # context, the summed loss over ln 2 over the text's UTF-8 bytes
    source = family_source(kind, model_dir, train_data, tmp_path)
    tok = Tokenizer.from_file(str(train_data / "tokenizer.json"))
    model = hf.load_pretrained(source).eval()
    seq = [tok.token_to_id("<|endoftext|>"), *tok.encode(HELD_OUT).ids]
    T = model.config.block_size
    assert len(seq) > 2 * T + 1  # windows of the full context and a shorter last one
    nll = 0.0
    with torch.no_grad():
        for s in range(0, len(seq) - 1, T):
            x, y = torch.tensor([seq[s : s + T + 1][:-1]]), torch.tensor(seq[s + 1 : s + T + 1])
            nll += torch.nn.functional.cross_entropy(model(x)[0].float(), y, reduction="sum").item()
    nbytes = len(HELD_OUT.encode("utf-8"))
    text = tmp_path / "held_out.txt"
    text.write_text(HELD_OUT, encoding="utf-8")
    res = run_json(["eval", "--task", "bpb", "--model", str(source), "--data", str(text), "--device", "cpu",
                    "--dtype", "fp32", "--batch_size", "2", "--json"], capsys)
    assert (res["task"], res["tokens"], res["bytes"]) == ("bpb", len(seq) - 1, nbytes)
    assert res["loss"] == pytest.approx(nll / (len(seq) - 1), rel=1e-5)
    assert res["bits_per_byte"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-5)


def test_bits_per_byte_default_to_the_val_split_of_the_training_data(
        train_data: Path, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = family_source("llama", model_dir, train_data, tmp_path)  # its checkpoint records train_data
    out = tmp_path / "eval_out"
    res = run_json(["eval", "--task", "bpb", "--model", str(source), "--device", "cpu", "--batch_size", "16",
                    "--output_dir", str(out), "--json"], capsys)
    val = np.fromfile(train_data / "val.bin", dtype=np.uint16)
    assert res["data"] == str(train_data.resolve()) and res["tokens"] == len(val) - 1
    assert res["bits_per_byte"] == pytest.approx(res["loss"] / math.log(2) / split_bytes_per_token(train_data),
                                                 rel=1e-6)
    assert json.loads((out / "results.json").read_text()) == res
    assert cli.main(["eval", "--task", "bpb", "--model", str(source), "--device", "cpu", "--limit", "2"]) == 0
    printed = capsys.readouterr().out
    assert "bits per byte" in printed and "loss (nats/token)" in printed and "2 windows" in printed


@pytest.mark.parametrize(("make", "needles"), [
    (None, ["records no training data", "--data"]),
    (lambda d: d / "missing.txt", ["no such file or folder", "a text file"]),
    (lambda d: (d / "empty.txt", (d / "empty.txt").write_text("\n"))[0], ["holds no text"]),
    (lambda d: (d / "bin.txt", (d / "bin.txt").write_bytes(b"\xff\xfe"))[0], ["not UTF-8"]),
    (lambda d: (d, (d / "train.bin").write_bytes(b"\0" * 8), (d / "val.bin").write_bytes(b"\0" * 8))[0],
     ["stores no tokenizer", "give the text itself"]),
])
def test_bits_per_byte_without_held_out_text_is_one_line_naming_the_fix(
        make: Any, needles: list[str], model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(evaluate, "load_for_inference", no_model)
    data = [] if make is None else ["--data", str(make(tmp_path))]
    assert cli.main(["eval", "--task", "bpb", "--model", str(model_dir), *data, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gptopt eval: error:"), err
    for needle in needles:
        assert needle in err, err


def test_output_still_names_the_output_dir_and_errors_name_output_dir(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --output is --output_dir's old name: command lines written for it still run, and are told the new name
    data = write_jsonl(tmp_path / "h.jsonl", EXAMPLES[1:], [0, 3])
    (tmp_path / "file").write_text("x")
    assert cli.main(eval_cli(model_dir, data, "--output", str(tmp_path / "file"))) == 2
    err = capsys.readouterr().err
    assert "--output_dir" in err and "is a file" in err and len(err.strip().splitlines()) == 1
    assert cli.main(eval_cli(model_dir, data, "--output", str(tmp_path / "out"))) == 0
    assert (tmp_path / "out" / "results.json").is_file()


def test_results_json_and_the_table(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "h.jsonl", EXAMPLES[1:], [0, 3])
    out = tmp_path / "eval_out"
    argv = eval_cli(model_dir, data, "--output_dir", str(out))
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "acc_norm" in stdout and "per byte" in stdout
    assert json.loads((out / "results.json").read_text()) == last_json_line(stdout)
    assert cli.main(argv) == 2 and "--overwrite" in capsys.readouterr().err  # an earlier output is kept
    assert cli.main([*argv, "--overwrite"]) == 0


def test_ctx_a_and_ctx_b_and_a_string_label_are_read_as_hellaswag_writes_them(tmp_path: Path) -> None:
    f = tmp_path / "h.jsonl"
    f.write_text(json.dumps({"ctx_a": "A man sits.", "ctx_b": "he", "endings": ["a", "b", "c", "d"], "label": "2"})
                 + "\n\n" + json.dumps({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n")
    first, second = evaluate.read_hellaswag(f)
    assert (first.context, first.label, first.line) == ("A man sits. he", 2, 1)
    assert second.line == 3  # the blank line is skipped, and still counted
    assert len(evaluate.read_hellaswag(f, limit=1)) == 1


# ----------------------------------------------------------------------------------------------
# The download


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gptopt" / "hellaswag"


def test_without_data_hellaswag_is_downloaded_once(model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    body = "".join(json.dumps({"ctx": c, "endings": e, "label": 0}) + "\n" for c, e in EXAMPLES).encode()
    asked: list[str] = []

    def fake_urlopen(url: str, timeout: float) -> io.BytesIO:
        asked.append(url)
        return io.BytesIO(body)

    monkeypatch.setattr(evaluate, "urlopen", fake_urlopen)
    argv = ["eval", "--model", str(model_dir), "--device", "cpu", "--json"]
    assert run_json(argv, capsys)["examples"] == 3
    assert asked == [evaluate.HELLASWAG_URL] and (cache / "hellaswag_val.jsonl").read_bytes() == body
    assert run_json(argv, capsys)["examples"] == 3 and len(asked) == 1  # the second run reads the cached copy


def test_offline_without_data_is_one_line_naming_data(model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def offline(url: str, timeout: float) -> Any:
        raise URLError(OSError(101, "Network is unreachable"))

    monkeypatch.setattr(evaluate, "urlopen", offline)
    monkeypatch.setattr(evaluate, "load_for_inference", no_model)
    assert cli.main(["eval", "--model", str(model_dir), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Network is unreachable" in err and "--data FILE.jsonl" in err, err
    assert not cache.exists() or not list(cache.iterdir())  # no half file taken for the val set later


def test_a_download_that_breaks_off_leaves_no_file(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(io.BytesIO):
        def read(self, *args: Any) -> bytes:
            raise TimeoutError("timed out")

    monkeypatch.setattr(evaluate, "urlopen", lambda url, timeout: Broken())
    with pytest.raises(ValueError, match="broke off .*--data"):
        evaluate.hellaswag_file()
    assert not (cache / "hellaswag_val.jsonl").exists()


# ----------------------------------------------------------------------------------------------
# Bad input: one line naming the problem (and the line), exit 2, before the model loads


def no_model(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model was loaded before the examples were checked")


GOOD = {"ctx": "A man sits.", "endings": ["a", "b", "c", "d"], "label": 1}


@pytest.mark.parametrize(("third_line", "needles"), [
    ("{not json", ["line 3", "not valid JSON"]),
    (json.dumps({**GOOD, "endings": ["a", "b", "c"]}), ["line 3", "3 endings", "4 per example"]),
    (json.dumps({**GOOD, "label": 4}), ["line 3", "label 4 is out of range", "0 to 3"]),
    (json.dumps({**GOOD, "label": "x"}), ["line 3", "label 'x' is out of range"]),
    (json.dumps({**GOOD, "label": ""}), ["line 3", "no label", "val set"]),
    (json.dumps({k: v for k, v in GOOD.items() if k != "ctx"}), ["line 3", "no context", "ctx_a"]),
    (json.dumps({**GOOD, "endings": ["a", "", "c", "d"]}), ["line 3", "ending 1 is empty"]),
    (json.dumps([1, 2]), ["line 3", "expected a JSON object"]),
    ('{"ctx": "\\udc80", "endings": ["a", "b", "c", "d"], "label": 0}', ["line 3", "lone surrogate"]),
])
def test_a_bad_line_is_named_by_its_number(third_line: str, needles: list[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(evaluate, "load_for_inference", no_model)
    f = tmp_path / "h.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n" + third_line + "\n")
    assert cli.main(["eval", "--data", str(f), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gptopt eval: error:") and str(f) in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(("make", "needle"), [
    (lambda d: d / "missing.jsonl", "no such file"),
    (lambda d: d, "is a folder"),
    (lambda d: (d / "empty.jsonl", (d / "empty.jsonl").write_text("\n"))[0], "holds no examples"),
    (lambda d: (d / "bin.jsonl", (d / "bin.jsonl").write_bytes(b'{"ctx": "\xff"}\n'))[0], "line 1: not UTF-8"),
])
def test_a_bad_data_file_is_one_line(make: Any, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(evaluate, "load_for_inference", no_model)
    assert cli.main(["eval", "--data", str(make(tmp_path)), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_eval_refuses_a_tokenizer_of_another_vocabulary_than_the_models(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the debug preset's 512 rows against the prepared data's 320 tokens: more apart than padding
    model = save_model(GPT(preset("debug")), tmp_path / "m")
    data = write_jsonl(tmp_path / "h.jsonl", EXAMPLES, [0, 0, 0])
    assert cli.main(eval_cli(model, data, "--tokenizer", str(train_data / "tokenizer.json"))) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert "Traceback" not in err and last.startswith("gptopt eval: error: the tokenizer has 320 tokens, the model 512")
    assert "pass the --tokenizer the model was trained with" in last


def test_an_ending_longer_than_the_context_window_is_named(model_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    long_ending = "word " * 200
    data = write_jsonl(tmp_path / "h.jsonl", [("ctx", ["a", "b", long_ending, "d"])], [0])
    assert cli.main(eval_cli(model_dir, data)) == 2
    err = capsys.readouterr().err.strip()  # after the loader's line naming the model it read
    last = err.splitlines()[-1]
    assert "Traceback" not in err and last.startswith("gptopt eval: error:"), err
    assert "line 1: ending 2 is" in last and "model's context of 64" in last, err
