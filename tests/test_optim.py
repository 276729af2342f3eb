"""The optimizer factory: --optimizer adamw|muon, which parameters Muon takes, each group's schedule,
the GradScaler over both parts, and the combinations refused.

    pytest -q tests/test_optim.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import exit_status

from gptopt.config import TrainConfig, preset
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve
from gptopt.train.optim import MuonAdamW, lr_at, make_optimizer
from gptopt.train.step import TrainStep


def build(model: GPT, kind: str = "muon") -> MuonAdamW:
    opt, _ = make_optimizer(model, kind=kind, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu")
    assert isinstance(opt, MuonAdamW)
    return opt


def batches(n: int, vocab: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (4, 16), generator=g), torch.randint(0, vocab, (4, 16), generator=g))
            for _ in range(n)]


def test_muon_takes_exactly_the_blocks_linear_weights_and_adamw_the_rest() -> None:
    model = GPT(preset("debug"))
    opt = build(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    expected = {f"transformer.h.{i}.{m}.weight" for i in range(model.config.n_layer)
                for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert muon == expected
    # the embedding, and so the head tied to it, stays with AdamW (and keeps its weight decay)
    assert model.lm_head.weight is model.transformer.wte.weight
    decay, no_decay = ({names[id(p)] for p in g["params"]} for g in opt.adamw.param_groups)
    assert decay == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert opt.adamw.param_groups[1]["weight_decay"] == 0.0 and all(n.endswith(("bias", "weight")) for n in no_decay)
    # every parameter is updated by exactly one of the two
    owned = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(owned) == sorted(names) and len(owned) == len(set(owned))
    # adamw is today's optimizer, over every parameter
    plain, _ = make_optimizer(model, kind="adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu")
    assert isinstance(plain, torch.optim.AdamW) and sum(len(g["params"]) for g in plain.param_groups) == len(names)


def test_each_group_follows_the_schedule_to_its_own_peak() -> None:
    cfg = TrainConfig(preset="debug", optimizer="muon", learning_rate=1e-3, min_lr=1e-4, muon_lr=4e-3, warmup_steps=2,
                      max_steps=6, device="cpu")
    model = GPT(preset("debug"))
    ts = TrainStep(model, model, resolve("cpu", "fp32"), cfg)
    data = batches(6)
    n_muon = len(ts.optimizer.muon.param_groups)
    for s in range(6):
        ts(s, lambda _micro, s=s: data[s])
        lrs = [g["lr"] for g in ts.optimizer.param_groups]
        assert lrs[:n_muon] == [pytest.approx(lr_at(s, 4e-3, 4e-4, 2, 6))] * n_muon, s
        assert lrs[n_muon:] == [ts.lr(s)] * (len(lrs) - n_muon), s
    # Muon's default rate is its own: the best of the studies on tiny, whatever AdamW's rate for the rest (the
    # tuned 4e-3 of the quality ladder's muon recipe must not carry Muon to 4x its best)
    assert [TrainConfig(optimizer="muon", learning_rate=lr).muon_lr for lr in (1e-3, 4e-3)] == [3e-3, 3e-3]


def test_fp16s_grad_scaler_unscales_and_steps_both_parts() -> None:
    cfg = TrainConfig(preset="debug", optimizer="muon", warmup_steps=1, device="cpu")
    plan = resolve("cpu", "fp32")
    a, b = GPT(preset("debug")), GPT(preset("debug"))
    b.load_state_dict(a.state_dict())
    scaled = TrainStep(a, a, dataclasses.replace(plan, use_grad_scaler=True), cfg)
    plain = TrainStep(b, b, plan, cfg)
    assert scaled.scaler is not None and plain.scaler is None
    for s, batch in enumerate(batches(3)):
        ra, rb = scaled(s, lambda _m, batch=batch: batch), plain(s, lambda _m, batch=batch: batch)
        # the norm is read after unscale_: Muon's gradients were unscaled too
        assert ra.grad_norm == pytest.approx(rb.grad_norm, rel=1e-5) and ra.finite
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, msg=name)

    # an inf gradient in Muon's part: the scaler skips the whole step (both parts) and lowers the scale
    model = GPT(preset("debug"))
    opt = build(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batches(1)[0]
    scaler.scale(model(x, y)).backward()
    model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert scaler.get_scale() < 2.0**10 and not opt.muon.state and not opt.adamw.state


def args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data_dir", str(data), "--output_dir", str(out), "--preset", "debug", "--seq_len", "32",
            "--batch_size", "4", "--device", "cpu", "--sample_tokens", "0", "--no-tensorboard", "--warmup_steps", "2",
            "--eval_interval", "0", *extra]


@pytest.mark.parametrize(("extra", "expect"), [
    (["--optimizer", "muon", "--fsdp"], "drop --fsdp (DDP), or use --optimizer adamw"),
    (["--muon_lr", "0.01"], "add --optimizer muon"),
    (["--optimizer", "sgd"], "adamw"),
    (["--optimizer", "muon", "--muon_lr", "0"], "--muon_lr must be"),
])
def test_bad_combinations_are_refused_with_the_fix(
    extra: list[str], expect: str, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(args(train_data, tmp_path / "o", *extra)) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_resuming_with_the_other_optimizer_is_refused_with_the_fix(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for first, second in (("adamw", "muon"), ("muon", "adamw")):
        out = tmp_path / first
        assert exit_status(args(train_data, out, "--max_steps", "2", "--optimizer", first)) == 0
        capsys.readouterr()
        before = {q: q.read_bytes() for q in out.rglob("*") if q.is_file()}
        assert exit_status(args(train_data, out, "--max_steps", "4", "--resume", "auto", "--optimizer", second)) == 2
        assert {q: q.read_bytes() for q in out.rglob("*") if q.is_file()} == before  # the run is left as it was
        err = capsys.readouterr().err
        assert f"resume with --optimizer {first}" in err and "--init_from" in err and "Traceback" not in err


def test_a_torch_without_muon_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.optim, "Muon")  # torch 2.6 to 2.8, which pyproject admits
    with pytest.raises(ValueError, match=r"torch >= 2\.9.*upgrade torch, or use --optimizer adamw"):
        TrainConfig(optimizer="muon")
    assert TrainConfig().optimizer == "adamw"  # and AdamW runs as ever
