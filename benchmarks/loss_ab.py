"""The full loss against the chunked one (gptopt train --loss): step time side by side, and each step's peak memory.

    python benchmarks/loss_ab.py [--preset tiny] [--batch_size 16] [--seq_len N] [--rounds 6]
        [--dtype fp32|bf16] [--compile] [--memory_only] [--vocab_size N]

Two copies of gptopt's model with the same weights, one per loss, train on the same batch of random
tokens: each round runs two steps (forward, backward, fused AdamW) of one, then of the other, after
two warm-up steps each, the order turned every round. It prints each one's median step and the
chunked loss's tokens/s over the full loss's. Then each loss's eager step runs once more under a dispatch
mode that counts the tensor storage the step allocates and frees: the most it holds at once beyond the
model and AdamW's state is the memory the loss decides. (The process's resident size is
no measure of it: the allocator's reuse and its threads' arenas blur it.)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gptopt.config import PRESETS, GPTConfig, preset
from gptopt.models.gpt import GPT
from gptopt.runtime.device import default_attention, reuse_host_memory

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


class LiveTensorBytes(TorchDispatchMode):
    """While active: the bytes of tensor storage created inside and still alive, and their peak. Each storage is
    counted once (views share it) until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (key := t.untyped_storage().data_ptr()) and key not in self._seen:
                storage = t.untyped_storage()
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def step_peak_bytes(config: GPTConfig, loss: str, batch_size: int, seq_len: int, bf16: bool) -> int:
    """The most tensor memory one eager training step holds at once beyond what existed before it: the model and
    AdamW's state (an untimed step first allocates it); the gradients are the step's own, as zero_grad frees them."""
    model, opt = build(config, loss, False)
    x = batch(config, batch_size, seq_len)
    step(model, opt, x, bf16)  # AdamW's state exists from here on
    with LiveTensorBytes() as counted:
        step(model, opt, x, bf16)
    return counted.peak


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
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.rounds < 1:
        ap.error("--batch_size and --rounds must be at least 1")
    bf16 = args.dtype == "bf16"
    config = preset(args.preset, vocab_pad_multiple=64, **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
    config.attention = default_attention("cpu", torch.bfloat16 if bf16 else None)
    seq_len = args.seq_len or config.block_size
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
        peak = step_peak_bytes(config, loss, args.batch_size, seq_len, bf16)
        print(f"{loss:<8} peak tensor memory of an eager step beyond the model and optimizer: {peak / 2**20:8.1f} MiB "
              f"({args.preset}, {args.batch_size} x {seq_len}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
