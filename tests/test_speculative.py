"""Speculative decoding: greedy text identical to plain decoding, sampled text of the same distribution, drafts
from the text itself (n-grams) or a smaller model of the same tokenizer, in generate and in the serving engine.

    pytest -q tests/test_speculative.py

Models are the debug preset's size (conftest.family_config), random weights, fp32 on the CPU.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import family_config, make_varied_model

from gptopt import cli
from gptopt.infer import sampling
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.infer.speculative import ModelDrafter, NgramDrafter, Speculator
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

CPU = resolve("cpu", quiet=True)
VOCAB = 320


def speculator(kind: str, family: str, vocab: int = VOCAB, slots: int = 4, k: int = 4) -> Speculator:
    if kind == "ngram":
        return Speculator(NgramDrafter(), k)
    if kind == "self":  # the model drafts for itself: greedy drafts are all kept
        draft = make_varied_model(vocab, family)
    else:  # another model: most drafts are rejected
        torch.manual_seed(5)
        draft = GPT(family_config(family, vocab)).eval()
    return Speculator(ModelDrafter(Generator(draft, CPU, max_batch_size=slots, max_len=64)), k)


def repeating_model(family: str = "gpt2") -> GPT:
    """A model of the small init before training: its greedy text repeats itself."""
    torch.manual_seed(0)
    return GPT(family_config(family, VOCAB)).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["ngram", "self", "other"])
def test_greedy_text_is_plain_decodings(family: str, kind: str) -> None:
    """Prompts of several lengths decoded together: the same greedy tokens as plain decoding, with drafts proposed,
    and all kept where the model drafts for itself. For n-grams the model has the small init of a model before
    training, whose greedy text repeats itself: the n-grams of its own output are drafts, and it keeps some."""
    if kind == "ngram":
        model = repeating_model(family)
    else:
        model = make_varied_model(VOCAB, family)
    prompts = [[5, 17, 99, 4, 5, 17, 99, 4, 5, 17], [7], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    want = generate(Generator(model, CPU, max_batch_size=4, max_len=64), prompts, params)
    spec = speculator(kind, family)
    got = generate(Generator(model, CPU, max_batch_size=4, max_len=64), prompts, params, spec)
    assert got == want
    assert spec.proposed > 0
    if kind == "self":
        assert spec.accepted == spec.proposed
    if kind == "ngram":
        assert spec.accepted > 0


def test_a_draft_with_fewer_embedding_rows_drafts_only_for_ids_it_has() -> None:
    """The model's embedding may have more rows than the tokenizer they share (padding, or a preset's own size):
    a sequence holding an id the draft lacks is decoded plainly, the others are drafted for."""
    model, draft = make_varied_model(VOCAB), make_varied_model(256)
    prompts = [[5, 300, 7, 5, 300], [5, 6, 7, 5, 6]]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    want = generate(Generator(model, CPU, max_batch_size=2, max_len=64), prompts, params)
    spec = Speculator(ModelDrafter(Generator(draft, CPU, max_batch_size=2, max_len=64)), 3)
    assert generate(Generator(model, CPU, max_batch_size=2, max_len=64), prompts, params, spec) == want
    assert spec.proposed > 0


def _joint(model: GPT, prompt: list[int], params: SamplingParams, n: int, vocab: int) -> torch.Tensor:
    """The exact probability of every n-token continuation (vocab**n of them, in itertools.product's order)."""
    seqs = [list(c) for c in itertools.product(range(vocab), repeat=n)]
    idx = torch.tensor([prompt + s for s in seqs])
    with torch.no_grad():
        logits = model(idx, last_only=False)[:, len(prompt) - 1 : -1].float()  # (N, n, V)
    probs = sampling.probabilities(logits.reshape(-1, vocab), [params] * (len(seqs) * n)).view(len(seqs), n, vocab)
    probs = probs / probs.sum(-1, keepdim=True)
    chosen = probs.gather(-1, torch.tensor(seqs).unsqueeze(-1)).squeeze(-1)
    return chosen.prod(-1)


@pytest.mark.parametrize(("kind", "top_p"), [("ngram", 1.0), ("other", 1.0), ("other", 0.8)])
def test_sampled_text_keeps_its_distribution(kind: str, top_p: float) -> None:
    """8,100 sampled continuations of 4 tokens over a 3-token vocabulary, the last three from speculative steps
    (drafts of up to 2 tokens, kept or rejected): their frequencies pass a chi-square test (p = 0.001) against
    the exact probabilities of all 81 continuations, and none of probability 0 is drawn."""
    vocab, n, rows = 3, 4, 81
    torch.manual_seed(3)
    model = GPT(family_config("gpt2", vocab)).eval()
    with torch.no_grad():  # moderate weights: distributions neither flat nor certain
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = SamplingParams(temperature=1.0, top_k=None, top_p=top_p, max_new_tokens=n)
    want = _joint(model, prompt, params, n, vocab)
    spec = speculator(kind, "gpt2", vocab=vocab, slots=rows, k=2)
    gen = Generator(model, CPU, max_batch_size=rows, max_len=16)
    counts = torch.zeros(vocab**n)
    torch.manual_seed(11)
    for _ in range(100):
        for seq in generate(gen, [prompt] * rows, params, spec):
            counts[int("".join(map(str, seq)), vocab)] += 1
    assert spec.proposed > 1000 and 0 < spec.accepted < spec.proposed
    total = counts.sum()
    assert total == 8100 and counts[want == 0].sum() == 0
    expected = want * total
    big = expected >= 5  # the cells too rare for the test pooled into one
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expect = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = expect > 0
    chi2 = float(((observed[keep] - expect[keep]) ** 2 / expect[keep]).sum())
    df = int(keep.sum()) - 1
    limit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # the 0.999 quantile (Wilson-Hilferty)
    assert chi2 < limit, (chi2, limit, df)


def test_ngram_drafts_what_followed_the_tail_earlier() -> None:
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest earlier occurrence
    assert d.lookup([4, 5, 6], 3) == []  # nothing repeats
    assert d.lookup([1, 2, 1], 5) == [2, 1]  # up to what there is
    assert d.lookup([9, 5, 5, 5, 5, 5, 5], 3) == [5, 5, 5]  # a run of one token: k more of it, not one


def test_the_engine_speculates_small_batches_only(debug_tokenizer: Any) -> None:
    """Through the serving engine: greedy tokens as without speculation; one request speculates (its drafts
    counted by /metrics), three at once with a bound of two decode plainly."""
    pytest.importorskip("prometheus_client")
    from gptopt.serve.engine import Engine
    from gptopt.serve.metrics import ServeMetrics

    model = repeating_model()
    prompts = [[5, 17, 99, 4, 5, 17, 99, 4, 5], [8, 8, 8, 8], [1, 2, 3]]
    params = SamplingParams(temperature=0, max_new_tokens=16)
    want = generate(Generator(model, CPU, max_batch_size=4, max_len=64), prompts, params)

    def run(batch: list[list[int]]) -> tuple[list[list[int]], Speculator, str]:
        gen = Generator(model, CPU, max_batch_size=4, max_len=64)
        spec, metrics = speculator("ngram", "gpt2"), ServeMetrics(http=False)
        engine = Engine(gen, debug_tokenizer, metrics=metrics, solo_threads=1, speculator=spec,
                        speculate_max_batch=2)
        done = threading.Semaphore(0)
        reqs = [engine.submit(p, params, lambda ev: done.release() if ev.finish_reason else None) for p in batch]
        engine.start()
        try:
            for _ in batch:
                assert done.acquire(timeout=30)
        finally:
            engine.shutdown(timeout=5)
        return [r.seq.tokens for r in reqs], spec, metrics.render().decode()

    tokens, spec, text = run(prompts[:1])
    assert tokens == want[:1] and spec.proposed > 0
    assert f"gptopt_spec_decode_draft_tokens_total {float(spec.proposed)}" in text
    assert f"gptopt_spec_decode_accepted_tokens_total {float(spec.accepted)}" in text
    tokens, spec, _ = run(prompts)
    assert tokens == want and spec.proposed == 0  # three decode together to the end: more than the bound


def _swap_two_ids(tokenizer_json: Path) -> None:
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer_json.write_text(json.dumps(data), encoding="utf-8")


def test_generate_speculates_and_refuses_a_draft_of_another_tokenizer(
        model_dir: Path, train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """generate --speculate ngram prints the text plain decoding prints and says what became of its drafts;
    a --draft_model whose tokenizer gives other ids is refused before any decoding, naming the reason."""
    args = ["generate", "--model", str(model_dir), "--temperature", "0", "--max_new_tokens", "24", "--device", "cpu",
            "def f(x):\n    return x\ndef f(x):\n"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    assert cli.main([*args, "--speculate", "ngram"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "speculative: " in err
    draft = tmp_path / "draft"
    shutil.copytree(model_dir, draft)
    tok = draft / "tokenizer.json"
    shutil.copy(train_data / "tokenizer.json", tok)
    _swap_two_ids(tok)
    assert cli.main([*args, "--draft_model", str(draft), "--tokenizer", str(train_data / "tokenizer.json")]) == 2
    assert "the draft's tokenizer is not the model's" in capsys.readouterr().err


def test_a_bad_draft_model_is_named_as_the_draft_at_once(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A --draft_model that names no folder is reported as --draft_model, not --model; a folder of a model
    without its tokenizer fails at once (no Hub asked for GPT-2's), advising about the draft, not --tokenizer."""
    from gptopt.data import tokenizer as tokenizer_module

    asked: list[str] = []
    monkeypatch.setattr(tokenizer_module, "_from_hub", lambda name: asked.append(name))
    args = ["generate", "--model", str(model_dir), "--max_new_tokens", "2", "--device", "cpu", "hi"]
    assert cli.main([*args, "--draft_model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"--draft_model {tmp_path / 'nope'}: no such directory" in err and "--model " not in err, err
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{}")
    assert cli.main([*args, "--draft_model", str(junk)]) == 2
    err = capsys.readouterr().err
    assert f"no tokenizer found for --draft_model {junk}" in err and "pass --tokenizer" not in err, err
    assert asked == []


def test_the_count_of_a_drafts_other_tokens_is_within_its_vocabulary() -> None:
    """Of the draft's tokens, those with another id or none in the model's; and the model's tokens it lacks."""
    from tokenizers import Tokenizer, models

    from gptopt.infer.speculative import same_tokenizer

    model = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "d": 3}, unk_token="a"))
    draft = Tokenizer(models.WordLevel({"a": 0, "b": 2, "x": 1}, unk_token="a"))
    with pytest.raises(ValueError, match=r"\(2 of its 3 tokens have other ids or none in the model's 4; it lacks 2 "
                                         r"of the model's 4 tokens\)"):
        same_tokenizer(model, draft, "--draft_model d")
    same_tokenizer(model, model, "--draft_model d")
