"""Generation: a preallocated KV cache, prefill + decode, sampling on the device, one token generator.

`gptopt generate`, the bench inference rungs, train's eval sample and the server's continuous-batching
engine all drive one `Generator`: `prefill` a prompt into a cache slot, `decode` one token for several
slots at their own positions, `sample` the next tokens, `free` the slot. `begin` / `decode_next` /
`sample_next` / `end` do the same for `Decoding`s, which hold each sequence's slot and tokens and decide
when it ends; `StopChecker` turns tokens into text that ends at a stop string. Shaped after gpt-fast's
generate.py. Loading a model for it: inference.py; the command: generate.py.

    python -c "from gptopt.infer.generator import Generator; help(Generator)"
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tokenizers import Tokenizer

from gptopt.config import GPTConfig, SamplingConfig
from gptopt.infer.compiled import GraphedDecode, compile_decode
from gptopt.models.gpt import GPT, KVCacheLayer
from gptopt.runtime.device import DevicePlan
from gptopt.runtime.torch_private import maybe_mark_dynamic

__all__ = ["Decoding", "Generator", "KVCache", "SamplingParams", "StopChecker", "TokenLogprob", "complete", "generate",
           "stream", "unescape"]

log = logging.getLogger("gptopt")


def unescape(text: str) -> str:
    """The escapes a shell cannot type easily (\\n, \\t, \\r, \\\\) -> their characters; other text as it is."""
    return re.sub(r"\\[ntr\\]", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group()[1]], text)


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
            (self.temperature >= 0, "temperature must be >= 0", self.temperature),
            (self.top_k is None or self.top_k >= 1, "top_k must be >= 1 (or None: all tokens)", self.top_k),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]", self.top_p),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0", self.repetition_penalty),
            (math.isfinite(self.presence_penalty), "presence_penalty must be finite", self.presence_penalty),
            (math.isfinite(self.frequency_penalty), "frequency_penalty must be finite", self.frequency_penalty),
            (all(t >= 0 and math.isfinite(b) for t, b in self.logit_bias),
             "logit_bias must map token ids >= 0 to finite values", self.logit_bias),
            (all(self.stop), "stop strings must not be empty", self.stop),
        ]:
            if not ok:
                raise ValueError(f"{rule}, got {value!r}")

    @classmethod
    def from_config(cls, c: SamplingConfig) -> SamplingParams:
        return cls(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                   repetition_penalty=c.repetition_penalty, seed=c.seed, stop=(unescape(c.stop),) if c.stop else ())


# Why a sequence ended: a stop token id or stop string ("stop"), or its token budget ("length").
Finish = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model's own distribution (log_softmax of the raw logits:
    before the repetition penalty, temperature, top-k and top-p, as vLLM reports by default), and the
    `k` most likely tokens at that position, most likely first (the token itself may be among them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(eq=False)
class Decoding:
    """One sequence in one cache slot, from its prefill to its end; `add` is the one end-of-sequence rule.

    Generator.begin makes one, Generator.decode_next and sample_next advance a batch of them, and
    Generator.end frees the slot: the CLI's token generators and the server's engine all use these.
    """

    slot: int
    params: SamplingParams
    prompt_len: int
    budget: int  # new tokens it may take: max_new_tokens, capped so prompt + new tokens fit the cache
    rng: torch.Generator | None  # Generator.rng(params.seed)
    ids: list[int]  # the prompt, then the new tokens (the repetition penalty's history)
    finish: Finish | None = None
    cached: int = 0  # prompt tokens in the cache so far: prefill_step runs the rest, a chunk at a time
    # With params.logprobs: one entry per new token, the stop token that ends it included (OpenAI's
    # legacy completions list it, and lm-eval reads it). With params.prompt_logprobs: one per prompt
    # token after the first (the first has no context to be predicted from), filled as prefill_step runs.
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    pending: TokenLogprob | None = None  # sample_next's entry for the token `add` takes next
    matcher: Any = None  # with params.grammar: the grammar's state after the tokens so far (constrain.Matcher)

    @property
    def prefilled(self) -> bool:
        return self.cached >= self.prompt_len

    @property
    def tokens(self) -> list[int]:
        """The new tokens so far."""
        return self.ids[self.prompt_len :]

    @property
    def n_new(self) -> int:
        return len(self.ids) - self.prompt_len

    def add(self, token: int) -> Finish | None:
        """Take the next sampled token; why the sequence ends with it, or None while it goes on.
        A stop token id ends it ("stop") and is not kept; the budget's last token ends it ("length")."""
        assert self.finish is None, "a finished sequence takes no more tokens"
        entry, self.pending = self.pending, None
        if entry is not None:  # a stop token's too, as OpenAI and vLLM list it: lm-eval counts on it being there
            self.logprobs.append(entry)
        if self.matcher is not None:
            self.matcher.accept(token)
        if token in self.params.stop_token_ids:
            self.finish = "stop"
        else:
            self.ids.append(token)
            if self.n_new >= self.budget:
                self.finish = "length"
        return self.finish

    def stop(self) -> None:
        """End it after its last token: its text reached a stop string (StopChecker)."""
        self.finish = "stop"


