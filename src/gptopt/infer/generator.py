"""The model runner: a model over a paged KV cache, and each running sequence's row (its slot) and block table.

`gptopt generate`, the bench inference rungs, train's eval sample and the server's engine all drive one
`Generator`, through scheduler.py's Scheduler (which sequences run, admission by free blocks, chunked prefill,
preemption) or directly: `prefill` a prompt into a slot, `extend` several slots by a chunk each, `decode` one
token for several slots at their own positions, `sample` the next tokens, `free` the slot. Its parts:
block_pool.py (which block is free, shared or cached), kv_cache.py (the blocks' keys and values), sampling.py
(the sampler), decode_graphs.py (the compiled or CUDA-graphed decode). Shaped after gpt-fast's generate.py and
vLLM's model runner.

    python -c "from gptopt.infer.generator import Generator; help(Generator)"

A slot is a row of the running batch: its block table (tables[slot]), its length, its tokens. Slots are handed
out lowest first, so the running rows stay packed at the front and a bucketed decode (compiled, or a CUDA graph)
runs the first `bucket` rows; a row it runs that is not asked for writes at its next position, which is in a
block of its own or, past its blocks, in NULL_BLOCK, and is overwritten before it is attended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from gptopt.infer import sampling
from gptopt.infer.block_pool import NULL_BLOCK, BlockPool
from gptopt.infer.decode_graphs import GraphedDecode, compile_decode
from gptopt.infer.decoding import Decoding
from gptopt.infer.kv_cache import PagedKVCache
from gptopt.infer.sampling import SamplingParams, TokenLogprob
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.runtime.torch_private import maybe_mark_dynamic
from gptopt.utils.errors import UserError

__all__ = ["BLOCK_SIZE", "GATHER_CHUNKS", "Generator", "Stepper"]

log = logging.getLogger("gptopt")

# Tokens a KV block holds (vLLM's default too): the unit of memory a sequence takes and of prefix reuse.
BLOCK_SIZE = 16

# A prefill forward gathers every row's keys and values to its longest row's length: rows x that length is kept
# within this many prefill budgets (the first row excepted), so one row deep into a long prompt does not make
# every row of the forward gather its whole context.
GATHER_CHUNKS = 8


class Stepper(Protocol):
    """A decode step that may make several tokens a sequence (speculative.Speculator)."""

    lookahead: int  # tokens past a sequence's own a step may write (its draft): blocks the scheduler reserves

    def step(self, gen: Generator, seqs: Sequence[Decoding]) -> list[list[int]]: ...

    def release(self, seq: Decoding) -> None: ...


class Generator:
    """The model and its paged KV cache: up to max_batch_size sequences at once, each up to max_len tokens, in
    kv_blocks blocks of block_size tokens.

    Runs in the weights' dtype (inference.load_for_inference casts them once), so there is no autocast here.
    Not thread-safe: one thread (the server's engine thread) drives it.
    """

    def __init__(self, model: GPT, plan: DevicePlan, *, max_batch_size: int = 8, max_len: int | None = None,
                 kv_blocks: int | None = None, block_size: int = BLOCK_SIZE, compile: bool = False,
                 cuda_graphs: bool = False, grammars: Any = None, prefix_cache: bool = False) -> None:
        """kv_blocks: the pool's blocks (default: max_batch_size sequences of max_len tokens). compile: the decode
        step compiled (decode_graphs.compile_decode). cuda_graphs: on CUDA without compile, the eager decode step
        recorded as a CUDA graph per bucket (decode_graphs.GraphedDecode); ignored elsewhere, and with compile
        (whose reduce-overhead mode records its own). grammars: the constrain.Grammars of the model's tokenizer,
        for sequences whose params name a grammar. prefix_cache: full blocks stay registered after their sequence
        ends, and a prompt starts after the longest run of them it begins with (block_pool.py); off where a
        prefill is what is measured (bench, profile)."""
        self.grammars = grammars
        cfg = model.config
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 2 <= self.max_len <= cfg.block_size:
            raise UserError(f"max_len must be in 2..{cfg.block_size} (the model's context), got {self.max_len}")
        if max_batch_size < 1:
            raise UserError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if block_size < 1:
            raise UserError(f"block_size must be >= 1 token, got {block_size}")
        self.model = model.eval().to(plan.device)
        self.plan, self.device = plan, plan.device
        self.max_batch_size, self.vocab_size, self.block_size = max_batch_size, cfg.vocab_size, block_size
        self.max_blocks = -(-self.max_len // block_size)  # a table's width: one sequence of max_len tokens
        kv_blocks = max_batch_size * self.max_blocks if kv_blocks is None else kv_blocks
        if kv_blocks < self.max_blocks:
            raise UserError(f"{kv_blocks} KV blocks of {block_size} tokens hold fewer than one sequence of max_len "
                            f"{self.max_len} tokens ({self.max_blocks} blocks): give more KV-cache memory or a "
                            "lower max_len")
        self.pool = BlockPool(kv_blocks, block_size, caching=prefix_cache)
        dtype = model.transformer.wte.weight.dtype
        self.cache = PagedKVCache(cfg, kv_blocks + 1, block_size, device=plan.device, dtype=dtype)  # + NULL_BLOCK
        # Each slot's block table, on the host and on the device (a decode step reads the device's, compiled
        # graphs included: its address never changes); entries past a slot's blocks are NULL_BLOCK.
        self.blocks: list[list[int]] = [[] for _ in range(max_batch_size)]
        self.tables = torch.full((max_batch_size, self.max_blocks), NULL_BLOCK, dtype=torch.long, device=plan.device)
        self.lengths = [0] * max_batch_size  # tokens cached per slot: where an idle row of a bucketed decode writes
        self.tokens: list[list[int]] = [[] for _ in range(max_batch_size)]  # those tokens (prefix registration)
        self.registered = [0] * max_batch_size  # leading blocks of each slot already registered in the pool
        self._used: set[int] = set()
        # The row counts a compiled decode runs: powers of two below max_batch_size, and max_batch_size.
        self.buckets = [2**i for i in range(max_batch_size.bit_length()) if 2**i < max_batch_size] + [max_batch_size]
        self._step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._keys = torch.empty(self.max_len, device=plan.device)  # _decode_rows' length, as a size
        if compile:  # the last inference transform (load.py's step 5): it needs this cache
            self._step = compile_decode(self._decode_rows, self.model, [*self.cache.tensors, self.tables],
                                        self.device, max_batch_size)
        elif cuda_graphs and self.device.type == "cuda":
            self._step = GraphedDecode(self._decode_rows, max_batch_size, self.device)

    @property
    def compiled(self) -> bool:
        return self._step is not None and not isinstance(self._step, GraphedDecode)

    @property
    def bucketed(self) -> bool:
        """The decode runs whole buckets (compiled, or recorded as CUDA graphs): each is built on its first step."""
        return self._step is not None

    @property
    def prefix_cache(self) -> bool:
        return self.pool.caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def kv_usage(self) -> float:
        """The share of KV blocks sequences hold, 0..1."""
        return self.pool.usage()

    # slots and blocks -------------------------------------------------------------------------
    def alloc(self) -> int:
        """The lowest free slot, holding no block yet (an engine may track slots itself)."""
        free = sorted(set(range(self.max_batch_size)) - self._used)
        if not free:
            raise RuntimeError(f"all {self.max_batch_size} sequence slots are in use")
        self._used.add(free[0])
        return free[0]

    def free(self, slot: int) -> None:
        """The slot and its blocks given back. With the prefix cache its full blocks stay registered, for later
        prompts, until their memory is needed."""
        self._check_slot(slot)
        self._used.discard(slot)
        blocks = self.blocks[slot]
        self.pool.register(blocks, self.tokens[slot][: self.lengths[slot]], self.registered[slot])
        self.pool.release(blocks)
        self.blocks[slot] = []
        if blocks:
            self.tables[slot, : len(blocks)] = NULL_BLOCK
        self.lengths[slot], self.tokens[slot], self.registered[slot] = 0, [], 0

    def rewind(self, slot: int, n: int) -> None:
        """Only the slot's first n positions hold its sequence: what a forward wrote after them (draft tokens the
        model did not keep) is left to be overwritten, in the slot's own blocks."""
        self.lengths[slot] = min(self.lengths[slot], n)
        del self.tokens[slot][n:]

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self._used)

    def blocks_short(self, slot: int, upto: int) -> int:
        """Blocks the slot needs beyond those it holds for positions 0..upto - 1."""
        return max(0, self.pool.blocks_for(upto) - len(self.blocks[slot]))

    def reserve(self, slot: int, upto: int) -> None:
        """Blocks for the slot's positions 0..upto - 1 (NoFreeBlocks where the pool has too few)."""
        short = self.blocks_short(slot, upto)
        if short:
            new = self.pool.allocate(short)
            have = len(self.blocks[slot])
            self.blocks[slot] += new
            self.tables[slot, have : have + short] = torch.tensor(new, dtype=torch.long)

    def forget_prefixes(self) -> None:
        """Every cached prefix dropped (a warm-up's prompts are no one's)."""
        self.pool.forget()

    def new(self, prompt: list[int], params: SamplingParams) -> Decoding:
        """A Decoding of `prompt`, holding no slot yet: `admit` gives it one, prefill_step runs its prompt."""
        self.check_prompt(prompt)
        budget = min(params.max_new_tokens, self.max_len - len(prompt))
        matcher = None if params.grammar is None else self._grammars().matcher(params.grammar)
        return Decoding(slot=-1, params=params, prompt_len=len(prompt), budget=budget, rng=self.rng(params.seed),
                        ids=list(prompt), matcher=matcher)

    def cached_prefix(self, seq: Decoding) -> list[int]:
        """The cached blocks `seq` would start from: the longest run of registered full blocks its tokens to
        prefill begin with, leaving at least its last prompt token to compute (its logits are sampled) unless
        it resumes after a preemption. A prompt that scores itself (prompt_logprobs) takes only blocks scored with
        as many alternatives, whose entries reach its next token."""
        if not self.pool.caching:
            return []
        want = seq.target if seq.resumed else seq.target - 1
        hit = self.pool.lookup(seq.ids[:want])
        k = seq.params.prompt_logprobs
        if k is not None and not seq.resumed:
            for i, b in enumerate(hit):
                scored = self.pool.scores.get(b)
                if scored is None or scored[0] < k:
                    del hit[i:]
                    break
            # a block's last entry scores the token after it, which its key does not hold: it must be this prompt's
            for i, b in enumerate(hit):
                if self.pool.scores[b][1][-1].token != seq.ids[(i + 1) * self.block_size]:
                    del hit[i:]
                    break
        return hit

    def admit(self, seq: Decoding, *, spare: int = 0) -> bool:
        """Give `seq` the lowest free slot, the cached blocks its prompt begins with (shared: a reference each) and
        blocks for the rest of what it must prefill, leaving at least `spare` blocks free; False, holding
        nothing, where there is no free slot or too few blocks."""
        if not self.free_slots:
            return False
        hit = self.cached_prefix(seq)
        fresh = [b for b in hit if self.pool.refs[b] == 0]  # cached blocks nobody holds count against the free ones
        need = self.pool.blocks_for(seq.target) - len(hit)
        if need + len(fresh) + spare > self.pool.free:
            return False
        slot = self.alloc()
        self.pool.take(hit)
        n = len(hit) * self.block_size
        self.blocks[slot] = list(hit)
        if hit:
            self.tables[slot, : len(hit)] = torch.tensor(hit, dtype=torch.long)
        self.reserve(slot, seq.target)
        self.lengths[slot], self.tokens[slot], self.registered[slot] = n, seq.ids[:n], len(hit)
        seq.slot, seq.cached, seq.reused = slot, n, n
        k = seq.params.prompt_logprobs
        if k is not None and hit and not seq.resumed:
            seq.prompt_logprobs = [sampling.top_of(e, k) for b in hit for e in self.pool.scores[b][1]]
        return True

    def open(self, prompt: list[int], params: SamplingParams) -> Decoding:
        """A Decoding of `prompt`, admitted now (UserError where no slot or too few blocks are free)."""
        seq = self.new(prompt, params)
        if not self.admit(seq):
            raise UserError(f"no room for a prompt of {len(prompt)} tokens: {self.free_slots} free slots, "
                            f"{self.pool.free} free KV blocks of {self.block_size} tokens")
        return seq

    def preempt(self, seq: Decoding) -> None:
        """Free `seq`'s slot and blocks, its full blocks cached: it is recomputed later from its tokens so far
        (admit, prefill_step), most of them found in the cache when nothing else took their blocks."""
        if seq.slot >= 0:
            self.free(seq.slot)
        seq.preempt()

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
        """One forward over the next chunk of each admitted sequence's tokens to prefill, taken in order while
        rows x the longest chunk stay within `budget` tokens and rows x the longest row's attended positions
        within GATHER_CHUNKS x `budget` (the first always runs, cut to `budget`): a long prompt is prefilled over
        several calls, so the decodes between them wait one chunk at most, and a chunk deep into a long prompt
        runs without rows whose tables would be gathered to its length.

        The sequences whose prefill is now complete, and logits (k, V) of their last token (a resumed sequence's
        row is there too: its caller does not sample it)."""
        if budget < 1:
            raise UserError(f"the prefill budget must be >= 1 token, got {budget}")
        rows: list[Decoding] = []
        width = reach = 0
        for s in seqs:
            if s.prefilled or s.slot < 0:
                raise UserError(f"slot {s.slot}'s sequence is already prefilled, or not admitted")
            w = min(budget, max(width, s.target - s.cached))
            r = max(reach, s.cached + min(w, s.target - s.cached))  # the longest row's attended positions
            if rows and (w * (len(rows) + 1) > budget or r * (len(rows) + 1) > GATHER_CHUNKS * budget):
                break
            rows.append(s)
            width, reach = w, r
        chunks = [s.ids[s.cached : min(s.cached + width, s.target)] for s in rows]
        scored = [i for i, s in enumerate(rows) if s.params.prompt_logprobs is not None and not s.resumed]
        if not scored:
            logits = self.extend([s.slot for s in rows], chunks, [s.cached for s in rows])
        else:  # every position's logits: (B, T, V), each row's chunk at its end (left-padded)
            every = self.extend([s.slot for s in rows], chunks, [s.cached for s in rows], every=True)
            self._score_prompts([rows[i] for i in scored], [chunks[i] for i in scored], every[scored])
            logits = every[:, -1].float()
        for s, c in zip(rows, chunks, strict=True):
            s.cached += len(c)
            self._register(s)
        done = [i for i, s in enumerate(rows) if s.prefilled]
        return [rows[i] for i in done], logits[done]

    def _register(self, seq: Decoding) -> None:
        """The sequence's full prompt blocks, now written, registered for later prompts; a scored prompt's with
        their entries (entry j scores token j + 1, so a block's entries need the prompt's token after it)."""
        slot = seq.slot
        if not self.pool.caching:
            return
        full = min(seq.cached, self.lengths[slot]) // self.block_size
        start = self.registered[slot]
        if full <= start:
            return
        self.pool.register(self.blocks[slot], self.tokens[slot][: full * self.block_size], start)
        k = seq.params.prompt_logprobs
        if k is not None and not seq.resumed:
            bs = self.block_size
            for i in range(start, full):
                entries = seq.prompt_logprobs[i * bs : (i + 1) * bs]
                if len(entries) == bs:
                    self.pool.score(self.blocks[slot][i], k, entries)
                else:  # its last entry comes with the next chunk: registered then
                    full = i
                    break
        self.registered[slot] = full

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
        """Free the sequence's slot and blocks, however it ended (nothing where it holds none)."""
        if seq.slot >= 0:
            self.free(seq.slot)
            seq.slot = -1

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

    def _tensor(self, values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype = torch.long
                ) -> torch.Tensor:
        # From pinned memory the copy is asynchronous: the host does not wait for the GPU to catch up.
        pinned = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(self.device, non_blocking=pinned)

    # forward ----------------------------------------------------------------------------------
    def _wrote(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        self._used.add(slot)
        self.lengths[slot] = start + len(tokens)
        held = self.tokens[slot]
        del held[start:]
        held.extend(tokens)

    def _write_rows(self, tables: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(B x T,) the pool row (block x block_size + offset) of each position of pos (B, T), each row's read from
        its block table (B, max_blocks), on the device."""
        bs = self.block_size
        return (tables.gather(1, pos // bs) * bs + pos % bs).view(-1)

    @torch.no_grad()
    def prefill(self, slot: int, tokens: list[int], *, every: bool = False) -> torch.Tensor:
        """Run the prompt in one forward into the slot's blocks (positions 0..L-1); logits (V,) of its last
        token, or with `every` (L, V) of every position, in the weights' dtype."""
        self._check_slot(slot)
        self.check_prompt(tokens)
        L = len(tokens)
        self.reserve(slot, L)
        idx = self._tensor(tokens).view(1, L)
        pos = torch.arange(L, device=self.device).view(1, L)
        kv = self.cache.layers(self._write_rows(self.tables[slot : slot + 1], pos), None, L)
        # No mask: with S == T the model takes SDPA's causal path (flash kernels where available).
        logits = self.model(idx, pos=pos, kv_cache=kv, last_only=not every)
        self._wrote(slot, 0, tokens)
        return logits[0] if every else logits[0, -1].float()

    @torch.no_grad()
    def extend(self, slots: list[int], chunks: list[list[int]], starts: list[int], *,
               every: bool = False) -> torch.Tensor:
        """Each slot's next tokens at positions start.. (a prompt, or its next chunk over the cached part),
        every slot in one forward; logits (B, V) of each slot's last token, or with `every` (B, T, V) of
        every position (the weights' dtype; a shorter chunk's logits at the end of its row).

        Shorter chunks are padded on the left, so every row's last position is a real token; the padding
        writes in NULL_BLOCK."""
        B = len(slots)
        if not B == len(chunks) == len(starts) > 0 or len(set(slots)) != B or not all(chunks):
            raise UserError(f"extend needs distinct slots, each with tokens and a start: {slots}, {starts}")
        if B == 1 and starts[0] == 0:
            return self.prefill(slots[0], chunks[0], every=every)[None]  # SDPA's causal path: no mask to build
        for s, c, p in zip(slots, chunks, starts, strict=True):
            self._check_slot(s)
            self._check_ids(c)
            if p < 0 or p + len(c) > self.max_len - 1 or p > self.lengths[s]:
                raise UserError(f"slot {s}: positions {p}..{p + len(c) - 1} leave no room for a new token "
                                 f"in max_len {self.max_len}, or leave a gap after its {self.lengths[s]} tokens")
        for s, c, p in zip(slots, chunks, starts, strict=True):
            self.reserve(s, p + len(c))
        T = max(len(c) for c in chunks)
        tokens = [[0] * (T - len(c)) + c for c in chunks]
        positions = [[0] * (T - len(c)) + list(range(p, p + len(c))) for c, p in zip(chunks, starts, strict=True)]
        length = max(p + len(c) for c, p in zip(chunks, starts, strict=True))
        W = -(-length // self.block_size)
        pos = self._tensor(positions).view(B, T)
        tables = self.tables[self._tensor(slots)]
        padding = torch.arange(T, device=self.device) < T - self._tensor([len(c) for c in chunks])[:, None]
        write = self._write_rows(tables, pos).masked_fill(padding.view(-1), NULL_BLOCK)  # row 0 of NULL_BLOCK
        kv = self.cache.layers(write, tables[:, :W], length)
        logits = self.model(self._tensor(tokens).view(B, T), pos=pos, kv_cache=kv,
                            attn_mask=self.cache.mask(pos, length), last_only=not every)
        for s, c, p in zip(slots, chunks, starts, strict=True):
            self._wrote(s, p, c)
        return logits[:, -1].float() if not every else logits

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each slot, at that slot's own position (its tokens cached so far); logits (B, V)."""
        B = len(slots)
        if not B == len(tokens) == len(positions) > 0 or len(set(slots)) != B:
            raise UserError(f"decode needs distinct slots, each with one token and one position: "
                             f"{slots}, {tokens}, {positions}")
        for s, p in zip(slots, positions, strict=True):
            self._check_slot(s)
            if not 0 <= p <= min(self.lengths[s], self.max_len - 1):
                raise UserError(f"slot {s}: position {p} is outside 0..{self.max_len - 1} (max_len) or past its "
                                 f"{self.lengths[s]} cached tokens")
        self._check_ids(tokens)
        for s, p in zip(slots, positions, strict=True):
            self.reserve(s, p + 1)
        if self._step is not None:
            logits = self._decode_static(slots, tokens, positions)
        else:
            # Attend over the longest row's positions only, not a whole table's.
            logits = self._decode(self._tensor(tokens).view(B, 1), self._tensor(positions).view(B, 1),
                                  self._tensor(slots), max(positions) + 1, in_place=True)
        for s, t, p in zip(slots, tokens, positions, strict=True):
            self._wrote(s, p, (t,))
        return logits

    def _decode(self, tok: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor | slice, length: int, *,
                in_place: bool = False) -> torch.Tensor:
        """The decode forward of these slots' rows, every index computed on the device from the block tables (a
        compiled graph or a CUDA graph replays it as it is). in_place: the eager step, whose attention may read the
        blocks where they lie (paged_attention.py; a compiled graph gathers them, which inductor can fuse)."""
        tables = self.tables[rows]  # (B, max_blocks)
        W = (length + self.block_size - 1) // self.block_size
        if not in_place:
            # the gathered blocks attended whole, the mask hiding what lies past each row: cut to a length inside a
            # block, they made dynamo guard on whether the length ends a block, and the first step at a block's end
            # compiled the bucket's graph again while serving
            length = W * self.block_size
        kv = self.cache.layers(self._write_rows(tables, pos), tables[:, :W], length,
                               lengths=pos.view(-1) + 1 if in_place else None)
        logits = self.model(tok, pos=pos, kv_cache=kv, attn_mask=self.cache.mask(pos, length))
        return logits[:, -1].float()

    def _decode_rows(self, tok: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        # The first B slots (B = tok's rows: a bucket) over the first len(keys) positions. `keys` only carries that
        # length as a size a compiled graph keeps symbolic (a Python int would be a constant).
        return self._decode(tok, pos, slice(0, tok.shape[0]), keys.shape[0])

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
        # The first `bucket` slots run, so each compiled graph (and CUDA graph) sees one shape only. A row not asked
        # for writes at its slot's next position: in a block of its own that it overwrites before it attends to it,
        # or past its blocks in NULL_BLOCK.
        rows = self.bucket(slots)
        tok_all = [0] * rows
        pos_all = [min(n, self.max_len - 1) for n in self.lengths[:rows]]
        for s, t, p in zip(slots, tokens, positions, strict=True):
            tok_all[s], pos_all[s] = t, p
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
            keys = self._keys  # a CUDA graph per length would be recorded every step: every table's whole width
        else:  # the asked rows' positions only, as the eager decode (an idle row's output, over fewer keys, is
            # discarded), but two blocks at least: a graph traced over one block specialises on it (dynamo's 0/1
            # rule) and the first longer step compiled the bucket again while serving
            keys = self._keys[: max(max(positions) + 1, self.block_size + 1)]
            maybe_mark_dynamic(keys, 0)
        assert self._step is not None
        logits = self._step(self._tensor(tok_all).view(-1, 1), self._tensor(pos_all).view(-1, 1), keys)
        if slots == list(range(rows)):
            return logits.clone()  # a copy: CUDA graphs reuse their output buffer next step
        return logits[self._tensor(slots)]
