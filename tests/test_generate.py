"""Generation: cached decoding equals uncached, batching and slots change nothing, sampling, stop text, CLI.

    pytest -q tests/test_generate.py

Every model is the debug preset with random weights (fp32, CPU) and train_data's byte-level BPE.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_draws_follow, exact_distribution
from tokenizers import Tokenizer

from gptopt import cli
from gptopt.commands import generate as gen_mod
from gptopt.config import GenerateConfig
from gptopt.data.tokenizer import eot_id
from gptopt.infer.decode_graphs import GraphedDecode
from gptopt.infer.decoding import Decoding
from gptopt.infer.generator import Generator, complete, generate, stream
from gptopt.infer.load import load_for_inference
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.stop import StopChecker
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

CPU = resolve("cpu")
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
PROMPTS = [[5, 17, 99, 4, 200, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [120, 3, 64]]


@torch.no_grad()
def uncached_greedy(model: GPT, prompt: list[int], n: int) -> list[int]:
    idx = torch.tensor([prompt])
    for _ in range(n):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0, len(prompt) :].tolist()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_cached_greedy_equals_uncached_greedy(varied_model: GPT, attention: str) -> None:
    model = GPT(dataclasses.replace(varied_model.config, attention=attention)).eval()
    model.load_state_dict(varied_model.state_dict())
    ref = uncached_greedy(model, PROMPTS[0], 40)
    assert len(set(ref)) > 5  # a varied sequence, not one token repeated
    assert generate(Generator(model, CPU), [PROMPTS[0]], dataclasses.replace(GREEDY, max_new_tokens=40)) == [ref]


def test_prompt_alone_equals_the_prompt_in_a_batch_of_other_lengths(varied_model: GPT) -> None:
    alone = [generate(Generator(varied_model, CPU, max_batch_size=1), [p], GREEDY)[0] for p in PROMPTS]
    assert generate(Generator(varied_model, CPU, max_batch_size=4), PROMPTS, GREEDY) == alone
    # More prompts than slots: decoded in groups, same tokens.
    assert generate(Generator(varied_model, CPU, max_batch_size=3), PROMPTS, GREEDY) == alone


def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(varied_model: GPT) -> None:
    """A long prompt prefilled a few tokens a forward, beside others in the same forwards, decodes the same."""
    alone = [generate(Generator(varied_model, CPU, max_batch_size=1), [p], GREEDY)[0] for p in PROMPTS]
    for chunk in (1, 3, 5, 16):
        gen = Generator(varied_model, CPU, max_batch_size=4)
        seqs, logits = gen.begin_many(PROMPTS, GREEDY, chunk=chunk)
        assert all(s.cached == len(p) for s, p in zip(seqs, PROMPTS, strict=True))
        out = [[t] for t in gen.sample_next(logits, seqs)]
        for _ in range(GREEDY.max_new_tokens - 1):
            for s, o in zip(seqs, out, strict=True):
                s.add(o[-1])
            for o, t in zip(out, gen.sample_next(gen.decode_next(seqs), seqs), strict=True):
                o.append(t)
        assert out == alone, f"chunk {chunk}"


def test_a_prefill_step_stays_within_its_token_budget_and_finishes_in_order(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU, max_batch_size=4)
    long, short = gen.open(PROMPTS[2], GREEDY), gen.open(PROMPTS[1], GREEDY)  # 17 tokens, then 1
    done, logits = gen.prefill_step([long, short], 8)  # the long one takes the whole budget
    assert (done, long.cached, short.cached, logits.shape[0]) == ([], 8, 0, 0)
    done, _ = gen.prefill_step([long, short], 8)
    assert (done, long.cached, short.cached) == ([], 16, 0)
    done, logits = gen.prefill_step([long, short], 8)  # the last token of the long one beside the short one
    assert done == [long, short] and logits.shape == (2, varied_model.config.vocab_size)
    with pytest.raises(ValueError, match="already prefilled"):
        gen.prefill_step([long], 8)


def test_greedy_equals_hugging_face_greedy(varied_model: GPT) -> None:
    pytest.importorskip("transformers")
    from gptopt.models.hf import to_hf_model

    hf_model = to_hf_model(varied_model).eval()
    idx = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ref = hf_model.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, max_new_tokens=20,
                                pad_token_id=0)
    ours = generate(Generator(varied_model, CPU), [PROMPTS[0]], dataclasses.replace(GREEDY, max_new_tokens=20))
    assert ours[0] == ref[0, idx.shape[1] :].tolist()


def test_decode_of_slots_at_different_positions_equals_separate_generation(varied_model: GPT) -> None:
    """The engine's use: sequences join at different times, sit in any slots, decode together."""
    a, b = PROMPTS[0], PROMPTS[2]
    ref_a, ref_b = (generate(Generator(varied_model, CPU, max_batch_size=1), [p], GREEDY)[0] for p in (a, b))
    gen = Generator(varied_model, CPU, max_batch_size=4)
    params, rng = [GREEDY], [None]
    out_a = [gen.sample(gen.prefill(3, a)[None], params, [a], rng)[0]]
    for _ in range(5):  # `a` runs alone for a while in slot 3 ...
        out_a += gen.sample(gen.decode([3], [out_a[-1]], [len(a) + len(out_a) - 1]), params, [a + out_a], rng)
    out_b = [gen.sample(gen.prefill(0, b)[None], params, [b], rng)[0]]  # ... then `b` joins in slot 0
    for _ in range(GREEDY.max_new_tokens - len(out_b)):
        logits = gen.decode([3, 0], [out_a[-1], out_b[-1]], [len(a) + len(out_a) - 1, len(b) + len(out_b) - 1])
        ta, tb = gen.sample(logits, params * 2, [a + out_a, b + out_b], rng * 2)
        out_a.append(ta)
        out_b.append(tb)
    assert out_a[: len(ref_a)] == ref_a
    assert out_b == ref_b


