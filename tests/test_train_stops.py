"""How a run ends early and what it keeps: signals (saved at the step boundary, a second Ctrl-C at once), the time
budget and --max_tokens, the old run of --overwrite given back, failures after a checkpoint.

    pytest -q tests/test_train_stops.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import file_tree, train_args, train_losses, train_run

from gptopt import cli
from gptopt.data.loader import BatchDataset
from gptopt.models import checkpoint
from gptopt.train import loop as train
from gptopt.utils.errors import UserError


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_step_boundary_and_resume_continues(
    train_data: Path, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    out = tmp_path / "r"
    args = train_args(train_data, out, "--max_steps", "100000")
    proc = subprocess.Popen([sys.executable, "-m", "gptopt", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # same thread count as this process: bitwise-equal sums
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until it is really training
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    last = checkpoint.latest_checkpoint(out)
    assert last is not None and "resume with --resume auto" in err
    stopped = checkpoint.load_train_state(last)["step"]
    assert max(train_losses(out)) == stopped
    # resuming continues exactly where a run that was never interrupted would be (same schedule)
    tokens = str((stopped + 3) * 4 * 32)
    args = train_args(train_data, out, "--max_steps", "100000", "--max_tokens", tokens, "--resume", "auto")
    assert cli.main(args) == 0
    assert train_run(train_data, tmp_path / "straight", max_steps=100000, max_tokens=int(tokens)) == 0
    assert train_losses(out) == train_losses(tmp_path / "straight")


def test_time_budget_and_max_tokens_stop_and_save(train_data: Path, tmp_path: Path) -> None:
    assert train_run(train_data, tmp_path / "t", max_steps=10**6, time_budget="2s") == 0
    assert checkpoint.latest_checkpoint(tmp_path / "t") is not None
    assert train_run(train_data, tmp_path / "m", max_steps=100, max_tokens=4 * 32 * 7) == 0
    assert max(train_losses(tmp_path / "m")) == 7


def test_a_run_that_stopped_before_its_first_checkpoint_is_not_written_over(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], break_forward: Callable[..., None]
) -> None:
    out = tmp_path / "r"
    with pytest.MonkeyPatch.context() as mp:  # the earlier run died at its first step: metrics, no checkpoint
        mp.setattr(train.Trainer, "_train_one", lambda *a: (_ for _ in ()).throw(RuntimeError("lost the device")))
        assert train_run(train_data, out, max_steps=5) == 1
    assert (out / "run.json").is_file() and checkpoint.latest_checkpoint(out) is None
    before = file_tree(out)
    assert cli.main(train_args(train_data, out, "--max_steps", "2")) == 2
    err = capsys.readouterr().err
    assert "holds a training run" in err and "--resume auto" in err and "--overwrite" in err
    assert file_tree(out) == before
    # a folder with only the user's files is written beside them
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert train_run(train_data, mine, max_steps=2) == 0
    assert (mine / "notes.txt").read_text() == "keep" and checkpoint.latest_checkpoint(mine) is not None


def test_sigterm_to_the_process_group_saves_and_leaves_no_staging_folder(train_data: Path, tmp_path: Path) -> None:
    # a scheduler (or torchrun, or Ctrl-C) signals the whole group: the loader's workers too, which used to
    # die first and take the run down mid-step, without its stop checkpoint
    out = tmp_path / "r"
    args = train_args(train_data, out, "--max_steps", "100000", "--save_interval", "1", "--num_workers", "2")
    proc = subprocess.Popen([sys.executable, "-m", "gptopt", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gptopt-output.json"]
    stopped = checkpoint.load_train_state(checkpoint.latest_checkpoint(out))["step"]
    # a writer killed mid-save (kill -9) leaves its staging folder: the next run there removes it at start
    leftover = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys; from pathlib import Path; from gptopt.outputs import staged_dir\n"
        "with staged_dir(Path(sys.argv[1])) as tmp:\n"
        "    (tmp / 'model.safetensors').write_bytes(b'half'); os.kill(os.getpid(), signal.SIGKILL)"),
        str(out / "ckpt-0000999")], capture_output=True)
    assert leftover.returncode == -signal.SIGKILL
    assert [p.name for p in out.iterdir() if p.name.startswith(".ckpt-0000999.tmp-")]
    # nothing to train
    assert cli.main(train_args(train_data, out, "--max_steps", str(stopped), "--resume", "auto")) == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gptopt-output.json"]
    assert cli.main(train_args(train_data, out, "--max_steps", str(stopped + 2), "--resume", "auto")) == 0
    assert max(train_losses(out)) == stopped + 2


def test_a_signal_before_the_first_checkpoint_gives_the_overwritten_run_back(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=4, save_interval=2) == 0
    before = file_tree(out)
    real = train.Trainer._train_one

    def interrupted(self: train.Trainer, progress: Any) -> None:  # Ctrl-C during the first step
        real(self, progress)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(train.Trainer, "_train_one", interrupted)
    assert train_run(train_data, out, max_steps=20, save_interval=10, overwrite=True, seed=7) == 130
    assert file_tree(out) == before  # the mistaken --overwrite is undone, its interrupt checkpoint with it


def test_ctrl_c_is_said_at_once_and_a_second_one_stops_at_once_without_a_checkpoint(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    real = train.Trainer._train_one
    calls = {"n": 0}

    def interrupted(self: train.Trainer, progress: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # a long step: Ctrl-C, then Ctrl-C again before it ends
            os.kill(os.getpid(), signal.SIGINT)
            assert "stopping after this step" in capsys.readouterr().err  # said before the step goes on
            os.kill(os.getpid(), signal.SIGINT)
        real(self, progress)

    monkeypatch.setattr(train.Trainer, "_train_one", interrupted)
    assert cli.main(train_args(train_data, out, "--max_steps", "20", "--save_interval", "1")) == 130
    assert "stopped (Ctrl-C)" in capsys.readouterr().err
    assert checkpoint.latest_checkpoint(out).name == "ckpt-0000002"  # the interrupted third step left none


@pytest.mark.parametrize("failure", ["out of memory", "refusal"])
def test_a_signal_stop_saves_first_and_an_evaluation_that_fails_then_keeps_the_checkpoint(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    break_forward: Callable[..., None], failure: str
) -> None:
    real = train.Trainer._train_one

    def interrupted(self: train.Trainer, progress: Any) -> None:  # Ctrl-C during the third step
        real(self, progress)
        if progress.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(train.Trainer, "_train_one", interrupted)
    if failure == "out of memory":
        break_forward(lambda model, idx: not model.training)  # every evaluation's forward
    else:
        monkeypatch.setattr(BatchDataset, "eval_batches",
                            lambda *a: (_ for _ in ()).throw(UserError("the val split cannot be read")))
    out = tmp_path / "r"
    assert cli.main(train_args(train_data, out, "--max_steps", "20", "--eval_interval", "10")) in (1, 2)
    assert checkpoint.latest_checkpoint(out).name == "ckpt-0000003"  # the evaluation failed; the checkpoint stays
    err = capsys.readouterr().err
    assert "stopping after this step: its checkpoint first, then its evaluation" in err
    assert "saved" in err and "resume with --resume auto" in err  # said before the evaluation
    assert cli.main(train_args(train_data, out, "--max_steps", "4", "--resume", "auto")) == 0  # and it resumes


def test_a_failure_after_a_checkpoint_keeps_it_whether_or_not_the_run_replaced_another(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal found once training has begun (here at step 3): the checkpoint of step 2 is the run's, and
    stays; under --overwrite it has already replaced the old run, which does not come back over it."""
    real = train.Trainer._train_one

    def refused(self: train.Trainer, progress: Any) -> None:
        if progress.step == 2:
            raise UserError("something found after training began")
        real(self, progress)

    new, old = tmp_path / "new", tmp_path / "old"
    assert train_run(train_data, old, max_steps=4, save_interval=4) == 0
    monkeypatch.setattr(train.Trainer, "_train_one", refused)
    for out, extra in ((new, []), (old, ["--overwrite"])):
        assert cli.main(train_args(train_data, out, "--max_steps", "6", "--save_interval", "2", *extra)) == 2
        assert "something found after training began" in capsys.readouterr().err
        assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000002"]
        assert checkpoint.latest_checkpoint(out).name == "ckpt-0000002"
