"""Text and `gptopt generate`: stop strings and UTF-8 across token boundaries, loading a model and its tokenizer,
the command line (prompt, stdin, batch files, overwriting), quantisation refused before loading.

    pytest -q tests/test_generate_cli.py

Every model is the debug preset with random weights (fp32, CPU) and train_data's byte-level BPE.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import GREEDY, PROMPTS
from tokenizers import Tokenizer

from gptopt import cli
from gptopt.commands import generate as gen_mod
from gptopt.config import GenerateConfig
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference
from gptopt.infer.scheduler import generate
from gptopt.infer.stop import StopChecker
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

CPU = resolve("cpu")


# ----------------------------------------------------------------------------------------------
# Text: stop strings and UTF-8 across token boundaries


def feed(checker: StopChecker, ids: list[int]) -> list[str]:
    chunks = []
    for t in ids:
        chunks.append(checker.add(t))
        if checker.stopped:
            break
    return chunks + [checker.finish()]


def test_stop_string_across_token_boundaries(debug_tokenizer: Tokenizer) -> None:
    text = "def parse(args):\n    return args\n\nclass Parser:\n"
    ids = debug_tokenizer.encode(text).ids
    assert "\n\n" not in [debug_tokenizer.decode([t]) for t in ids]  # the stop spans tokens
    checker = StopChecker(debug_tokenizer, stop=("rn a", "\n\nclass"))
    assert "".join(feed(checker, ids)) == "def parse(args):\n    retu"
    assert checker.stopped and checker.text == "def parse(args):\n    retu"


def test_text_ending_in_a_stop_prefix_is_emitted_at_the_end(debug_tokenizer: Tokenizer) -> None:
    checker = StopChecker(debug_tokenizer, stop=("\n\n\n",))
    chunks = feed(checker, debug_tokenizer.encode("x = 1\n\n").ids)
    assert chunks[-1].endswith("\n\n") and "".join(chunks) == "x = 1\n\n" and not checker.stopped


def test_no_broken_utf8_when_a_character_spans_tokens(debug_tokenizer: Tokenizer) -> None:
    text = "naïve café 😀 ok 🚀!"
    ids = debug_tokenizer.encode(text).ids
    assert any("\ufffd" in debug_tokenizer.decode([t]) for t in ids)  # emoji bytes are separate tokens
    chunks = feed(StopChecker(debug_tokenizer), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
    assert "".join(feed(StopChecker(debug_tokenizer, stop=("🚀",)), ids)) == "naïve café 😀 ok "


def test_streamed_text_holds_back_exactly_the_tail_that_may_begin_a_stop_string(debug_tokenizer: Tokenizer) -> None:
    """After every token, what is shown is the text so far less its longest end that begins a stop string:
    nothing of a stop string leaks, and nothing more waits than must (many and long stop strings too)."""
    g = torch.Generator().manual_seed(0)
    alphabet = "ab\n "
    for _ in range(30):
        draw = torch.randint(len(alphabet), (120,), generator=g).tolist()
        text = "".join(alphabet[i] for i in draw)
        stops = tuple("".join(alphabet[i] for i in torch.randint(len(alphabet), (int(n),), generator=g).tolist())
                      for n in torch.randint(2, 9, (12,), generator=g))
        checker, shown = StopChecker(debug_tokenizer, stop=stops), ""
        ids = debug_tokenizer.encode(text).ids
        for k, t in enumerate(ids, 1):
            shown += checker.add(t)
            if checker.stopped:
                break
            so_far = debug_tokenizer.decode(ids[:k])
            hold = max((n for s in stops for n in range(1, len(s)) if so_far.endswith(s[:n])), default=0)
            assert shown == so_far[: len(so_far) - hold]
        shown += checker.finish()
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        assert shown == text[:cut]


# ----------------------------------------------------------------------------------------------
# Loading and the CLI


def greedy_cli(model: Path | str, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--device", "cpu", "--temperature", "0", "--max_new_tokens", "12",
            *extra]


def test_cli_prompt_argument_streams_the_completion(model_dir: Path, debug_tokenizer: Tokenizer,
                                                    varied_model: GPT, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(greedy_cli(model_dir, "def f(x):")) == 0
    out, err = capsys.readouterr()
    ids = debug_tokenizer.encode("def f(x):").ids
    eot = debug_tokenizer.token_to_id("<|endoftext|>")  # the CLI stops at the end of a document
    params = dataclasses.replace(GREEDY, max_new_tokens=12, stop_token_ids=(eot,))
    loaded, _ = load_for_inference(str(model_dir), tokenizer=None, plan=CPU)  # as the CLI loads it: its dtype
    expected = generate(Generator(loaded, CPU), [ids], params)[0]
    assert out == debug_tokenizer.decode(expected) + "\n"
    assert "tokens/s" in err


def test_cli_reads_the_prompt_from_stdin_and_stops_at_a_stop_string(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n"))
    assert cli.main(greedy_cli(model_dir, "-")) == 0
    full = capsys.readouterr().out.removesuffix("\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):"))  # same prompt: the newline echo adds is dropped
    stop = full[4:7]
    assert cli.main(greedy_cli(model_dir, "--stop", stop)) == 0
    assert capsys.readouterr().out == full[: full.index(stop)] + "\n"


def test_cli_batch_mode_writes_jsonl_and_refuses_to_overwrite(model_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["import os", "def main():", "x", "class A:", "# comment"]
    (tmp_path / "in.txt").write_text("\n".join(prompts) + "\n\n")
    lines = (json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts))
    (tmp_path / "in.jsonl").write_text("".join(lines))
    out = tmp_path / "out.jsonl"
    assert cli.main(greedy_cli(model_dir, "--input", str(tmp_path / "in.txt"), "--output", str(out),
                               "--batch_size", "2")) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert all(r["tokens"] == 12 and r["finish_reason"] == "length" and r["completion"] for r in rows)
    assert "generate" in capsys.readouterr().err  # the progress bar
    # The same prompts from .jsonl, another batch size: the same greedy completions.
    assert cli.main(greedy_cli(model_dir, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "b.jsonl"),
                               "--batch_size", "3")) == 0
    assert [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()] == rows
    with pytest.raises(ValueError, match="out.jsonl exists; nothing was written: pass --overwrite"):
        gen_mod.main(GenerateConfig(model=str(model_dir), input=str(tmp_path / "in.txt"), output=str(out)))


def test_overwrite_replaces_an_output_file_only_when_the_new_one_is_complete(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in.txt").write_text("import os\ndef main():\nx\n")
    out = tmp_path / "out.jsonl"
    earlier = json.dumps({"prompt": "a", "completion": "b", "tokens": 1, "finish_reason": "length"}) + "\n"
    out.write_text(earlier)  # an earlier run's output: the one kind of file --overwrite replaces
    args = greedy_cli(model_dir, "--input", str(tmp_path / "in.txt"), "--output", str(out), "--batch_size", "2")

    def broken(*a: object, **kw: object) -> None:
        raise RuntimeError("out of memory in the second batch")

    with monkeypatch.context() as m:
        m.setattr(gen_mod, "complete", broken)
        with pytest.raises(RuntimeError):
            gen_mod.main(cli.parse_config("generate", GenerateConfig, [*args[1:], "--overwrite"],
                                          cli.build_parser("generate", GenerateConfig)))
    assert out.read_text() == earlier  # the failed run left it as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"]  # and no temporary file
    assert cli.main([*args, "--overwrite"]) == 0
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["import os", "def main():", "x"]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The error line of a CLI run that must exit 2 without writing anything (after the model's log line, if
    it was loaded)."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("gptopt generate: error: "), err
    return err.splitlines()[-1]


def test_generate_refuses_a_tokenizer_of_another_vocabulary_than_the_models(
    debug_model: GPT, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the debug preset's 512 rows against the prepared data's 320 tokens: more apart than padding
    model = checkpoint.save_model(debug_model, tmp_path / "m")
    line = refused(greedy_cli(model, "--tokenizer", str(train_data / "tokenizer.json"), "x"), capsys)
    assert "the tokenizer has 320 tokens, the model 512" in line
    assert "pass the --tokenizer the model was trained" in line


def test_output_never_replaces_the_input_or_a_model_file(trained_out: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    run = shutil.copytree(trained_out, tmp_path / "run")  # a copy: a broken check must not harm the shared one
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    (tmp_path / "link.jsonl").symlink_to(prompts)
    base = greedy_cli(run, "--max_new_tokens", "3", "--input", str(prompts), "--overwrite", "--output")
    for output in (prompts, tmp_path / "link.jsonl"):
        assert "is the --input file" in refused([*base, str(output)], capsys)
    assert prompts.read_text() == "a\nb\n"
    ckpt = checkpoint.latest_checkpoint(run)
    assert ckpt is not None
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for output in (ckpt / "model.safetensors", run / "latest", run / "new.jsonl"):
        assert "inside the model folder" in refused([*base, str(output)], capsys)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_overwrite_replaces_only_a_generate_output(model_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in.txt").write_text("a\nb\n")
    base = greedy_cli(model_dir, "--max_new_tokens", "3", "--input", str(tmp_path / "in.txt"), "--overwrite",
                      "--output")
    for name, text in [("notes.txt", "my notes\n"), ("data.jsonl", '{"prompt": "x", "id": 1}\n'),
                       ("latin.jsonl", "caf\xe9\n")]:
        (tmp_path / name).write_text(text, encoding="latin-1")
        assert "is not a generate output" in refused([*base, str(tmp_path / name)], capsys)
        assert (tmp_path / name).read_text(encoding="latin-1") == text
    assert cli.main([*base, str(tmp_path / "out.jsonl")]) == 0
    assert cli.main([*base, str(tmp_path / "out.jsonl")]) == 0  # its own output: replaced
    assert [json.loads(line)["prompt"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["a", "b"]


def test_prompts_that_are_not_utf8_are_named(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    prompt = b"\xff".decode("utf-8", "surrogateescape")  # how Python hands over a non-UTF-8 argv byte
    assert "the prompt is not valid UTF-8 text (byte 0xff" in refused(greedy_cli(model_dir, prompt), capsys)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"), encoding="utf-8"))
    assert "stdin is not UTF-8 text (byte 0xe9 at offset 3)" in refused(greedy_cli(model_dir, "-"), capsys)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"ok\ncaf\xe9\n")
    err = refused(greedy_cli(model_dir, "--input", str(latin)), capsys)
    assert f"--input {latin} is not UTF-8 text (byte 0xe9 at offset 6)" in err
    jsonl = tmp_path / "surrogate.jsonl"
    jsonl.write_text('{"prompt": "\\udcff"}\n')
    assert "prompt 1 is not valid UTF-8 text" in refused(greedy_cli(model_dir, "--input", str(jsonl)), capsys)
    assert "no prompts in it" in refused(greedy_cli(model_dir, "--input", "/dev/null"), capsys)
    assert "is a folder; give a file of prompts" in refused(greedy_cli(model_dir, "--input", str(tmp_path)), capsys)


def test_cli_loads_a_training_output_dir(trained_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, tok = load_for_inference(str(trained_out), tokenizer=None, plan=CPU)
    assert model.config.vocab_size == tok.get_vocab_size() == 320
    assert cli.main(greedy_cli(trained_out, "import")) == 0
    assert "12 tokens" in capsys.readouterr().err


def test_loads_a_hugging_face_dir_with_its_tokenizer_beside_it(varied_model: GPT, train_data: Path,
                                                               tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import shutil

    from gptopt.models.hf import export_hf

    directory = export_hf(varied_model, tmp_path / "hf")
    shutil.copy(train_data / "tokenizer.json", directory / "tokenizer.json")
    model, tok = load_for_inference(str(directory), tokenizer=None, plan=CPU)
    assert tok.get_vocab_size() == 320
    assert generate(Generator(model, CPU), [PROMPTS[0]], GREEDY) == generate(Generator(varied_model, CPU),
                                                                             [PROMPTS[0]], GREEDY)


def test_missing_model_or_tokenizer_is_a_clear_error(tmp_path: Path, varied_model: GPT) -> None:
    with pytest.raises(ValueError, match="gptopt train"):
        gen_mod.main(GenerateConfig(model=str(tmp_path / "nothing"), prompt="x"))
    bare = checkpoint.save_model(varied_model, tmp_path / "bare")  # no tokenizer recorded or beside it
    with pytest.raises(ValueError, match="--tokenizer"):
        load_for_inference(str(bare), tokenizer=None, plan=CPU)


def test_int8_weight_only_runs_on_cpu_and_says_it_is_slower(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torchao")
    with caplog.at_level("WARNING", logger="gptopt"):
        model, _ = load_for_inference(str(model_dir), tokenizer=None, plan=CPU, quantize="int8-weight")
    assert "slower" in caplog.text
    assert len(generate(Generator(model, CPU), [PROMPTS[0]], GREEDY)[0]) == GREEDY.max_new_tokens


@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_quantize_int8_is_refused_naming_int8_weight(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    # int8-weight is what gptopt compress calls torchao's int8 weight-only method too.
    with pytest.raises(SystemExit) as exit_:
        cli.main([verb, "--model", "gpt2", "--quantize", "int8"])
    assert exit_.value.code == 2 and "int8-weight" in capsys.readouterr().err


def test_quantize_int4_on_a_cpu_is_refused_before_loading_with_the_reason(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # torchao's int4 kernel runs on sm_80+ CUDA only: say so at once, not after loading the weights
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before int4-weight was refused")

    monkeypatch.setattr("gptopt.models.hf.load_pretrained", no_loading)
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(model_dir), "--device", "cpu", "--quantize", "int4-weight", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gptopt generate: error: "), err
    assert "int4-weight needs an NVIDIA GPU of compute capability 8.0 or newer" in err and "this cpu" in err
    assert "drop --quantize here, or use --quantize int8-weight" in err


def test_quantize_int8_from_a_config_file_is_refused_before_loading(tmp_path: Path) -> None:
    # A TOML config skips argparse's choices: the loader names the valid ones, before reading any weights.
    with pytest.raises(ValueError, match="int8-weight"):
        load_for_inference(str(tmp_path / "nothing"), tokenizer=None, plan=CPU, quantize="int8")


def test_end_of_text_lookup_never_adds_a_token() -> None:
    from tokenizers import models

    from gptopt.data.tokenizer import eot_id

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert eot_id(words) is None and words.get_vocab_size() == 3
    words.add_special_tokens(["</s>"])  # another tokenizer family's end-of-text spelling
    assert eot_id(words) == 3 and words.get_vocab_size() == 4
