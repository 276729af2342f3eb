"""Checkpoints and resuming: exact resume, retention, a crash while saving, corrupt checkpoints, the refusals of a
resume that would change the run, the lineage, the tokenizer a checkpoint carries.

    pytest -q tests/test_train_resume.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import eval_samples, file_tree, train_args, train_losses, train_run

from gptopt import cli
from gptopt.config import preset
from gptopt.data.loader import load_tokenizer
from gptopt.models import checkpoint
from gptopt.runtime.device import resolve


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_bitwise_exact(train_data: Path, tmp_path: Path, optimizer: str) -> None:
    # dropout on, so the RNG state must be restored too, not only weights and optimizer; eval samples
    # on, so sampling must leave training's RNG stream alone (the first leg samples at step 5 too)
    kw = dict(optimizer=optimizer, dropout=0.1, save_interval=5, max_steps=10, eval_interval=3, eval_iters=2,
              sample_tokens=8)
    assert train_run(train_data, tmp_path / "straight", **kw) == 0
    # the first leg stops after 5 steps of the same 10-step schedule (as a crash or a signal would)
    assert train_run(train_data, tmp_path / "split", max_tokens=5 * 4 * 32, **kw) == 0
    assert train_run(train_data, tmp_path / "split", resume="auto", **kw) == 0
    straight, split = train_losses(tmp_path / "straight"), train_losses(tmp_path / "split")
    assert list(split) == list(range(1, 11))  # no step logged twice after the resume
    assert split == straight  # bitwise: == on floats
    assert eval_samples(tmp_path / "straight") == {s: t for s, t in eval_samples(tmp_path / "split").items() if s != 5}
    a = checkpoint.load_model(tmp_path / "straight" / "ckpt-0000010").state_dict()
    b = checkpoint.load_model(tmp_path / "split" / "ckpt-0000010").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_keeps_the_last_k_checkpoints(train_data: Path, tmp_path: Path) -> None:
    train_run(train_data, tmp_path / "r", max_steps=12, save_interval=2, save_total_limit=2)
    assert [d.name for d in checkpoint.checkpoint_dirs(tmp_path / "r")] == ["ckpt-0000010", "ckpt-0000012"]
    state = checkpoint.load_train_state(tmp_path / "r" / "ckpt-0000012")
    assert state["step"] == 12 and state["tokens_seen"] == 12 * 4 * 32


def test_crash_while_saving_keeps_the_previous_checkpoint(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"
    train_run(train_data, out, max_steps=4, save_interval=4)
    real_save = torch.save

    def crash(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        real_save({"half": torch.zeros(3)}, f)  # something reached the disk, then the process died
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train_run(train_data, out, max_steps=8, save_interval=8, resume="auto")
    monkeypatch.setattr(torch, "save", real_save)
    assert [d.name for d in out.iterdir() if d.name.startswith((".ckpt", "ckpt"))] == ["ckpt-0000004"]
    assert train_run(train_data, out, max_steps=8, resume="auto") == 0  # the old one still resumes


@pytest.mark.parametrize("damage", ["truncate_state", "truncate_weights", "garbage_meta"])
def test_corrupt_checkpoint_is_refused(
    train_data: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    train_run(train_data, out, max_steps=2)
    ckpt = checkpoint.latest_checkpoint(out)
    target = {"truncate_state": checkpoint.TRAIN_STATE, "truncate_weights": checkpoint.WEIGHTS,
              "garbage_meta": checkpoint.META}[damage]
    blob = (ckpt / target).read_bytes()
    (ckpt / target).write_bytes(blob[: len(blob) // 2] if damage.startswith("truncate") else b"{not json")
    before = (ckpt / target).read_bytes()
    assert cli.main(train_args(train_data, out, "--resume", str(ckpt), "--max_steps", "4")) == 2
    err = capsys.readouterr().err
    assert "corrupt" in err or "truncated" in err
    assert (ckpt / target).read_bytes() == before


def test_resume_refuses_a_preset_chosen_for_another_shape_than_the_checkpoints(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    train_run(train_data, out, max_steps=2)
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert cli.main(train_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--preset", "gpt2")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gptopt train: error: --preset gpt2 does not apply to a resumed run")
    assert "the run's debug model" in err
    assert "n_layer 2" in err and "drop --preset" in err and "another --output_dir" in err
    assert sorted(p.name for p in out.iterdir()) == before and checkpoint.latest_checkpoint(out).name == "ckpt-0000002"


def test_resume_without_preset_keeps_the_checkpoints_and_a_given_default_is_refused_too(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    train_run(train_data, out, max_steps=2)
    capsys.readouterr()
    without = [a for a in train_args(train_data, out) if a not in ("--preset", "debug")]
    assert cli.main([*without, "--resume", "auto", "--max_steps", "3"]) == 0  # no --preset: quiet, its own shape
    assert "--preset" not in capsys.readouterr().err
    assert checkpoint.load_model(checkpoint.latest_checkpoint(out)).config.n_layer == preset("debug").n_layer
    # tiny is what a new run is without --preset; given for a debug run, it is refused like any other
    assert cli.main([*without, "--resume", "auto", "--max_steps", "4", "--preset", "tiny"]) == 2
    assert "--preset tiny does not apply to a resumed run" in capsys.readouterr().err
    assert checkpoint.latest_checkpoint(out).name == "ckpt-0000003"


def test_resume_refuses_a_vocab_pad_multiple_other_than_the_checkpoints(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The padded rows are part of the checkpoint's weights: --vocab_pad_multiple shapes a new run only, and one
    given for a resumed run that differs from its own is refused, never left unused without a word."""
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=2) == 0  # train_data's 320 tokens, padded to 64: 320 rows
    before = file_tree(out)
    capsys.readouterr()
    assert cli.main(train_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--vocab_pad_multiple",
                             "128")) == 2
    err = capsys.readouterr().err
    assert "--vocab_pad_multiple 128 does not apply to a resumed run" in err and "a multiple of 64" in err
    assert "drop --vocab_pad_multiple" in err and file_tree(out) == before
    # its own padding, or none given: it goes on
    assert cli.main(train_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--vocab_pad_multiple",
                             "64")) == 0
    assert cli.main(train_args(train_data, out, "--resume", "auto", "--max_steps", "4")) == 0
    # a new run takes it
    assert train_run(train_data, tmp_path / "new", max_steps=1, vocab_pad_multiple=128) == 0
    config = checkpoint.load_model(checkpoint.latest_checkpoint(tmp_path / "new")).config
    assert (config.vocab_pad_multiple, config.padded_vocab_size) == (128, 384)


