"""The full loss against the chunked one (gptopt train --loss): step time side by side, and each step's peak memory.

    python benchmarks/loss_ab.py [--preset tiny] [--batch_size 16] [--seq_len N] [--rounds 6]
        [--dtype fp32|bf16] [--compile] [--memory_only] [--vocab_size N]

Two copies of gptopt's model with the same weights, one per loss, train on the same batch of random
tokens: each round runs two steps (forward, backward, fused AdamW) of one, then of the other, after
two warm-up steps each, the order turned every round. It prints each one's median step and the
chunked loss's tokens/s over the full loss's. Then each loss's step runs once more in a fresh process
of its own, which reports the growth of its peak resident memory over what the model, its gradients and
the optimizer state held before the step: the memory the loss decides. Freed host memory stays resident
there (as `gptopt train` runs on CPUs), so the peak before the step is the resident size then.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil
import torch

from gptopt.config import PRESETS, GPTConfig, preset
from gptopt.device import default_attention, reuse_host_memory
from gptopt.model import GPT

LOSSES = ("full", "chunked")


def build(config: GPTConfig, loss: str, compile: bool) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same weights for both
    model = GPT(dataclasses.replace(config, loss=loss))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return (torch.compile(model) if compile else model), opt


def step(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor, bf16: bool) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def batch(config: GPTConfig, batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(1))


def compare(config: GPTConfig, *, batch_size: int, seq_len: int, rounds: int, bf16: bool,
            compile: bool) -> dict[str, Any]:
    runs = {loss: build(config, loss, compile) for loss in LOSSES}
    x = batch(config, batch_size, seq_len)
    last = {}
    for loss, (model, opt) in runs.items():
        step(model, opt, x, bf16)
        last[loss] = step(model, opt, x, bf16)
    times: dict[str, list[float]] = {loss: [] for loss in LOSSES}
    for r in range(rounds):
        for loss in LOSSES if r % 2 == 0 else LOSSES[::-1]:
            t0 = time.perf_counter()
            step(*runs[loss], x, bf16)
            step(*runs[loss], x, bf16)
            times[loss].append((time.perf_counter() - t0) / 2)
    median = {loss: statistics.median(t) for loss, t in times.items()}
    return {"median_step_s": median, "ratio": median["full"] / median["chunked"], "warm_loss": last}


def step_peak_growth(config: GPTConfig, loss: str, batch_size: int, seq_len: int, bf16: bool) -> int:
    """In this process: the growth of the peak resident memory over the model and optimizer's, for one step."""
    reuse_host_memory()  # freed memory stays resident: the RSS before the step is the peak so far
    model, opt = build(config, loss, False)
    x = batch(config, batch_size, seq_len)
    for p in model.parameters():  # AdamW's state and the gradients exist before the step, as in training
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = psutil.Process().memory_info().rss
    step(model, opt, x, bf16)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # ru_maxrss: KiB on Linux


def peak_growth(preset_name: str, loss: str, batch_size: int, seq_len: int, bf16: bool, *,
                vocab_size: int | None = None) -> int:
    """step_peak_growth in a fresh process of its own (this one's peak is already spent)."""
    cmd = [sys.executable, __file__, "--preset", preset_name, "--batch_size", str(batch_size), "--seq_len",
           str(seq_len), "--dtype", "bf16" if bf16 else "fp32", "--peak_of", loss]
    cmd += ["--vocab_size", str(vocab_size)] if vocab_size else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape (default tiny)")
    ap.add_argument("--batch_size", type=int, default=16, help="sequences a step")
    ap.add_argument("--seq_len", type=int, default=None, help="tokens a sequence (default: the preset's context)")
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds, two steps of each loss a round")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="fp32, or bf16 autocast")
    ap.add_argument("--compile", action="store_true", help="torch.compile both models (default mode)")
    ap.add_argument("--memory_only", action="store_true", help="only the peak memory of each loss's step")
    ap.add_argument("--vocab_size", type=int, default=None, help="another vocabulary than the preset's")
    ap.add_argument("--peak_of", choices=LOSSES, help=argparse.SUPPRESS)  # the child process of peak_growth
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.rounds < 1:
        ap.error("--batch_size and --rounds must be at least 1")
    bf16 = args.dtype == "bf16"
    config = preset(args.preset, vocab_pad_multiple=64, **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
    config.attention = default_attention("cpu", torch.bfloat16 if bf16 else None)
    seq_len = args.seq_len or config.block_size
    if args.peak_of:
        print(step_peak_growth(config, args.peak_of, args.batch_size, seq_len, bf16))
        return 0
    tokens = args.batch_size * seq_len
    what = f"{args.preset}, {args.batch_size} x {seq_len}, {args.dtype}, {'compiled' if args.compile else 'eager'}"
    if not args.memory_only:
        reuse_host_memory()  # as gptopt train runs on CPUs
        r = compare(config, batch_size=args.batch_size, seq_len=seq_len, rounds=args.rounds, bf16=bf16,
                    compile=args.compile)
        for loss, s in r["median_step_s"].items():
            warm = r["warm_loss"][loss]
            print(f"{loss:<8} median step {s * 1e3:8.1f} ms  {tokens / s:9.0f} tokens/s  loss {warm:.5f}")
        print(f"chunked / full: {r['ratio']:.2f}x ({what})")
    for loss in LOSSES:
        grew = peak_growth(args.preset, loss, args.batch_size, seq_len, bf16, vocab_size=args.vocab_size)
        print(f"{loss:<8} peak memory of an eager step over the model and optimizer: {grew / 2**20:8.1f} MiB "
              f"({args.preset}, {args.batch_size} x {seq_len}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
