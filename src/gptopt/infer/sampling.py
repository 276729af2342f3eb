"""Sampling: how one sequence is sampled (SamplingParams), and the one batched step that picks every row's next
token on the device, in one order: the grammar's mask (response_format), logit_bias, the repetition, presence
and frequency penalties, then temperature, top-k and top-p. Log-probabilities (TokenLogprob) are the model's
raw distribution, computed only for the rows that ask.

    python -c "from gptopt.infer.sampling import SamplingParams; print(SamplingParams(temperature=0))"
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
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
# A row with top_k or top_p is drawn among its most likely tokens only: its 64 largest (or its top_k's, when
# larger), then its 1,024, found by a partial sort; a row whose kept set is wider sorts its whole vocabulary.
CANDIDATES = (64, 1024)
# When drawing on a CPU, a top-p row (without top_k) whose nucleus its first 64 candidates do not hold races over
# its whole vocabulary instead, and tests the race's 32 leaders for membership in order (one pass over the
# vocabulary each, and the first is inside the nucleus with about top_p's chance) before it sorts: the first
# leader inside is the race's winner within the nucleus. That costs about what a plain row's race does, where the
# wider partial sort costs more.
RACE_LEADERS = 32
# ... and races at once, without trying its candidates, when its largest probability times 8 is below top_p:
# its nucleus is then most likely wider than the candidates.
WIDE_REACH = 8


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
    device throughout; the host syncs with it only for the final .tolist() and, with top_k or top_p, to learn
    which rows each stage of _Truncated settles.

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
    params.logprobs alternatives, from the raw `logits` (None for the other rows). No host sync but sample's:
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
    """sample's tokens (B,), on the device: no host sync but a top-k or top-p row's (_Truncated)."""
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
    if all(p.temperature == 0 for p in params):
        return _unless_none_allowed(logits.argmax(dim=-1), logits, allowed)
    return _unless_none_allowed(_sampled(logits, params, generators), logits, allowed)


def _sampled(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
             ) -> torch.Tensor:
    """Each sampled row's token, drawn from its own row alone: a plain row (no top_k, top_p 1) by one uniform draw
    against its cumulative distribution (`inverse_cdf`), a row with top_k or top_p by an exponential race (`race`)
    over its kept candidates only (_Truncated). Nothing is sorted unless a row's kept set is wider than its
    candidates (vLLM sorts every top-p row). A seeded truncated row's noise is its own generator's, drawn over the
    whole vocabulary and taken by token id, so it draws the same token alone and in any batch, however its kept set
    is found; a seeded plain row's one number is its generator's too. Greedy rows (temperature 0) take their
    argmax."""
    on_device = functools.partial(_tensor, logits.device)
    B, V = logits.shape
    x = _scaled(logits, params)
    plain = [i for i, p in enumerate(params) if p.temperature > 0 and not _truncates(p, V)]
    cut = [i for i, p in enumerate(params) if p.temperature > 0 and _truncates(p, V)]
    if len(plain) == B:
        return inverse_cdf(x.softmax(dim=-1), generators)
    greedy = len(plain) + len(cut) < B  # the greedy rows take their argmax
    tokens = logits.argmax(dim=-1) if greedy else torch.empty(B, dtype=torch.long, device=logits.device)
    if plain:
        tokens[on_device(plain)] = inverse_cdf(x[plain].softmax(dim=-1), [generators[i] for i in plain])
    if cut:
        tokens[on_device(cut)] = _Truncated(x, params, cut).draw([generators[i] for i in cut])
    return tokens


def inverse_cdf(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """(B,) one token drawn from each row of `probs` (B, V; any non-negative weights): the first token whose
    cumulative weight reaches a uniform draw in (0, total]. One random number a row, where a race draws one a
    token: over a whole vocabulary the noise, not the arithmetic, set a plain sampled row's cost. A token of weight 0
    is never drawn (its cumulative weight equals the one before it, which reaches the draw first). A seeded row
    draws its number from its own generator: the same token alone and in any batch."""
    B = probs.shape[0]
    cdf = probs.cumsum(dim=-1)
    u = torch.empty(B, 1, device=probs.device)
    if any(g is None for g in generators):
        u.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    target = (1.0 - u).mul_(cdf[:, -1:])  # in (0, total]: never past the last token with any weight
    # a row whose weights overflowed (NaN: a temperature that rounds to 0 in fp32) finds no token past the
    # vocabulary's end: it takes the last token, an id like any other, as the race took the first NaN's
    return torch.searchsorted(cdf, target).view(B).clamp_max_(probs.shape[1] - 1)


def race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """(B,) one token drawn from each row of `probs` (B, V; any non-negative weights): the exponential race, its
    noise from each row's own generator (None: the global RNG), on the device. argmax(probs / Exp(1) noise) is how
    torch.multinomial draws one sample, minus its input check, which syncs with the host; unnormalised weights
    are fine for it. A seeded row draws the same noise, and the same token, alone and in any batch."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].uniform_(generator=g)
    return (probs / _exponential(noise)).argmax(dim=-1)


