"""Prefix caching: a prompt that shares its first full KV blocks with one the cache holds prefills only the rest,
with the output it has without the cache, and shares those blocks by reference; the least recently freed blocks are
reclaimed first; /metrics counts the hits.

    pytest -q tests/test_prefix_cache.py

Every model is the debug preset's size with wide random weights (conftest.make_varied_model), fp32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Any

import pytest
import torch
from conftest import make_varied_model

from gptopt.infer.generator import BLOCK_SIZE, Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import complete
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
VOCAB = 320


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request: pytest.FixtureRequest) -> GPT:
    return make_varied_model(VOCAB, request.param)


def prompts_sharing(rng: random.Random, prefix: list[int], n: int, suffix: int = 5) -> list[list[int]]:
    return [prefix + [rng.randrange(VOCAB) for _ in range(suffix)] for _ in range(n)]


def reused_by(gen: Generator, prompts: list[list[int]], params: SamplingParams = GREEDY
              ) -> tuple[list[list[int]], list[int], list[int]]:
    """complete()'s tokens of each prompt, the prompt tokens each took from the cache, and the slot each took."""
    seqs: list[Any] = []
    slots: list[int] = []
    new, admit = gen.new, gen.admit

    def spy_new(prompt: list[int], p: SamplingParams) -> Any:
        seqs.append(new(prompt, p))
        return seqs[-1]

    def spy_admit(seq: Any, **kw: Any) -> bool:
        ok = admit(seq, **kw)
        if ok:
            slots.append(seq.slot)
        return ok

    gen.new, gen.admit = spy_new, spy_admit  # type: ignore[method-assign]
    try:
        out = complete(gen, prompts, params)
    finally:
        del gen.new, gen.admit
    return [ids for ids, _ in out], [s.reused for s in seqs], slots


def bucketed(gen: Generator) -> Generator:
    """The Generator decoding whole buckets, as compiled or CUDA-graphed decodes do (the rows not asked for write
    at their slot's next position, in a block of their own or NULL_BLOCK), with the eager step standing in for the
    graph."""
    gen._step = gen._decode_rows
    return gen


@pytest.mark.parametrize("bucket", [False, True], ids=["eager", "bucketed"])
def test_a_cached_prefix_gives_the_tokens_a_whole_prefill_gives(model: GPT, bucket: bool) -> None:
    """Batches of prompts sharing prefixes of several lengths, with finished and running sequences' prefixes
    reused: greedy tokens equal to the same batches without the cache, and most prompt tokens came from it."""
    rng = random.Random(0)
    base = [rng.randrange(VOCAB) for _ in range(40)]
    batches = [prompts_sharing(rng, base[:n], 3) for n in (40, 40, 25, 33, 40)]
    batches.insert(2, [[rng.randrange(VOCAB) for _ in range(30)]])  # nothing shared
    plan = resolve("cpu", quiet=True)
    cold = Generator(model, plan, max_batch_size=4, max_len=64)
    warm = Generator(model, plan, max_batch_size=4, max_len=64, prefix_cache=True)
    if bucket:
        cold, warm = bucketed(cold), bucketed(warm)
    reused = []
    for prompts in batches:
        want = reused_by(cold, prompts)[0]
        got, used, _ = reused_by(warm, prompts)
        assert got == want
        reused += used
    assert sum(reused) > 0.5 * sum(len(p) for b in batches[1:] for p in b), reused


def test_a_bucketed_step_leaves_the_prefix_of_a_slot_it_runs_idle_intact(model: GPT) -> None:
    """Of three sequences the middle one ends first, as the engine frees a slot, while the two beside it decode
    on, their bucket running its slot idle: what it holds stays intact, and a prompt that reuses it gets a whole
    prefill's tokens."""
    rng = random.Random(4)
    batch = [[rng.randrange(VOCAB) for _ in range(n)] for n in (10, 40, 10)]
    plan = resolve("cpu", quiet=True)
    warm = bucketed(Generator(model, plan, max_batch_size=4, max_len=64, prefix_cache=True))
    seqs, logits = warm.begin_many(batch, GREEDY)
    for s, t in zip(seqs, warm.sample_next(logits, seqs), strict=True):
        s.add(t)
    warm.end(seqs[1])
    going = [seqs[0], seqs[2]]
    for _ in range(4):
        for s, t in zip(going, warm.sample_next(warm.decode_next(going), going), strict=True):
            s.add(t)
    for s in going:
        warm.end(s)
    probe = [batch[1][:30] + [1, 2]]
    got, used, _ = reused_by(warm, probe)
    assert used == [BLOCK_SIZE]  # its first full block: the second holds other tokens from position 30 on
    assert got == reused_by(Generator(model, plan, max_batch_size=4, max_len=64), probe)[0]


