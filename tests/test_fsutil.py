"""Published directories: readable by other accounts under the usual umask, and never half-written;
one writer per output.

    pytest -q tests/test_fsutil.py
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import another_writer

from gptopt import outputs
from gptopt.config import PrepareConfig
from gptopt.data.corpus import tokenize_corpus
from gptopt.models import checkpoint, hf
from gptopt.models.gpt import GPT
from gptopt.outputs import staged_dir
from gptopt.outputs.staging import _HOST


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_published(directory: Path) -> None:
    """0755 and 0644 throughout, as mkdir and open give under umask 022; no temporary sibling left."""
    assert mode(directory) == 0o755
    for path in directory.rglob("*"):
        assert mode(path) == (0o755 if path.is_dir() else 0o644), path
    assert [p.name for p in directory.parent.iterdir() if p.name.startswith(".")] == []


def _checkpoint(model: GPT, out: Path) -> Path:
    return checkpoint.save_checkpoint(out / "run", 1, model.config, model.state_dict(), {"step": 1})


def _model_dir(model: GPT, out: Path) -> Path:
    return checkpoint.save_model(model, out / "model")


def _hf_export(model: GPT, out: Path) -> Path:
    return hf.export_hf(model, out / "hf")


def _prepared(model: GPT, out: Path) -> Path:
    (out / "text.txt").write_text("one line of text\n" * 200 + "and another\n" * 200)
    return tokenize_corpus(PrepareConfig(input=str(out / "text.txt"), output_dir=str(out / "data"), vocab_size=260))


def _staged(model: GPT, out: Path) -> Path:  # the ONNX export's path, without its minute of tracing
    with staged_dir(out / "onnx") as tmp:
        (tmp / "model.onnx").write_bytes(b"graph")
    return out / "onnx"


@pytest.mark.parametrize("write", [_checkpoint, _model_dir, _hf_export, _prepared, _staged])
def test_published_directories_are_readable_by_other_accounts(
        write: Callable[[GPT, Path], Path], debug_model: GPT, tmp_path: Path, umask_022: None) -> None:
    published = write(debug_model, tmp_path)
    if published.name == "run":
        published = checkpoint.latest_checkpoint(published)
        assert_published(published.parent)
    assert_published(published)


def test_an_interrupted_write_leaves_the_old_directory_and_no_temporary_one(tmp_path: Path,
                                                                            debug_model: GPT) -> None:
    target = checkpoint.save_model(debug_model, tmp_path / "model")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(KeyboardInterrupt), staged_dir(target, replace=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert torch.equal(checkpoint.load_model(target).transformer.wte.weight, debug_model.transformer.wte.weight)


def test_a_replacement_swaps_the_whole_directory(tmp_path: Path) -> None:
    with staged_dir(tmp_path / "out") as tmp:
        (tmp / "old.txt").write_text("old")
    with staged_dir(tmp_path / "out", replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_without_replace_a_filled_target_is_never_replaced(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with staged_dir(target) as tmp:  # an empty directory is taken, as a missing one
        target.mkdir()
        (tmp / "a.txt").write_text("a")
    assert (target / "a.txt").read_text() == "a"
    with pytest.raises(FileExistsError, match="not empty"), staged_dir(target) as tmp:
        (tmp / "b.txt").write_text("b")
    assert [p.name for p in target.iterdir()] == ["a.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ----------------------------------------------------------------------------------------------
# Ownership: check_output, Aside, and the leftovers of killed processes.

def _dead_pid() -> int:
    """A pid that no live process has: a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_check_output_refuses_before_any_work_and_names_the_fix(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        outputs.check_output(tmp_path / "afile", kind="bench", overwrite=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    assert outputs.check_output(run, kind="bench", overwrite=False, ours=["report.md"]) == []  # beside the user's
    (run / "report.md").write_text("an old report")
    for overwrite in (False, True):  # a report.md gptopt did not write is never replaced, and that is said at once
        with pytest.raises(ValueError, match="not marked") as refused:
            outputs.check_output(run, kind="bench", overwrite=overwrite, ours=["report.md"])
        assert "pass --overwrite" not in str(refused.value)
    outputs.mark(run, "bench")
    with pytest.raises(ValueError, match="pass --overwrite"):  # gptopt's own report: --overwrite replaces it
        outputs.check_output(run, kind="bench", overwrite=False, ours=["report.md"])
    outputs.mark(run, "tune")
    with pytest.raises(ValueError, match="holds gptopt tune output"):  # each kind in a folder of its own
        outputs.check_output(run, kind="bench", overwrite=True, ours=["report.md"])
    outputs.mark(run, "bench")
    assert outputs.check_output(run, kind="bench", overwrite=True, ours=["report.md"]) == [run / "report.md"]
    assert (run / "notes.txt").read_text() == "mine"


def test_check_output_refuses_a_folder_that_cannot_be_written(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: let the OS say no as it does to everyone else
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    try:
        with pytest.raises(ValueError, match="permission denied"):
            outputs.check_output(locked / "out" / "deeper", kind="bench", overwrite=False)
    finally:
        locked.chmod(0o755)


def test_a_whole_directory_output_is_replaced_only_when_gptopt_wrote_all_of_it(tmp_path: Path) -> None:
    downloaded = tmp_path / "gpt2"  # a model folder from the hub: the same file names as an export
    downloaded.mkdir()
    (downloaded / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not marked"):
        outputs.check_output(downloaded, kind="export-hf", overwrite=True, whole=True)
    with outputs.staged_dir(tmp_path / "export", kind="export-hf") as tmp:
        (tmp / "config.json").write_text("{}")
    export = tmp_path / "export"
    assert outputs.check_output(export, kind="export-hf", overwrite=True, whole=True) == [export / "config.json"]
    (export / "README.md").write_text("my notes on this export")
    with pytest.raises(ValueError, match="did not write .*README.md"):
        outputs.check_output(export, kind="export-hf", overwrite=True, whole=True)


def test_aside_restores_the_old_output_when_the_new_one_fails(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    outputs.mark(run, "train-run")
    (run / "metrics.jsonl").write_text("old metrics")
    (run / "notes.txt").write_text("the user's")
    ours = ["metrics.jsonl", "ckpt-*"]
    with pytest.raises(RuntimeError), outputs.Aside(run, outputs.check_output(run, kind="train-run", overwrite=True,
                                                                             ours=ours), ours):
        assert not (run / "metrics.jsonl").exists()
        (run / "metrics.jsonl").write_text("new metrics")
        (run / "ckpt-0000001").mkdir()
        raise RuntimeError("the new run failed")
    assert sorted(p.name for p in run.iterdir()) == [outputs.OWNER_FILE, "metrics.jsonl", "notes.txt"]
    assert (run / "metrics.jsonl").read_text() == "old metrics"
    with outputs.Aside(run, outputs.check_output(run, kind="train-run", overwrite=True, ours=ours), ours) as aside:
        (run / "metrics.jsonl").write_text("new metrics")
        aside.commit()
    assert sorted(p.name for p in run.iterdir()) == [outputs.OWNER_FILE, "metrics.jsonl", "notes.txt"]
    assert (run / "metrics.jsonl").read_text() == "new metrics"


def test_a_first_run_that_fails_part_way_can_be_rerun_with_overwrite(tmp_path: Path) -> None:
    """bench, tune and profile write as they go: a crash after the first files must not leave a folder
    that --overwrite then refuses as the user's."""
    out = tmp_path / "prof"
    ours = ["trace.json", "diagnosis.json"]
    with pytest.raises(RuntimeError), outputs.replacing(out, kind="profile", ours=ours):
        (out / "trace.json").write_text("partial")
        raise RuntimeError("the run crashed after its trace")
    assert outputs.check_output(out, kind="profile", overwrite=True, ours=ours) == [out / "trace.json"]
    with pytest.raises(ValueError, match="--overwrite"):  # and without --overwrite it is still kept
        outputs.check_output(out, kind="profile", overwrite=False, ours=ours)


def test_a_killed_replacement_is_undone_and_killed_staging_is_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    outputs.mark(run, "train-run")
    (run / "metrics.jsonl").write_text("old metrics")
    ours = ["metrics.jsonl"]
    aside = outputs.Aside(run, [run / "metrics.jsonl"], ours).__enter__()  # then the process is killed
    dead = _dead_pid()
    assert aside.folder is not None
    aside.folder.rename(run / aside.folder.name.replace(f"-{os.getpid()}-", f"-{dead}-"))
    (run / "metrics.jsonl").write_text("the killed run's first steps")
    host = _HOST
    (run / f".ckpt-0000010.tmp-{host}-{dead}-0123abcd").mkdir()  # a checkpoint being written when killed
    (run / f".ckpt-0000020.tmp-{host}-{os.getpid()}-0123abcd").mkdir()  # one this process is writing
    (run / f".ckpt-0000030.tmp-otherhost-{dead}-0123abcd").mkdir()  # another machine's, on shared storage
    assert outputs.check_output(run, kind="train-run", overwrite=True, ours=ours) == [run / "metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == "old metrics"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".ckpt")) == [
        f".ckpt-0000020.tmp-{host}-{os.getpid()}-0123abcd", f".ckpt-0000030.tmp-otherhost-{dead}-0123abcd"]


def test_a_staging_folder_is_judged_dead_only_by_a_writer_that_can_see_its_process(tmp_path: Path) -> None:
    """Staging folders name their writer's host, its boot and pid namespace, pid and start time: two containers
    sharing a hostname and a volume never take each other's live folders (another namespace's pids are not ours
    to judge), and a pid reused by another process since is known dead."""
    from gptopt.outputs.staging import _space, _start_time

    here, me = _space(), os.getpid()
    start = _start_time(me)
    if start is None:
        pytest.skip("no /proc here: start times are not read")
    dead = _dead_pid()
    names = {
        "gone": f".a.tmp-{_HOST}-{here}-{dead}-{start}-0123abcd",  # this machine and namespace, no such process
        "reused": f".b.tmp-{_HOST}-{here}-{me}-{start + 1}-0123abcd",  # its pid now runs another process
        "live": f".c.tmp-{_HOST}-{here}-{me}-{start}-0123abcd",  # this very process
        "elsewhere": f".d.tmp-{_HOST}-{'f' * 8 if here != 'f' * 8 else '0' * 8}-{dead}-1-0123abcd",  # another container
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    outputs.clean_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["live"], names["elsewhere"]])


def test_a_swap_killed_between_its_renames_gets_the_old_directory_back(tmp_path: Path) -> None:
    dead = _dead_pid()
    old = tmp_path / f".model.old-{_HOST}-{dead}-0123abcd"  # renamed away; the new never arrived
    old.mkdir()
    (old / "weights").write_text("the only copy")
    with outputs.staged_dir(tmp_path / "other") as tmp:
        (tmp / "x").write_text("x")
    assert (tmp_path / "model" / "weights").read_text() == "the only copy"


def test_the_current_folder_is_a_valid_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nanoGPT's layout: `cd data/x && gptopt prepare --input input.txt --output_dir .` beside input.txt."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input.txt").write_text("one line of text\n" * 200 + "and another\n" * 200)
    tokenize_corpus(PrepareConfig(input="input.txt", output_dir=".", vocab_size=260))
    tokenize_corpus(PrepareConfig(input="input.txt", output_dir=".", vocab_size=260, overwrite=True))
    assert {"input.txt", "train.bin", "val.bin", "meta.json"} <= {p.name for p in tmp_path.iterdir()}


def test_overwrite_never_deletes_a_users_file_inside_gptopts_folders(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    outputs.mark(run, "train-run")
    (run / "logs" / "events.out.tfevents.1").write_text("gptopt's")
    contents = {"logs": ["events.out.tfevents.*"]}
    assert outputs.check_output(run, kind="train-run", overwrite=True, ours=["logs"], contents=contents) == [
        run / "logs"]
    (run / "logs" / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match=r"did not write \(logs/notes.txt\)"):
        outputs.check_output(run, kind="train-run", overwrite=True, ours=["logs"], contents=contents)


@pytest.mark.parametrize("where", ["/", "~"])
def test_the_root_and_the_home_folder_are_never_an_output(where: str) -> None:
    with pytest.raises(ValueError, match="a folder of its own"):
        outputs.check_output(Path(where), kind="train-run", overwrite=True)


# ----------------------------------------------------------------------------------------------
# One writer per output: lock_output


@pytest.mark.parametrize("whole", [False, True], ids=["written in place", "published whole"])
def test_a_second_writer_is_refused_at_once_naming_the_first(tmp_path: Path, whole: bool) -> None:
    out = tmp_path / "out"
    with another_writer(out, whole=whole) as first:
        before = sorted(p.name for p in tmp_path.rglob("*"))
        with pytest.raises(ValueError, match=rf"being written by another gptopt process \(pid {first.pid}\); "
                                             "nothing was written"), outputs.lock_output(out, whole=whole):
            pass
        assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_writer_killed_outright_leaves_no_lock_behind(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with another_writer(out):
        pass  # SIGKILL: no clean-up ran, its lock file (beside the output) is still there
    assert (tmp_path / f".out{outputs.LOCK_FILE}").exists()
    with outputs.lock_output(out):
        out.mkdir()
        (out / "written.txt").write_text("mine")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the lock file goes with the lock
    assert [p.name for p in out.iterdir()] == ["written.txt"]


_FORKS = """
import os, sys, time
from gptopt import outputs
held = outputs.lock_output(sys.argv[1])
held.__enter__()
child = os.fork()
if child == 0:  # a DataLoader worker's life: longer than the writer's
    print(os.getpid(), flush=True)  # said by the worker: its fork handlers have run
    time.sleep(120)
    os._exit(0)
sys.stdin.read()
"""


def test_a_worker_forked_by_a_killed_writer_does_not_keep_its_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    writer = subprocess.Popen([sys.executable, "-c", _FORKS, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert writer.stdout is not None
    worker = int(writer.stdout.readline())
    try:
        writer.kill()
        writer.wait()
        with outputs.lock_output(out):  # the worker lives on; the lock went with the writer
            pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_the_lock_is_taken_again_inside_one_process_and_leaves_no_folder_it_made(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    with outputs.lock_output(out), outputs.lock_output(out):  # a verb calling another verb's writer
        assert out.parent.is_dir()  # made to hold the lock, beside the output
    assert list(tmp_path.iterdir()) == []  # refused or failed before writing: nothing made stays


def test_a_waiting_writer_goes_on_once_the_first_has_finished(tmp_path: Path) -> None:
    out = tmp_path / "data"
    got = threading.Event()

    def second() -> None:
        with outputs.lock_output(out, wait=True):
            got.set()

    with another_writer(out) as first:
        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        assert not got.wait(0.5)  # the first still writes
        assert first.stdin is not None
        first.stdin.close()  # the first finishes
        thread.join(timeout=60)
    assert got.is_set()


def test_a_filesystem_without_locks_is_written_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "nfs" / "out"
    with caplog.at_level("WARNING", logger="gptopt"), outputs.lock_output(out):
        pass  # the verb goes on
    assert "takes no lock (No locks available)" in caplog.text
    assert list(tmp_path.iterdir()) == []  # the lock file, and the folders made for it, are gone
