"""Sampling: how one sequence is sampled (SamplingParams), and the one batched step that picks every row's next
token on the device, in one order: the grammar's mask (response_format), logit_bias, the repetition, presence
and frequency penalties, then temperature, top-k and top-p. Log-probabilities (TokenLogprob) are the model's
raw distribution, computed only for the rows that ask.

    python -c "from gptopt.infer.sampling import SamplingParams; print(SamplingParams(temperature=0))"
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptopt.config import sampling as bounds
from gptopt.config.sampling import SamplingConfig
from gptopt.infer.stop import unescape
from gptopt.utils.errors import UserError


@dataclass(kw_only=True)
class SamplingParams:
    """How one sequence is sampled (the server builds one per request)."""

    max_new_tokens: int = 128
    temperature: float = 0.8  # 0 = greedy (argmax)
    top_k: int | None = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # HF's rule: a seen token's logit / p if positive, * p if negative
    # OpenAI's penalties, by vLLM's rule: a token's logit minus presence_penalty once it has been generated,
    # minus frequency_penalty times the number of times it has (the prompt's tokens do not count).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, a value added to its logit before sampling)
    # Constrained decoding: the key of a grammar (constrain.Grammars) every new token must keep the text a
    # prefix of; the end-of-text token only once the text is complete.
    grammar: str | None = None
    seed: int | None = None  # the same seed and prompt give the same sample, alone or in a batch
    stop: tuple[str, ...] = ()  # texts that end the sequence (StopChecker); not part of the output
    stop_token_ids: tuple[int, ...] = ()  # ids that end it (e.g. <|endoftext|>); not part of the output
    # Log-probabilities, only computed when asked (None): each new token's, with this many most likely
    # alternatives (Decoding.logprobs); and each prompt token's after the first (Decoding.prompt_logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)
        self.logit_bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        for ok, rule, value in [
            # 0: the prompt only, no new token (scoring a text by its prompt_logprobs)
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0", self.max_new_tokens),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0 (or None)", self.logprobs),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs must be >= 0 (or None)",
             self.prompt_logprobs),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias must map token ids >= 0", self.logit_bias),
            (all(self.stop), "stop strings must not be empty", self.stop),
        ]:
            if not ok:
                raise UserError(f"{rule}, got {value!r}")
        # the bounds the CLI and the HTTP schemas check too (config/sampling.py)
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            getattr(bounds, name.upper()).check(name, getattr(self, name))
        if self.top_k is not None:
            bounds.TOP_K.check("top_k", self.top_k)
        if self.seed is not None:
            bounds.SEED.check("seed", self.seed)
        for _, b in self.logit_bias:
            bounds.LOGIT_BIAS.check("a logit_bias value", b)

    @classmethod
    def from_config(cls, c: SamplingConfig) -> SamplingParams:
        return cls(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                   repetition_penalty=c.repetition_penalty, seed=c.seed, stop=(unescape(c.stop),) if c.stop else ())


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model's own distribution (log_softmax of the raw logits:
    before the repetition penalty, temperature, top-k and top-p, as vLLM reports by default), and the
    `k` most likely tokens at that position, most likely first (the token itself may be among them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


# What pick gives a row that may take no token (a grammar at a dead end): never a token id.
NO_TOKEN = -1
# top_p's candidates: a row's threshold is looked for among its 64 largest probabilities (a partial sort), then
# among its 1,024; a row whose nucleus is wider still sorts its whole vocabulary, as every top-p row once did.
TOP_P_CANDIDATES = (64, 1024)


def _tensor(device: torch.device, values: Sequence[float], dtype: torch.dtype = torch.long) -> torch.Tensor:
    # From pinned memory the copy is asynchronous: the host does not wait for the GPU to catch up.
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


@torch.no_grad()
def sample(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
           generators: list[torch.Generator | None], *, prompt_lens: Sequence[int] | None = None,
           allowed: torch.Tensor | None = None) -> list[int]:
    """The next token of each row: the allowed tokens only, logit bias, repetition, presence and
    frequency penalties, then argmax (temperature 0) or temperature, top-k and top-p sampling. On the
    device throughout; the one host sync is the final .tolist().

    histories: each row's prompt + generated ids (for the penalties); prompt_lens: where each row's
    generated ids begin in it (None: all of it is generated). generators: Generator.rng(seed) per
    row, or None for the global RNG. allowed: (B, V) bool, the tokens each row may take (None: all).
    """
    return pick(logits, params, histories, generators, prompt_lens, allowed).tolist()

@torch.no_grad()
def sample_logprobs(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                    generators: list[torch.Generator | None], *, prompt_lens: Sequence[int] | None = None,
                    allowed: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """`sample`, and for each row whose params ask (logprobs not None) its token's TokenLogprob with
    params.logprobs alternatives, from the raw `logits` (None for the other rows). Still one host sync:
    the tokens travel in the same float32 tensor as the log-probabilities."""
    tokens = pick(logits, params, histories, generators, prompt_lens, allowed)
    on_device = functools.partial(_tensor, logits.device)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    k = max(params[i].logprobs or 0 for i in rows)
    index = on_device(rows)
    table = logprob_table(logits[index], tokens[index], k)  # (R, 2 + 2k)
    flat = torch.cat([tokens.float(), table.flatten()]).tolist()
    B = len(params)
    entries: list[TokenLogprob | None] = [None] * B
    for i, e in zip(rows, unpack([flat[B + r * table.shape[1] : B + (r + 1) * table.shape[1]]
                                   for r in range(len(rows))]), strict=True):
        entries[i] = top_of(e, params[i].logprobs or 0)
    return [int(t) for t in flat[:B]], entries

def pick(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
          generators: list[torch.Generator | None], prompt_lens: Sequence[int] | None = None,
          allowed: torch.Tensor | None = None) -> torch.Tensor:
    """sample's tokens (B,), on the device: no host sync but top-p's (probabilities)."""
    on_device = functools.partial(_tensor, logits.device)
    B, V = logits.shape
    logits = logits.float()
    # Out-of-place throughout: the raw logits stay as they are, for the log-probabilities.
    if allowed is not None:  # first, so that no bias or penalty can bring a forbidden token back
        logits = torch.where(allowed, logits, float("-inf"))
    if any(p.logit_bias for p in params):
        rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
        cols = [t for p in params for t, _ in p.logit_bias]
        bias = on_device([b for p in params for _, b in p.logit_bias], torch.float32)
        logits = logits.index_put((on_device(rows), on_device(cols)), bias, accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in params):  # vLLM's order: it, then OpenAI's two
        seen = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 for _ in histories[i]]
        cols = [t for i, p in enumerate(params) if p.repetition_penalty != 1.0 for t in histories[i]]
        seen[on_device(rows), on_device(cols)] = True
        pen = on_device([p.repetition_penalty for p in params], torch.float32).view(B, 1)
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        starts = prompt_lens or [0] * B
        penalised = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        rows = [i for i in penalised for _ in histories[i][starts[i]:]]
        cols = [t for i in penalised for t in histories[i][starts[i]:]]
        counts = torch.zeros(B, V, device=logits.device)
        counts.index_put_((on_device(rows), on_device(cols)), torch.ones(len(rows), device=logits.device),
                          accumulate=True)
        frequency = on_device([p.frequency_penalty for p in params], torch.float32).view(B, 1)
        presence = on_device([p.presence_penalty for p in params], torch.float32).view(B, 1)
        logits = logits - frequency * counts - presence * (counts > 0)
    greedy = logits.argmax(dim=-1)
    if all(p.temperature == 0 for p in params):
        return _unless_none_allowed(greedy, logits, allowed)
    return _unless_none_allowed(_sampled(logits, params, generators, greedy), logits, allowed)


def _sampled(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
             greedy: torch.Tensor) -> torch.Tensor:
    """Each sampled row's token, drawn from its own row alone: temperature, its top-k (the k-th largest logit as a
    threshold), its top-p, then one exponential race over the whole vocabulary. So a seeded row draws the same
    noise, and the same token, alone and in any batch; and only rows with a top-p sort anything (vLLM's
    sampler works this way). Greedy rows (temperature 0) take `greedy`."""
    on_device = functools.partial(_tensor, logits.device)
    probs = probabilities(logits, params)
    # argmax(probs / Exp(1) noise) is how torch.multinomial draws one sample, minus its input check, which
    # syncs with the host. Unnormalised probs are fine for it. A seeded row's noise comes from its own generator,
    # over the whole vocabulary: the same draw in any batch. The Exp(1) noise is -log(U), U uniform: torch's
    # CPU exponential_ is not vectorised, and over a large vocabulary it cost a batched decode step a sizeable
    # share of its time (benchmarks/2026-12-06-serving-smollm2.md, "Where a decode step goes"). U = 0 (one draw
    # in 2^24) is raised to the smallest normal float, so every noise is finite and positive: a token of
    # probability 0 scores 0, never NaN.
    sampled = race(probs, generators)
    is_greedy = on_device([p.temperature == 0 for p in params], torch.bool)
    return torch.where(is_greedy, greedy, sampled)


def race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """(B,) one token drawn from each row of `probs` (B, V; any non-negative weights): the exponential race, its
    noise from each row's own generator (None: the global RNG), on the device."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].uniform_(generator=g)
    noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
    return (probs / noise).argmax(dim=-1)


