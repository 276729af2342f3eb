"""Speculative decoding: a drafter proposes a sequence's next k tokens, the model scores them all in one forward,
and the sequence keeps the run of them the model agrees with plus one token of the model's own, so one read of
the weights can make up to k + 1 tokens.

    pytest -q tests/test_speculative.py

Drafters: NgramDrafter (prompt lookup: the tokens that followed the last earlier occurrence of the sequence's
last few tokens; free, and right where the output copies its input: editing or continuing a given text) and
ModelDrafter (a smaller model of the same tokenizer, run greedily or sampled over its own KV cache).

Exactness. Greedy rows keep a draft token while it is the model's argmax, then take the argmax where they
differ: the tokens of plain greedy decoding. Sampled rows follow the standard rejection rule (Leviathan et al.
2023; Chen et al. 2023): draft token d, drawn with probability q(d), is kept with probability min(1, p(d) / q(d))
under the model's distribution p (its temperature, top-k and top-p); at the first rejection the row draws from
max(0, p - q) normalised, and after k kept tokens from p. Every token is then distributed as plain sampling
draws it. A drafter that proposes deterministically (n-grams) has q one-hot: d is kept with probability p(d).
Rows whose sampling needs the history or the vocabulary mask token by token (penalties, logit bias, a grammar,
logprobs) are decoded plainly in the same forward.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from tokenizers import Tokenizer

from gptopt.infer import generator_memory, sampling
from gptopt.infer.decoding import Decoding
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference
from gptopt.infer.sampling import SamplingParams
from gptopt.runtime import memory_check
from gptopt.runtime.device import DevicePlan
from gptopt.utils.errors import UserError

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "Speculator", "build", "same_tokenizer", "speculable"]

log = logging.getLogger("gptopt")


def speculable(params: SamplingParams) -> bool:
    """Whether a sequence's sampling can be speculated: its distribution at a position depends on the logits
    alone (no penalty over the history, no bias, no grammar), and it asks for no log-probabilities."""
    return (params.grammar is None and params.logprobs is None and not params.logit_bias
            and params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty)


class Drafter(Protocol):
    def propose(self, seqs: Sequence[Decoding], ks: Sequence[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to ks[i] tokens to follow each sequence, and the probabilities (B, k, V) they were drawn with (None:
        proposed deterministically, each a one-hot)."""
        ...

    def kept(self, seq: Decoding, valid: int) -> None:
        """The model kept the sequence's first `valid` tokens of those it verified: later drafts are stale."""
        ...

    def release(self, seq: Decoding) -> None:
        """The sequence ended: what the drafter keeps of it may go."""
        ...


