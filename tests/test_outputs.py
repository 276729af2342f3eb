"""Nothing a user owns is ever lost: every verb that writes, walked through the same two situations.

    pytest -q tests/test_outputs.py

(a) The output folder holds a user's file (notes.txt) and an earlier gptopt output. Without --overwrite:
    exit 2, one line, nothing changed. With --overwrite: the user's file survives; where the verb publishes
    a whole directory (compress, export), the overwrite is refused and everything survives.
(b) The output folder cannot be written: exit 2, one line naming the folder, nothing written, before any
    model or measurement (the suite may run as root, so os.access is what says no, as in test_fsutil).
(c) Another gptopt process is writing the output: exit 2 at once, one line naming its pid, nothing written;
    and two real trains started into one folder: the second is refused while the first runs, and the
    first's run is continued by --resume auto after it was killed outright.

Every run uses the debug preset and the fewest steps each verb takes; refusals come before any model work,
which the tests enforce by making that work fail if it is reached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import another_writer

from gptopt import cli, outputs
from gptopt.models import checkpoint

NOTES = "notes.txt"
DEBUG = ["--preset", "debug", "--seq_len", "32", "--device", "cpu"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under folder (mark included) with its bytes: 'nothing changed' means this is equal."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def with_notes(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / NOTES).write_text("my notes: keep")
    return folder


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err, err
    return err


def no_model_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching any model loading, building or measuring fails the test: refusals must come first."""
    from gptopt.bench import ladder
    from gptopt.commands import compress, generate, profile, tune
    from gptopt.commands import eval as evaluate
    from gptopt.infer import load as inference
    from gptopt.models import hf

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("model work began before the output was checked")

    monkeypatch.setattr(ladder, "Bench", reached)
    monkeypatch.setattr(tune, "Tuner", reached)
    monkeypatch.setattr(profile, "profile_steps", reached)
    monkeypatch.setattr(inference, "load_for_inference", reached)
    for module in (compress, evaluate, generate):
        monkeypatch.setattr(module, "load_for_inference", reached)
    monkeypatch.setattr(hf, "load_pretrained", reached)  # export's loader


