"""A run's evaluation: the val loss over the same windows every time (with perplexity, bits per byte and a text
sample) and what it means for the run: the best val loss so far, and --target_loss reached.

    python -c "from gptopt.train.validation import record; help(record)"

The val split is checked against the context before the run's first step (data.loader.check_split), so an
evaluation never finds it too short after the steps before it.
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from gptopt.config import TrainConfig
from gptopt.data import loader as data
from gptopt.data.bpb import bits_per_byte, bytes_per_token
from gptopt.models.gpt import GPT, document_mask
from gptopt.models.loss import IGNORE_INDEX
from gptopt.runtime.device import DevicePlan
from gptopt.train import distributed
from gptopt.train.distributed import DistInfo
from gptopt.train.metrics import Metrics, Progress, chat_sample, sample


@torch.no_grad()
def evaluate(model: GPT, tokens: data.TokenData, cfg: TrainConfig, plan: DevicePlan, info: DistInfo, seq_len: int,
             step: int, train_s: float, metrics: Metrics | None) -> float:
    """The val loss of --eval_iters batches (every rank's mean), said and written to metrics.jsonl (rank 0) with
    perplexity, bits per byte, the sample (--sample_tokens) and train_s: the training steps' wall time so far (bench
    --mode quality's curves of val loss against training time). The model goes back to training mode."""
    model.eval()
    if tokens.chat is not None:  # conversations: the mean over every assistant token of every val row
        rows = data.ChatRows(tokens, "val", cfg.batch_size, cfg.seed, info.rank, info.world_size)
        total = torch.zeros(2, device=plan.device)  # (the summed loss, the targets counted)
        for x, y, pos in rows.eval_batches(cfg.eval_iters):
            x, y, pos = x.to(plan.device), y.to(plan.device), pos.to(plan.device)
            with plan.autocast():
                loss = model(x, y, pos=pos, attn_mask=document_mask(pos)).float()
            n = (y != IGNORE_INDEX).sum()
            total += torch.stack([loss * n, n.float()])
        total = distributed.all_reduce_sum(total, info)
        val = (total[0] / total[1].clamp(min=1)).item()
    else:
        ds = data.BatchDataset(tokens, "val", cfg.batch_size, seq_len, cfg.seed, info.rank, info.world_size)
        losses = []
        for x, y in ds.eval_batches(cfg.eval_iters):
            with plan.autocast():
                losses.append(model(x.to(plan.device), y.to(plan.device)).float())
        val = distributed.all_reduce_mean(torch.stack(losses).mean(), info).item()
    text = _sample_text(model, tokens, cfg, plan, step) if cfg.sample_tokens else ""
    model.train()
    if info.is_main:
        assert metrics is not None
        ppl = math.exp(min(val, 50.0))
        # None for nanoGPT data (no tokenizer), and for conversations (the loss covers the replies, not the bytes)
        bpb = bits_per_byte(val, bytes_per_token(tokens, "val")) if tokens.chat is None else None
        tqdm.write(f"step {step}: val loss {val:.4f}, perplexity {ppl:.2f}"
                   + (f", {bpb:.4f} bits/byte" if bpb is not None else "")
                   + (f"\n  sample: {text!r}" if text else ""))
        metrics.write({"step": step, "val_loss": val, "val_ppl": ppl, "val_bpb": bpb, "sample": text,
                       "train_s": train_s})
    return val


def _sample_text(model: GPT, tokens: data.TokenData, cfg: TrainConfig, plan: DevicePlan, step: int) -> str:
    """The eval log's sample: the greedy reply to a val conversation for chat data, else text from a document's
    start."""
    if tokens.chat is not None:
        return chat_sample(model, plan, tokens, cfg.sample_tokens)
    return sample(model, plan, tokens.tokenizer(), tokens.eot_id, cfg.sample_tokens, cfg.seed + step)


@torch.no_grad()
def log_sample(model: GPT, tokens: data.TokenData, cfg: TrainConfig, plan: DevicePlan, info: DistInfo, step: int,
               metrics: Metrics | None) -> None:
    """--sample_every: the sample alone, between evaluations, said and written to metrics.jsonl (rank 0). Every
    rank generates it: a sharded model's forwards are collective."""
    model.eval()
    text = _sample_text(model, tokens, cfg, plan, step)
    model.train()
    if info.is_main:
        assert metrics is not None
        tqdm.write(f"step {step}: sample: {text!r}")
        metrics.write({"step": step, "sample": text})


def record(progress: Progress, val: float, target_loss: float | None, metrics: Metrics | None) -> None:
    """The best val loss so far, and --target_loss reached: what it took (step time summed, evals and saves left
    out; with and without each process's first step, which compiles), written to metrics.jsonl once."""
    if math.isfinite(val):  # a diverged evaluation is neither the best nor a target reached
        progress.best_val = val if progress.best_val is None else min(progress.best_val, val)
    if target_loss is None or not val <= target_loss or progress.target is not None:
        return
    progress.target = {
        "loss": target_loss, "reached": True, "val_loss": val, "time_to_target_s": progress.train_s,
        "time_to_target_excl_compile_s": progress.train_s - progress.first_steps_s,
        "tokens_to_target": progress.tokens_seen, "steps_to_target": progress.step,
        "best_val_loss": progress.best_val,
    }
    if metrics is not None:
        metrics.write({"step": progress.step, "target": progress.target})

