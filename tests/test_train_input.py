"""Bad input and the output folder: refusals before the first step, which write and delete nothing, and --overwrite,
which replaces only a run, and keeps it until the new one has a checkpoint.

    pytest -q tests/test_train_input.py
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import exit_status, file_tree, train_args, train_losses, train_run

from gptopt import cli
from gptopt.config import preset
from gptopt.data.loader import TokenData
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.train import step

# -- bad input: one line naming the fix, exit 2, nothing overwritten -----------------------------


def test_missing_or_empty_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(train_args(tmp_path / "nope", tmp_path / "o")) == 2
    assert "gptopt prepare" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(train_args(tmp_path / "empty", tmp_path / "o")) == 2
    assert "gptopt prepare" in capsys.readouterr().err


def test_token_ids_beyond_the_model_vocabulary(train_data: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    small = GPT(preset("debug", vocab_size=100))
    checkpoint.save_model(small, tmp_path / "small")
    assert cli.main(train_args(train_data, tmp_path / "o", "--init_from", str(tmp_path / "small"))) == 2
    assert "vocabulary" in capsys.readouterr().err


def test_seq_len_beyond_the_context(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_status(train_args(train_data, tmp_path / "o", "--seq_len", "65")) == 2
    assert "exceeds the model's context 64" in capsys.readouterr().err


def test_contradicting_flags(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_status(train_args(train_data, tmp_path / "o", "--use_amp", "--amp_dtype", "fp16")) == 2
    assert "fp16 autocast on a CPU" in capsys.readouterr().err
    assert exit_status(train_args(train_data, tmp_path / "o", "--fsdp")) == 2
    assert "torchrun" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert exit_status(train_args(train_data, tmp_path / "o", "--cpu_offload")) == 2
    assert "--cpu_offload needs --fsdp" in capsys.readouterr().err


def test_existing_run_is_not_overwritten(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    train_run(train_data, out, max_steps=2)
    before = (checkpoint.latest_checkpoint(out) / checkpoint.WEIGHTS).read_bytes()
    assert cli.main(train_args(train_data, out, "--max_steps", "2")) == 2
    assert "--resume auto" in capsys.readouterr().err
    assert (out / "ckpt-0000002" / checkpoint.WEIGHTS).read_bytes() == before
    assert cli.main(train_args(train_data, out, "--max_steps", "3", "--overwrite")) == 0
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000003"]


# -- nothing a user owns is lost: each test starts from a folder holding something that must survive ----


def test_overwrite_validates_first_and_keeps_the_old_run_until_the_new_one_has_a_checkpoint(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], break_forward: Callable[..., None]
) -> None:
    out = tmp_path / "ow"
    assert train_run(train_data, out, max_steps=4, save_interval=2) == 0
    (out / "notes.txt").write_text("the user's own file")
    before = file_tree(out)
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000002", "ckpt-0000004"]
    # a bad argument: refused before anything is moved or deleted
    assert exit_status(train_args(train_data, out, "--max_steps", "20", "--overwrite", "--seq_len", "100000")) == 2
    assert "exceeds the model's context" in capsys.readouterr().err
    assert file_tree(out) == before
    # a new run that fails before its first checkpoint: the old run is back, as it was
    break_forward(lambda model, idx: model.training, "nan")
    assert train_run(train_data, out, max_steps=20, overwrite=True, max_bad_steps=1) == 1
    assert file_tree(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".gptopt-old")]


def test_overwrite_replaces_the_run_and_nothing_else(train_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "ow"
    assert train_run(train_data, out, max_steps=4, save_interval=2) == 0
    (out / "notes.txt").write_text("the user's own file")
    assert train_run(train_data, out, max_steps=3, overwrite=True) == 0
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000003"]
    assert max(train_losses(out)) == 3 and (out / "notes.txt").read_text() == "the user's own file"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gptopt-output.json"]


@pytest.mark.parametrize("bad", ["output_is_a_file", "output_unwritable", "resume_missing", "resume_not_a_checkpoint",
                                 "init_from_missing"])
def test_bad_arguments_write_and_delete_nothing(
    train_data: Path, tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=2) == 0
    (out / "notes.txt").write_text("the user's own file")
    target, extra, expect = out, [], ""
    if bad == "output_is_a_file":
        target, expect = out / "notes.txt", "is a file"
    elif bad == "output_unwritable":
        (out / "locked").mkdir()
        (out / "locked").chmod(0o555)
        if os.geteuid() == 0:  # root writes anywhere: let the OS say no as it does to everyone else
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == out / "locked" else real(p, mode))
        target, expect = out / "locked" / "new", "permission denied"
    elif bad == "resume_missing":
        extra, expect = ["--resume", str(tmp_path / "nope")], "no such directory"
    elif bad == "resume_not_a_checkpoint":
        (tmp_path / "empty").mkdir()
        extra, expect = ["--resume", str(tmp_path / "empty")], "not a training checkpoint"
    else:
        target, extra, expect = tmp_path / "new", ["--init_from", str(tmp_path / "nope")], "--init_from"
    before = file_tree(tmp_path)
    assert cli.main(train_args(train_data, target, "--max_steps", "4", *extra)) == 2
    assert expect in capsys.readouterr().err
    assert file_tree(tmp_path) == before
    assert not (tmp_path / "new").exists()


def test_overwrite_keeps_a_users_file_inside_the_runs_folders(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=2) == 0
    (out / "ckpt-0000002" / "notes.txt").write_text("the user's, inside a checkpoint")
    before = file_tree(out)
    assert cli.main(train_args(train_data, out, "--max_steps", "2", "--overwrite")) == 2
    assert "ckpt-0000002/notes.txt" in capsys.readouterr().err
    assert file_tree(out) == before


def test_each_kind_of_output_keeps_a_folder_of_its_own(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=2) == 0
    before = file_tree(out)
    (tmp_path / "text.txt").write_text("some words of text\n" * 300)
    assert cli.main(["prepare", "--input", str(tmp_path / "text.txt"), "--output_dir", str(out),
                     "--vocab_size", "300"]) == 2  # shards beside a run would take over its mark
    assert "holds gptopt train-run output" in capsys.readouterr().err
    assert file_tree(out) == before
    assert cli.main(train_args(train_data, train_data, "--max_steps", "2")) == 2  # and a run into the data folder
    assert "holds gptopt prepared-data output" in capsys.readouterr().err


@pytest.mark.parametrize("arch, problem", [
    ("mlp=swish", "--arch: mlp must be one of gelu, swiglu, relu2"),
    ("n_layer=2", "'n_layer=2' is not FIELD=VALUE of a block field"),
    ("qk_norm=maybe", "qk_norm takes true or false"),
    ("n_kv_head=3", "must be a multiple of n_kv_head"),
])
def test_a_bad_arch_is_refused_naming_the_field_before_anything_is_written(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str, problem: str
) -> None:
    out = tmp_path / "r"
    with pytest.raises(SystemExit) as e:  # argparse's exit: the config is checked as the flags are read
        cli.main(train_args(train_data, out, "--max_steps", "2", "--arch", arch))
    assert e.value.code == 2 and problem in capsys.readouterr().err and not out.exists()


# -- what a run finds before its first step ---------------------------------------------------------------------


def short_val_data(tmp_path: Path) -> Path:
    """One short document prepared with a tiny val share: a train split of ~1,800 tokens, a val split of ~13."""
    import sysconfig

    from gptopt.config import PrepareConfig
    from gptopt.data.corpus import tokenize_corpus

    (tmp_path / "texts").mkdir()
    text = (Path(sysconfig.get_paths()["stdlib"]) / "bisect.py").read_text(encoding="utf-8")
    (tmp_path / "texts" / "bisect.txt").write_text(text, encoding="utf-8")
    return tokenize_corpus(PrepareConfig(input=str(tmp_path / "texts"), output_dir=str(tmp_path / "data"),
                                         vocab_size=300, val_fraction=0.01))


def test_a_val_split_shorter_than_the_context_is_refused_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = short_val_data(tmp_path)
    n = TokenData(data).num_tokens("val")
    assert 1 < n < 33  # shorter than a window of --seq_len 32
    steps = {"n": 0}
    real = step.TrainStep.__call__
    monkeypatch.setattr(step.TrainStep, "__call__", lambda *a: (steps.update(n=steps["n"] + 1), real(*a))[1])
    out = tmp_path / "r"
    assert cli.main(train_args(data, out, "--max_steps", "4", "--eval_interval", "2")) == 2
    assert steps["n"] == 0 and not out.exists()  # refused before any step, and nothing written
    err = capsys.readouterr().err
    assert f"the val split of {data} has {n} tokens" in err and "the context 32" in err
    assert f"--seq_len of at most {n - 1}" in err and "--val_fraction" in err and "--eval_interval 0" in err
    # the fix it names: without evaluation the run reads only the train split, which is long enough
    assert cli.main(train_args(data, out, "--max_steps", "2")) == 0
    assert steps["n"] == 2 and checkpoint.latest_checkpoint(out).name == "ckpt-0000002"