def a_shared_folder(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, out: Path,
                    argv: list[str], *, check: Callable[[Path], None] = lambda out: None) -> None:
    """(a) for a verb that writes into a folder it shares with the user: run once (beside notes.txt), then
    refused without --overwrite (nothing changed), then replaced with it (notes.txt kept)."""
    with_notes(out)
    assert cli.main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    before = snapshot(out)
    assert len(before) > 2  # the notes, the mark and the verb's own files
    with monkeypatch.context() as m:
        no_model_work(m)
        refused(argv, capsys, "already holds output", "--overwrite")
    assert snapshot(out) == before
    assert cli.main([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    assert (out / NOTES).read_text() == "my notes: keep"
    assert outputs.marked_kind(out) is not None
    check(out)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != outputs.OWNER_FILE]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no staging sibling left


# ----------------------------------------------------------------------------------------------
# (a) Verbs that write into a folder beside the user's files


def test_prepare(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "input.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(400)))
    out = tmp_path / "run" / "data"
    a_shared_folder(capsys, monkeypatch, out, ["prepare", "--input", str(corpus), "--output_dir", str(out),
                                               "--vocab_size", "300", "--val_fraction", "0.3"])


def test_bench(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run" / "bench_out"
    a_shared_folder(capsys, monkeypatch, out, ["bench", *DEBUG, "--batch_size", "4", "--warmup", "1", "--rungs",
                                               "eager", "--data_dir", str(train_data), "--output_dir", str(out)])


def test_tune(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run" / "tune_out"
    a_shared_folder(capsys, monkeypatch, out, ["tune", *DEBUG, "--global_batch_tokens", "256", "--steps", "3",
                                               "--warmup", "1", "--axes", "amp", "--time_budget", "1s",
                                               "--data_dir", str(train_data), "--output_dir", str(out)])


def test_profile(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run" / "profile_out"

    def one_trace(out: Path) -> None:  # the old trace was replaced, not left beside the new one
        assert len(list((out / "tensorboard").glob("*.pt.trace.json"))) == 1

    a_shared_folder(capsys, monkeypatch, out, ["profile", *DEBUG, "--batch_size", "2", "--wait", "0", "--warmup", "1",
                                               "--active", "1", "--data_dir", str(train_data), "--output_dir",
                                               str(out)], check=one_trace)


def test_generate_output(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    folder = with_notes(tmp_path / "run")
    (folder / "prompts.txt").write_text("def f():\nimport os\n")
    out = folder / "out.jsonl"
    argv = ["generate", "--model", str(model_dir), "--device", "cpu", "--max_new_tokens", "4", "--input",
            str(folder / "prompts.txt"), "--output", str(out)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    before = snapshot(folder)
    with monkeypatch.context() as m:
        no_model_work(m)
        refused(argv, capsys, "exists", "--overwrite")
    assert snapshot(folder) == before
    assert cli.main([*argv, "--overwrite"]) == 0
    assert (folder / NOTES).read_text() == "my notes: keep" and len(out.read_text().splitlines()) == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted([NOTES, "prompts.txt", "out.jsonl"])


def test_train(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What holds of train whoever changes its output handling: the user's file survives a run and an
    # --overwrite run. (Its refusals and marks are train's own tests'.)
    out = with_notes(tmp_path / "run" / "out")
    argv = ["train", *DEBUG, "--batch_size", "4", "--max_steps", "2", "--warmup_steps", "1", "--sample_tokens", "0",
            "--eval_interval", "0", "--no-tensorboard", "--data_dir", str(train_data), "--output_dir", str(out)]
    assert cli.main(argv) == 0
    assert cli.main([*argv, "--overwrite"]) == 0
    assert (out / NOTES).read_text() == "my notes: keep"


# ----------------------------------------------------------------------------------------------
# (a) Verbs that publish a whole directory: --overwrite replaces only one holding nothing but gptopt's files


def earlier_output(folder: Path, kind: str, files: dict[str, str]) -> Path:
    """An earlier output of this kind as gptopt leaves it (its files and its mark), with the user's notes added."""
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    outputs.mark(folder, kind, files=list(files))
    return with_notes(folder)


def whole_directory(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, out: Path,
                    argv: list[str]) -> None:
    before = snapshot(out)
    no_model_work(monkeypatch)
    for overwrite in ([], ["--overwrite"]):  # what --overwrite would refuse is said at once, never advised first
        assert "pass --overwrite" not in refused([*argv, *overwrite], capsys,
                                                 f"holds files gptopt did not write ({NOTES})")
    assert snapshot(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_compress(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = earlier_output(tmp_path / "run" / "out_int8", "compressed",
                         {"gptopt.json": "{}", "model.safetensors": "weights", "results.json": "{}"})
    whole_directory(capsys, monkeypatch, out, ["compress", "--model", str(model_dir), "--output_dir", str(out),
                                               "--quantize", "int8-dynamic", "--device", "cpu"])


def test_eval(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
              monkeypatch: pytest.MonkeyPatch) -> None:
    out = earlier_output(tmp_path / "run" / "eval_out", "eval", {"results.json": "{}"})
    whole_directory(capsys, monkeypatch, out, ["eval", "--model", str(model_dir), "--data", str(tmp_path / "h.jsonl"),
                                               "--output_dir", str(out), "--device", "cpu"])


def test_export_hf(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "run" / "export_hf"
    argv = ["export", "--model", str(model_dir), "--format", "hf", "--output_dir", str(out)]
    assert cli.main(argv) == 0  # a real earlier export
    capsys.readouterr()
    with_notes(out)
    whole_directory(capsys, monkeypatch, out, argv)


def test_export_onnx(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The refusals come before onnx is imported, so they hold without the onnx extra too.
    out = earlier_output(tmp_path / "run" / "export_onnx", "export-onnx",
                         {"model.onnx": "graph", "gptopt_onnx.json": '{"format": "gptopt-onnx"}'})
    whole_directory(capsys, monkeypatch, out, ["export", "--model", str(model_dir), "--output_dir", str(out)])


# ----------------------------------------------------------------------------------------------
# (b) An output folder that cannot be written: one line, before any work, nothing written

UNWRITABLE = {
    "prepare": lambda d, m, out: ["prepare", "--input", str(d / "tokenizer.json"), "--output_dir", str(out)],
    "bench": lambda d, m, out: ["bench", *DEBUG, "--rungs", "eager", "--data_dir", str(d), "--output_dir", str(out)],
    "bench --mode infer": lambda d, m, out: ["bench", "--mode", "infer", *DEBUG, "--data_dir", str(d),
                                             "--output_dir", str(out)],
    "tune": lambda d, m, out: ["tune", *DEBUG, "--data_dir", str(d), "--output_dir", str(out)],
    "profile": lambda d, m, out: ["profile", *DEBUG, "--data_dir", str(d), "--output_dir", str(out)],
    "compress": lambda d, m, out: ["compress", "--model", str(m), "--output_dir", str(out), "--quantize",
                                   "int8-dynamic"],
    "export onnx": lambda d, m, out: ["export", "--model", str(m), "--output_dir", str(out)],
    "export hf": lambda d, m, out: ["export", "--model", str(m), "--format", "hf", "--output_dir", str(out)],
    "generate --output": lambda d, m, out: ["generate", "--model", str(m), "--input", str(d / "tokenizer.json"),
                                            "--output", str(out / "out.jsonl")],
    "eval": lambda d, m, out: ["eval", "--model", str(m), "--data", str(d / "h.jsonl"), "--output_dir", str(out)],
}


@pytest.mark.parametrize("verb", list(UNWRITABLE))
def test_an_output_folder_that_cannot_be_written(verb: str, train_data: Path, model_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    locked = with_notes(tmp_path / "locked")
    before = snapshot(tmp_path)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    no_model_work(monkeypatch)
    for out in (locked, locked / "new"):  # the folder itself, and a new one to be made in it
        refused(UNWRITABLE[verb](train_data, model_dir, out), capsys, "cannot write in", str(locked))
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in locked.iterdir()) == [NOTES]


# ----------------------------------------------------------------------------------------------
# (c) An output another gptopt process is writing: refused at once, naming that process

# The verbs that publish their output whole (a directory, or generate's file); the others write in place.
WHOLE = {"compress", "export onnx", "export hf", "generate --output", "eval"}


@pytest.mark.parametrize("verb", list(UNWRITABLE))
def test_an_output_another_process_is_writing(verb: str, train_data: Path, model_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    folder = with_notes(tmp_path / "busy")
    argv = UNWRITABLE[verb](train_data, model_dir, folder)
    target = folder / "out.jsonl" if verb == "generate --output" else folder
    no_model_work(monkeypatch)
    with another_writer(target, whole=verb in WHOLE) as first:
        before = snapshot(tmp_path)
        refused(argv, capsys, f"{target} is being written by another gptopt process (pid {first.pid})",
                "nothing was written")
        assert snapshot(tmp_path) == before


@pytest.mark.parametrize("verb", list(UNWRITABLE))
def test_an_output_a_writer_of_the_other_kind_holds_is_refused_too(
        verb: str, train_data: Path, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One lock for every kind of writer: a folder a compress (published whole) is writing refuses a train
    (written in place), and the other way round, for every verb."""
    folder = with_notes(tmp_path / "busy")
    argv = UNWRITABLE[verb](train_data, model_dir, folder)
    target = folder / "out.jsonl" if verb == "generate --output" else folder
    no_model_work(monkeypatch)
    with another_writer(target, whole=verb not in WHOLE) as first:
        before = snapshot(tmp_path)
        refused(argv, capsys, f"{target} is being written by another gptopt process (pid {first.pid})",
                "nothing was written")
        assert snapshot(tmp_path) == before


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        assert proc.poll() is None, "the first train ended before it was seen running"
        assert time.monotonic() < deadline, "the first train did not start"
        time.sleep(0.1)


def test_two_trains_into_one_folder_never_mix_their_runs(train_data: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dup"
    argv = ["train", *DEBUG, "--batch_size", "2", "--eval_interval", "0", "--sample_tokens", "0", "--no-tensorboard",
            "--data_dir", str(train_data), "--output_dir", str(out), "--save_interval", "1"]
    first = subprocess.Popen([sys.executable, "-m", "gptopt", *argv, "--max_steps", "100000", "--seed", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: bool(checkpoint.checkpoint_dirs(out)), first)  # it is training
        refused([*argv, "--max_steps", "4", "--seed", "2", "--learning_rate", "0.01"], capsys,
                f"is being written by another gptopt process (pid {first.pid})")
        refused([*argv, "--max_steps", "4", "--resume", "auto"], capsys, f"(pid {first.pid})")
    finally:
        first.send_signal(signal.SIGKILL)  # no clean-up: its lock must go with it all the same
        first.wait()
    run = (out / "run.json").read_text()
    assert '"seed": 1' in run and '"learning_rate": 0.01' not in run
    last = checkpoint.latest_checkpoint(out)
    assert cli.main([*argv, "--max_steps", str(int(last.name.split("-")[1]) + 1), "--resume", "auto"]) == 0
