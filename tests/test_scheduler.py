"""The scheduler over a paged KV cache: requests admitted as blocks allow, shared prefixes held once, the newest
request preempted when a decode step finds no free block and recomputed to the same output, and no block leaked
whatever the workload.

    pytest -q tests/test_scheduler.py

Models are the debug preset's size with wide random weights (conftest.make_varied_model), fp32 on the CPU, or a
one-layer GPT with a context long enough for 512-token prefixes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import make_varied_model

from gptopt.config import GPTConfig
from gptopt.infer.decoding import Decoding
from gptopt.infer.generator import BLOCK_SIZE, Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import Scheduler, generate
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

VOCAB = 320
CPU = resolve("cpu", quiet=True)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_new_tokens=12)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request: pytest.FixtureRequest) -> GPT:
    return make_varied_model(VOCAB, request.param)


def run(sched: Scheduler, seqs: list[Decoding], cancel: dict[int, int] | None = None) -> list[list[int]]:
    """Every sequence to its end through the scheduler; cancel: sequence index -> tokens after which it is
    dropped, as a client that goes away. The new tokens of each."""
    cancel = cancel or {}
    for s in seqs:
        sched.add(s)
    index = {id(s): i for i, s in enumerate(seqs)}
    while sched.busy:
        sched.admit()
        for step in (sched.prefill, sched.decode):
            for seq, tokens in step():
                for t in [tokens] if isinstance(tokens, int) else tokens or []:
                    if seq.add(t) is not None or cancel.get(index[id(seq)]) == seq.n_new:
                        sched.finish(seq)
                        break
                if tokens is None:
                    sched.finish(seq)
    return [s.tokens for s in seqs]


def alone(model: GPT, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt decoded by itself in a roomy cache: the output the scheduler must keep."""
    gen = Generator(model, CPU, max_batch_size=1, max_len=64)
    return [generate(gen, [p], params)[0] for p in prompts]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_preempted_request_gives_the_output_it_gives_alone(model: GPT, params: SamplingParams) -> None:
    """Four requests in a pool too small for them all: the newest running ones are preempted, freed and
    recomputed later, and every request's tokens are those it has decoded alone."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 5, 7, 3)]
    params = dataclasses.replace(params, max_new_tokens=20)
    gen = Generator(model, CPU, max_batch_size=4, max_len=48, kv_blocks=6, block_size=8, prefix_cache=True)
    sched = Scheduler(gen)
    got = run(sched, [gen.new(p, params) for p in prompts])
    assert sched.preemptions > 0
    assert got == alone(model, prompts, params)
    sched.check_idle()


def test_the_newest_running_request_is_the_one_preempted(model: GPT) -> None:
    gen = Generator(model, CPU, max_batch_size=2, max_len=32, kv_blocks=5, block_size=8)
    sched = Scheduler(gen)
    old, new = gen.new([1] * 15, GREEDY), gen.new([2] * 15, GREEDY)
    sched.add(old)
    sched.add(new)
    assert sched.admit() == [old, new]  # 2 blocks each, one left free (the watermark)
    for seq, t in sched.prefill():
        seq.add(t)
    sched.decode()  # position 15 still fits each one's second block
    for seq in (old, new):
        seq.add(1)
    sched.decode()  # position 16 needs a third block each: the newer request makes room
    assert sched.running == [old] and list(sched.waiting) == [new] and new.slot == -1
    assert sched.preemptions == 1 and new.preemptions == 1


def test_sixteen_requests_sharing_a_512_token_prefix_hold_one_copy_of_it() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=1024, vocab_size=VOCAB)).eval()
    gen = Generator(model, CPU, max_batch_size=16, max_len=1024, kv_blocks=16 * 40, prefix_cache=True)
    sched = Scheduler(gen)
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(512)]
    seqs = [gen.new(prefix + [rng.randrange(VOCAB) for _ in range(8)], GREEDY) for _ in range(16)]
    for s in seqs:
        sched.add(s)
    while any(not s.prefilled for s in seqs):
        sched.admit()
        sched.prefill()
    shared = 512 // BLOCK_SIZE
    assert [s.reused for s in seqs] == [0] + [512] * 15
    assert gen.pool.used == shared + 16  # the prefix's blocks once, and a block of its own for each request
    assert gen.kv_usage() == pytest.approx((shared + 16) / gen.num_blocks)
    assert all(gen.blocks[s.slot][:shared] == gen.blocks[seqs[0].slot][:shared] for s in seqs)
    for s in seqs:
        sched.finish(s)
    sched.check_idle()


def test_a_request_up_to_the_context_is_admitted_once_blocks_are_free(model: GPT) -> None:
    """A prompt of the whole context but one token waits while others hold the blocks, and runs once they end."""
    gen = Generator(model, CPU, max_batch_size=4, max_len=64, kv_blocks=8, block_size=8)
    sched = Scheduler(gen)
    short = [gen.new([5] * 20, GREEDY) for _ in range(2)]
    longest = gen.new([7] * 63, dataclasses.replace(GREEDY, max_new_tokens=4))
    out = run(sched, [*short, longest])
    assert len(out[2]) == 1  # the context ends it after one token
    sched.check_idle()


def test_mixed_workloads_leak_no_block(model: GPT) -> None:
    """Random rounds of requests of random lengths, shared prefixes, samples of one prompt, seeds, cancellations
    and a pool small enough to preempt: after each round every block and slot is free, and the requests that ran
    to their end give the tokens they give alone."""
    rng = random.Random(7)
    gen = Generator(model, CPU, max_batch_size=4, max_len=64, kv_blocks=12, block_size=8, prefix_cache=True)
    base = [rng.randrange(VOCAB) for _ in range(40)]
    preempted = 0
    for _ in range(6):
        prompts, params = [], []
        for _ in range(rng.randrange(2, 7)):
            p = base[: rng.randrange(1, 40)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
            copies = rng.choice([1, 1, 2, 3])  # n > 1: samples of one prompt
            prompts += [p] * copies
            seed = rng.randrange(100)
            params += [dataclasses.replace(rng.choice([GREEDY, SEEDED]), seed=seed,
                                           max_new_tokens=rng.randrange(1, 16))] * copies
        cancel = {i: rng.randrange(1, 4) for i in range(len(prompts)) if rng.random() < 0.2}
        sched = Scheduler(gen, prefill_chunk=rng.choice([8, 32, 512]))
        seqs = [gen.new(p, q) for p, q in zip(prompts, params, strict=True)]
        got = run(sched, seqs, cancel)
        sched.check_idle()
        preempted += sched.preemptions
        for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
            if i not in cancel:
                assert got[i] == alone(model, [p], q)[0], (i, sched.preemptions)
    assert preempted > 0  # the workload did make the scheduler preempt


def run_scored(gen: Generator, prompt: list[int], prefill_chunk: int = 512) -> Decoding:
    """A prompt scored (prompt_logprobs 1, one new token) through a scheduler of its own: its Decoding."""
    seq = gen.new(prompt, SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=1))
    run(Scheduler(gen, prefill_chunk=prefill_chunk), [seq])
    return seq


def test_a_scored_prompt_preempted_while_prefilling_is_scored_once(model: GPT) -> None:
    gen = Generator(model, CPU, max_batch_size=2, max_len=64, kv_blocks=8, block_size=8)
    sched = Scheduler(gen, prefill_chunk=4)
    first = gen.new(list(range(1, 16)), dataclasses.replace(GREEDY, max_new_tokens=40))
    scored = gen.new(list(range(100, 140)), SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=1))
    run(sched, [first, scored])
    assert scored.preemptions >= 1  # the older request's decode took its blocks mid-prefill
    want = run_scored(Generator(model, CPU, max_batch_size=1, max_len=64, block_size=8), list(range(100, 140)))
    assert [e.token for e in scored.prompt_logprobs] == [e.token for e in want.prompt_logprobs]


def test_a_cached_blocks_entries_are_reused_only_where_the_token_after_it_is_the_prompts(model: GPT) -> None:
    """X and Y share 8 tokens (2 blocks of 4), then differ: the entry of a block's last position scores the
    token after it, X's, so Y does not take X's entries for it; Y's own second run reuses its own."""
    context = [10, 11, 12, 13, 14, 15, 16, 17]
    x, y = context + [35, 36, 37, 38, 39], context + [257, 258, 259, 260, 261]
    gen = Generator(model, CPU, max_batch_size=2, max_len=32, block_size=4, prefix_cache=True)
    run_scored(gen, x)
    run_scored(gen, y)
    again = run_scored(gen, y)
    want = run_scored(Generator(model, CPU, max_batch_size=1, max_len=32, block_size=4), y)
    assert again.reused > 0
    for got, ref in zip(again.prompt_logprobs, want.prompt_logprobs, strict=True):
        assert got.token == ref.token and got.logprob == pytest.approx(ref.logprob, abs=1e-4)


def test_a_chat_turn_reuses_the_blocks_of_the_turn_before_it_reply_included(model: GPT) -> None:
    """A conversation resends its history: the next turn's prompt (the last prompt, its reply, a new message) starts
    from the blocks the last turn wrote, its reply's tokens included, not only from its prompt's."""
    gen = Generator(model, CPU, max_batch_size=2, max_len=64, block_size=8, prefix_cache=True)
    first = [3 + i % 50 for i in range(13)]
    (reply,) = generate(gen, [first], dataclasses.replace(GREEDY, max_new_tokens=20))
    turn = gen.new(first + reply + [7, 8, 9], GREEDY)
    run(Scheduler(gen), [turn])
    written = len(first) + len(reply) - 1  # the reply's last token was sampled, never written
    assert turn.reused == written // 8 * 8 > len(first)
