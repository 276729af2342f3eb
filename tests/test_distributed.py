"""Training on several processes: DDP and FSDP2 over gloo, two CPU ranks launched by torchrun.

    pytest -q tests/test_distributed.py
    pytest -q tests/test_distributed.py -m slow     # SIGTERM to torchrun, then resume; a Llama-shaped model

Each run is a real `torchrun --standalone` (it finds a free port itself, so runs may overlap) or a
plain `python -m gptopt train` to compare with. Batches are a pure function of (seed, micro-step),
and rank r takes rows r*B .. (r+1)*B of the step's global batch: two ranks at micro-batch B train on
exactly the windows one process sees at 2B, so the runs agree up to fp32 rounding of the reductions.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from safetensors.torch import load_file

from gptopt import cli
from gptopt.models import checkpoint

Weights = dict[str, torch.Tensor]
RANKS = 2
TIMEOUT_S = 240  # far above a launch's time; the limit only stops a hang
# Six steps through warmup and cosine decay, with a checkpoint and an evaluation every three.
ARGS = (
    "--device", "cpu", "--preset", "debug", "--seq_len", "32", "--max_steps", "6", "--warmup_steps", "2",
    "--save_interval", "3", "--eval_interval", "3", "--eval_iters", "2", "--log_interval", "1",
    "--sample_tokens", "0", "--no-tensorboard",
)
# What torchrun sets: a test session started under torchrun must not make the plain runs join its group.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT")


@dataclass
class Run:
    """One `gptopt train` process tree, working in root; its output_dir is root/out."""

    root: Path
    proc: subprocess.Popen[bytes]
    log: IO[str]  # its stderr (a file, not a pipe: nothing blocks while another run is waited for)
    stderr: str = ""

    @property
    def out(self) -> Path:
        return self.root / "out"

    def wait(self) -> Run:
        """Wait for the exit (failing on a hang); then stderr holds what it logged."""
        hung = False
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher and its workers: the session it leads
            self.proc.wait()
            hung = True
        self.log.seek(0)
        self.stderr = self.log.read()
        self.log.close()
        assert not hung, f"no exit in {TIMEOUT_S} s: {self._where()}"
        return self

    def ok(self) -> Run:
        assert self.proc.returncode == 0, f"exit {self.proc.returncode}: {self._where()}"
        return self

    def _where(self) -> str:
        return f"{' '.join(self.proc.args)}\n{self.stderr[-4000:]}"

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records() if "loss" in r}

    def val_losses(self) -> dict[int, float]:
        return {r["step"]: r["val_loss"] for r in self.records() if "val_loss" in r}

    def ckpt(self, step: int) -> Path:
        return self.out / f"{checkpoint.PREFIX}{step:07d}"

    def weights(self, step: int) -> Weights:
        return load_file(str(self.ckpt(step) / checkpoint.WEIGHTS))


def launch(root: Path, data: Path, *args: str, ranks: int | None = RANKS, env_add: dict[str, str] | None = None) -> Run:
    """Start training in root: under torchrun with `ranks` processes, or as one plain process (None);
    env_add: more environment variables."""
    launcher = [sys.executable]
    if ranks is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = [*launcher, "-m", "gptopt", "train", "--data_dir", str(data), "--output_dir", "out", *ARGS, *args]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"  # a thread per rank: two ranks share two cores, and sums keep one order
    env.update(env_add or {})
    root.mkdir(parents=True, exist_ok=True)
    log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
    )
    return Run(root, proc, log)


def train(root: Path, data: Path, *args: str, ranks: int | None = RANKS) -> Run:
    return launch(root, data, *args, ranks=ranks).wait().ok()


def assert_close(got: dict[int, float], want: dict[int, float], rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rtol), f"step {step}"


def assert_weights_close(got: Weights, want: Weights, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def runs(train_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Global batch 8 three ways: one process, DDP and FSDP on two ranks; and two accumulated
    micro-batches of 4, in one process and split over two DDP ranks. Started together: they share
    the cores, which changes their speed, never their numbers. Each test checks the exits it reads."""
    root = tmp_path_factory.mktemp("runs")
    plans = {
        "one": (None, "--batch_size", "8"),
        "ddp": (RANKS, "--batch_size", "4"),
        "fsdp": (RANKS, "--batch_size", "4", "--fsdp"),
        "one_accum": (None, "--batch_size", "4", "--gradient_accumulation_steps", "2"),
        "ddp_accum": (RANKS, "--batch_size", "2", "--gradient_accumulation_steps", "2"),
        "one_muon": (None, "--batch_size", "8", "--optimizer", "muon"),
        "ddp_muon": (RANKS, "--batch_size", "4", "--optimizer", "muon"),
    }
    started = {name: launch(root / name, train_data, *args, ranks=n) for name, (n, *args) in plans.items()}
    return {name: run.wait() for name, run in started.items()}


