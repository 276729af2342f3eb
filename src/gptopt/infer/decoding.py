"""One sequence from its prefill to its end (Decoding): its slot, its tokens, and the one end-of-sequence rule;
Generator.new makes one, admit gives it a slot and blocks, decode_next and sample_next advance a batch of them, end
frees them, and preempt takes them back for a recompute later.

    python -c "from gptopt.infer.decoding import Decoding; help(Decoding.add)"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gptopt.infer.sampling import NO_TOKEN, SamplingParams, TokenLogprob

# Why a sequence ended: a stop token id or stop string ("stop"), its token budget ("length"), or, for a sequence
# its grammar constrains, before its document was complete ("incomplete": a stop string cut it, or no token
# could follow), so that a reply that breaks its schema never ends "stop".
Finish = Literal["stop", "length", "incomplete"]


@dataclass(eq=False)
class Decoding:
    """One sequence from its prefill to its end; `add` is the one end-of-sequence rule.

    Generator.new makes one, the Scheduler admits, prefills, decodes, preempts and ends them: the CLI's token
    generators and the server's engine all use these.
    """

    slot: int  # its row in the Generator's batch (its block table), -1 while it holds none
    params: SamplingParams
    prompt_len: int
    budget: int  # new tokens it may take: max_new_tokens, capped so prompt + new tokens fit the cache
    rng: torch.Generator | None  # Generator.rng(params.seed)
    ids: list[int]  # the prompt, then the new tokens (the repetition penalty's history)
    finish: Finish | None = None
    cached: int = 0  # tokens in the cache so far: prefill_step runs the rest up to `target`, a chunk at a time
    reused: int = 0  # prompt tokens cached blocks gave it at admission (block_pool.py), never computed for it
    preemptions: int = 0  # times it was preempted: its blocks freed, its tokens recomputed when admitted again
    # With params.logprobs: one entry per new token, the stop token that ends it included (OpenAI's
    # legacy completions list it, and lm-eval reads it). With params.prompt_logprobs: one per prompt
    # token after the first (the first has no context to be predicted from), filled as prefill_step runs.
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    pending: TokenLogprob | None = None  # sample_next's entry for the token `add` takes next
    matcher: Any = None  # with params.grammar: the grammar's state after the tokens so far (constrain.Matcher)
    stop_token: int | None = None  # the stop token id that ended it

    @property
    def resumed(self) -> bool:
        """Preempted after its first token: its prefill recomputes its tokens so far, and samples nothing."""
        return self.preemptions > 0 and self.n_new > 0

    @property
    def target(self) -> int:
        """Tokens its prefill puts in the cache: the prompt, or once resumed every token but the last (the next
        decode step feeds that one, as it would have without the preemption)."""
        return len(self.ids) - 1 if self.resumed else self.prompt_len

    @property
    def prefilled(self) -> bool:
        return self.cached >= self.target

    def preempt(self) -> None:
        """Its slot and blocks were taken back (Generator.preempt): it starts again from admission. Its tokens, its
        random generator and its grammar's state stay, so it goes on as it would have."""
        self.slot, self.cached, self.reused = -1, 0, 0
        if self.n_new == 0:  # its prompt is prefilled again from the start, and scored again
            self.prompt_logprobs = []
        self.preemptions += 1

    @property
    def tokens(self) -> list[int]:
        """The new tokens so far."""
        return self.ids[self.prompt_len :]

    @property
    def n_new(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def generated(self) -> int:
        """Tokens the model generated: the new ones and the stop token that ended it, which is not kept (usage's
        completion_tokens, as OpenAI and vLLM count it, and as its logprobs list it)."""
        return self.n_new + (1 if self.stop_token is not None else 0)

    def add(self, token: int) -> Finish | None:
        """Take the next sampled token; why the sequence ends with it, or None while it goes on.
        A stop token id ends it ("stop") and is not kept; the budget's last token ends it ("length"); NO_TOKEN
        (its grammar allowed none) or a token its grammar rejects ends it "incomplete", not kept either."""
        assert self.finish is None, "a finished sequence takes no more tokens"
        entry, self.pending = self.pending, None
        if token == NO_TOKEN or self.matcher is not None and not self.matcher.accept(token):
            self.finish = "incomplete"
            return self.finish
        if entry is not None:  # a stop token's too, as OpenAI and vLLM list it: lm-eval counts on it being there
            self.logprobs.append(entry)
        if token in self.params.stop_token_ids:
            self.finish, self.stop_token = "stop", token
        else:
            self.ids.append(token)
            if self.n_new >= self.budget:
                self.finish = "length"
        return self.finish

    @property
    def stop_reason(self) -> Finish:
        """How it ends if its text reaches a stop string (StopChecker) after its last token: "incomplete" where that
        cuts a constrained document short, else "stop"."""
        return "incomplete" if self.matcher is not None and not self.matcher.is_complete() else "stop"