def probabilities(logits: torch.Tensor, params: list[SamplingParams], *, normalized: bool = False) -> torch.Tensor:
    """(B, V) float32: each row's distribution after its temperature, top-k and top-p, not normalised (a kept
    token's weight is its softmax probability, a dropped one's 0). A greedy row (temperature 0) is taken at
    temperature 1. What `pick` draws from, and what speculative decoding's rejection rule compares (normalized:
    each row summing to 1)."""
    on_device = functools.partial(_tensor, logits.device)
    B, V = logits.shape
    x = logits / on_device([p.temperature or 1.0 for p in params], torch.float32).view(B, 1)
    ks = [p.top_k if p.top_k is not None and p.top_k < V else None for p in params]
    if any(ks):
        rows = [i for i, k in enumerate(ks) if k]
        k_max = max(k for k in ks if k)
        sub = x if len(rows) == B else x[rows]  # every row: no gathered copy of the logits
        # The k-th largest of each row, whatever the other rows ask: a threshold, not the top-k's indices (whose
        # order among equal logits could change with k_max)
        kth = sub.topk(k_max, dim=-1).values.gather(-1, on_device([ks[i] - 1 for i in rows]).view(-1, 1))
        if len(rows) == B:
            x.masked_fill_(x < kth, float("-inf"))  # x is this function's own tensor
        else:
            x[rows] = sub.masked_fill(sub < kth, float("-inf"))
    probs = x.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        sub = probs if len(rows) == B else probs[rows]
        top_p = on_device([params[i].top_p for i in rows], torch.float32).view(-1, 1)
        # The smallest prefix of the row in descending order whose mass reaches p: a token stays while the mass
        # before it is < p. Only the sorted values decide where that prefix ends, so the row's threshold (its
        # smallest kept probability) comes from its m largest values (topk, a partial sort) when they hold p;
        # a row whose nucleus is wider tries the next m, and the widest sort the whole vocabulary. So a peaked
        # row, or one with a small top_k, never sorts it. Values alone, never indices: a row's threshold is the
        # same whichever stage finds it, in any batch. Tokens tied with the threshold are all kept.
        t, left = torch.empty_like(top_p), torch.arange(len(rows), device=logits.device)
        for m in sorted({min(c, V) for c in (*TOP_P_CANDIDATES, V)}):
            part = sub[left] if len(left) < len(rows) else sub
            values = part.topk(m, dim=-1).values if m < V else part.sort(dim=-1, descending=True).values
            t[left], wide = _smallest_kept(values, top_p[left])
            left = left[wide]
            if not len(left):  # the host learns whether a row is left: the one sync of a sampling step with top-p
                break
        if len(rows) == B:
            probs.masked_fill_(probs < t, 0.0)
        else:
            probs[rows] = sub.masked_fill(sub < t, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True) if normalized else probs


