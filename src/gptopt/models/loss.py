"""The training loss without the full logits: the lm_head projection and cross-entropy, a chunk of
positions at a time, with the gradients taken in the same pass.

    python -c "import gptopt.models.loss as l; help(l.linear_cross_entropy)"

The plain loss builds logits of every position (B x T x vocab; gpt2 at micro-batch 16 x 1,024 holds
16,384 x 50,304 of them, in fp32 for the softmax, and autograd keeps them and their gradient until
backward). Here each chunk's logits live only while that chunk is processed: its loss is summed,
and its gradients with respect to the hidden states and the projection weight are computed at once
and kept (hidden-state-sized and weight-sized), so backward only scales them. The arithmetic is the
plain loss's, chunk by chunk, in the same dtypes (under autocast the matmuls run in its dtype and the
softmax in fp32), so no FLOP is added and nothing is recomputed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "chunk_rows", "linear_cross_entropy"]

IGNORE_INDEX = -100  # targets equal to it do not count, as in F.cross_entropy


def chunk_rows(n_rows: int, n_embd: int, vocab: int) -> int:
    """Positions per chunk: enough chunks that one chunk's logits are about as large as all the hidden
    states (so the loss adds no more than one activation's memory), each chunk a multiple of 64 rows
    for the matmul kernels' tiles."""
    chunks = max(1, math.ceil(vocab / max(n_embd, 1)))
    rows = math.ceil(n_rows / chunks)
    return max(64, (rows + 63) // 64 * 64)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                         rows: int | None = None) -> torch.Tensor:
    """mean cross-entropy of (x @ weight[:vocab_size].T) against targets, the positions equal to -100 left out:
    what F.cross_entropy(F.linear(x, weight)[..., :vocab_size].float(), targets) gives, without its logits.

    x: (..., C) hidden states; weight: (V_padded, C), the rows past vocab_size never predicted; targets: x's
    leading shape. rows: positions per chunk (default chunk_rows). The gradients reach x and weight.
    """
    x2, t = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    rows = rows or chunk_rows(x2.size(0), x2.size(1), vocab_size)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x2, weight, t, vocab_size, rows)
    with torch.no_grad():
        total, count = _chunks(x2, weight, t, vocab_size, rows, None)
    return total / count.clamp(min=1)


def _chunks(x: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, vocab: int, rows: int,
            grads: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss and the count of counted positions; with grads = (d x, d weight) buffers, fills them with
    the gradients of the mean loss."""
    w = weight[:vocab]
    if torch.is_autocast_enabled(x.device.type):  # cast once: autocast does not cache casts of a view, per chunk
        w = w.to(torch.get_autocast_dtype(x.device.type))
    valid = t != IGNORE_INDEX
    count = valid.sum()
    scale = 1.0 / count.clamp(min=1).float()  # a tensor: no host sync to read the count
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for s in range(0, x.size(0), rows):
        xc, tc, vc = x[s:s + rows], t[s:s + rows], valid[s:s + rows]
        logits = F.linear(xc, w)  # under autocast in its dtype, as the plain lm_head runs
        lf = logits.float()
        lse = torch.logsumexp(lf, dim=-1)
        target = tc.clamp(min=0).unsqueeze(1)
        total = total + ((lse - lf.gather(1, target).squeeze(1)) * vc).sum()
        if grads is None:
            continue
        # d loss / d logits = (softmax - one-hot) / count on counted positions, 0 elsewhere. The matmuls take it
        # unscaled, in the matmul's (autocast) dtype as autograd would, and the 1 / count comes after them, in
        # fp32: in fp16, dividing first would flush the small probabilities to zero (the GradScaler's scale only
        # arrives in backward).
        # The positions left out are zeroed in the (rows x C) operands and results, not in the (rows x V) gradient.
        g = torch.softmax(lf, dim=-1)
        g.scatter_add_(1, target, torch.full_like(target, -1, dtype=g.dtype))
        g = g.to(logits.dtype)
        keep = vc.unsqueeze(1).to(xc.dtype)  # (rows, 1): 1, or 0 where left out
        gx, gw = grads
        gx[s:s + rows] = ((g @ w).float() * (keep * scale)).to(gx.dtype)
        gw[:vocab] += (g.t() @ (xc * keep).to(g.dtype)).float() * scale
    return total, count


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, vocab: int,  # type: ignore[override]
                rows: int) -> torch.Tensor:
        gx = torch.empty_like(x)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # summed over chunks in fp32
        total, count = _chunks(x, weight, t, vocab, rows, (gx, gw))
        ctx.save_for_backward(gx, gw.to(weight.dtype))
        return total / count.clamp(min=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        gx, gw = ctx.saved_tensors
        return gx * grad.to(gx.dtype), gw * grad.to(gw.dtype), None, None, None