def test_resume_refuses_a_preset_of_another_family_of_the_same_size(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-tiny has tiny's size: over a GPT-2-shaped tiny run it is still another model, and refused."""
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=2, preset="tiny", seq_len=16) == 0
    before = file_tree(out)
    capsys.readouterr()
    assert cli.main([*train_args(train_data, out, "--resume", "auto", "--max_steps", "3"), "--preset", "llama-tiny",
                     "--seq_len", "16"]) == 2
    err = capsys.readouterr().err
    assert "--preset llama-tiny does not apply to a resumed run" in err and "positions learned" in err
    assert "positions rope" in err and file_tree(out) == before


def _other_data(text_dir: Path, out: Path, **kw: Any) -> Path:
    """Data of another tokenizer: a BPE trained on other text (kw: prepare's options)."""
    import sysconfig

    from gptopt.config import PrepareConfig
    from gptopt.data.corpus import tokenize_corpus

    text_dir.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/encoder.py", "csv.py", "string.py", "ast.py"):
        (text_dir / f"{Path(name).name}.txt").write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    return tokenize_corpus(PrepareConfig(input=str(text_dir), output_dir=str(out), val_fraction=0.3,
                                         **{"vocab_size": 300, **kw}))


def test_a_run_never_resumes_or_starts_from_a_model_on_another_tokenizers_data(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The quick start's model, then `gptopt prepare` of the user's own text (a BPE of its own): --resume auto and
    --init_from on that data are refused, naming the fix, which then works: prepare with the model's tokenizer."""
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=2) == 0
    mine = _other_data(tmp_path / "texts", tmp_path / "mine")
    before = file_tree(out)
    capsys.readouterr()
    assert cli.main(train_args(mine, out, "--resume", "auto", "--max_steps", "3")) == 2
    err = capsys.readouterr().err
    ckpt = checkpoint.latest_checkpoint(out)
    assert "was tokenized with another tokenizer than the run's checkpoint" in err and "nothing was written" in err
    assert f"--tokenizer {ckpt / 'tokenizer.json'}" in err and file_tree(out) == before
    assert cli.main(train_args(mine, tmp_path / "ft", "--init_from", str(out), "--max_steps", "2")) == 2
    assert "another tokenizer than --init_from" in capsys.readouterr().err and not (tmp_path / "ft").exists()
    # the fix: the same text, tokenized with the model's own tokenizer
    fixed = _other_data(tmp_path / "texts2", tmp_path / "fixed", tokenizer=str(ckpt / "tokenizer.json"))
    assert cli.main(train_args(fixed, out, "--resume", "auto", "--max_steps", "3")) == 0
    assert checkpoint.latest_checkpoint(out).name == "ckpt-0000003"