def test_the_same_seed_gives_the_same_sample_and_another_seed_another(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU, max_batch_size=4)
    params = SamplingParams(temperature=1.0, top_k=None, max_new_tokens=20, seed=123)
    first = generate(gen, [PROMPTS[0]], params)
    assert generate(gen, [PROMPTS[0]], params) == first
    # Each sequence has its own generator: the same sample alone or among other prompts.
    assert generate(gen, [PROMPTS[1], PROMPTS[0]], params)[1] == first[0]
    assert generate(gen, [PROMPTS[0]], dataclasses.replace(params, seed=124)) != first


def _decode_together(gen: Generator, rows: list[tuple[list[int], SamplingParams, int]]) -> list[list[int]]:
    """Each (prompt, params, step it joins at) decoded in one batch, as the server's engine batches requests:
    a row joins the running ones at its step and leaves when it ends. Each row's new tokens."""
    seqs: dict[int, Decoding] = {}
    running: dict[int, Decoding] = {}
    step = 0
    while step <= max(at for *_, at in rows) or running:
        if running:  # one decode step of the rows already running
            ids = list(running)
            logits = gen.decode_next([running[i] for i in ids])
            for i, token in zip(ids, gen.sample_next(logits, [running[i] for i in ids]), strict=True):
                if running[i].add(token) is not None:
                    gen.end(running.pop(i))
        for i, (prompt, params, at) in enumerate(rows):  # then the rows that join at this step
            if at == step:
                seq, logits = gen.begin(prompt, params)
                seqs[i] = running[i] = seq
                if seq.add(gen.sample_next(logits[None], [seq])[0]) is not None:
                    gen.end(running.pop(i))
        step += 1
    return [seqs[i].tokens for i in range(len(rows))]


def test_a_seeded_row_gives_the_same_tokens_alone_and_in_any_batch(varied_model: GPT, debug_tokenizer: Any) -> None:
    """The sampler draws each row from its own settings and generator only: a request with a seed gets the same
    text whatever shares its batch (other top_k, top_p, temperature, penalties, grammars, lengths, join times)."""
    grammars = None
    if importlib.util.find_spec("llguidance") is not None:
        from gptopt.infer.constrain import Grammars
        grammars = Grammars(debug_tokenizer, eot_id(debug_tokenizer), varied_model.config.vocab_size)
    gen = Generator(varied_model, CPU, max_batch_size=6, grammars=grammars)
    seeded = [SamplingParams(temperature=1.0, top_k=k, top_p=p, max_new_tokens=12, seed=11)
              for k, p in ((5, 1.0), (None, 1.0), (None, 0.9), (40, 0.8))]
    others = [SamplingParams(temperature=1.0, top_k=None, max_new_tokens=16),
              SamplingParams(temperature=0.7, top_k=200, top_p=0.5, max_new_tokens=5),
              SamplingParams(temperature=0, max_new_tokens=9, repetition_penalty=2.0),
              SamplingParams(temperature=1.3, top_k=2, presence_penalty=1.0, frequency_penalty=0.5, max_new_tokens=20,
                             seed=3)]
    if grammars is not None:  # a constrained row masks its own logits only
        from gptopt.infer.constrain import grammar_for
        others.append(SamplingParams(temperature=1.0, max_new_tokens=10, grammar=grammar_for({"type": "json_object"})))
    for params in seeded:
        alone = _decode_together(gen, [(PROMPTS[0], params, 0)])[0]
        assert len(alone) == 12
        mixes = [[(PROMPTS[1], others[0], 0), (PROMPTS[0], params, 0)],
                 [(PROMPTS[2], others[1], 0), (PROMPTS[1], others[2], 1), (PROMPTS[0], params, 2)],
                 [(PROMPTS[0], params, 0), *[(PROMPTS[j % len(PROMPTS)], o, j) for j, o in enumerate(others)]]]
        for mix in mixes:
            got = _decode_together(gen, mix)
            assert got[[r[1] for r in mix].index(params)] == alone, (params, mix)


def test_top_k_1_and_a_tiny_top_p_equal_greedy(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU, max_batch_size=4)
    greedy = generate(gen, PROMPTS, GREEDY)
    sampled = dataclasses.replace(GREEDY, temperature=1.5, seed=0)
    assert generate(gen, PROMPTS, dataclasses.replace(sampled, top_k=1)) == greedy
    assert generate(gen, PROMPTS, dataclasses.replace(sampled, top_k=None, top_p=1e-6)) == greedy