class NgramDrafter:
    """Prompt lookup decoding: the tokens that followed the last earlier occurrence of the sequence's last n tokens,
    n from max_n down to min_n (vLLM's ngram method, its prompt_lookup_max and _min)."""

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise UserError(f"the n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: Sequence[Decoding], ks: Sequence[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        return [self.lookup(s.ids, k) for s, k in zip(seqs, ks, strict=True)], None

    def lookup(self, ids: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of ids' longest matching tail that k tokens follow (else
        the one with the most after it), up to k tokens. An occurrence that overlaps the tail (a repeated
        token, a loop) would leave fewer: a run of one token draws k more of it, not one."""
        if k < 1:
            return []
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            # the latest occurrence with k tokens after it, then the ones nearer the tail (fewer after them)
            for start in [*range(len(ids) - n - k, -1, -1), *range(len(ids) - n - k + 1, len(ids) - n)]:
                if start >= 0 and ids[start] == tail[0] and ids[start : start + n] == tail:
                    return ids[start + n : start + n + k]
        return []

    def kept(self, seq: Decoding, valid: int) -> None:
        pass

    def release(self, seq: Decoding) -> None:
        pass


class ModelDrafter:
    """A smaller model of the same tokenizer, drafting over its own Generator (its own KV blocks), whose slots
    mirror the model's: a sequence's draft keys and values live in the draft's slot of the same number, brought up
    to date (its prompt, then the tokens kept since) before each proposal."""

    def __init__(self, draft: Generator) -> None:
        self.gen = draft
        self._held: dict[int, tuple[Decoding, int]] = {}  # slot -> (its sequence, tokens of it the draft holds)

    def propose(self, seqs: Sequence[Decoding], ks: Sequence[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        gen = self.gen
        # none past the draft's context, nor for a sequence holding an id the draft's embedding lacks (the model's
        # may have more rows than their shared tokenizer, and an untrained row can still be sampled)
        ks = [0 if max(s.ids) >= gen.vocab_size else min(k, gen.max_len - 1 - len(s.ids))
              for s, k in zip(seqs, ks, strict=True)]
        rows = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not rows:
            return drafts, None
        go = [seqs[i] for i in rows]
        held = [self._held[s.slot][1] if self._held.get(s.slot, (None,))[0] is s else 0 for s in go]
        # what the draft lacks of each sequence (its whole prompt at first), the last token included
        logits = gen.extend([s.slot for s in go], [s.ids[h:] for s, h in zip(go, held, strict=True)], held)
        params = [s.params for s in go]
        sampled = any(p.temperature > 0 for p in params)
        k_max = max(ks[i] for i in rows)
        q = torch.zeros(len(go), k_max, logits.shape[-1], device=logits.device) if sampled else None
        tokens: list[list[int]] = [[] for _ in go]
        for step in range(k_max):
            live = [r for r, i in enumerate(rows) if ks[i] > step]
            best = logits.argmax(dim=-1)
            if q is not None:  # a sampled draft token is drawn from the very distribution the rule compares
                probs = sampling.probabilities(logits, [params[r] for r in live], normalized=True)
                q[live, step] = probs
                greedy = torch.tensor([params[r].temperature == 0 for r in live], device=logits.device)
                best = torch.where(greedy, best, sampling.race(probs, [go[r].rng for r in live]))
            picked = best.tolist()
            for r, t in zip(live, picked, strict=True):
                tokens[r].append(t)
            more = [r for r in live if ks[rows[r]] > step + 1]
            if not more:
                break
            logits = gen.decode([go[r].slot for r in more], [tokens[r][-1] for r in more],
                                [len(go[r].ids) + step for r in more])
        for r, i in enumerate(rows):
            drafts[i] = tokens[r]
            # the draft now holds the sequence and its draft tokens but the last
            self._held[go[r].slot] = (go[r], len(go[r].ids) + len(tokens[r]) - 1)
        if q is None:
            return drafts, None
        out = torch.zeros(len(seqs), k_max, q.shape[-1], device=q.device)
        out[rows] = q
        return drafts, out

    def kept(self, seq: Decoding, valid: int) -> None:
        """The model kept the sequence's tokens up to `valid`: the draft's later positions are stale."""
        entry = self._held.get(seq.slot)
        if entry is not None and entry[0] is seq:
            self._held[seq.slot] = (seq, min(entry[1], valid))

    def release(self, seq: Decoding) -> None:
        """The sequence ended or was preempted: the draft's slot of its number and its blocks are free."""
        entry = self._held.get(seq.slot)
        if entry is not None and entry[0] is seq:
            del self._held[seq.slot]
            self.gen.free(seq.slot)


@dataclasses.dataclass
class Speculator:
    """One speculative step for running sequences over a Generator: propose, verify in one forward, keep."""

    drafter: Drafter
    k: int  # tokens proposed a step (--num_speculative_tokens)
    proposed: int = 0  # draft tokens proposed and verified, since it began
    accepted: int = 0  # of those, kept

    def __post_init__(self) -> None:
        if self.k < 1:
            raise UserError(f"--num_speculative_tokens must be >= 1, got {self.k}")

    @property
    def lookahead(self) -> int:
        """Positions past a sequence's own a step may write: its draft's (the scheduler reserves their blocks)."""
        return self.k

    @property
    def acceptance(self) -> float | None:
        """Draft tokens kept / proposed (None before any)."""
        return self.accepted / self.proposed if self.proposed else None

    @torch.no_grad()
    def step(self, gen: Generator, seqs: Sequence[Decoding]) -> list[list[int]]:
        """Each sequence's next tokens (1 to k + 1) from one forward of the model. Each sequence's last token is
        sampled and not yet in the cache (as for Generator.decode_next); its new tokens are not added (the caller
        adds them one by one with Decoding.add, which may end it early)."""
        # no more drafts than the sequence may still take (the step adds one of its own) or its slot holds
        ks = [min(self.k, s.budget - s.n_new - 1, gen.max_len - 1 - len(s.ids)) if speculable(s.params) else 0
              for s in seqs]
        drafts, q = self.drafter.propose(seqs, [max(k, 0) for k in ks])
        V = gen.vocab_size
        if q is not None and q.shape[-1] != V:  # a draft's padded vocabulary: the tokenizer's ids are below both
            q = q[..., :V] if q.shape[-1] > V else torch.nn.functional.pad(q, (0, V - q.shape[-1]))
        drafts = [d[: next((j for j, t in enumerate(d) if t >= V), len(d))] for d in drafts]
        if not any(drafts):  # nothing to verify: a plain decode step (compiled or on CUDA graphs where it is)
            return [[t] for t in gen.sample_next(gen.decode_next(seqs), seqs)]
        chunks = [[s.ids[-1], *d] for s, d in zip(seqs, drafts, strict=True)]
        starts = [len(s.ids) - 1 for s in seqs]
        every = gen.extend([s.slot for s in seqs], chunks, starts, every=True).float()  # (B, T, V)
        T = every.shape[1]
        out: list[list[int]] = [[] for _ in seqs]
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:  # no draft: the row's last position, sampled as any decode step
            out_plain = gen.sample_next(every[plain, -1], [seqs[i] for i in plain])
            for i, t in zip(plain, out_plain, strict=True):
                out[i] = [t]
        for i, d in enumerate(drafts):
            if d:
                s = seqs[i]
                logits = every[i, T - len(d) - 1 :]  # (len(d) + 1, V): after the last token, then after each draft
                out[i] = self._keep(logits, d, None if q is None else q[i, : len(d)], s)
                self.proposed += len(d)
                self.accepted += len(out[i]) - 1
        for s, toks in zip(seqs, out, strict=True):
            valid = len(s.ids) + len(toks) - 1  # the last token and the draft tokens kept; not the model's own
            gen.rewind(s.slot, valid)
            self.drafter.kept(s, valid)
        return out

    def release(self, seq: Decoding) -> None:
        self.drafter.release(seq)

    @staticmethod
    def _keep(logits: torch.Tensor, draft: list[int], q: torch.Tensor | None, seq: Decoding) -> list[int]:
        """The rejection rule over one row: the draft tokens kept, then the model's own token."""
        p = seq.params
        n = len(draft)
        if p.temperature == 0:
            best = logits.argmax(dim=-1).tolist()
            kept = 0
            while kept < n and draft[kept] == best[kept]:
                kept += 1
            return draft[:kept] + [best[kept]]
        probs = sampling.probabilities(logits, [p] * (n + 1), normalized=True)
        idx = torch.tensor(draft, device=logits.device)
        p_d = probs[torch.arange(n, device=logits.device), idx]
        q_d = torch.ones_like(p_d) if q is None else q[torch.arange(n, device=logits.device), idx]
        u = torch.rand(n, generator=seq.rng, device=logits.device) if seq.rng is not None else torch.rand(
            n, device=logits.device)
        ok = (u * q_d < p_d).tolist()  # u < p / q, without dividing by a q of 0
        kept = 0
        while kept < n and ok[kept]:
            kept += 1
        if kept < n:  # rejected: the residual max(0, p - q) of that position
            row = probs[kept]
            q_row = torch.zeros_like(row).index_fill_(0, idx[kept : kept + 1], 1.0) if q is None else q[kept]
            row = (row - q_row).clamp_min_(0)
            if float(row.sum()) <= 0:  # p == q: the residual is empty, and p itself is the law
                row = probs[kept]
        else:
            row = probs[n]
        token = int(sampling.race(row[None], [seq.rng])[0])
        return draft[:kept] + [token]


def same_tokenizer(model: Tokenizer, draft: Tokenizer, where: str) -> None:
    """Refuse a draft whose tokenizer maps any text to other ids than the model's: its tokens would be another
    language to the model, and none would be kept."""
    a, b = model.get_vocab(with_added_tokens=True), draft.get_vocab(with_added_tokens=True)
    differ = sum(1 for piece, i in b.items() if a.get(piece) != i)  # of the draft's tokens: at most all of them
    lacks = sum(1 for piece in a if piece not in b)
    if differ or lacks:
        what = [f"{differ} of its {len(b)} tokens have other ids or none in the model's {len(a)}"] if differ else []
        what += [f"it lacks {lacks} of the model's {len(a)} tokens"] if lacks else []
        raise UserError(f"{where}: the draft's tokenizer is not the model's ({'; '.join(what)}); a draft must share "
                         "the model's tokenizer: train it on data prepared with the model's (gptopt prepare "
                         "--tokenizer MODEL_DIR)")


def build(cfg: Any, gen: Generator, tokenizer: Tokenizer, plan: DevicePlan) -> Speculator | None:
    """The Speculator a generate or serve config asks for (its speculate, draft_model, num_speculative_tokens,
    dtype and compile), over the model's Generator `gen`; None without speculation. A draft model is loaded now,
    on the model's device and in its dtype, with a Generator of as many slots (its decode compiled with
    --compile)."""
    if cfg.speculate == "none":
        return None
    if cfg.speculate == "ngram":
        return Speculator(NgramDrafter(), cfg.num_speculative_tokens)
    draft, draft_tok = load_for_inference(cfg.draft_model, tokenizer=None, plan=plan, dtype=cfg.dtype,
                                          option="--draft_model")
    same_tokenizer(tokenizer, draft_tok, f"--draft_model {cfg.draft_model}")
    max_len = min(draft.config.block_size, gen.max_len)
    dtype = draft.transformer.wte.weight.dtype
    # The draft's own pool: a sequence's draft holds at most its tokens and the lookahead, and the model's pool
    # bounds the running sequences' tokens, so as many blocks, and a lookahead's more for each sequence, suffice.
    lookahead = -(-cfg.num_speculative_tokens // gen.block_size) + 1
    blocks = gen.num_blocks + gen.max_batch_size * lookahead
    need = memory_check.Estimate({
        "KV cache": generator_memory.pool_bytes(draft.config, blocks, gen.block_size, dtype),
        # a draft prefills a sequence's whole prompt in one forward (ModelDrafter.propose)
        "forward": generator_memory.forward_bytes(draft.config, prefill_chunk=max_len,
                                                  max_batch_size=gen.max_batch_size, max_len=max_len, dtype=dtype)})
    memory_check.require(need, plan.device, f"the draft's KV cache ({blocks:,} blocks of {gen.block_size} tokens)",
                         "use a smaller --draft_model, or a smaller --kv_cache_memory or --max_batch_size")
    log.info("drafting with %s (%.1f M parameters, context %d)", cfg.draft_model,
             sum(p.numel() for p in draft.parameters()) / 1e6, max_len)
    # --compile compiles the draft's decode too: a small model's step is mostly the overhead compiling removes
    drafter = ModelDrafter(Generator(draft, plan, max_batch_size=gen.max_batch_size, max_len=max_len,
                                     kv_blocks=blocks, block_size=gen.block_size, compile=cfg.compile))
    return Speculator(drafter, cfg.num_speculative_tokens)