def _smallest_kept(values: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In each row of `values` (R, n; its largest probabilities, descending): the last value the mass before which
    is < top_p (R, 1), and whether the row's n values hold less than top_p (R,), so that it may keep more."""
    mass = values.cumsum(dim=-1)
    # at least the first: nothing comes before it (unless the row is NaN, a row no token is allowed in)
    kept = ((mass - values) < top_p).sum(dim=-1, keepdim=True).clamp_min_(1)
    return values.gather(-1, kept - 1), mass[:, -1] < top_p.view(-1)


def _unless_none_allowed(tokens: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """NO_TOKEN for a row that may take no token at all (its grammar allows none): never a forbidden one."""
    if allowed is None:
        return tokens
    return torch.where(allowed.any(dim=-1), tokens, NO_TOKEN)


def logprob_table(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """(R, 2 + 2k) float32: each row's target token, its log-probability, the k most likely token ids and
    their log-probabilities, most likely first. One log_softmax gives both, so a greedy token's logprob
    equals the top one exactly. Token ids are exact in float32 below 2**24 (config.MAX_VOCAB)."""
    lp = logits.float().log_softmax(dim=-1)  # (R, V)
    top, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return torch.cat([targets[:, None].float(), lp.gather(-1, targets[:, None]), ids.float(), top], dim=-1)


def unpack(rows: list[list[float]]) -> list[TokenLogprob]:
    """logprob_table's rows, on the host, as TokenLogprobs."""
    out = []
    for row in rows:
        n = (len(row) - 2) // 2
        out.append(TokenLogprob(token=int(row[0]), logprob=row[1],
                                top=tuple((int(t), v) for t, v in zip(row[2 : 2 + n], row[2 + n :], strict=True))))
    return out


def top_of(entry: TokenLogprob, k: int) -> TokenLogprob:
    """The entry with its k most likely alternatives only (a batch computes its rows' largest k)."""
    return entry if len(entry.top) <= k else dataclasses.replace(entry, top=entry.top[:k])