def test_kept_sets_are_the_smallest_most_likely_however_wide_and_whatever_their_batch() -> None:
    """A top-k or top-p row's kept set is looked for among its largest logits first (a partial sort) and its whole
    vocabulary is sorted only for a wider set: nuclei of a few tokens, of hundreds and of thousands, top-k sets
    whose k-th logit ties with tokens beyond the candidates, with and without each other, each give the
    distribution computed directly, alone and in one batch."""
    from gptopt.infer.sampling import CANDIDATES, probabilities

    torch.manual_seed(3)
    V = 8192
    randn = lambda scale: torch.randn(V) * scale  # noqa: E731
    settings = [(1.0, None, 0.9, randn(6.0)), (1.0, None, 0.9, randn(3.0)), (1.0, None, 0.9, randn(0.3)),
                (0.7, 50, 0.8, randn(3.0)), (1.0, 2000, 0.95, randn(0.3)), (1.3, None, 0.5, randn(3.0)),
                (1.0, 100, 1.0, randn(3.0)),
                # ties: the k-th largest logit shared by tens of tokens, by a thousand and more, by every token;
                (1.0, 50, 1.0, randn(2.0).round()), (0.8, 60, 0.9, randn(0.5).round()), (1.0, 5, 1.0, randn(0.0)),
                # and a nucleus whose last token ties with every token beyond the first ten
                (1.0, None, 0.155, torch.cat([torch.full((10,), 5.0), torch.zeros(V - 10)]))]
    logits = torch.stack([x for *_, x in settings])
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p, _ in settings]
    batch = probabilities(logits, params, normalized=True)
    widths = []
    for i, (t, k, p, _) in enumerate(settings):
        want = exact_distribution(logits[i], t, k, p)
        alone = probabilities(logits[i : i + 1], [params[i]], normalized=True)[0]
        assert torch.equal(batch[i] > 0, want > 0) and torch.equal(alone > 0, want > 0), i
        assert torch.allclose(batch[i], want) and torch.allclose(alone, want), i
        widths.append(int((want > 0).sum()))
    # every stage was taken: the first candidates, the wider ones, and the whole sort; and ties beyond 64 and 1,024
    small, large = CANDIDATES
    assert min(widths) <= small < max(w for w in widths if w <= large) and max(widths) > large, widths
    assert small < widths[7] <= large < widths[8] and widths[9] == widths[10] == V, widths


def _wide_logits() -> torch.Tensor:
    """8 likely tokens holding about 40% of the mass, then 4,088 of graded small logits: a top-p of 0.7 keeps the
    8 and about 2,000 of the rest, wider than every candidate stage."""
    return torch.cat([torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0]) + 5.5, torch.linspace(1.0, 0.0, 4088)])


@pytest.mark.parametrize(("vocab", "temperature", "top_k", "top_p"), [
    ("8", 1.0, None, 1.0), ("8", 0.6, None, 1.0), ("8", 1.0, 3, 1.0), ("8", 1.0, None, 0.7), ("8", 1.3, 4, 0.8),
    ("wide", 1.0, None, 1.0), ("wide", 1.0, 3, 1.0), ("wide", 1.0, None, 0.3), ("wide", 1.0, None, 0.7),
    ("wide", 1.3, 4, 0.8), ("wide", 1.0, 2000, 1.0)])
def test_sampled_tokens_follow_the_distribution_their_settings_define(vocab: str, temperature: float,
                                                                      top_k: int | None, top_p: float) -> None:
    """20,000 draws of one row's settings, in batches mixed with rows of other settings: no token outside the
    distribution computed directly is drawn, and the frequencies pass a chi-square test (p = 0.001) against it,
    token by token over its 8 likely tokens and the rest as one. Over 8 tokens every setting sorts; over 4,096 the
    top-k and peaked top-p rows draw among their candidates, the wide nucleus races first, top_k 2,000 sorts."""
    from gptopt.infer.sampling import pick

    torch.manual_seed(7)
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0]) if vocab == "8" else _wide_logits()
    want = exact_distribution(logits, temperature, top_k, top_p)
    mine = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    other = SamplingParams(temperature=0.9, top_k=2, top_p=0.5, max_new_tokens=1)
    params = [mine, other] * 500
    counts = torch.zeros(len(logits))
    for _ in range(40):
        tokens = pick(logits.repeat(len(params), 1), params, [[]] * len(params), [None] * len(params))
        counts += torch.bincount(tokens[0::2], minlength=len(logits)).float()
    assert counts.sum() == 20_000
    assert_draws_follow(counts, want)


def test_a_seeded_row_draws_the_same_token_alone_and_beside_rows_that_change_its_stages() -> None:
    """Over a large vocabulary a top-k or top-p row is settled by whichever candidate stage first holds its kept
    set, and the stages' widths follow the batch's largest top_k: a seeded row draws the same token alone and
    beside plain rows, greedy rows and rows of other top_k, its set peaked, tied at the k-th logit or too wide for
    any candidates."""
    from gptopt.infer.sampling import pick

    torch.manual_seed(5)
    V = 4096
    kinds = {"peaked": torch.randn(V) * 4, "ties": (torch.randn(V) * 3).round(), "wide": _wide_logits()}
    mine = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in ((20, 1.0), (None, 0.9), (None, 0.7),
                                                                           (300, 0.95), (5, 0.5))]
    others = [SamplingParams(temperature=1.0, top_k=None), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_k=900), SamplingParams(temperature=1.0, top_k=3000, top_p=0.2)]

    def draws(rows: list[tuple[torch.Tensor, SamplingParams, int | None]]) -> list[int]:
        gens = [None if s is None else torch.Generator().manual_seed(s) for *_, s in rows]
        return pick(torch.stack([x for x, *_ in rows]), [p for _, p, _ in rows], [[]] * len(rows), gens).tolist()

    drawn = set()
    for (name, logits), params in ((kv, p) for kv in kinds.items() for p in mine):
        for seed in range(4):
            alone = draws([(logits, params, seed)])[0]
            drawn.add((name, alone))
            for j in range(len(others)):
                mix = [(torch.randn(V) * 2, o, None) for o in others[j:]] + [(logits, params, seed)]
                assert draws(mix)[-1] == alone, (name, params, seed, others[j:])
    assert len(drawn) > 10  # the seeds draw different tokens: the equality is not a constant's


