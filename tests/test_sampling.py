"""The sampler: a seeded row's tokens are the same alone and in any batch, each row's kept set and distribution are
those its settings define, penalties and logit_bias are applied in vLLM's order, and a grammar's mask holds.

    pytest -q tests/test_sampling.py

Every model is the debug preset with random weights (fp32, CPU) and train_data's byte-level BPE.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch
from conftest import GREEDY, PROMPTS, assert_draws_follow, exact_distribution

from gptopt.config import GenerateConfig
from gptopt.data.tokenizer import eot_id
from gptopt.infer.decoding import Decoding
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

CPU = resolve("cpu")


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


def test_sampling_params_from_config_decodes_escapes() -> None:
    params = SamplingParams.from_config(GenerateConfig(stop="\\n\\nclass", temperature=0.0))
    assert params.stop == ("\n\nclass",) and params.temperature == 0.0
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_a_plain_rows_draw_never_takes_a_token_of_weight_zero_first_or_last_included() -> None:
    # a forbidden token's weight is exactly 0 (its logit -inf): the cumulative draw must never land on one, at the
    # start of the vocabulary, between kept tokens, or past the last kept one
    from gptopt.infer.sampling import inverse_cdf

    weights = torch.tensor([0.0, 0.2, 0.0, 0.0, 0.5, 0.3, 0.0, 0.0])
    torch.manual_seed(0)
    counts = torch.zeros(len(weights))
    for _ in range(20):
        counts += torch.bincount(inverse_cdf(weights.repeat(1000, 1), [None] * 1000), minlength=len(weights)).float()
    assert_draws_follow(counts, weights)
    # a seeded row: its own generator's number, the same token alone and beside other rows
    alone = inverse_cdf(weights[None], [torch.Generator().manual_seed(4)])
    beside = inverse_cdf(torch.stack([weights.flip(0), weights]), [None, torch.Generator().manual_seed(4)])
    assert alone.item() == beside[1].item()