def test_ddp_matches_one_process_on_the_same_global_batch(runs: dict[str, Run]) -> None:
    one, ddp = runs["one"].ok(), runs["ddp"].ok()
    assert list(one.losses()) == [1, 2, 3, 4, 5, 6]
    assert_close(ddp.losses(), one.losses())
    assert_close(ddp.val_losses(), one.val_losses())  # each rank evaluates half the windows
    assert_weights_close(ddp.weights(6), one.weights(6))


def test_ddp_runs_muon_unchanged(runs: dict[str, Run]) -> None:
    # the gradients are all-reduced before the step, so every rank orthogonalises the same whole matrices
    one, ddp = runs["one_muon"].ok(), runs["ddp_muon"].ok()
    assert_close(ddp.losses(), one.losses())
    # The losses agree to fp32 rounding; the weights less closely: Newton-Schulz runs in bf16, so where the
    # reductions' fp32 rounding differs its bf16 roundings can too, and five iterations carry that on. After the
    # 6 steps the difference stays below one step's update, whose RMS per element is 0.2 x muon_lr
    # (match_rms_adamw): 6e-4 at the default muon_lr 3e-3.
    assert_weights_close(ddp.weights(6), one.weights(6), atol=1e-3)
    assert set(checkpoint.load_train_state(ddp.ckpt(6))["optimizer"]) == {"muon", "adamw"}


def test_ddp_gradient_accumulation_matches_one_process(runs: dict[str, Run]) -> None:
    # Micro-step m = step * accum + micro draws the same 4 windows in both runs; there rank r takes
    # rows 2r and 2r + 1, here the one process all four.
    one, ddp = runs["one_accum"].ok(), runs["ddp_accum"].ok()
    assert_close(ddp.losses(), one.losses())
    assert_weights_close(ddp.weights(6), one.weights(6))


