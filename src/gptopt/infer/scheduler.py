"""Which sequences run each step: a waiting and a running queue over one Generator, admission by free slots and
KV blocks, chunked prefill within a token budget, and preemption when a decode step finds no free block. The
server's engine, `gptopt generate` and the bench rungs all step one.

    pytest -q tests/test_scheduler.py

A step (Engine._iterate, _run here): `admit` the waiting sequences, oldest first, while a slot is free and the
blocks of what each must prefill are (cached blocks its prompt begins with are shared, not counted); `prefill`
runs one forward over the next chunk of the admitted prompts (at most `prefill_chunk` tokens, so a long prompt
never stalls the running decodes for more than a chunk) and samples the first token of those complete; `decode`
runs one step of every sequence past its prefill. Before it, each needs a block for the token it writes (and, when
speculating, for its draft): where too few are free, the newest running sequence is preempted (vLLM's recompute
policy): its blocks are freed, its full ones staying cached, and it goes back to the front of the waiting queue,
to be prefilled again from its tokens so far, most of them found in the cache when nothing else took their blocks.
Its random generator and grammar state are its own, so it goes on as it would have: the same tokens, greedy or
seeded.

Samples of one prompt (n > 1, lm-evaluation-harness's choices of one context) arrive together: a sequence whose
prompt shares more full blocks with one still being prefilled than the cache holds waits for that prefill, and
then takes its blocks by reference instead of computing them again.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence

from gptopt.infer.decoding import Decoding, Finish
from gptopt.infer.generator import Generator, Stepper
from gptopt.infer.sampling import SamplingParams
from gptopt.utils.errors import UserError

__all__ = ["PREFILL_CHUNK", "Scheduler", "common_prefix", "complete", "generate", "stream"]

# Prompt tokens one prefill forward takes by default (serve's --prefill_chunk): 16 clients' 32-token prompts in one
# forward, and a prompt of GPT-2's whole 1,024-token context in two.
PREFILL_CHUNK = 512

# Tokens compared as one slice before common_prefix's loop narrows down to the first difference
_STRIDE = 64


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens a and b share from their start."""
    n = min(len(a), len(b))
    i = 0
    while i + _STRIDE <= n and a[i : i + _STRIDE] == b[i : i + _STRIDE]:  # list slices compare in C
        i += _STRIDE
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """The waiting and running sequences of one Generator; see the module docstring. Not thread-safe: the
    thread that drives the Generator drives this."""

    def __init__(self, gen: Generator, *, prefill_chunk: int = PREFILL_CHUNK, stepper: Stepper | None = None,
                 speculate_max_batch: int = 4, on_forward: Callable[[int], None] | None = None) -> None:
        """stepper: speculative decoding, for decode steps of at most `speculate_max_batch` sequences (a larger
        batch already keeps the arithmetic busy, and decodes plainly). on_forward(rows): called before each
        forward, rows 0 for a prefill, else the rows the decode step computes (the server sets its thread count)."""
        if prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.gen, self.prefill_chunk = gen, prefill_chunk
        self.stepper, self.speculate_max_batch = stepper, speculate_max_batch
        self.on_forward = on_forward or (lambda rows: None)
        self.waiting: collections.deque[Decoding] = collections.deque()
        self.running: list[Decoding] = []  # admitted, oldest first: prefilling, then decoding
        self.preemptions = 0
        # free blocks kept back while sequences run: a new prompt is not admitted only to be preempted at once
        self.watermark = max(1, gen.num_blocks // 100)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Decoding) -> None:
        """Queue a sequence (Generator.new) behind the waiting ones."""
        self.waiting.append(seq)

    def finish(self, seq: Decoding) -> None:
        """Drop the sequence wherever it is, its slot and blocks freed (its full blocks stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.stepper is not None:
            self.stepper.release(seq)
        self.gen.end(seq)

    # -- one step -----------------------------------------------------------------------------
    def admit(self) -> list[Decoding]:
        """Waiting sequences into the batch, oldest first, while their slot and blocks are free: those admitted.
        The oldest that does not fit stops the rest (first come, first served)."""
        admitted = []
        while self.waiting:
            seq = self.waiting[0]
            if self._wait_for_prefix(seq):
                break
            if not self.gen.admit(seq, spare=self.watermark if self.running else 0):
                break
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _wait_for_prefix(self, seq: Decoding) -> bool:
        """Whether `seq` should wait a forward: a sequence being prefilled writes more full blocks of its prompt
        than the cache holds now."""
        if not self.gen.prefix_cache or seq.resumed:
            return False
        bs, have = self.gen.block_size, len(self.gen.cached_prefix(seq)) * self.gen.block_size
        k = seq.params.prompt_logprobs
        for w in self.running:
            if w.prefilled or w.resumed:
                continue
            if k is not None and (w.params.prompt_logprobs is None or w.params.prompt_logprobs < k):
                continue
            shared = min(common_prefix(seq.ids[: seq.target], w.ids[: w.target]), seq.target - 1)
            if shared // bs * bs > have:
                return True
        return False

    def prefill(self) -> list[tuple[Decoding, int | None]]:
        """One prefill forward over the admitted sequences' next chunks. Those whose prefill is complete: each with
        its first token, or None for a prompt that takes no new token (max_new_tokens 0: its prompt scored only);
        a resumed sequence goes back to decoding and is not listed."""
        todo = [s for s in self.running if not s.prefilled]
        if not todo:
            return []
        self.on_forward(0)
        done, logits = self.gen.prefill_step(todo, self.prefill_chunk)
        keep = [i for i, s in enumerate(done) if s.budget > 0 and not s.resumed]
        sampled = [done[i] for i in keep]
        tokens = self.gen.sample_next(logits[keep], sampled) if sampled else []
        out: list[tuple[Decoding, int | None]] = [(s, None) for s in done if s.budget <= 0]
        return out + list(zip(sampled, tokens, strict=True))

    def decode(self) -> list[tuple[Decoding, list[int]]]:
        """One decode step of every sequence past its prefill: each with its new tokens (several where a
        speculative step kept a draft). Makes room first, preempting the newest sequences where blocks run out."""
        seqs = self._make_room()
        if not seqs:
            return []
        spec = self.stepper if self.stepper is not None and len(seqs) <= self.speculate_max_batch else None
        # by the rows the step computes: a compiled step runs a whole bucket, and a speculative step with no draft
        # to verify is that very decode step
        self.on_forward(self.gen.step_rows([s.slot for s in seqs]))
        if spec is not None:
            news = spec.step(self.gen, seqs)
        else:
            news = [[t] for t in self.gen.sample_next(self.gen.decode_next(seqs), seqs)]
        return list(zip(seqs, news, strict=True))

    def _make_room(self) -> list[Decoding]:
        """The decoding sequences, each with the blocks its step writes; the newest preempted until they fit."""
        while True:
            seqs = [s for s in self.running if s.prefilled]
            spec = self.stepper is not None and len(seqs) <= self.speculate_max_batch
            ahead = self.stepper.lookahead if spec and self.stepper is not None else 0
            gen = self.gen
            need = sum(gen.blocks_short(s.slot, min(len(s.ids) + ahead, gen.max_len)) for s in seqs)
            if need <= gen.pool.free or not self.running:
                break
            self.preempt(self.running[-1])
        for s in seqs:
            gen.reserve(s.slot, min(len(s.ids) + ahead, gen.max_len))
        return seqs

    def preempt(self, seq: Decoding) -> None:
        """Take the sequence's slot and blocks back; it waits at the front of the queue to be recomputed."""
        self.running.remove(seq)
        if self.stepper is not None:
            self.stepper.release(seq)
        self.gen.preempt(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def check_idle(self) -> None:
        """With nothing running: every slot and block free (a leak test's check)."""
        if self.running or self.gen.free_slots != self.gen.max_batch_size:
            raise AssertionError(f"{len(self.running)} sequences running, "
                                 f"{self.gen.max_batch_size - self.gen.free_slots} slots held")
        self.gen.pool.check_idle()


# ----------------------------------------------------------------------------------------------
# Token generators on top of a Scheduler


def _run(gen: Generator, prompts: list[list[int]], params: SamplingParams, finished: set[int],
         stepper: Stepper | None = None) -> Iterator[tuple[int, int | None, Finish | None]]:
    """Decode prompts together: yields (row, token, finish) as tokens come. finish is None while the
    row goes on, "length" on its last token, "stop" with token None for a stop token id ("incomplete" with
    token None where its grammar allowed no token). Rows the caller adds to `finished` end after their
    current token. A stepper (speculative decoding) may make several tokens a row a step. Slots and blocks are
    freed however this ends."""
    seqs = [gen.new(p, params) for p in prompts]
    row = {id(s): i for i, s in enumerate(seqs)}
    # every prompt of a batch in one prefill forward, as a batch of them is given
    chunk = gen.max_batch_size * max(len(p) for p in prompts)
    sched = Scheduler(gen, prefill_chunk=chunk, stepper=stepper, speculate_max_batch=gen.max_batch_size)
    for s in seqs:
        sched.add(s)
    try:
        while sched.busy:
            sched.admit()
            for step in (sched.prefill, sched.decode):  # the first tokens are taken before the decode step
                for seq, tokens in step():
                    i = row[id(seq)]
                    if tokens is None:  # max_new_tokens 0: the prompt only
                        seq.finish = "length"
                        sched.finish(seq)
                        yield i, None, "length"
                        continue
                    for t in [tokens] if isinstance(tokens, int) else tokens:
                        finish = seq.add(t)
                        yield i, None if finish in ("stop", "incomplete") else t, finish
                        if finish is not None or i in finished:
                            sched.finish(seq)
                            break
    finally:
        for seq in seqs:
            sched.finish(seq)


def complete(gen: Generator, prompts: list[list[int]], params: SamplingParams,
             on_token: Callable[[int, int], bool] | None = None,
             stepper: Stepper | None = None) -> list[tuple[list[int], Finish]]:
    """(new token ids, finish reason "stop" | "length") per prompt, as many decoded at once as the Generator
    holds.

    on_token(row, token) is called for every new token; returning True ends that row ("stop"), e.g.
    when its StopChecker found a stop string. Stop token ids end a row and are not returned. stepper: a
    speculative.Speculator, which may make several tokens a row a step.
    """
    for p in prompts:
        gen.check_prompt(p)  # every prompt, before any work
    out: list[list[int]] = [[] for _ in prompts]
    reasons: list[Finish] = ["length"] * len(prompts)
    if not prompts:
        return []
    finished: set[int] = set()
    for r, token, finish in _run(gen, prompts, params, finished, stepper):
        if token is not None:
            out[r].append(token)
            if on_token is not None and on_token(r, token):
                finished.add(r)
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
    """The new token ids of one prompt, one at a time; leaving the loop early frees its slot and blocks."""
    gen.check_prompt(prompt)  # now, not at the first next()

    def tokens() -> Iterator[int]:
        with contextlib.closing(_run(gen, [prompt], params, set(), stepper)) as steps:
            for _, token, _ in steps:
                if token is not None:
                    yield token

    return tokens()