# ----------------------------------------------------------------------------------------------
# KV cache


class _LayerView:
    """One layer of a KVCache as one forward sees it: these rows, writing at these positions."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | slice, flat: torch.Tensor,
                 length: int) -> None:
        self.k, self.v, self.rows, self.flat, self.length = k, v, rows, flat, length

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Each row writes at its own positions: rows at different lengths share one forward. One
        # index_copy_ into the cache seen as rows of head_dim: faster on a CPU than the equivalent
        # cache[rows, :, positions] = ..., whose indexing around a slice takes a general scatter
        # (benchmarks/2026-12-04-serving-vs-transformers.md, "Where an engine iteration's time goes").
        hs = k.size(-1)
        self.k.view(-1, hs).index_copy_(0, self.flat, k.reshape(-1, hs).to(self.k.dtype))  # k: (B, nh, T, hs)
        self.v.view(-1, hs).index_copy_(0, self.flat, v.reshape(-1, hs).to(self.v.dtype))
        return self.k[self.rows, :, : self.length], self.v[self.rows, :, : self.length]  # (B, nh, S, hs)


class KVCache:
    """Preallocated keys/values for `slots` sequences of up to `max_len` tokens, every layer:
    (slots, nh, max_len, hs)."""

    def __init__(self, config: GPTConfig, slots: int, max_len: int, *, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        shape = (slots, config.kv_heads, max_len, config.head_dim)  # grouped-query attention keeps fewer heads
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.slots, self.max_len, self.n_head, self.device = slots, max_len, config.kv_heads, torch.device(device)

    def layers(self, rows: torch.Tensor | slice, positions: torch.Tensor,
               length: int | None = None) -> list[KVCacheLayer]:
        """Per-layer views for one forward. rows: (B,) slot indices, or a slice of consecutive slots (the
        layers then return views of the cache, no gather copy). positions: (B, T) being written.
        length: return only the first `length` positions (more than any written), so fewer keys are attended."""
        if isinstance(rows, slice):
            # not rows.indices(): it would make a compiled decode's row count a constant (one graph per count)
            assert rows.step in (None, 1), "a slice of rows must be consecutive"
            start, stop = rows.start or 0, self.slots if rows.stop is None else rows.stop
            index = torch.arange(start, stop, device=self.device)
        else:
            index = rows
        # (B, nh, T): the row of each written key in the cache viewed as (slots * nh * max_len, hs)
        heads = torch.arange(self.n_head, device=self.device)
        flat = ((index[:, None, None] * self.n_head + heads[None, :, None]) * self.max_len + positions[:, None, :])
        flat = flat.reshape(-1)
        length = self.max_len if length is None else length
        return [_LayerView(k, v, rows, flat, length) for k, v in zip(self.k, self.v, strict=True)]

    def mask(self, positions: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """(B, 1, T, length) bool, True where the key's position <= the query's: each row sees its own past only."""
        keys = torch.arange(self.max_len if length is None else length, device=positions.device)
        return (keys <= positions[..., None]).unsqueeze(1)


# ----------------------------------------------------------------------------------------------
# The generator


class Generator:
    """Owns the model and one KVCache with max_batch_size slots; the single token generator behind CLI, bench
    and server.

    Runs in the weights' dtype (inference.load_for_inference casts them once), so there is no autocast here.
    Not thread-safe: one thread (the server's engine thread) drives it.
    """

    def __init__(self, model: GPT, plan: DevicePlan, *, max_batch_size: int = 8, max_len: int | None = None,
                 compile: bool = False, cuda_graphs: bool = False, grammars: Any = None) -> None:
        """compile: the decode step compiled (inference.compile_decode). cuda_graphs: on CUDA without
        compile, the eager decode step recorded as a CUDA graph per bucket (inference.GraphedDecode);
        ignored elsewhere, and with compile (whose reduce-overhead mode records its own). grammars: the
        constrain.Grammars of the model's tokenizer, for sequences whose params name a grammar."""
        self.grammars = grammars
        cfg = model.config
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 2 <= self.max_len <= cfg.block_size:
            raise ValueError(f"max_len must be in 2..{cfg.block_size} (the model's context), got {self.max_len}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval().to(plan.device)
        self.plan, self.device = plan, plan.device
        self.max_batch_size, self.vocab_size = max_batch_size, cfg.vocab_size
        dtype = model.transformer.wte.weight.dtype
        self.cache = KVCache(cfg, max_batch_size, self.max_len, device=plan.device, dtype=dtype)
        self.lengths = [0] * max_batch_size  # tokens cached per slot: where an idle row of a static decode writes
        self._used: set[int] = set()
        # The row counts a compiled decode runs: powers of two below max_batch_size, and max_batch_size.
        self.buckets = [2**i for i in range(max_batch_size.bit_length()) if 2**i < max_batch_size] + [max_batch_size]
        self._step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._keys = torch.empty(self.max_len, device=plan.device)  # _decode_rows' length, as a size
        if compile:  # the last inference transform (inference.py's step 5): it needs this cache
            self._step = compile_decode(self._decode_rows, self.model, self.cache.k + self.cache.v, self.device,
                                        max_batch_size)
        elif cuda_graphs and self.device.type == "cuda":
            self._step = GraphedDecode(self._decode_rows, max_batch_size, self.device)

    @property
    def compiled(self) -> bool:
        return self._step is not None and not isinstance(self._step, GraphedDecode)

    @property
    def bucketed(self) -> bool:
        """The decode runs whole buckets (compiled, or recorded as CUDA graphs): each is built on its first step."""
        return self._step is not None

    # slots ------------------------------------------------------------------------------------
    def alloc(self) -> int:
        """The lowest free slot (an engine may track slots itself and only call prefill/free)."""
        free = sorted(set(range(self.max_batch_size)) - self._used)
        if not free:
            raise RuntimeError(f"all {self.max_batch_size} cache slots are in use")
        self._used.add(free[0])
        return free[0]

    def free(self, slot: int) -> None:
        self._check_slot(slot)
        self._used.discard(slot)
        self.lengths[slot] = 0  # nothing to clear on the device: positions past a sequence are masked

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self._used)

    def open(self, prompt: list[int], params: SamplingParams) -> Decoding:
        """A Decoding of `prompt` in the lowest free slot, nothing cached yet: prefill_step runs its prompt."""
        self.check_prompt(prompt)
        slot = self.alloc()
        budget = min(params.max_new_tokens, self.max_len - len(prompt))
        try:
            matcher = None if params.grammar is None else self._grammars().matcher(params.grammar)
        except BaseException:
            self.free(slot)
            raise
        return Decoding(slot=slot, params=params, prompt_len=len(prompt), budget=budget, rng=self.rng(params.seed),
                        ids=list(prompt), matcher=matcher)

    def _grammars(self) -> Any:
        if self.grammars is None:
            raise ValueError("this Generator has no grammars (Generator(grammars=constrain.Grammars(...))), so it "
                             "cannot constrain a sequence")
        return self.grammars

    def begin(self, prompt: list[int], params: SamplingParams) -> tuple[Decoding, torch.Tensor]:
        """Prefill `prompt` into the lowest free slot: its Decoding, and logits (V,) of its last token."""
        seqs, logits = self.begin_many([prompt], params)
        return seqs[0], logits[0]

    def begin_many(self, prompts: Sequence[list[int]], params: SamplingParams,
                   chunk: int | None = None) -> tuple[list[Decoding], torch.Tensor]:
        """Prefill prompts together (prefill_step, `chunk` tokens a forward; default: all at once), each
        in its own slot: their Decodings, and logits (B, V) of each one's last token."""
        if not prompts:
            raise ValueError("begin_many needs at least one prompt")
        seqs: list[Decoding] = []
        try:
            for p in prompts:
                seqs.append(self.open(p, params))
            logits: dict[int, torch.Tensor] = {}
            while len(logits) < len(seqs):
                done, out = self.prefill_step([s for s in seqs if not s.prefilled],
                                              chunk or len(seqs) * max(len(p) for p in prompts))
                logits.update((id(s), row) for s, row in zip(done, out, strict=True))
        except BaseException:
            for s in seqs:
                self.end(s)
            raise
        return seqs, torch.stack([logits[id(s)] for s in seqs])

    def prefill_step(self, seqs: Sequence[Decoding], budget: int) -> tuple[list[Decoding], torch.Tensor]:
        """One forward over the next chunk of each sequence's prompt, taken in order while rows x the
        longest chunk stay within `budget` tokens (the first always runs, cut to `budget`): a long
        prompt is prefilled over several calls, so the decodes between them wait one chunk at most.

        The sequences whose prompt is now complete, and logits (k, V) of their last prompt token."""
        if budget < 1:
            raise ValueError(f"the prefill budget must be >= 1 token, got {budget}")
        rows: list[Decoding] = []
        width = 0
        for s in seqs:
            if s.prefilled:
                raise ValueError(f"slot {s.slot}'s prompt is already prefilled")
            w = min(budget, max(width, s.prompt_len - s.cached))
            if rows and w * (len(rows) + 1) > budget:
                break
            rows.append(s)
            width = w
        chunks = [s.ids[s.cached : s.cached + width] for s in rows]
        scored = [i for i, s in enumerate(rows) if s.params.prompt_logprobs is not None]
        if not scored:
            logits = self.extend([s.slot for s in rows], chunks, [s.cached for s in rows])
        else:  # every position's logits: (B, T, V), each row's chunk at its end (left-padded)
            every = self.extend([s.slot for s in rows], chunks, [s.cached for s in rows], every=True)
            self._score_prompts([rows[i] for i in scored], [chunks[i] for i in scored], every[scored])
            logits = every[:, -1].float()
        for s, c in zip(rows, chunks, strict=True):
            s.cached += len(c)
        done = [i for i, s in enumerate(rows) if s.prefilled]
        return [rows[i] for i in done], logits[done]

    def _score_prompts(self, seqs: list[Decoding], chunks: list[list[int]], logits: torch.Tensor) -> None:
        """Each prompt token's TokenLogprob from the logits of the position before it, for the chunk being
        prefilled (not yet counted in `cached`); one host sync for all of them."""
        T, picked, targets = logits.shape[1], [], []
        for r, (s, c) in enumerate(zip(seqs, chunks, strict=True)):
            nxt = s.ids[s.cached + 1 : min(s.cached + len(c) + 1, s.prompt_len)]  # the tokens these positions predict
            picked.append(logits[r, T - len(c) : T - len(c) + len(nxt)])
            targets += nxt
        if not targets:  # a one-token prompt: nothing to predict
            return
        k = max(s.params.prompt_logprobs or 0 for s in seqs)
        entries = _unpack(_logprob_table(torch.cat(picked), self._tensor(targets), k).tolist())
        for s, c in zip(seqs, chunks, strict=True):
            n = min(s.cached + len(c) + 1, s.prompt_len) - (s.cached + 1)
            s.prompt_logprobs += [_top(e, s.params.prompt_logprobs or 0) for e in entries[:n]]
            entries = entries[n:]

    def decode_next(self, seqs: Sequence[Decoding]) -> torch.Tensor:
        """Feed each sequence's last token back at its position, in one forward: logits (B, V)."""
        return self.decode([s.slot for s in seqs], [s.ids[-1] for s in seqs], [len(s.ids) - 1 for s in seqs])

    def sample_next(self, logits: torch.Tensor, seqs: Sequence[Decoding]) -> list[int]:
        """`sample` with each sequence's own parameters, history and random generator. A sequence whose
        params ask for logprobs gets its token's TokenLogprob as `pending`, which its `add` keeps."""
        params = [s.params for s in seqs]
        extra = {"prompt_lens": [s.prompt_len for s in seqs],
                 "allowed": self._grammars().allowed([s.matcher for s in seqs], logits.shape[-1], logits.device)
                 if any(s.matcher is not None for s in seqs) else None}
        if all(p.logprobs is None for p in params):
            return self.sample(logits, params, [s.ids for s in seqs], [s.rng for s in seqs], **extra)
        tokens, entries = self.sample_logprobs(logits, params, [s.ids for s in seqs], [s.rng for s in seqs], **extra)
        for s, e in zip(seqs, entries, strict=True):
            s.pending = e
        return tokens

    def end(self, seq: Decoding) -> None:
        """Free the sequence's slot, however it ended."""
        self.free(seq.slot)

    def rng(self, seed: int | None) -> torch.Generator | None:
        """A per-sequence random generator on the device for `sample`, or None (the global RNG) without a seed."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def check_prompt(self, tokens: Sequence[int]) -> None:
        if not tokens:
            raise ValueError("the prompt is empty: give at least one token")
        if len(tokens) > self.max_len - 1:
            raise ValueError(f"the prompt has {len(tokens)} tokens; at most {self.max_len - 1} fit "
                             f"(max_len {self.max_len} leaves room for one new token)")
        self._check_ids(tokens)

    def _check_ids(self, tokens: Sequence[int]) -> None:
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.vocab_size - 1} (does the tokenizer belong to the model?)")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch_size:
            raise ValueError(f"slot {slot} is outside 0..{self.max_batch_size - 1}")

    def _tensor(self, values: Sequence[float], dtype: torch.dtype = torch.long) -> torch.Tensor:
        # From pinned memory the copy is asynchronous: the host does not wait for the GPU to catch up.
        pinned = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(self.device, non_blocking=pinned)

    # forward ----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, slot: int, tokens: list[int], *, every: bool = False) -> torch.Tensor:
        """Run the prompt in one forward into the slot's cache (positions 0..L-1); logits (V,) of its last
        token, or with `every` (L, V) of every position, in the weights' dtype."""
        self._check_slot(slot)
        self.check_prompt(tokens)
        L = len(tokens)
        idx = self._tensor(tokens).view(1, L)
        pos = torch.arange(L, device=self.device).view(1, L)
        kv = self.cache.layers(slice(slot, slot + 1), pos, length=L)
        # No mask: with S == T the model takes SDPA's causal path (flash kernels where available).
        logits = self.model(idx, pos=pos, kv_cache=kv, last_only=not every)
        self._used.add(slot)
        self.lengths[slot] = L
        return logits[0] if every else logits[0, -1].float()

    @torch.no_grad()
    def extend(self, slots: list[int], chunks: list[list[int]], starts: list[int], *,
               every: bool = False) -> torch.Tensor:
        """Each slot's next tokens at positions start.. (a prompt, or its next chunk over the cached part),
        every slot in one forward; logits (B, V) of each slot's last token, or with `every` (B, T, V) of
        every position (the weights' dtype; a shorter chunk's logits at the end of its row).

        Shorter chunks are padded on the left, so every row's last position is a real token. The
        padding writes at the cache's last position, which holds no prompt token (a prompt leaves room
        for one new token) and which a sequence only reaches by writing its own token there first."""
        B = len(slots)
        if not B == len(chunks) == len(starts) > 0 or len(set(slots)) != B or not all(chunks):
            raise ValueError(f"extend needs distinct slots, each with tokens and a start: {slots}, {starts}")
        if B == 1 and starts[0] == 0:
            return self.prefill(slots[0], chunks[0], every=every)[None]  # SDPA's causal path: no mask to build
        for s, c, p in zip(slots, chunks, starts, strict=True):
            self._check_slot(s)
            self._check_ids(c)
            if p < 0 or p + len(c) > self.max_len - 1:
                raise ValueError(f"slot {s}: positions {p}..{p + len(c) - 1} leave no room for a new token "
                                 f"in the cache's {self.max_len}")
        T, pad = max(len(c) for c in chunks), self.max_len - 1
        tokens = [[0] * (T - len(c)) + c for c in chunks]
        positions = [[pad] * (T - len(c)) + list(range(p, p + len(c))) for c, p in zip(chunks, starts, strict=True)]
        length = max(p + len(c) for c, p in zip(chunks, starts, strict=True))
        logits = self._forward(self._tensor(tokens).view(B, T), self._tensor(positions).view(B, T), self._rows(slots),
                               length, last_only=not every)
        for s, c, p in zip(slots, chunks, starts, strict=True):
            self._used.add(s)
            self.lengths[s] = p + len(c)
        return logits

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each slot, at that slot's own position (its tokens cached so far); logits (B, V)."""
        B = len(slots)
        if not B == len(tokens) == len(positions) > 0 or len(set(slots)) != B:
            raise ValueError(f"decode needs distinct slots, each with one token and one position: "
                             f"{slots}, {tokens}, {positions}")
        for s in slots:
            self._check_slot(s)
        if min(positions) < 0 or max(positions) >= self.max_len:
            raise ValueError(f"positions must be in 0..{self.max_len - 1} (the cache's max_len), got {positions}")
        self._check_ids(tokens)
        if self._step is not None:
            logits = self._decode_static(slots, tokens, positions)
        else:
            # Attend over the longest row's positions only, not the whole cache.
            logits = self._forward(self._tensor(tokens).view(B, 1), self._tensor(positions).view(B, 1),
                                   self._rows(slots), max(positions) + 1)
        for s, p in zip(slots, positions, strict=True):
            self.lengths[s] = p + 1
        return logits

    def _rows(self, slots: list[int]) -> torch.Tensor | slice:
        """The cache rows of these slots: a slice when they are consecutive (views, no gather copy)."""
        B = len(slots)
        return slice(slots[0], slots[0] + B) if slots == list(range(slots[0], slots[0] + B)) else self._tensor(slots)

    def _forward(self, tok: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor | slice, length: int,
                 last_only: bool = True) -> torch.Tensor:
        kv = self.cache.layers(rows, pos, length)
        mask = self.cache.mask(pos, length)
        logits = self.model(tok, pos=pos, kv_cache=kv, attn_mask=mask, last_only=last_only)
        return logits[:, -1].float() if last_only else logits

    def _decode_rows(self, tok: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        # The first B cache rows (B = tok's rows: a bucket) over the first len(keys) positions. `keys` only
        # carries that length as a size a compiled graph keeps symbolic (a Python int would be a constant).
        return self._forward(tok, pos, slice(0, tok.shape[0]), keys.shape[0])

    def step_rows(self, slots: Sequence[int]) -> int:
        """The rows a decode step of these slots computes: their whole bucket when it runs compiled or
        as a CUDA graph, else the slots alone."""
        return self.bucket(slots) if self.bucketed else len(slots)

    def bucket(self, slots: Sequence[int]) -> int:
        """The rows a compiled decode of these slots runs: the smallest bucket that holds the highest slot
        (alloc hands out the lowest free slot, so the busy slots stay packed at the front)."""
        top = max(slots) + 1
        return next(b for b in self.buckets if b >= top)

    def _decode_static(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        # The first `bucket` slots run, so each compiled graph (and CUDA graph) sees one shape only.
        # A row not asked for writes at its slot's next free position, which that slot overwrites
        # before it ever attends to it (a full slot cannot decode again), so no cache is harmed.
        rows = self.bucket(slots)
        tok_all = [0] * rows
        pos_all = [min(n, self.max_len - 1) for n in self.lengths[:rows]]
        for s, t, p in zip(slots, tokens, positions, strict=True):
            tok_all[s], pos_all[s] = t, p
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
            keys = self._keys  # a CUDA graph per length would be recorded every step: the whole cache
        else:  # the positions written so far only, as the eager decode: faster at many rows than the whole cache
            keys = self._keys[: max(pos_all) + 1]
            maybe_mark_dynamic(keys, 0)
        assert self._step is not None
        logits = self._step(self._tensor(tok_all).view(-1, 1), self._tensor(pos_all).view(-1, 1), keys)
        if slots == list(range(rows)):
            return logits.clone()  # a copy: CUDA graphs reuse their output buffer next step
        return logits[self._tensor(slots)]

    # sampling ---------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
               generators: list[torch.Generator | None], *, prompt_lens: Sequence[int] | None = None,
               allowed: torch.Tensor | None = None) -> list[int]:
        """The next token of each row: the allowed tokens only, logit bias, repetition, presence and
        frequency penalties, then argmax (temperature 0) or temperature, top-k and top-p sampling. On the
        device throughout; the one host sync is the final .tolist().

        histories: each row's prompt + generated ids (for the penalties); prompt_lens: where each row's
        generated ids begin in it (None: all of it is generated). generators: Generator.rng(seed) per
        row, or None for the global RNG. allowed: (B, V) bool, the tokens each row may take (None: all).
        """
        return self._pick(logits, params, histories, generators, prompt_lens, allowed).tolist()

    @torch.no_grad()
    def sample_logprobs(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                        generators: list[torch.Generator | None], *, prompt_lens: Sequence[int] | None = None,
                        allowed: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """`sample`, and for each row whose params ask (logprobs not None) its token's TokenLogprob with
        params.logprobs alternatives, from the raw `logits` (None for the other rows). Still one host sync:
        the tokens travel in the same float32 tensor as the log-probabilities."""
        tokens = self._pick(logits, params, histories, generators, prompt_lens, allowed)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        k = max(params[i].logprobs or 0 for i in rows)
        index = self._tensor(rows)
        table = _logprob_table(logits[index], tokens[index], k)  # (R, 2 + 2k)
        flat = torch.cat([tokens.float(), table.flatten()]).tolist()
        B = len(params)
        entries: list[TokenLogprob | None] = [None] * B
        for i, e in zip(rows, _unpack([flat[B + r * table.shape[1] : B + (r + 1) * table.shape[1]]
                                       for r in range(len(rows))]), strict=True):
            entries[i] = _top(e, params[i].logprobs or 0)
        return [int(t) for t in flat[:B]], entries

    def _pick(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
              generators: list[torch.Generator | None], prompt_lens: Sequence[int] | None = None,
              allowed: torch.Tensor | None = None) -> torch.Tensor:
        """sample's tokens (B,), on the device: no host sync."""
        B, V = logits.shape
        logits = logits.float()
        # Out-of-place throughout: the raw logits stay as they are, for the log-probabilities.
        if allowed is not None:  # first, so that no bias or penalty can bring a forbidden token back
            logits = torch.where(allowed, logits, float("-inf"))
        if any(p.logit_bias for p in params):
            rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
            cols = [t for p in params for t, _ in p.logit_bias]
            bias = self._tensor([b for p in params for _, b in p.logit_bias], torch.float32)
            logits = logits.index_put((self._tensor(rows), self._tensor(cols)), bias, accumulate=True)
        if any(p.repetition_penalty != 1.0 for p in params):  # vLLM's order: it, then OpenAI's two
            seen = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
            rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 for _ in histories[i]]
            cols = [t for i, p in enumerate(params) if p.repetition_penalty != 1.0 for t in histories[i]]
            seen[self._tensor(rows), self._tensor(cols)] = True
            pen = self._tensor([p.repetition_penalty for p in params], torch.float32).view(B, 1)
            logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            starts = prompt_lens or [0] * B
            penalised = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
            rows = [i for i in penalised for _ in histories[i][starts[i]:]]
            cols = [t for i in penalised for t in histories[i][starts[i]:]]
            counts = torch.zeros(B, V, device=logits.device)
            counts.index_put_((self._tensor(rows), self._tensor(cols)), torch.ones(len(rows), device=logits.device),
                              accumulate=True)
            frequency = self._tensor([p.frequency_penalty for p in params], torch.float32).view(B, 1)
            presence = self._tensor([p.presence_penalty for p in params], torch.float32).view(B, 1)
            logits = logits - frequency * counts - presence * (counts > 0)
        greedy = logits.argmax(dim=-1)
        if all(p.temperature == 0 for p in params):
            return greedy
        # Work in the k_max best logits, sorted; k_max = V (a full sort) when some row has no top-k.
        k_max = min(V, max(p.top_k or V for p in params))
        vals, idx = logits.topk(k_max, dim=-1)  # (B, k_max)
        vals = vals / self._tensor([p.temperature or 1.0 for p in params], torch.float32).view(B, 1)
        ranks = torch.arange(k_max, device=logits.device)
        keep = ranks < self._tensor([min(p.top_k or V, k_max) for p in params]).view(B, 1)
        probs = vals.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        if any(p.top_p < 1.0 for p in params):
            # The smallest prefix whose mass reaches p: a token stays while the mass before it is < p.
            top_p = self._tensor([p.top_p for p in params], torch.float32).view(B, 1)
            probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
        # argmax(probs / Exp(1) noise) is how torch.multinomial draws one sample (same generator, same
        # draw), minus its input check, which syncs with the host. Unnormalised probs are fine for it.
        noise = torch.empty_like(probs)
        if any(g is None for g in generators):
            noise.exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = idx.gather(-1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(-1)
        is_greedy = self._tensor([p.temperature == 0 for p in params], torch.bool)
        return torch.where(is_greedy, greedy, sampled)


def _logprob_table(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """(R, 2 + 2k) float32: each row's target token, its log-probability, the k most likely token ids and
    their log-probabilities, most likely first. One log_softmax gives both, so a greedy token's logprob
    equals the top one exactly. Token ids are exact in float32 below 2**24 (config.MAX_VOCAB)."""
    lp = logits.float().log_softmax(dim=-1)  # (R, V)
    top, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return torch.cat([targets[:, None].float(), lp.gather(-1, targets[:, None]), ids.float(), top], dim=-1)


def _unpack(rows: list[list[float]]) -> list[TokenLogprob]:
    """_logprob_table's rows, on the host, as TokenLogprobs."""
    out = []
    for row in rows:
        n = (len(row) - 2) // 2
        out.append(TokenLogprob(token=int(row[0]), logprob=row[1],
                                top=tuple((int(t), v) for t, v in zip(row[2 : 2 + n], row[2 + n :], strict=True))))
    return out


def _top(entry: TokenLogprob, k: int) -> TokenLogprob:
    """The entry with its k most likely alternatives only (a batch computes its rows' largest k)."""
    return entry if len(entry.top) <= k else dataclasses.replace(entry, top=entry.top[:k])


# ----------------------------------------------------------------------------------------------
# Token generators on top of Generator


def _run(gen: Generator, prompts: list[list[int]], params: SamplingParams,
         finished: set[int]) -> Iterator[tuple[int, int | None, Finish | None]]:
    """Decode prompts together: yields (row, token, finish) as tokens come. finish is None while the
    row goes on, "length" on its last token, "stop" with token None for a stop token id. Rows the
    caller adds to `finished` end after their current token. Slots are freed however this ends."""
    if len(prompts) > gen.max_batch_size:
        raise ValueError(f"{len(prompts)} prompts exceed the {gen.max_batch_size} cache slots")
    for p in prompts:
        gen.check_prompt(p)
    seqs, logits = gen.begin_many(prompts, params)  # one forward for all the prompts
    try:
        active = [i for i, s in enumerate(seqs) if s.budget > 0]
        for i in sorted(set(range(len(seqs))) - set(active)):  # max_new_tokens 0: the prompt only
            seqs[i].finish = "length"
            yield i, None, "length"
        logits = logits[active]
        while active:
            tokens = gen.sample_next(logits, [seqs[i] for i in active])
            going = []
            for i, t in zip(active, tokens, strict=True):
                finish = seqs[i].add(t)
                yield i, None if finish == "stop" else t, finish
                if finish is None and i not in finished:
                    going.append(i)
            active = going
            if active:
                logits = gen.decode_next([seqs[i] for i in active])
    finally:
        for seq in seqs:
            gen.end(seq)


def complete(gen: Generator, prompts: list[list[int]], params: SamplingParams,
             on_token: Callable[[int, int], bool] | None = None) -> list[tuple[list[int], Finish]]:
    """(new token ids, finish reason "stop" | "length") per prompt, decoded in groups of gen.max_batch_size.

    on_token(row, token) is called for every new token; returning True ends that row ("stop"), e.g.
    when its StopChecker found a stop string. Stop token ids end a row and are not returned.
    """
    for p in prompts:
        gen.check_prompt(p)  # every prompt, before any work
    out: list[list[int]] = [[] for _ in prompts]
    reasons: list[Finish] = ["length"] * len(prompts)
    for start in range(0, len(prompts), gen.max_batch_size):
        finished: set[int] = set()
        for row, token, finish in _run(gen, prompts[start : start + gen.max_batch_size], params, finished):
            r = start + row
            if token is not None:
                out[r].append(token)
                if on_token is not None and on_token(r, token):
                    finished.add(row)
                    reasons[r] = "stop"
                    continue
            if finish is not None:
                reasons[r] = finish
    return list(zip(out, reasons, strict=True))


def generate(gen: Generator, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """New token ids for each prompt (prompts of any lengths, batched); stop_token_ids end a sequence."""
    return [ids for ids, _ in complete(gen, prompts, params)]


def stream(gen: Generator, prompt: list[int], params: SamplingParams) -> Iterator[int]:
    """The new token ids of one prompt, one at a time; leaving the loop early frees the slot."""
    gen.check_prompt(prompt)  # now, not at the first next()

    def tokens() -> Iterator[int]:
        with contextlib.closing(_run(gen, [prompt], params, set())) as steps:
            for _, token, _ in steps:
                if token is not None:
                    yield token

    return tokens()


class StopChecker:
    """Incremental detokenizer: a growing list of token ids -> text safe to show, ended at a stop string.

    Byte-level BPE splits multi-byte characters (emoji, accents) across tokens, so text ending in
    U+FFFD (an incomplete UTF-8 sequence) is held back until a later token completes it. A stop
    string may span tokens, so the longest tail that could begin one is held back too. The text
    before a stop string is emitted; the stop string and anything after it never are.

        checker = StopChecker(tokenizer, ("\\n\\n",))
        for token in stream(gen, ids, params):
            print(checker.add(token), end="")
            if checker.stopped:
                break
        print(checker.finish())
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        # Each stop string's proper prefixes by their last character, longest first: the tail held back
        # is found by trying only the prefixes that end as the text does, not every prefix of every string.
        self._prefixes: dict[str, list[str]] = {}
        for p in sorted({s[:k] for s in self.stop for k in range(1, len(s))}, key=len, reverse=True):
            self._prefixes.setdefault(p[-1], []).append(p)
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False
        # ids[_prefix:_read] is text already accounted for: decoding a short window, not the whole
        # list, keeps each step O(1) and still gives the decoder its context (vLLM's scheme).
        self._prefix = self._read = 0
        self._pending = ""  # decoded but held back: it may be the start of a stop string

    def add(self, token: int) -> str:
        """Take one token; the new text that is safe to show now (often "")."""
        if self.stopped:
            return ""
        self.ids.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The held-back rest, when no more tokens come (an incomplete character stays U+FFFD)."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self.tokenizer.decode  # skips special tokens (<|endoftext|>) by default
        before, after = decode(self.ids[self._prefix : self._read]), decode(self.ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # an incomplete character: wait for the token that completes it
        self._prefix, self._read = self._read, len(self.ids)
        text = self._pending + after[len(before) :]
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self._pending, self.stopped = text[: min(hits)], "", True
        else:  # hold back the longest tail that may begin a stop string
            hold = 0 if final or not text else next(
                (len(p) for p in self._prefixes.get(text[-1], ()) if text.endswith(p)), 0)
            out, self._pending = text[: len(text) - hold], text[len(text) - hold :]
        self.text += out
        return out