def test_a_seeded_row_at_the_edge_of_its_nucleus_draws_alike_whatever_the_batchs_top_k() -> None:
    """A top_p that falls where two ways of summing the mass before the nucleus's last token differ in their last
    bit: alone, the row's nucleus is wider than its first candidates; beside a top_k 900 row the candidates are
    900. Its way to its token is its own either way, so the seed draws the same token."""
    from gptopt.infer.sampling import pick

    V = 4096
    torch.manual_seed(11)
    x = torch.cat([torch.tensor([5.5]), torch.randn(V - 1) * 0.5 - 1.0])
    mine = SamplingParams(temperature=1.0, top_k=None, top_p=0.33076757192611694)
    other = SamplingParams(temperature=1.0, top_k=900)
    for seed in (295, *range(20)):
        alone = pick(x[None], [mine], [[]], [torch.Generator().manual_seed(seed)])
        beside = pick(torch.stack([x, torch.zeros(V)]), [mine, other], [[]] * 2,
                      [torch.Generator().manual_seed(seed), None])
        assert int(alone[0]) == int(beside[0]), seed


def test_sample_applies_each_rows_own_settings(debug_model: GPT) -> None:
    gen = Generator(debug_model, CPU, max_batch_size=4)
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0, -2.0]]).repeat(4, 1)
    seen = [[1], [1], [1, 3], []]
    params = [SamplingParams(temperature=0),  # greedy: token 1
              SamplingParams(temperature=0, repetition_penalty=2.0),  # 3.0 / 2 < 2.5: token 2
              SamplingParams(temperature=0, repetition_penalty=2.0),  # the negative -1.0 becomes -2.0: still token 2
              SamplingParams(temperature=1.0, top_k=2, seed=0)]  # only tokens 1 and 2 can come
    draws = {gen.sample(logits, params, seen, [None, None, None, gen.rng(s)])[3] for s in range(40)}
    assert gen.sample(logits, params, seen, [None] * 4)[:3] == [1, 2, 2]
    assert draws == {1, 2}


def test_repetition_penalty_changes_greedy_output_on_a_repetitive_prompt(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU)
    prompt = [11, 12, 13] * 6
    plain = generate(gen, [prompt], GREEDY)[0]
    penalised = generate(gen, [prompt], dataclasses.replace(GREEDY, repetition_penalty=5.0))[0]
    assert penalised != plain
    # Every token the model saw is discouraged: the penalised text repeats fewer of them.
    assert len(set(penalised)) > len(set(plain))


def test_stop_token_ids_end_a_sequence_and_are_not_returned(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU)
    full = generate(gen, [PROMPTS[0]], GREEDY)[0]
    stop = full[5]
    ((ids, reason),) = complete(gen, [PROMPTS[0]], dataclasses.replace(GREEDY, stop_token_ids=(stop,)))
    assert (ids, reason) == (full[: full.index(stop)], "stop")
    assert complete(gen, [PROMPTS[0]], GREEDY)[0][1] == "length"


def test_prompts_that_do_not_fit_are_refused(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU, max_len=16)
    with pytest.raises(ValueError, match="at most 15 fit"):
        generate(gen, [[1] * 16], GREEDY)
    assert len(generate(gen, [[1] * 15], GREEDY)[0]) == 1  # the context ends the sequence
    with pytest.raises(ValueError, match="max_len must be in 2..64"):
        Generator(varied_model, CPU, max_len=65)
    with pytest.raises(ValueError, match="positions must be in 0..15"):
        gen.decode([0], [1], [16])


def test_leaving_a_stream_early_frees_its_slot(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU, max_batch_size=1)
    tokens = stream(gen, PROMPTS[0], GREEDY)
    first = [next(tokens), next(tokens)]
    tokens.close()
    assert list(stream(gen, PROMPTS[0], GREEDY))[:2] == first  # the one slot is free again


# ----------------------------------------------------------------------------------------------
# Text: stop strings and UTF-8 across token boundaries


def feed(checker: StopChecker, ids: list[int]) -> list[str]:
    chunks = []
    for t in ids:
        chunks.append(checker.add(t))
        if checker.stopped:
            break
    return chunks + [checker.finish()]


def test_stop_string_across_token_boundaries(debug_tokenizer: Tokenizer) -> None:
    text = "def parse(args):\n    return args\n\nclass Parser:\n"
    ids = debug_tokenizer.encode(text).ids
    assert "\n\n" not in [debug_tokenizer.decode([t]) for t in ids]  # the stop spans tokens
    checker = StopChecker(debug_tokenizer, stop=("rn a", "\n\nclass"))
    assert "".join(feed(checker, ids)) == "def parse(args):\n    retu"
    assert checker.stopped and checker.text == "def parse(args):\n    retu"


