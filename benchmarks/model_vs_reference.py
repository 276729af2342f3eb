"""gptopt's GPT-2 module against the plain one a user writes by hand, training side by side in one process.

    python benchmarks/model_vs_reference.py [--preset tiny] [--batch_size 16] [--rounds 6]
        [--dtype fp32|bf16] [--compile] [--attention auto|sdpa|eager]

The reference is GPT-2 as the textbook (and nanoGPT's single-file model) writes it, written here:
LayerNorm, one fused q/k/v projection, `F.scaled_dot_product_attention(is_causal=True)`, a tanh-GELU
MLP, a tied head, the loss on the full logits. It takes gptopt's parameter names, so both models start
from the same weights and compute the same loss (tests/test_model_vs_reference.py checks that). Each
round runs two training steps (forward, backward, AdamW) of one model, then of the other, on the same
batch of random tokens, after two warm-up steps each; it prints each model's median step and gptopt's
tokens/s over the reference's. gptopt's attention is what `gptopt train --attention auto` picks for the
step's dtype on this device, unless --attention names one.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptopt.config import PRESETS, GPTConfig, preset
from gptopt.models.gpt import GPT
from gptopt.runtime.device import default_attention


class _Attention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, bias=c.bias)
        self.attn = _Attention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, bias=c.bias)
        self.mlp = _MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ReferenceGPT(nn.Module):
    """GPT-2 written plainly, for training only (no cache, no masks, no dropout)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.padded_vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
            h=nn.ModuleList(_Block(c) for _ in range(c.n_layer)),
            ln_f=nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, bias=c.bias)))
        self.lm_head = nn.Linear(c.n_embd, c.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.vocab_size = c.vocab_size  # the rows past it pad the matrix and are never tokens

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))[..., : self.vocab_size]
        return F.cross_entropy(logits.reshape(-1, self.vocab_size).float(), targets.view(-1))


def pair(config: GPTConfig, seed: int = 0) -> tuple[GPT, ReferenceGPT]:
    """gptopt's model and the reference, with the same weights."""
    torch.manual_seed(seed)
    ours = GPT(config)
    reference = ReferenceGPT(config)
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def compare(config: GPTConfig, *, batch_size: int, rounds: int, bf16: bool, compile: bool) -> dict[str, Any]:
    """Median training step of each model, alternated round by round; gptopt's tokens/s over the reference's."""
    models = dict(zip(("gptopt", "reference"), pair(config), strict=True))
    run = {name: torch.compile(m) if compile else m for name, m in models.items()}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, config.vocab_size, (batch_size, config.block_size), generator=g) for _ in range(2))

    def step(name: str) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = run[name](x, y)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    for name in models:
        step(name)
        step(name)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name in models:
            t0 = time.perf_counter()
            step(name)
            step(name)
            times[name].append((time.perf_counter() - t0) / 2)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"median_step_s": median, "ratio": median["reference"] / median["gptopt"],
            "attention": config.attention}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape (default tiny)")
    ap.add_argument("--batch_size", type=int, default=16, help="sequences a step, each the preset's context")
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds, two steps of each model a round")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="fp32, or bf16 autocast")
    ap.add_argument("--compile", action="store_true", help="torch.compile both models (default mode)")
    ap.add_argument("--attention", choices=("auto", "sdpa", "eager"), default="auto",
                    help="gptopt's attention kernel (auto: what `gptopt train` picks for the dtype here)")
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.rounds < 1:
        ap.error("--batch_size and --rounds must be at least 1")
    bf16 = args.dtype == "bf16"
    config = preset(args.preset)
    config.attention = (default_attention("cpu", torch.bfloat16 if bf16 else None)
                        if args.attention == "auto" else args.attention)
    r = compare(config, batch_size=args.batch_size, rounds=args.rounds, bf16=bf16, compile=args.compile)
    tokens = args.batch_size * config.block_size
    for name, s in r["median_step_s"].items():
        print(f"{name:<10} median step {s * 1e3:8.1f} ms  {tokens / s:9.0f} tokens/s")
    print(f"gptopt / reference: {r['ratio']:.2f}x ({args.preset}, {args.dtype}, "
          f"{'compiled' if args.compile else 'eager'}, gptopt's attention {r['attention']}; "
          f"torch.get_num_threads() = {torch.get_num_threads()})")
    return 0 if math.isfinite(r["ratio"]) else 1


if __name__ == "__main__":
    sys.exit(main())
