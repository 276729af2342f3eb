"""Generation: prefill + decode over a preallocated KV cache, one token generator.

`gptopt generate`, the bench inference rungs, train's eval sample and the server's continuous-batching
engine all drive one `Generator`: `prefill` a prompt into a cache slot, `decode` one token for several
slots at their own positions, `sample` the next tokens, `free` the slot. `begin` / `decode_next` /
`sample_next` / `end` do the same for `Decoding`s (decoding.py), which hold each sequence's slot and
tokens and decide when it ends. Shaped after gpt-fast's generate.py. Its parts: kv_cache.py (the cache),
sampling.py (the sampler), stop.py (tokens -> text that ends at a stop string); loading a model for it:
load.py; the command: commands/generate.py.

    python -c "from gptopt.infer.generator import Generator; help(Generator)"
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from gptopt.infer import sampling
from gptopt.infer.decode_graphs import GraphedDecode, compile_decode
from gptopt.infer.decoding import Decoding, Finish
from gptopt.infer.kv_cache import KVCache
from gptopt.infer.prefix_cache import MIN_COPY, SlotPrefixes, common_prefix
from gptopt.infer.sampling import SamplingParams, TokenLogprob
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.runtime.torch_private import maybe_mark_dynamic
from gptopt.utils.errors import UserError

__all__ = ["Generator", "Stepper", "complete", "generate", "stream"]

log = logging.getLogger("gptopt")


class Stepper(Protocol):
    """A decode step that may make several tokens a sequence (speculative.Speculator)."""

    def step(self, gen: Generator, seqs: Sequence[Decoding]) -> list[list[int]]: ...

    def release(self, seq: Decoding) -> None: ...



class Generator:
    """Owns the model and one KVCache with max_batch_size slots; the single token generator behind CLI, bench
    and server.

    Runs in the weights' dtype (inference.load_for_inference casts them once), so there is no autocast here.
    Not thread-safe: one thread (the server's engine thread) drives it.
    """

    def __init__(self, model: GPT, plan: DevicePlan, *, max_batch_size: int = 8, max_len: int | None = None,
                 compile: bool = False, cuda_graphs: bool = False, grammars: Any = None,
                 prefix_cache: bool = False) -> None:
        """compile: the decode step compiled (inference.compile_decode). cuda_graphs: on CUDA without
        compile, the eager decode step recorded as a CUDA graph per bucket (inference.GraphedDecode);
        ignored elsewhere, and with compile (whose reduce-overhead mode records its own). grammars: the
        constrain.Grammars of the model's tokenizer, for sequences whose params name a grammar.
        prefix_cache: a prompt starts from the longest prefix of it some slot holds (prefix_cache.py); off
        where a prefill is what is measured (bench, profile)."""
        self.grammars = grammars
        cfg = model.config
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 2 <= self.max_len <= cfg.block_size:
            raise UserError(f"max_len must be in 2..{cfg.block_size} (the model's context), got {self.max_len}")
        if max_batch_size < 1:
            raise UserError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval().to(plan.device)
        self.plan, self.device = plan, plan.device
        self.max_batch_size, self.vocab_size = max_batch_size, cfg.vocab_size
        dtype = model.transformer.wte.weight.dtype
        self.cache = KVCache(cfg, max_batch_size, self.max_len, device=plan.device, dtype=dtype)
        self.lengths = [0] * max_batch_size  # tokens cached per slot: where an idle row of a static decode writes
        self._used: set[int] = set()
        self.prefixes = SlotPrefixes(max_batch_size, self.max_len) if prefix_cache else None
        # The row counts a compiled decode runs: powers of two below max_batch_size, and max_batch_size.
        self.buckets = [2**i for i in range(max_batch_size.bit_length()) if 2**i < max_batch_size] + [max_batch_size]
        self._step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._keys = torch.empty(self.max_len, device=plan.device)  # _decode_rows' length, as a size
        if compile:  # the last inference transform (load.py's step 5): it needs this cache
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
        if self.prefixes is None:
            self.lengths[slot] = 0  # nothing to clear on the device: positions past a sequence are masked
        else:  # what it holds stays for later prompts (the rows of a bucketed step write past it)
            self.prefixes.touch(slot)

    def rewind(self, slot: int, n: int) -> None:
        """Only the slot's first n positions hold its sequence: what a forward wrote after them (draft tokens the
        model did not keep) is left to be overwritten."""
        self.lengths[slot] = min(self.lengths[slot], n)
        if self.prefixes is not None:
            self.prefixes.keep(slot, n)

    def forget_prefixes(self) -> None:
        """Every slot's cached prefix dropped (a warm-up's prompts are no one's)."""
        if self.prefixes is not None:
            self.prefixes.clear()

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self._used)

    def open(self, prompt: list[int], params: SamplingParams) -> Decoding:
        """A Decoding of `prompt` in the lowest free slot, nothing cached yet: prefill_step runs its prompt."""
        self.check_prompt(prompt)
        slot = self.alloc()
        if self.prefixes is not None:  # what the slot holds moves to the least recently used free slot
            moved = self.prefixes.relocate(slot, sorted(set(range(self.max_batch_size)) - self._used), prompt)
            if moved is not None:
                self.cache.copy(slot, *moved)
                self.lengths[moved[0]] = moved[1]
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
            raise UserError("this Generator has no grammars (Generator(grammars=constrain.Grammars(...))), so it "
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
            raise UserError("begin_many needs at least one prompt")
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
            raise UserError(f"the prefill budget must be >= 1 token, got {budget}")
        rows: list[Decoding] = []
        width = 0
        for s in seqs:
            if s.prefilled:
                raise UserError(f"slot {s.slot}'s prompt is already prefilled")
            if s.cached == 0 and self.prefixes is not None and self._reuse(s, rows):
                continue
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
            if self.prefixes is not None and s.prefilled and s.params.prompt_logprobs is not None:
                self.prefixes.score(s.slot, s.prompt_logprobs, s.params.prompt_logprobs)
        done = [i for i, s in enumerate(rows) if s.prefilled]
        return [rows[i] for i in done], logits[done]

    def _reuse(self, seq: Decoding, writing: Sequence[Decoding]) -> bool:
        """Start `seq`'s prefill after the longest prefix of its prompt a slot holds (copied into its own slot,
        unless it is its own), with its prompt's log-probabilities where it asks for them; True to wait a forward
        instead, where a row of this one (`writing`) writes a longer prefix of it from scratch (n samples of one
        prompt, lm-eval's choices of one context)."""
        p = self.prefixes
        assert p is not None
        prompt, k = seq.ids[: seq.prompt_len], seq.params.prompt_logprobs
        src, n = p.best(prompt, k)
        if any(common_prefix(prompt, w.ids[: w.prompt_len]) >= n + MIN_COPY
               and (k is None or (w.params.prompt_logprobs is not None and w.params.prompt_logprobs >= k))
               for w in writing):
            return True
        own = p.reusable(seq.slot, prompt, k)
        if n < own + MIN_COPY:  # what its own slot holds, where it lies: no copy
            src, n = seq.slot, own
        # tokens 1..n's entries: token n's too, which is the prompt's own (reusable's rule)
        entries = p.scores[src][:n] if k is not None else []
        if src != seq.slot:
            self.cache.copy(src, seq.slot, n)
            p.set(seq.slot, prompt[:n], entries, p.score_k[src])
        else:
            p.keep(seq.slot, n)
        if n:
            p.touch(src)
            if k is not None:
                seq.prompt_logprobs = [sampling.top_of(e, k) for e in entries]
        self.lengths[seq.slot] = n
        seq.cached = seq.reused = n
        return False

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
        entries = sampling.unpack(sampling.logprob_table(torch.cat(picked), self._tensor(targets), k).tolist())
        for s, c in zip(seqs, chunks, strict=True):
            n = min(s.cached + len(c) + 1, s.prompt_len) - (s.cached + 1)
            s.prompt_logprobs += [sampling.top_of(e, s.params.prompt_logprobs or 0) for e in entries[:n]]
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

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
               generators: list[torch.Generator | None], *, prompt_lens: Sequence[int] | None = None,
               allowed: torch.Tensor | None = None) -> list[int]:
        """sampling.sample: the next token of each row."""
        return sampling.sample(logits, params, histories, generators, prompt_lens=prompt_lens, allowed=allowed)

    def sample_logprobs(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                        generators: list[torch.Generator | None], *, prompt_lens: Sequence[int] | None = None,
                        allowed: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """sampling.sample_logprobs: the next token of each row, with its TokenLogprob where asked."""
        return sampling.sample_logprobs(logits, params, histories, generators, prompt_lens=prompt_lens,
                                        allowed=allowed)

    def rng(self, seed: int | None) -> torch.Generator | None:
        """A per-sequence random generator on the device for `sample`, or None (the global RNG) without a seed."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def check_prompt(self, tokens: Sequence[int]) -> None:
        if not tokens:
            raise UserError("the prompt is empty: give at least one token")
        if len(tokens) > self.max_len - 1:
            raise UserError(f"the prompt has {len(tokens)} tokens; at most {self.max_len - 1} fit "
                             f"(max_len {self.max_len} leaves room for one new token)")
        self._check_ids(tokens)

    def _check_ids(self, tokens: Sequence[int]) -> None:
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise UserError(f"token ids must be in 0..{self.vocab_size - 1} (does the tokenizer belong to the model?)")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch_size:
            raise UserError(f"slot {slot} is outside 0..{self.max_batch_size - 1}")

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
        if self.prefixes is not None:
            self.prefixes.wrote(slot, 0, tokens)
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
            raise UserError(f"extend needs distinct slots, each with tokens and a start: {slots}, {starts}")
        if B == 1 and starts[0] == 0:
            return self.prefill(slots[0], chunks[0], every=every)[None]  # SDPA's causal path: no mask to build
        for s, c, p in zip(slots, chunks, starts, strict=True):
            self._check_slot(s)
            self._check_ids(c)
            if p < 0 or p + len(c) > self.max_len - 1:
                raise UserError(f"slot {s}: positions {p}..{p + len(c) - 1} leave no room for a new token "
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
            if self.prefixes is not None:
                self.prefixes.wrote(s, p, c)
        return logits

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each slot, at that slot's own position (its tokens cached so far); logits (B, V)."""
        B = len(slots)
        if not B == len(tokens) == len(positions) > 0 or len(set(slots)) != B:
            raise UserError(f"decode needs distinct slots, each with one token and one position: "
                             f"{slots}, {tokens}, {positions}")
        for s in slots:
            self._check_slot(s)
        if min(positions) < 0 or max(positions) >= self.max_len:
            raise UserError(f"positions must be in 0..{self.max_len - 1} (the cache's max_len), got {positions}")
        self._check_ids(tokens)
        if self._step is not None:
            logits = self._decode_static(slots, tokens, positions)
        else:
            # Attend over the longest row's positions only, not the whole cache.
            logits = self._forward(self._tensor(tokens).view(B, 1), self._tensor(positions).view(B, 1),
                                   self._rows(slots), max(positions) + 1)
        for s, t, p in zip(slots, tokens, positions, strict=True):
            self.lengths[s] = p + 1
            if self.prefixes is not None:
                self.prefixes.wrote(s, p, (t,))
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
        else:  # the asked rows' positions only, as the eager decode: faster at many rows than the whole cache (an
            # idle row still writes in the full cache; its output, over fewer keys, is discarded)
            keys = self._keys[: max(positions) + 1]
            maybe_mark_dynamic(keys, 0)
        assert self._step is not None
        logits = self._step(self._tensor(tok_all).view(-1, 1), self._tensor(pos_all).view(-1, 1), keys)
        if slots == list(range(rows)):
            return logits.clone()  # a copy: CUDA graphs reuse their output buffer next step
        return logits[self._tensor(slots)]

# ----------------------------------------------------------------------------------------------
# Token generators on top of Generator


def _run(gen: Generator, prompts: list[list[int]], params: SamplingParams, finished: set[int],
         stepper: Stepper | None = None) -> Iterator[tuple[int, int | None, Finish | None]]:
    """Decode prompts together: yields (row, token, finish) as tokens come. finish is None while the
    row goes on, "length" on its last token, "stop" with token None for a stop token id ("incomplete" with
    token None where its grammar allowed no token). Rows the caller adds to `finished` end after their
    current token. A stepper (speculative decoding) may make several tokens a row a step. Slots are freed
    however this ends."""
    if len(prompts) > gen.max_batch_size:
        raise UserError(f"{len(prompts)} prompts exceed the {gen.max_batch_size} cache slots")
    for p in prompts:
        gen.check_prompt(p)
    seqs, logits = gen.begin_many(prompts, params)  # one forward for all the prompts
    try:
        active = [i for i, s in enumerate(seqs) if s.budget > 0]
        for i in sorted(set(range(len(seqs))) - set(active)):  # max_new_tokens 0: the prompt only
            seqs[i].finish = "length"
            yield i, None, "length"
        news = [[t] for t in gen.sample_next(logits[active], [seqs[i] for i in active])] if active else []
        while active:
            going = []
            for i, tokens in zip(active, news, strict=True):
                for t in tokens:
                    finish = seqs[i].add(t)
                    yield i, None if finish in ("stop", "incomplete") else t, finish
                    if finish is not None or i in finished:
                        break
                else:
                    going.append(i)
            active = going
            if active:
                run = [seqs[i] for i in active]
                news = stepper.step(gen, run) if stepper is not None else [
                    [t] for t in gen.sample_next(gen.decode_next(run), run)]
    finally:
        for seq in seqs:
            if stepper is not None:
                stepper.release(seq)
            gen.end(seq)


def complete(gen: Generator, prompts: list[list[int]], params: SamplingParams,
             on_token: Callable[[int, int], bool] | None = None,
             stepper: Stepper | None = None) -> list[tuple[list[int], Finish]]:
    """(new token ids, finish reason "stop" | "length") per prompt, decoded in groups of gen.max_batch_size.

    on_token(row, token) is called for every new token; returning True ends that row ("stop"), e.g.
    when its StopChecker found a stop string. Stop token ids end a row and are not returned. stepper: a
    speculative.Speculator, which may make several tokens a row a step.
    """
    for p in prompts:
        gen.check_prompt(p)  # every prompt, before any work
    out: list[list[int]] = [[] for _ in prompts]
    reasons: list[Finish] = ["length"] * len(prompts)
    for start in range(0, len(prompts), gen.max_batch_size):
        finished: set[int] = set()
        for row, token, finish in _run(gen, prompts[start : start + gen.max_batch_size], params, finished,
                                         stepper):
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


def generate(gen: Generator, prompts: list[list[int]], params: SamplingParams,
             stepper: Stepper | None = None) -> list[list[int]]:
    """New token ids for each prompt (prompts of any lengths, batched); stop_token_ids end a sequence."""
    return [ids for ids, _ in complete(gen, prompts, params, stepper=stepper)]


def stream(gen: Generator, prompt: list[int], params: SamplingParams,
           stepper: Stepper | None = None) -> Iterator[int]:
    """The new token ids of one prompt, one at a time; leaving the loop early frees the slot."""
    gen.check_prompt(prompt)  # now, not at the first next()

    def tokens() -> Iterator[int]:
        with contextlib.closing(_run(gen, [prompt], params, set(), stepper)) as steps:
            for _, token, _ in steps:
                if token is not None:
                    yield token

    return tokens()


