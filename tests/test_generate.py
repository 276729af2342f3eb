"""The Generator: cached decoding equals uncached and Hugging Face's, batching, chunked prefill and slots change
nothing, the end of a sequence, the compiled and graphed decode.

    pytest -q tests/test_generate.py
    pytest -q -m slow tests/test_generate.py      # the compiled decode too

Every model is the debug preset with random weights (fp32, CPU) and train_data's byte-level BPE. The sampler has
tests/test_sampling.py; stop text and `gptopt generate` have tests/test_generate_cli.py.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import GREEDY, PROMPTS

from gptopt.infer.decode_graphs import GraphedDecode
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference
from gptopt.infer.scheduler import complete, generate, stream
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

CPU = resolve("cpu")


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
    with pytest.raises(ValueError, match=r"position 16 is outside 0..15"):
        gen.decode([0], [1], [16])


def test_leaving_a_stream_early_frees_its_slot(varied_model: GPT) -> None:
    gen = Generator(varied_model, CPU, max_batch_size=1)
    tokens = stream(gen, PROMPTS[0], GREEDY)
    first = [next(tokens), next(tokens)]
    tokens.close()
    assert list(stream(gen, PROMPTS[0], GREEDY))[:2] == first  # the one slot is free again


def test_loaded_for_inference_on_cpu_in_the_fast_layout_with_the_same_tokens(model_dir: Path,
                                                                              varied_model: GPT) -> None:
    model, _ = load_for_inference(str(model_dir), tokenizer=None, plan=CPU, dtype="fp32")
    assert model.lm_head.weight.t().is_contiguous() and model.lm_head.weight is model.transformer.wte.weight
    plain = checkpoint.load_model(model_dir).eval()
    assert generate(Generator(model, CPU), PROMPTS[:2], GREEDY) == generate(Generator(plain, CPU), PROMPTS[:2], GREEDY)
    kept, _ = load_for_inference(str(model_dir), tokenizer=None, plan=CPU, dtype="fp32", layout=False)
    assert kept.lm_head.weight.is_contiguous()


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