def test_text_ending_in_a_stop_prefix_is_emitted_at_the_end(debug_tokenizer: Tokenizer) -> None:
    checker = StopChecker(debug_tokenizer, stop=("\n\n\n",))
    chunks = feed(checker, debug_tokenizer.encode("x = 1\n\n").ids)
    assert chunks[-1].endswith("\n\n") and "".join(chunks) == "x = 1\n\n" and not checker.stopped


def test_no_broken_utf8_when_a_character_spans_tokens(debug_tokenizer: Tokenizer) -> None:
    text = "naïve café 😀 ok 🚀!"
    ids = debug_tokenizer.encode(text).ids
    assert any("\ufffd" in debug_tokenizer.decode([t]) for t in ids)  # emoji bytes are separate tokens
    chunks = feed(StopChecker(debug_tokenizer), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
    assert "".join(feed(StopChecker(debug_tokenizer, stop=("🚀",)), ids)) == "naïve café 😀 ok "


def test_streamed_text_holds_back_exactly_the_tail_that_may_begin_a_stop_string(debug_tokenizer: Tokenizer) -> None:
    """After every token, what is shown is the text so far less its longest end that begins a stop string:
    nothing of a stop string leaks, and nothing more waits than must (many and long stop strings too)."""
    g = torch.Generator().manual_seed(0)
    alphabet = "ab\n "
    for _ in range(30):
        draw = torch.randint(len(alphabet), (120,), generator=g).tolist()
        text = "".join(alphabet[i] for i in draw)
        stops = tuple("".join(alphabet[i] for i in torch.randint(len(alphabet), (int(n),), generator=g).tolist())
                      for n in torch.randint(2, 9, (12,), generator=g))
        checker, shown = StopChecker(debug_tokenizer, stop=stops), ""
        ids = debug_tokenizer.encode(text).ids
        for k, t in enumerate(ids, 1):
            shown += checker.add(t)
            if checker.stopped:
                break
            so_far = debug_tokenizer.decode(ids[:k])
            hold = max((n for s in stops for n in range(1, len(s)) if so_far.endswith(s[:n])), default=0)
            assert shown == so_far[: len(so_far) - hold]
        shown += checker.finish()
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        assert shown == text[:cut]


def test_sampling_params_from_config_decodes_escapes() -> None:
    params = SamplingParams.from_config(GenerateConfig(stop="\\n\\nclass", temperature=0.0))
    assert params.stop == ("\n\nclass",) and params.temperature == 0.0
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


# ----------------------------------------------------------------------------------------------
# Loading and the CLI


def greedy_cli(model: Path | str, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--device", "cpu", "--temperature", "0", "--max_new_tokens", "12",
            *extra]


def test_cli_prompt_argument_streams_the_completion(model_dir: Path, debug_tokenizer: Tokenizer,
                                                    varied_model: GPT, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(greedy_cli(model_dir, "def f(x):")) == 0
    out, err = capsys.readouterr()
    ids = debug_tokenizer.encode("def f(x):").ids
    eot = debug_tokenizer.token_to_id("<|endoftext|>")  # the CLI stops at the end of a document
    params = dataclasses.replace(GREEDY, max_new_tokens=12, stop_token_ids=(eot,))
    expected = generate(Generator(varied_model, CPU), [ids], params)[0]
    assert out == debug_tokenizer.decode(expected) + "\n"
    assert "tokens/s" in err


def test_cli_reads_the_prompt_from_stdin_and_stops_at_a_stop_string(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n"))
    assert cli.main(greedy_cli(model_dir, "-")) == 0
    full = capsys.readouterr().out.removesuffix("\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):"))  # same prompt: the newline echo adds is dropped
    stop = full[4:7]
    assert cli.main(greedy_cli(model_dir, "--stop", stop)) == 0
    assert capsys.readouterr().out == full[: full.index(stop)] + "\n"


def test_cli_batch_mode_writes_jsonl_and_refuses_to_overwrite(model_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["import os", "def main():", "x", "class A:", "# comment"]
    (tmp_path / "in.txt").write_text("\n".join(prompts) + "\n\n")
    lines = (json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts))
    (tmp_path / "in.jsonl").write_text("".join(lines))
    out = tmp_path / "out.jsonl"
    assert cli.main(greedy_cli(model_dir, "--input", str(tmp_path / "in.txt"), "--output", str(out),
                               "--batch_size", "2")) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert all(r["tokens"] == 12 and r["finish_reason"] == "length" and r["completion"] for r in rows)
    assert "generate" in capsys.readouterr().err  # the progress bar
    # The same prompts from .jsonl, another batch size: the same greedy completions.
    assert cli.main(greedy_cli(model_dir, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "b.jsonl"),
                               "--batch_size", "3")) == 0
    assert [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()] == rows
    with pytest.raises(ValueError, match="out.jsonl exists; nothing was written: pass --overwrite"):
        gen_mod.main(GenerateConfig(model=str(model_dir), input=str(tmp_path / "in.txt"), output=str(out)))


def test_overwrite_replaces_an_output_file_only_when_the_new_one_is_complete(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in.txt").write_text("import os\ndef main():\nx\n")
    out = tmp_path / "out.jsonl"
    earlier = json.dumps({"prompt": "a", "completion": "b", "tokens": 1, "finish_reason": "length"}) + "\n"
    out.write_text(earlier)  # an earlier run's output: the one kind of file --overwrite replaces
    args = greedy_cli(model_dir, "--input", str(tmp_path / "in.txt"), "--output", str(out), "--batch_size", "2")

    def broken(*a: object, **kw: object) -> None:
        raise RuntimeError("out of memory in the second batch")

    with monkeypatch.context() as m:
        m.setattr(gen_mod, "complete", broken)
        with pytest.raises(RuntimeError):
            gen_mod.main(cli.parse_config("generate", GenerateConfig, [*args[1:], "--overwrite"],
                                          cli.build_parser("generate", GenerateConfig)))
    assert out.read_text() == earlier  # the failed run left it as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"]  # and no temporary file
    assert cli.main([*args, "--overwrite"]) == 0
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["import os", "def main():", "x"]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The error line of a CLI run that must exit 2 without writing anything (after the model's log line, if
    it was loaded)."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("gptopt generate: error: "), err
    return err.splitlines()[-1]


def test_generate_refuses_a_tokenizer_of_another_vocabulary_than_the_models(
    debug_model: GPT, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the debug preset's 512 rows against the prepared data's 320 tokens: more apart than padding
    model = checkpoint.save_model(debug_model, tmp_path / "m")
    line = refused(greedy_cli(model, "--tokenizer", str(train_data / "tokenizer.json"), "x"), capsys)
    assert "the tokenizer has 320 tokens, the model 512" in line
    assert "pass the --tokenizer the model was trained" in line


def test_output_never_replaces_the_input_or_a_model_file(trained_out: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    run = shutil.copytree(trained_out, tmp_path / "run")  # a copy: a broken check must not harm the shared one
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    (tmp_path / "link.jsonl").symlink_to(prompts)
    base = greedy_cli(run, "--max_new_tokens", "3", "--input", str(prompts), "--overwrite", "--output")
    for output in (prompts, tmp_path / "link.jsonl"):
        assert "is the --input file" in refused([*base, str(output)], capsys)
    assert prompts.read_text() == "a\nb\n"
    ckpt = checkpoint.latest_checkpoint(run)
    assert ckpt is not None
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for output in (ckpt / "model.safetensors", run / "latest", run / "new.jsonl"):
        assert "inside the model folder" in refused([*base, str(output)], capsys)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_overwrite_replaces_only_a_generate_output(model_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in.txt").write_text("a\nb\n")
    base = greedy_cli(model_dir, "--max_new_tokens", "3", "--input", str(tmp_path / "in.txt"), "--overwrite",
                      "--output")
    for name, text in [("notes.txt", "my notes\n"), ("data.jsonl", '{"prompt": "x", "id": 1}\n'),
                       ("latin.jsonl", "caf\xe9\n")]:
        (tmp_path / name).write_text(text, encoding="latin-1")
        assert "is not a generate output" in refused([*base, str(tmp_path / name)], capsys)
        assert (tmp_path / name).read_text(encoding="latin-1") == text
    assert cli.main([*base, str(tmp_path / "out.jsonl")]) == 0
    assert cli.main([*base, str(tmp_path / "out.jsonl")]) == 0  # its own output: replaced
    assert [json.loads(line)["prompt"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["a", "b"]


def test_prompts_that_are_not_utf8_are_named(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    prompt = b"\xff".decode("utf-8", "surrogateescape")  # how Python hands over a non-UTF-8 argv byte
    assert "the prompt is not valid UTF-8 text (byte 0xff" in refused(greedy_cli(model_dir, prompt), capsys)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"), encoding="utf-8"))
    assert "stdin is not UTF-8 text (byte 0xe9 at offset 3)" in refused(greedy_cli(model_dir, "-"), capsys)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"ok\ncaf\xe9\n")
    err = refused(greedy_cli(model_dir, "--input", str(latin)), capsys)
    assert f"--input {latin} is not UTF-8 text (byte 0xe9 at offset 6)" in err
    jsonl = tmp_path / "surrogate.jsonl"
    jsonl.write_text('{"prompt": "\\udcff"}\n')
    assert "prompt 1 is not valid UTF-8 text" in refused(greedy_cli(model_dir, "--input", str(jsonl)), capsys)
    assert "no prompts in it" in refused(greedy_cli(model_dir, "--input", "/dev/null"), capsys)
    assert "is a folder; give a file of prompts" in refused(greedy_cli(model_dir, "--input", str(tmp_path)), capsys)


def test_cli_loads_a_training_output_dir(trained_out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, tok = load_for_inference(str(trained_out), tokenizer=None, plan=CPU)
    assert model.config.vocab_size == tok.get_vocab_size() == 320
    assert cli.main(greedy_cli(trained_out, "import")) == 0
    assert "12 tokens" in capsys.readouterr().err


def test_loads_a_hugging_face_dir_with_its_tokenizer_beside_it(varied_model: GPT, train_data: Path,
                                                               tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import shutil

    from gptopt.models.hf import export_hf

    directory = export_hf(varied_model, tmp_path / "hf")
    shutil.copy(train_data / "tokenizer.json", directory / "tokenizer.json")
    model, tok = load_for_inference(str(directory), tokenizer=None, plan=CPU)
    assert tok.get_vocab_size() == 320
    assert generate(Generator(model, CPU), [PROMPTS[0]], GREEDY) == generate(Generator(varied_model, CPU),
                                                                             [PROMPTS[0]], GREEDY)


def test_missing_model_or_tokenizer_is_a_clear_error(tmp_path: Path, varied_model: GPT) -> None:
    with pytest.raises(ValueError, match="gptopt train"):
        gen_mod.main(GenerateConfig(model=str(tmp_path / "nothing"), prompt="x"))
    bare = checkpoint.save_model(varied_model, tmp_path / "bare")  # no tokenizer recorded or beside it
    with pytest.raises(ValueError, match="--tokenizer"):
        load_for_inference(str(bare), tokenizer=None, plan=CPU)


def test_int8_weight_only_runs_on_cpu_and_says_it_is_slower(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torchao")
    with caplog.at_level("WARNING", logger="gptopt"):
        model, _ = load_for_inference(str(model_dir), tokenizer=None, plan=CPU, quantize="int8-weight")
    assert "slower" in caplog.text
    assert len(generate(Generator(model, CPU), [PROMPTS[0]], GREEDY)[0]) == GREEDY.max_new_tokens


@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_quantize_int8_is_refused_naming_int8_weight(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    # int8-weight is what gptopt compress calls torchao's int8 weight-only method too.
    with pytest.raises(SystemExit) as exit_:
        cli.main([verb, "--model", "gpt2", "--quantize", "int8"])
    assert exit_.value.code == 2 and "int8-weight" in capsys.readouterr().err


def test_quantize_int4_on_a_cpu_is_refused_before_loading_with_the_reason(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # torchao's int4 kernel runs on sm_80+ CUDA only: say so at once, not after loading the weights
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before int4-weight was refused")

    monkeypatch.setattr("gptopt.models.hf.load_pretrained", no_loading)
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(model_dir), "--device", "cpu", "--quantize", "int4-weight", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gptopt generate: error: "), err
    assert "int4-weight needs an NVIDIA GPU of compute capability 8.0 or newer" in err and "this cpu" in err
    assert "drop --quantize here, or use --quantize int8-weight" in err


def test_quantize_int8_from_a_config_file_is_refused_before_loading(tmp_path: Path) -> None:
    # A TOML config skips argparse's choices: the loader names the valid ones, before reading any weights.
    with pytest.raises(ValueError, match="int8-weight"):
        load_for_inference(str(tmp_path / "nothing"), tokenizer=None, plan=CPU, quantize="int8")


def test_end_of_text_lookup_never_adds_a_token() -> None:
    from tokenizers import models

    from gptopt.data.tokenizer import eot_id

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert eot_id(words) is None and words.get_vocab_size() == 3
    words.add_special_tokens(["</s>"])  # another tokenizer family's end-of-text spelling
    assert eot_id(words) == 3 and words.get_vocab_size() == 4


@pytest.mark.slow
def test_compiled_static_decode_equals_eager(varied_model: GPT) -> None:
    model = copy.deepcopy(varied_model)  # a compiled CPU Generator changes its model's Linear layers
    eager = generate(Generator(varied_model, CPU, max_batch_size=4), PROMPTS[:3], GREEDY)
    assert generate(Generator(model, CPU, max_batch_size=4, compile=True), PROMPTS[:3], GREEDY) == eager
    # A second model of the same shapes gets its own tokens, not the first one's graph with stale weights.
    other = copy.deepcopy(varied_model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    theirs = generate(Generator(copy.deepcopy(other), CPU, max_batch_size=4), PROMPTS[:3], GREEDY)
    assert theirs != eager
    assert generate(Generator(other, CPU, max_batch_size=4, compile=True), PROMPTS[:3], GREEDY) == theirs


@pytest.mark.slow
def test_compiled_decode_of_any_slots_equals_eager(varied_model: GPT) -> None:
    """The server's case: busy slots anywhere in a large cache; the compiled decode runs the smallest bucket
    of rows that holds them (1, 4, 8 here), and the idle rows it runs must not disturb the busy ones."""
    eager = Generator(varied_model, CPU, max_batch_size=8)
    compiled = Generator(copy.deepcopy(varied_model), CPU, max_batch_size=8, compile=True)
    for slots in ([0], [0, 1, 2], [5], [1, 6]):
        out: dict[Generator, list[list[int]]] = {}
        for g in (eager, compiled):
            ids = [list(PROMPTS[i]) for i in range(len(slots))]
            for s, p in zip(slots, ids, strict=True):
                p.append(int(g.prefill(s, p).argmax()))
            for _ in range(6):
                logits = g.decode(slots, [p[-1] for p in ids], [len(p) - 1 for p in ids])
                for p, row in zip(ids, logits.argmax(-1).tolist(), strict=True):
                    p.append(row)
            for s in slots:
                g.free(s)
            out[g] = ids
        assert out[compiled] == out[eager], slots


def test_loaded_for_inference_on_cpu_in_the_fast_layout_with_the_same_tokens(model_dir: Path,
                                                                              varied_model: GPT) -> None:
    model, _ = load_for_inference(str(model_dir), tokenizer=None, plan=CPU)
    assert model.lm_head.weight.t().is_contiguous() and model.lm_head.weight is model.transformer.wte.weight
    plain = checkpoint.load_model(model_dir).eval()
    assert generate(Generator(model, CPU), PROMPTS[:2], GREEDY) == generate(Generator(plain, CPU), PROMPTS[:2], GREEDY)
    kept, _ = load_for_inference(str(model_dir), tokenizer=None, plan=CPU, layout=False)
    assert kept.lm_head.weight.is_contiguous()


def test_a_bucket_whose_cuda_graph_cannot_be_recorded_runs_eagerly_and_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that refuses stream capture (a quantised layer's, say) must not stop the server from
    starting: that bucket runs the eager step, with a warning naming --no-cuda_graphs. Running out of
    memory while recording is not hidden: it is raised, for the warm-up to report. (GraphedDecode's
    recording itself needs a GPU: tests/test_cuda.py.)"""
    calls: list[int] = []

    def step(tok: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        calls.append(tok.shape[0])
        return (tok + pos).float() * keys.shape[0]

    graphed = object.__new__(GraphedDecode)  # its constructor refuses a CPU
    graphed.step, graphed.graphs, graphed.record_s = step, {}, 0.0
    graphed.tok, graphed.pos = torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, 1, dtype=torch.long)

    def refuse(rows: int, keys: torch.Tensor) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed, "_capture", refuse)
    tok, pos, keys = torch.tensor([[3], [4]]), torch.tensor([[10], [20]]), torch.empty(7)
    with caplog.at_level("WARNING", logger="gptopt"):
        out = graphed(tok, pos, keys)
        again = graphed(tok, pos, keys)
    assert out.tolist() == again.tolist() == [[91.0], [168.0]]  # the eager step's own result, every call
    assert graphed.graphs == {2: None} and calls == [2, 2]  # one attempt to record, then eager
    assert "could not record the decode of 2 rows" in caplog.text and "--no-cuda_graphs" in caplog.text

    def oom(rows: int, keys: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(graphed, "_capture", oom)
    with pytest.raises(torch.OutOfMemoryError):
        graphed(torch.tensor([[1]]), torch.tensor([[1]]), keys)


def test_logit_bias_and_the_openai_penalties_equal_a_direct_computation(debug_model: GPT) -> None:
    """Bias added, then the repetition penalty on every token seen (prompt too), then each generated token's
    logit minus frequency x its count and presence once (the prompt's tokens do not count there), vLLM's
    order. Greedy, so the pick is the argmax of exactly that."""
    gen = Generator(debug_model, CPU, max_batch_size=4)
    g = torch.Generator().manual_seed(0)
    V, B, P = 40, 4, 6
    for _ in range(25):
        logits = torch.randn(B, V, generator=g) * 3
        prompts = [torch.randint(V, (P,), generator=g).tolist() for _ in range(B)]
        outs = [torch.randint(V, (int(n),), generator=g).tolist() for n in torch.randint(0, 12, (B,), generator=g)]
        params = []
        for _ in range(B):
            pp, fp = (torch.rand(2, generator=g) * 4 - 2).tolist()
            rp = float(torch.rand(1, generator=g)) * 2 + 0.5
            bias = [(int(t), float(b)) for t, b in zip(torch.randint(V, (3,), generator=g).tolist(),
                                                       (torch.rand(3, generator=g) * 20 - 10).tolist(), strict=True)]
            params.append(SamplingParams(temperature=0, presence_penalty=pp, frequency_penalty=fp, logit_bias=bias,
                                         repetition_penalty=rp))
        expected = []
        for i, p in enumerate(params):
            row = logits[i].clone()
            for t, b in p.logit_bias:
                row[t] += b
            for t in set(prompts[i] + outs[i]):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
            counts = torch.bincount(torch.tensor(outs[i], dtype=torch.long), minlength=V).float()
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            expected.append(int(row.argmax()))
        got = gen.sample(logits, params, [p + o for p, o in zip(prompts, outs, strict=True)], [None] * B,
                         prompt_lens=[P] * B)
        assert got == expected
    # The favourite token, in the prompt only: a presence penalty leaves it the favourite.
    logits = torch.tensor([[0.0, 5.0, 1.5]])
    penalised = [SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)]
    assert gen.sample(logits, penalised, [[1, 1, 2]], [None], prompt_lens=[2]) == [1]  # generated: [2]
    assert gen.sample(logits, penalised, [[1, 1, 1]], [None], prompt_lens=[2]) == [2]  # generated: [1]


def test_a_token_outside_the_allowed_ones_is_never_sampled_whatever_its_bias(debug_model: GPT) -> None:
    gen = Generator(debug_model, CPU, max_batch_size=2)
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, 2.0]]).repeat(2, 1)
    allowed = torch.tensor([[False, True, True, False, True], [True, False, False, False, False]])
    params = [SamplingParams(temperature=1.0, top_k=None, logit_bias=[(0, 100.0), (3, 100.0)]),
              SamplingParams(temperature=0)]
    draws = [gen.sample(logits, params, [[], []], [gen.rng(s), None], allowed=allowed) for s in range(60)]
    assert {d[0] for d in draws} == {1, 2, 4}
    assert {d[1] for d in draws} == {0}