def test_seeded_sampling_is_the_same_with_a_cached_prefix(model: GPT) -> None:
    rng = random.Random(1)
    prompts = prompts_sharing(rng, [rng.randrange(VOCAB) for _ in range(30)], 2)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=10)
    plan = resolve("cpu", quiet=True)
    warm = Generator(model, plan, max_batch_size=2, max_len=64, prefix_cache=True)
    first = reused_by(warm, prompts[:1], params)[0]
    again, used, _ = reused_by(warm, prompts[:1], params)
    assert used == [(len(prompts[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE] and again == first
    cold = Generator(model, plan, max_batch_size=2, max_len=64)
    assert reused_by(warm, prompts[1:], params)[0] == reused_by(cold, prompts[1:], params)[0]


def test_samples_of_one_prompt_prefill_it_once(model: GPT) -> None:
    """n prompts alike in one batch (n samples, lm-eval's choices of one context): the first prefills it, the others
    wait one forward and share its full blocks, computing only the tokens after them."""
    prompt = list(range(3, 43))
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=4, max_len=64, prefix_cache=True)
    widths = []
    extend = gen.extend

    def spy(slots: list[int], chunks: list[list[int]], starts: list[int], **kw: Any) -> torch.Tensor:
        widths.append(sum(len(c) for c in chunks))
        return extend(slots, chunks, starts, **kw)

    gen.extend = spy  # type: ignore[method-assign]
    tokens, used, _ = reused_by(gen, [prompt] * 4)
    full = 39 // BLOCK_SIZE * BLOCK_SIZE
    assert used == [0, full, full, full] and sum(widths) == 40 + 3 * (40 - full)
    assert tokens == [tokens[0]] * 4


def test_the_least_recently_freed_prefix_is_reclaimed_first(model: GPT) -> None:
    """A pool of 8 blocks, three prompts of 3 blocks each, one at a time: the third reclaims the first one's
    blocks, and the two newest prefixes are still found."""
    rng = random.Random(2)
    a, b, c = ([rng.randrange(VOCAB) for _ in range(2 * BLOCK_SIZE)] for _ in range(3))
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=2, max_len=64, kv_blocks=8, prefix_cache=True)
    for p in (a, b, c):
        assert reused_by(gen, [p + [1]])[1] == [0]
    _, used, _ = zip(*(reused_by(gen, [p + [2]]) for p in (c, b, a)), strict=True)
    assert used == ([len(c)], [len(b)], [0])


def test_no_cache_reuses_nothing(model: GPT) -> None:
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=2, max_len=64)
    prompt = list(range(3, 40))
    reused_by(gen, [prompt])
    assert reused_by(gen, [prompt])[1] == [0]


def _scored(gen: Generator, prompt: list[int], k: int) -> Any:
    """The prompt scored alone (max_new_tokens 0, as lm-evaluation-harness asks): its Decoding."""
    seqs, _ = gen.begin_many([prompt], dataclasses.replace(GREEDY, prompt_logprobs=k, max_new_tokens=0))
    gen.end(seqs[0])
    return seqs[0]


def test_a_scored_prompt_reuses_only_a_scored_prefix_and_gets_its_log_probabilities(model: GPT) -> None:
    """lm-evaluation-harness scores each choice of a question as context + choice: a choice after the first reuses
    the context with its prompt log-probabilities, the same as a whole prefill's; a prefix nobody scored, or
    scored with fewer alternatives, is prefilled again."""
    rng = random.Random(5)
    context = [rng.randrange(VOCAB) for _ in range(30)]
    choices = [context + [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 3, 4)]
    plan = resolve("cpu", quiet=True)
    warm = Generator(model, plan, max_batch_size=2, max_len=64, prefix_cache=True)
    cold = Generator(model, plan, max_batch_size=2, max_len=64)
    reused_by(warm, [choices[0]])  # generated, not scored
    first = _scored(warm, choices[0], 2)
    assert first.reused == 0
    for prompt in choices[1:]:
        got, want = _scored(warm, prompt, 2), _scored(cold, prompt, 2)
        assert got.reused == len(context) // BLOCK_SIZE * BLOCK_SIZE  # the context's full blocks
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(prompt) - 1
        for a, b in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert _scored(warm, choices[2] + [1], 3).reused == 0  # 3 alternatives: the cached entries have 2


def test_a_cancelled_request_frees_its_slot_and_leaves_its_prefix(model: GPT, debug_tokenizer: Any) -> None:
    """A request cancelled while decoding gives its slot and blocks back within an iteration; its full blocks are a
    prefix the next request reuses; the engine's /metrics counters count the tokens looked up and reused."""
    pytest.importorskip("prometheus_client")
    from gptopt.serve.engine import Engine
    from gptopt.serve.metrics import ServeMetrics

    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=2, max_len=64, prefix_cache=True)
    metrics = ServeMetrics(http=False)
    engine = Engine(gen, debug_tokenizer, metrics=metrics, solo_threads=1)
    prompt = list(range(3, 43))
    started, finished = threading.Event(), threading.Event()

    def first(ev: Any) -> None:
        started.set()
        if ev.finish_reason is not None:
            finished.set()

    engine.start()
    try:
        slow = engine.submit(prompt, dataclasses.replace(GREEDY, max_new_tokens=20), first)
        assert started.wait(30)
        slow.cancel()
        assert finished.wait(30)
        assert gen.free_slots == 2
        done = threading.Event()
        nxt = engine.submit(prompt[:30] + [7, 8], GREEDY, lambda ev: done.set() if ev.finish_reason else None)
        assert done.wait(30)
    finally:
        engine.shutdown(timeout=5)
    assert nxt.seq is not None and nxt.seq.reused == BLOCK_SIZE
    gen.pool.check_idle()
    text = metrics.render().decode()
    assert f"gptopt_prefix_cache_hits_total {BLOCK_SIZE}.0" in text
    assert f"gptopt_prefix_cache_queries_total {len(prompt) + 32}.0" in text