@pytest.fixture(scope="module")
def sft_runs(trained_out: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Fine-tuning trained_out on conversations whose rows supervise different numbers of tokens, global batch 4:
    one process, DDP and FSDP on two ranks, and one process accumulating 4 micro-batches of 1."""
    from gptopt.commands import prepare
    from gptopt.config import PrepareConfig

    root = tmp_path_factory.mktemp("sft")
    words = ["ab", "he", "x", "ca", "su", "abc", "no", "po", "te", "ri", "go", "mi"]
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": w}, {"role": "assistant", "content": w[::-1] * (1 + i % 3)}]}) + "\n"
        for i, w in enumerate(words * 2)))
    assert prepare.main(PrepareConfig(input=str(root / "chats.jsonl"), output_dir=str(root / "data"),
                                      tokenizer=str(trained_out), seq_len=32, val_fraction=0.25)) == 0
    plans = {
        "one": (None, "--batch_size", "4"),
        "ddp": (RANKS, "--batch_size", "2"),
        "fsdp": (RANKS, "--batch_size", "2", "--fsdp"),
        "one_accum": (None, "--batch_size", "1", "--gradient_accumulation_steps", "4"),
    }
    started = {name: launch(root / name, root / "data", "--init_from", str(trained_out), *args, ranks=n)
               for name, (n, *args) in plans.items()}
    return {name: run.wait() for name, run in started.items()}


@pytest.mark.parametrize("name", ["ddp", "fsdp", "one_accum"])
def test_fine_tuning_normalises_the_loss_by_every_supervised_token_across_ranks_and_micro_batches(
        sft_runs: dict[str, Run], name: str) -> None:
    one, other = sft_runs["one"].ok(), sft_runs[name].ok()
    assert list(one.losses()) == [1, 2, 3, 4, 5, 6]
    assert_close(other.losses(), one.losses())
    if name != "one_accum":  # --eval_iters batches of the micro-batch: the accumulating run evaluates fewer rows
        assert_close(other.val_losses(), one.val_losses())  # the mean over every assistant token of those rows
    if name != "fsdp":  # an FSDP checkpoint's tied head is compared through the model (below)
        assert_weights_close(other.weights(6), one.weights(6))


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_only_rank_0_writes(runs: dict[str, Run], kind: str) -> None:
    run = runs[kind].ok()
    assert os.listdir(run.root) == ["out"]  # nothing beside the output directory, from either rank
    assert sorted(os.listdir(run.out)) == [".gptopt-output.json", "ckpt-0000003", "ckpt-0000006", "latest",
                                           "metrics.jsonl", "monitor.json", "run.json"]
    records = run.records()
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # once each, not once per rank
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert run.stderr.count("gptopt: done: step 6") == 1  # one voice in the log
    assert checkpoint.load_train_state(run.ckpt(6))["world_size"] == RANKS


def test_fsdp_trains_like_ddp_and_saves_a_full_checkpoint(runs: dict[str, Run]) -> None:
    fsdp, ddp = runs["fsdp"].ok(), runs["ddp"].ok()
    losses = fsdp.losses()
    assert all(math.isfinite(v) for v in losses.values()) and losses[6] < losses[1]
    assert_close(losses, ddp.losses())
    # The checkpoint holds whole tensors, gathered from the shards: one process reads it as any model.
    model = checkpoint.load_model(fsdp.ckpt(6))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert_weights_close(state, ddp.weights(6))
    optimizer = checkpoint.load_train_state(fsdp.ckpt(6))["optimizer"]
    for name, param in model.named_parameters():
        assert optimizer["state"][name]["exp_avg"].shape == param.shape, name


@pytest.mark.slow
def test_a_llama_shaped_model_trains_on_ddp_and_fsdp_as_on_one_process(train_data: Path, tmp_path: Path) -> None:
    """Rotary positions (a buffer each rank computes, not a weight), RMSNorm, SwiGLU, grouped-query attention and
    an untied head: the same losses and weights as one process on the same global batch."""
    plans = {"one": (None, "--batch_size", "8"), "ddp": (RANKS, "--batch_size", "4"),
             "fsdp": (RANKS, "--batch_size", "4", "--fsdp")}
    started = {name: launch(tmp_path / name, train_data, "--preset", "llama-tiny", *args, ranks=n)
               for name, (n, *args) in plans.items()}
    one, ddp, fsdp = (started[name].wait().ok() for name in plans)
    assert checkpoint.load_model(one.ckpt(6)).config.positions == "rope"
    for run in (ddp, fsdp):
        assert_close(run.losses(), one.losses())
        assert_weights_close(run.weights(6), one.weights(6))


@pytest.fixture(scope="module")
def resumed(
    runs: dict[str, Run], train_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Run]:
    """Step 3's checkpoint of a run, alone in a fresh output_dir, continued to step 6 by --resume auto:
    FSDP's on FSDP, and across world sizes, one process's on two FSDP ranks and FSDP's on one process."""
    root = tmp_path_factory.mktemp("resumed")
    plans = {
        "fsdp_on_fsdp": ("fsdp", RANKS, ("--batch_size", "4", "--fsdp")),
        "one_on_fsdp": ("one", RANKS, ("--batch_size", "4", "--fsdp")),
        "fsdp_on_one": ("fsdp", None, ("--batch_size", "8")),
    }
    started = {}
    for name, (src, ranks, args) in plans.items():
        ckpt = runs[src].ok().ckpt(3)
        shutil.copytree(ckpt, root / name / "out" / ckpt.name)
        started[name] = launch(root / name, train_data, *args, "--resume", "auto", ranks=ranks)
    return {name: run.wait() for name, run in started.items()}


def test_fsdp_resume_continues_bit_for_bit(runs: dict[str, Run], resumed: dict[str, Run]) -> None:
    run, straight = resumed["fsdp_on_fsdp"].ok(), runs["fsdp"]
    assert "resumed from" in run.stderr
    # Same ranks, same shards, same gloo reduction order, one thread each: nothing may differ at all.
    assert run.losses() == {step: loss for step, loss in straight.losses().items() if step > 3}
    assert run.val_losses() == {6: straight.val_losses()[6]}
    want = straight.weights(6)
    assert all(torch.equal(t, want[name]) for name, t in run.weights(6).items())


@pytest.mark.parametrize("name", ["one_on_fsdp", "fsdp_on_one"])
def test_resume_across_world_sizes(runs: dict[str, Run], resumed: dict[str, Run], name: str) -> None:
    """A checkpoint holds whole tensors and the optimizer state of every parameter, however it was sharded:
    the run continues as the one-process run did, to fp32 rounding."""
    run, want = resumed[name].ok(), runs["one"]
    assert_close(run.losses(), {step: loss for step, loss in want.losses().items() if step > 3})
    assert_weights_close(run.weights(6), want.weights(6))


# Loaded at interpreter start (from PYTHONPATH): rank 1 finds no checkpoint, as on a machine whose disk lacks it.
HIDE_CHECKPOINTS_ON_RANK_1 = """import os
if os.environ.get("RANK") == "1":
    import gptopt.models.checkpoint
    gptopt.models.checkpoint.latest_checkpoint = lambda *a, **k: None
"""


def test_ranks_that_would_resume_at_different_steps_are_refused_on_every_rank(
    runs: dict[str, Run], tmp_path: Path, train_data: Path
) -> None:
    """--resume auto on machines without shared storage: rank 0 finds the run's checkpoint, rank 1 none."""
    root = tmp_path / "run"
    shutil.copytree(runs["ddp"].ok().out, root / "out")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_CHECKPOINTS_ON_RANK_1)
    run = launch(root, train_data, "--batch_size", "4", "--resume", "auto", "--max_steps", "8",
                 env_add={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}).wait()
    assert run.proc.returncode != 0
    assert run.stderr.count("the ranks disagree on where to start: some would start afresh, others resume at "
                            "step 6") == 2, run.stderr[-3000:]  # both ranks say it, neither hangs
    assert "put the output folder on storage every machine shares" in run.stderr
    names = [[p.name for p in checkpoint.checkpoint_dirs(r)] for r in (root / "out", runs["ddp"].out)]
    assert names[0] == names[1]  # nothing saved, nothing removed


