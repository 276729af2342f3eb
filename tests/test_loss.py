"""The chunked training loss: the plain loss's value and gradients, without the full logits; and when train picks it.

    pytest -q tests/test_loss.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import load_script
from torch.utils._python_dispatch import TorchDispatchMode

from gptopt.commands import train as train_cmd
from gptopt.config import TrainConfig, preset
from gptopt.models.gpt import GPT
from gptopt.models.loss import linear_cross_entropy
from gptopt.runtime import memory_check
from gptopt.train import step_memory

N, C, V, V_PADDED = 300, 32, 500, 512  # 300 rows: the last chunk of 64 is short


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(V_PADDED, C, generator=g) * 0.1
    w[V:] = 0  # padding rows, never a token
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -100  # ignored positions
    return x, w, t


def loss_and_grads(fn: Any, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor,
                   bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = fn(x, w, t)
    (3 * loss).backward()  # a scaled loss, as accumulation divides it: the gradients follow the scale
    assert x.grad is not None and w.grad is not None
    return loss.detach(), x.grad, w.grad


def plain(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(x, w)[..., :V].float(), t, ignore_index=-100)


@pytest.mark.parametrize("rows", [64, 128, 1024])
def test_the_chunked_loss_and_its_gradients_are_the_plain_ones(rows: int) -> None:
    x, w, t = inputs()
    want = loss_and_grads(plain, x, w, t)
    got = loss_and_grads(lambda x, w, t: linear_cross_entropy(x, w, t, V, rows), x, w, t)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not got[2][V:].any()  # the padding rows get no gradient


def test_under_bf16_autocast_the_chunked_loss_stays_within_bf16_of_the_plain_one() -> None:
    x, w, t = inputs(1)
    want = loss_and_grads(plain, x, w, t, bf16=True)
    got = loss_and_grads(lambda x, w, t: linear_cross_entropy(x, w, t, V, 64), x, w, t, bf16=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(got[1:], want[1:], strict=True):  # both run their matmuls in bf16: 8 bits of mantissa
        assert (a - b).norm() < 1e-2 * b.norm()


def test_without_gradients_it_gives_the_same_loss() -> None:
    x, w, t = inputs(2)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, w, t, V, 64), plain(x, w, t))


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_a_model_step_on_the_chunked_loss_never_holds_the_full_logits_and_matches_the_full_loss() -> None:
    cfg = preset("debug", vocab_pad_multiple=64)
    B, T = 8, 64
    x = torch.randint(0, cfg.vocab_size, (B, T))
    y = torch.randint(0, cfg.vocab_size, (B, T))
    results = {}
    for loss in ("full", "chunked"):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(cfg, loss=loss))
        with LargestTensor() as seen:
            value = model(x, y)
            value.backward()
        results[loss] = (value.detach(), {n: p.grad for n, p in model.named_parameters()}, seen.largest)
    full, chunked = results["full"], results["chunked"]
    torch.testing.assert_close(chunked[0], full[0], rtol=1e-5, atol=1e-6)
    for name, g in full[1].items():  # the tied head/embedding too: both of its gradients arrive
        torch.testing.assert_close(chunked[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    logits = B * T * cfg.vocab_size
    assert full[2] >= logits > chunked[2]


def test_auto_takes_the_chunked_loss_only_where_the_full_logits_would_not_fit(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = preset("gpt2", vocab_pad_multiple=64)
    run = TrainConfig(preset="gpt2", batch_size=16, seq_len=1024)
    cpu = torch.device("cpu")

    def estimate(loss: str) -> memory_check.Estimate:
        return step_memory.for_training(dataclasses.replace(cfg, loss=loss), run, 1024, torch.bfloat16)

    full, chunked = estimate("full").total, estimate("chunked").total
    assert chunked < full
    for free, want, why in [(10 * full, "full", "the full logits fit"),
                            ((full + chunked) // 2 / memory_check.REFUSE_ABOVE, "chunked", "would not fit"),
                            (chunked // 2, "chunked", "does not fit with either loss")]:
        monkeypatch.setattr(memory_check, "available_bytes", lambda device, f=int(free): (f, "test RAM"))
        loss, reason = step_memory.pick_loss("auto", estimate, cpu, "16 x 1024")
        assert loss == want and why in reason
    # what the user names is kept, fitting or not
    assert step_memory.pick_loss("full", estimate, cpu, "16 x 1024") == ("full", "--loss full")


def test_train_on_the_chunked_loss_follows_the_full_loss_curve(
    train_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    curves = {}
    for loss in ("full", "chunked"):
        out = tmp_path / loss
        kw = dict(preset="debug", seq_len=32, batch_size=4, device="cpu", sample_tokens=0, tensorboard=False,
                  eval_interval=0, log_interval=1, warmup_steps=2, max_steps=4)
        with caplog.at_level(logging.INFO, logger="gptopt"):
            assert train_cmd.main(TrainConfig(data_dir=str(train_data), output_dir=str(out), loss=loss, **kw)) == 0
        assert f"loss: {loss} (--loss {loss})" in caplog.text
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        curves[loss] = [r["loss"] for r in records if "loss" in r]
    assert len(curves["full"]) == 4
    assert curves["chunked"] == pytest.approx(curves["full"], rel=1e-5)


@pytest.mark.slow
def test_compiled_the_chunked_loss_gives_the_eager_loss_and_gradients() -> None:
    cfg = preset("debug", vocab_pad_multiple=64, loss="chunked")
    x = torch.randint(0, cfg.vocab_size, (4, 64))
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        value = (torch.compile(model) if compiled else model)(x, x)
        value.backward()
        grads.append((value.detach(), model.transformer.wte.weight.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-4, atol=1e-6)


def test_the_loss_comparison_trains_both_losses_from_the_same_weights_and_sees_the_memory_saved() -> None:
    """benchmarks/loss_ab.py times two computations of one step: the same loss after the warm-up steps, and
    the chunked step's peak memory below the full one's."""
    ab = load_script("loss_ab")
    cfg = preset("debug", vocab_pad_multiple=64)
    r = ab.compare(cfg, batch_size=8, seq_len=64, rounds=1, bf16=False, compile=False)
    assert r["warm_loss"]["chunked"] == pytest.approx(r["warm_loss"]["full"], rel=1e-5)
    peaks = {loss: ab.step_peak_bytes(cfg, loss, 8, 64, False) for loss in ("full", "chunked")}
    logits = 8 * 64 * cfg.vocab_size * 4  # one fp32 copy of the full logits
    assert peaks["full"] - peaks["chunked"] > 2 * logits


def test_auto_batch_size_takes_the_larger_micro_batch_the_chunked_loss_lets_fit(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory that holds micro-batch 4 with the chunked loss's logits but only 2 with the full loss's."""
    real = memory_check.shortfall
    limit = {"logits": 0}

    def shortfall(estimate: memory_check.Estimate, device: torch.device) -> str | None:
        return "needs more than this test allows" if estimate.parts["logits"] > limit["logits"] else real(
            estimate, device)

    def logits_bytes(loss: str, batch: int) -> int:
        cfg = dataclasses.replace(GPT(preset("debug", vocab_size=320, vocab_pad_multiple=64)).config, loss=loss)
        return step_memory.train_step_bytes(cfg, batch, 32).parts["logits"]

    assert logits_bytes("full", 2) < logits_bytes("chunked", 4) < logits_bytes("full", 4)
    limit["logits"] = logits_bytes("chunked", 4)
    monkeypatch.setattr(memory_check, "shortfall", shortfall)
    out = tmp_path / "o"
    assert train_cmd.main(TrainConfig(data_dir=str(train_data), output_dir=str(out), preset="debug", seq_len=32,
                                  batch_size=4, auto_batch_size=True, max_steps=2, device="cpu", sample_tokens=0,
                                  tensorboard=False, eval_interval=0)) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["config"]["batch_size"], run["config"]["gradient_accumulation_steps"]) == (4, 1)
    assert run["model"]["loss"] == "chunked"


def test_under_fp16_the_chunked_gradients_keep_the_small_probabilities() -> None:
    """fp16 with a GradScaler: the plain loss's gradients arrive scaled up, so its small softmax terms survive the
    cast to fp16; the chunked loss takes its gradients before any scale, so it must not divide by the position
    count before its fp16 matmuls (8,192 positions: p / count would be fp16-subnormal)."""
    g = torch.Generator().manual_seed(3)
    n = 8192
    x, w = torch.randn(n, C, generator=g), torch.randn(V_PADDED, C, generator=g) * 0.1
    t = torch.randint(0, V, (n,), generator=g)
    grads = []
    for fn in (plain, lambda x, w, t: linear_cross_entropy(x, w, t, V, 1024)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", torch.float16):
            loss = fn(xg, wg, t)
        (loss * 65536.0).backward()  # what the GradScaler does, then unscales
        grads.append((xg.grad / 65536.0, wg.grad / 65536.0))
    for got, want in zip(grads[1], grads[0], strict=True):
        assert (got - want).norm() < 1e-2 * want.norm()