def _exponential(uniform: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise from uniform noise, in place: -log(U). torch's CPU exponential_ is not vectorised, and over a
    large vocabulary it cost a batched decode step a sizeable share of its time
    (benchmarks/2026-12-06-serving-smollm2.md, "Where a decode step goes"). U = 0 (one draw in 2^24) is raised to
    the smallest normal float, so every noise is finite and positive: a token of probability 0 scores 0, never
    NaN."""
    return uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()


def probabilities(logits: torch.Tensor, params: list[SamplingParams], *, normalized: bool = False) -> torch.Tensor:
    """(B, V) float32: each row's distribution after its temperature, top-k and top-p, not normalised (a kept
    token's weight is its probability over the row's top k, or its softmax probability without one; a dropped
    token's 0). A greedy row (temperature 0) is taken at temperature 1. What speculative decoding's draft draws
    from and its rejection rule compares (normalized: each row summing to 1)."""
    B, V = logits.shape
    x = _scaled(logits, params)
    cut = [i for i, p in enumerate(params) if _truncates(p, V)]
    probs = x.softmax(dim=-1) if len(cut) < B else torch.zeros_like(x)
    if cut:
        rows = _tensor(logits.device, cut)
        if len(cut) < B:
            probs[rows] = 0.0
        for idx, ids, q in _Truncated(x, params, cut).kept():
            probs[rows[idx].view(-1, 1), ids] = q
    return probs / probs.sum(dim=-1, keepdim=True) if normalized else probs


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits over each row's temperature (a greedy row's taken as 1), in float32."""
    temperature = _tensor(logits.device, [p.temperature or 1.0 for p in params], torch.float32)
    return logits.float() / temperature.view(-1, 1)


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return (p.top_k is not None and p.top_k < vocab) or p.top_p < 1.0


class _Truncated:
    """A batch's rows with top_k or top_p (R of them), and each one's kept set: looked for among the row's
    CANDIDATES largest scaled logits (a partial sort, one width a stage), where a stage settles the rows whose
    set ends within its width; the others sort their whole vocabulary. Each figure of a row comes from its own
    values in descending order, by elementwise steps and running sums, so it is the same at any width and in any
    batch: the stage that settles a row changes the cost, never the set or the draw. (`wide`'s membership test
    sums otherwise, so which rows reach it depends on each row alone: see _stage's `within`.)"""

    def __init__(self, x: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
        on_device = functools.partial(_tensor, x.device)
        B, self.V = x.shape
        self.x = x if len(rows) == B else x[rows]  # (R, V) the rows' scaled logits
        ks = [params[i].top_k if params[i].top_k is not None and params[i].top_k < self.V else 0 for i in rows]
        self.k = on_device(ks).view(-1, 1)  # 0: no top_k
        self.has_k = self.k > 0
        self.p = on_device([params[i].top_p for i in rows], torch.float32).view(-1, 1)
        # A row without top_k measures top_p against its whole vocabulary's softmax; its largest probability
        # bounds its nucleus from below (no m tokens hold more than m times it), so a flat row skips the stages
        # that cannot hold it.
        self.full = self.x.softmax(dim=-1) if not all(ks) else None
        self.q_max = self.full.amax(dim=-1, keepdim=True) if self.full is not None else None
        small, large = CANDIDATES
        first = max(small, max(ks)) if max(ks) <= large else small  # a top_k of 64..1,024 is one stage
        self.widths = sorted(w for w in {first, large} if w < self.V)

    def kept(self, wide: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Groups of rows (indices into the R rows), with their candidates' token ids (n, m) and probabilities
        (n, m; a dropped token's 0), each row in one group. `wide` may settle the top-p rows (without top_k) the
        first candidates did not hold, in place of the wider stages and the sort: it gets their indices and gives
        the positions among them of those it settled."""
        pending = torch.ones(len(self.x), dtype=torch.bool, device=self.x.device)
        for n, m in enumerate(self.widths):
            go = pending
            if self.q_max is not None:
                # With `wide`, a top-p row tries the first candidates only if its 8 most likely tokens could
                # hold p (a flat row races at once), and never a wider stage: `wide` settles it for less.
                reach = m if wide is None else WIDE_REACH
                go = pending & ~(~self.has_k & (self.q_max * reach < self.p)).view(-1)
                if wide is not None and n > 0:
                    go = go & self.has_k.view(-1)
            rows = go.nonzero().view(-1)  # a host sync: how many rows this stage takes
            if len(rows):
                fits, ids, q = self._stage(rows, m, within=None if wide is None else CANDIDATES[0])
                pending[rows[fits]] = False
                yield rows[fits], ids[fits], q[fits]
        if wide is not None:
            rows = (pending & ~self.has_k.view(-1)).nonzero().view(-1)
            if len(rows):
                pending[rows[wide(rows)]] = False
        rows = pending.nonzero().view(-1)
        if len(rows):
            _, ids, q = self._stage(rows, self.V)
            yield rows, ids, q

    def _stage(self, rows: torch.Tensor, m: int, within: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rows` (n,) among their m largest (m = V: all of them, sorted): whether each row's kept set ends within
        them (n,), their token ids (n, m) and kept probabilities (n, m). `within`: a row without top_k is settled
        only if its nucleus ends within that many, whatever m the batch's top_k make."""
        inf = float("-inf")
        x = _rows(self.x, rows)
        if m < self.V:  # one more than m: whether a token beyond them ties with the last kept
            c, ids = x.topk(m + 1, dim=-1)
            beyond, beyond_id, c, ids = c[:, m:], ids[:, m:], c[:, :m], ids[:, :m]
        else:
            c, ids = x.sort(dim=-1, descending=True)
        k, p, has_k = self.k[rows], self.p[rows], self.has_k[rows]
        # top-k: the k-th largest logit a threshold, the tokens tied with it kept (as transformers and vLLM do);
        # the probabilities over the top k normalised by their sum in descending order
        kth = torch.where(has_k, c.gather(-1, k.clamp(1, m) - 1), inf)
        w = (c - c[:, :1]).exp_().masked_fill_(c < kth, 0.0)
        q = w / w.cumsum(dim=-1)[:, -1:]
        if self.full is not None:
            q = torch.where(has_k, q, self.full[rows.view(-1, 1), ids])
        # top-p: the smallest prefix in descending order whose mass reaches p (a token stays while the mass
        # before it is < p), the tokens tied with its last all kept
        mass = q.cumsum(dim=-1)
        # at least the first: nothing comes before it (unless the row is NaN, a row no token is allowed in)
        kept = ((mass - q) < p).sum(dim=-1, keepdim=True).clamp_min_(1)
        t = torch.where(p < 1.0, q.gather(-1, kept - 1), 0.0)
        q = q.masked_fill_(q < t, 0.0)
        if m == self.V:
            return torch.ones(len(rows), dtype=torch.bool, device=x.device), ids, q
        # Settled here: its top k end within the m and nothing beyond ties the k-th (or all beyond are forbidden,
        # -inf); its nucleus ends within them, and nothing beyond ties its last.
        fits_k = (beyond == inf) | ((k <= m) & (beyond < kth))
        q_beyond = torch.zeros_like(t)  # beyond the top k: probability 0
        if self.full is not None:
            q_beyond = torch.where(has_k, q_beyond, self.full[rows.view(-1, 1), beyond_id])
        fits_p = (p >= 1.0) | ((mass[:, -1:] >= p) & (q_beyond < t))
        if within is not None and within < m:
            # So a drawn row's way is its own: one settled here and one `wide` settles may differ in the last bit
            # of the mass before the nucleus's last token, and a seeded row must draw the same alone and in any
            # batch.
            early = (p >= 1.0) | ((mass[:, within - 1 : within] >= p) & (q[:, within : within + 1] < t))
            fits_p = torch.where(has_k, fits_p, early)
        return (torch.where(has_k, fits_k, True) & fits_p).view(-1), ids, q

    def draw(self, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """(R,) each row's token: the race among its kept candidates, with each seeded row's noise over the whole
        vocabulary from its own generator, taken by token id."""
        device = self.x.device
        R, V = self.x.shape
        own = None
        if any(g is not None for g in generators):
            own = torch.empty(R, V, device=device)
            for r, g in enumerate(generators):
                if g is not None:
                    own[r].uniform_(generator=g)
        is_seeded = [g is not None for g in generators]
        seeded = _tensor(device, is_seeded, torch.bool).view(-1, 1)
        tokens = torch.empty(R, dtype=torch.long, device=device)

        def noise(rows: torch.Tensor, ids: torch.Tensor | None, width: int) -> torch.Tensor:
            """Uniform noise (a tensor of its own) for `rows` over `width` candidates: a seeded row's is its own
            noise at the candidates' ids (None: the whole vocabulary), another row's fresh."""
            mine = [is_seeded[r] for r in rows.tolist()]
            if own is None or not any(mine):
                return torch.empty(len(mine), width, device=device).uniform_()
            drawn = own[rows] if ids is None else own[rows.view(-1, 1), ids]  # a copy: _exponential works in place
            return drawn if all(mine) else torch.where(seeded[rows], drawn, torch.empty_like(drawn).uniform_())

        def race_first(rows: torch.Tensor) -> torch.Tensor:
            """A wide nucleus: the race over the whole vocabulary, its leaders tested in order; the first inside
            the nucleus (the mass of the more likely tokens < p) is the race's winner within it. Which rows it
            settles."""
            assert self.full is not None  # only rows without top_k come here
            q = _rows(self.full, rows)
            u = noise(rows, None, V)
            lead = torch.div(q, _exponential(u), out=u).topk(min(RACE_LEADERS, V), dim=-1).indices
            found: dict[int, int] = {}  # the settled rows' positions in `rows`, and their tokens
            for i, (ids, values, p) in enumerate(zip(lead.tolist(), q.gather(-1, lead).tolist(),
                                                     self.p[rows].view(-1).tolist(), strict=True)):
                inside = next((t for t, v in zip(ids, values, strict=True)
                               if float(torch.nn.functional.threshold(q[i], v, 0.0).sum()) < p), None)
                if inside is not None:
                    found[i] = inside
            settled = _tensor(device, list(found))
            tokens[rows[settled]] = _tensor(device, list(found.values()))
            return settled

        # On a GPU a sort is cheap and each membership test a host sync: there a wide nucleus sorts (as vLLM's do).
        for rows, ids, q in self.kept(race_first if device.type == "cpu" else None):
            u = noise(rows, ids, ids.shape[1])
            tokens[rows] = ids.gather(-1, (q / _exponential(u)).argmax(dim=-1, keepdim=True)).view(-1)
        return tokens


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t's `rows` (ascending, as nonzero gives them), to read: t itself when they are all of its rows, no copy."""
    return t if len(rows) == len(t) else t[rows]


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