def test_fsdp_without_torchrun_exits_2(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    assert cli.main(["train", "--data_dir", str(train_data), "--output_dir", str(out), *ARGS, "--fsdp"]) == 2
    assert "torchrun --nproc_per_node" in capsys.readouterr().err
    assert checkpoint.checkpoint_dirs(out) == [] and not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_on_every_rank_at_one_step(train_data: Path, tmp_path: Path) -> None:
    # What `kill <pid>` or a scheduler does: torchrun passes SIGTERM on, the ranks agree on one step
    # boundary to stop at, save there together, and the run resumes from it.
    long = ("--batch_size", "4", "--max_steps", "100000", "--save_interval", "100000", "--eval_interval", "0")
    run = launch(tmp_path, train_data, *long)
    metrics, deadline = run.out / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.is_file() and metrics.read_text().count('"loss"') >= 3):  # both ranks are in the loop
        assert run.proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGTERM)
    run.wait()  # torchrun itself exits 1 after a signal, whatever its workers return
    assert "signal SIGTERM: saved" in run.stderr
    (ckpt,) = checkpoint.checkpoint_dirs(run.out)
    step = int(ckpt.name.removeprefix(checkpoint.PREFIX))
    assert max(run.losses()) == step
    more = ("--batch_size", "4", "--resume", "auto", "--max_steps", f"{step + 2}")
    resumed = train(tmp_path, train_data, *more)
    assert f"at step {step}" in resumed.stderr
    assert list(resumed.losses())[-2:] == [step + 1, step + 2]