def test_resuming_an_earlier_checkpoint_keeps_the_new_branch_and_points_latest_at_it(
    train_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gptopt.infer.load import model_source

    out = tmp_path / "tl"
    assert train_run(train_data, out, max_steps=30, save_interval=10) == 0
    with caplog.at_level("WARNING", logger="gptopt"):
        assert cli.main(train_args(train_data, out, "--resume", str(out / "ckpt-0000010"), "--max_steps", "17",
                                 "--save_interval", "5", "--save_total_limit", "1")) == 0
    assert "ckpt-0000020, ckpt-0000030 belong to an abandoned branch" in caplog.text
    # retention kept the last of the new lineage (10 -> 15 -> 17) and left the abandoned branch alone
    assert [d.name for d in checkpoint.checkpoint_dirs(out)] == ["ckpt-0000017", "ckpt-0000020", "ckpt-0000030"]
    assert checkpoint.latest_checkpoint(out) == out / "ckpt-0000017"
    assert model_source(str(out)) == out / "ckpt-0000017"  # what generate --model / serve load
    assert checkpoint.lineage(out / "ckpt-0000017") == ["ckpt-0000010", "ckpt-0000015", "ckpt-0000017"]
    # --resume auto continues the new branch, not the larger step of the old one
    assert train_run(train_data, out, max_steps=18, resume="auto") == 0
    assert checkpoint.load_train_state(checkpoint.latest_checkpoint(out))["step"] == 18
    assert max(train_losses(out)) == 18


def test_generate_uses_the_checkpoints_tokenizer_from_any_working_directory(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from gptopt.infer.load import load_for_inference

    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(train_data, here / "data" / "stdlib")
    monkeypatch.chdir(here)  # trained with a relative --data_dir, as the default data/stdlib is
    assert train_run(Path("data/stdlib"), Path("out"), max_steps=2) == 0
    other = load_tokenizer(train_data / "tokenizer.json")
    other.add_tokens(["another corpus's token"])
    (there / "data" / "stdlib").mkdir(parents=True)
    other.save(str(there / "data" / "stdlib" / "tokenizer.json"))
    monkeypatch.chdir(there)
    _, tok = load_for_inference(str(here / "out"), tokenizer=None, plan=resolve("cpu", "fp32"))
    assert tok.get_vocab() == load_tokenizer(train_data / "tokenizer.json").get_vocab()
    (there / "data" / "stdlib" / "tokenizer.json").unlink()  # and with nothing in this folder at all
    _, tok = load_for_inference(str(here / "out"), tokenizer=None, plan=resolve("cpu", "fp32"))
    assert tok.get_vocab_size() == 320
    # and the data it was trained on, which compress and bench evaluate on by default
    assert checkpoint.training_data(checkpoint.latest_checkpoint(here / "out")) == str(here / "data" / "stdlib")


# -- what a run may write over ---------------------------------------------------------------------


def test_resume_auto_never_writes_over_a_users_files_of_a_runs_names(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "u"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 5, "note": "mine"}\n')
    (out / "run.json").write_text('{"mine": true}\n')
    before = file_tree(out)
    # --resume, --overwrite or neither: the same refusal at once, never advice that then refuses
    for extra in (["--resume", "auto"], ["--overwrite"], []):
        assert cli.main(train_args(train_data, out, "--max_steps", "2", *extra)) == 2
        err = capsys.readouterr().err
        assert "which gptopt did not write" in err and "pass --" not in err, err
        assert file_tree(out) == before


def test_a_metrics_file_that_is_not_gptopts_stops_a_resume_with_the_fix(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    assert train_run(train_data, out, max_steps=2) == 0
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write("not json\n")
    assert cli.main(train_args(train_data, out, "--max_steps", "4", "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: a line is not one of gptopt's metrics records" in err and "Traceback" not in err


def test_arch_trains_a_new_design_over_the_preset_and_a_resumed_run_keeps_its_own(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    design = "positions=rope,qk_norm=true,mlp=relu2,tie_embeddings=false,zero_init=true"
    assert cli.main(train_args(train_data, out, "--max_steps", "2", "--arch", design)) == 0
    model = checkpoint.load_model(checkpoint.latest_checkpoint(out))
    c = model.config
    assert (c.positions, c.qk_norm, c.mlp, c.tie_embeddings, c.zero_init) == ("rope", True, "relu2", False, True)
    assert (c.n_layer, c.n_embd) == (preset("debug").n_layer, preset("debug").n_embd)  # the preset's sizes
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    # resumed under another design: refused, nothing written; its own design (or none) goes on
    assert cli.main(train_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--arch", "mlp=gelu")) == 2
    err = capsys.readouterr().err
    assert "--arch mlp=gelu does not apply to a resumed run" in err and "mlp=relu2" in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert cli.main(train_args(train_data, out, "--resume", "auto", "--max_steps", "3", "--arch", design)) == 0
