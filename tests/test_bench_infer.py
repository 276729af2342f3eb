"""gptopt bench --mode infer: rung selection, the results contract, HF parity, missing extras, the batch sweep.

    pytest -q tests/test_bench_infer.py
    pytest -q -m slow tests/test_bench_infer.py     # the whole default ladder, compiled rungs included

Every bench here is the debug preset on train_data: 16-token prompts, 16 new tokens, batches 1 and 2.
No timing is asserted, only that every figure is there and positive.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_draws_follow, exact_distribution, last_json_line

from gptopt import cli
from gptopt.bench import infer_ladder, infer_rungs, levers, report
from gptopt.bench.infer_ladder import InferBench
from gptopt.bench.infer_rungs import RUNGS, InferRung, select_rungs
from gptopt.bench.levers import HFSamplingGenerator, RepeatedKVGenerator
from gptopt.config import BenchConfig, preset
from gptopt.infer.generator import Generator
from gptopt.infer.measure import GREEDY, STOPPED, GptoptRunner, Sampling, weight_bytes
from gptopt.infer.sampling import SamplingParams
from gptopt.models.gpt import GPT
from gptopt.runtime.device import CPU_BF16_ENV, resolve
from gptopt.utils import extras
from gptopt.utils.errors import UserError

CONTRACT = ("name", "prefill_s", "ttft_s", "decode_tokens_per_s", "batch_sweep", "bandwidth_gbs", "bandwidth_util",
            "tokens_match", "status", "note", "speedup_vs_baseline")
RUNG = {r.name: r for r in RUNGS}


@pytest.fixture(scope="module", autouse=True)
def _fp32_policy() -> Iterator[None]:
    # The rungs' agreement with the fp32 baseline, token for token and to 1e-3 in the logits, is fp32's: these
    # tests run the CPU policy without native bf16 on every machine (kv-fp32's test sets the other itself).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_BF16_ENV, "0")
        yield


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny forwards: a second thread only adds contention on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def infer_args(data: Path, out: Path, rungs: str, *extra: str) -> list[str]:
    return ["bench", "--mode", "infer", "--preset", "debug", "--seq_len", "32", "--batch_size", "2", "--warmup", "1",
            "--device", "cpu", "--data_dir", str(data), "--output_dir", str(out), "--rungs", rungs, *extra]


@pytest.fixture(scope="module")
def bench(train_data: Path, tmp_path_factory: pytest.TempPathFactory) -> InferBench:
    out = tmp_path_factory.mktemp("infer")
    return InferBench(BenchConfig(mode="infer", preset="debug", seq_len=32, batch_size=2, warmup=1, device="cpu",
                                  data_dir=str(train_data), output_dir=str(out)))


def test_default_is_every_rung_and_unknown_names_list_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert [r.name for r in select_rungs("default")] == ["hf", "kv", "graphs", "compiled", "bf16", "int8", "int4",
                                                         "onnxruntime", "speculative"]
    levers = ["kv-hf-sampling", "kv-repeat-kv", "kv-plain-weights", "kv-fp32", "kv-stacked", "kv-unfused"]
    assert [r.name for r in select_rungs("levers")] == ["kv", *levers]  # each lever's gain is kv's rate over its rung's
    assert [r.name for r in select_rungs("all")] == [r.name for r in select_rungs("default")] + levers
    assert [r.name for r in select_rungs("kv,hf,kv")] == ["kv", "hf"]
    with pytest.raises(ValueError) as e:
        select_rungs("kv,turbo")
    for name in ("hf", "kv", "graphs", "compiled", "bf16", "int8", "int4", "onnxruntime"):
        assert name in str(e.value)
    assert cli.main(infer_args(tmp_path, tmp_path / "o", "turbo")) == 2
    assert "unknown rung 'turbo'" in capsys.readouterr().err


def test_hf_and_kv_write_the_contract_and_agree_token_for_token(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "b"
    assert cli.main(infer_args(train_data, out, "hf,kv", "--json")) == 0
    stdout = capsys.readouterr().out
    last = last_json_line(stdout)
    results = json.loads((out / "infer_results.json").read_text())
    assert last == results
    assert "decode tokens/s by batch size" in stdout
    # a CPU has no bandwidth table: the achieved GB/s is reported, the utilisation is not
    assert results["peak_bandwidth"] is None and "cpu" in results["bandwidth_source"]
    assert (results["prompt_len"], results["max_new_tokens"], results["batch_sizes"]) == (16, 16, [1, 2])
    hf, kv = results["rungs"]
    for r in (hf, kv):
        assert set(CONTRACT) <= set(r), r["name"]
        assert r["status"] == "ok", r["note"]
        assert r["prefill_s"] > 0 and r["ttft_s"] > 0 and r["bandwidth_gbs"] > 0 and r["bandwidth_util"] is None
        sizes = [p["batch_size"] for p in r["batch_sweep"]]
        assert sizes == sorted(set(sizes)) == [1, 2]
        assert all(p["tokens_per_s"] > 0 for p in r["batch_sweep"])
        assert r["decode_tokens_per_s"] == r["batch_sweep"][0]["tokens_per_s"]
    assert results["baseline"] == "hf" and hf["speedup_vs_baseline"] == 1.0 and hf["tokens_match"] == 1.0
    # the same weights in fp32: gptopt's cached greedy decoding is Hugging Face's, token for token
    assert kv["tokens_match"] == 1.0 and kv["tokens"] == hf["tokens"]
    assert len(set(kv["tokens"])) > 3  # varied text, not one token repeated (which would agree trivially)
    assert kv["max_logit_diff"] < 1e-4 and hf["max_logit_diff"] < 1e-4
    csv_text = (out / "infer_results.csv").read_text()
    assert csv_text.startswith("name,") and "tokens_per_s_b2" in csv_text and len(csv_text.splitlines()) == 3
    assert "| tokens match |" in (out / "infer_report.md").read_text()
    assert (out / "infer_batch_sweep.png").is_file() == extras.has("matplotlib")


def test_a_rotary_models_rungs_have_its_weights_and_agree_with_transformers(train_data: Path, tmp_path: Path) -> None:
    # Each rung's model is rebuilt from the saved weights; the rotary frequencies are not among them, and a
    # model without them decodes garbage that disagrees with every other rung from the first token.
    pytest.importorskip("transformers")
    args = infer_args(train_data, tmp_path / "b", "hf,kv")
    args[args.index("debug")] = "llama-tiny"
    assert cli.main(args) == 0
    hf, kv = json.loads((tmp_path / "b" / "infer_results.json").read_text())["rungs"]
    assert kv["tokens_match"] == 1.0 and kv["tokens"] == hf["tokens"] and len(set(kv["tokens"])) > 3
    assert kv["max_logit_diff"] < 1e-3 and hf["max_logit_diff"] < 1e-3


def test_the_lever_rungs_decode_kvs_tokens_and_report_what_each_lever_buys(train_data: Path, tmp_path: Path) -> None:
    # The repeated cache and the weights as loaded compute kv's model another way: the same greedy tokens and logits.
    # Each lever's gain (kv's rate over its own) is given at every batch size, the same in the results and the report.
    pytest.importorskip("transformers")
    args = infer_args(train_data, tmp_path / "b", "levers", "--temperature", "1", "--top_k", "20", "--top_p", "0.9")
    args[args.index("debug")] = "llama-tiny"  # grouped-query: 4 query heads over 2 key/value heads
    assert cli.main(args) == 0
    results = json.loads((tmp_path / "b" / "infer_results.json").read_text())
    rungs = {r["name"]: r for r in results["rungs"]}
    assert list(rungs) == ["kv", "kv-hf-sampling", "kv-repeat-kv", "kv-plain-weights", "kv-fp32", "kv-stacked",
                           "kv-unfused"]
    assert len(set(rungs["kv"]["tokens"])) > 3 and rungs["kv"]["lever_gain"] == []
    # fp32 already (this module's policy): nothing for bf16 weights to buy
    assert rungs["kv-fp32"]["status"] == "skipped" and "float32 here already" in rungs["kv-fp32"]["note"]
    for name in ("kv-repeat-kv", "kv-plain-weights", "kv-stacked", "kv-unfused"):
        assert rungs[name]["tokens"] == rungs["kv"]["tokens"] and rungs[name]["max_logit_diff"] < 1e-3, rungs[name]
    kv = {p["batch_size"]: p["tokens_per_s"] for p in rungs["kv"]["batch_sweep"]}
    report_md = (tmp_path / "b" / "infer_report.md").read_text()
    for name in ("kv-hf-sampling", "kv-repeat-kv", "kv-plain-weights", "kv-stacked", "kv-unfused"):
        r = rungs[name]
        own = {p["batch_size"]: p["tokens_per_s"] for p in r["batch_sweep"]}
        assert r["status"] == "ok" and [g["batch_size"] for g in r["lever_gain"]] == [1, 2]
        assert [g["gain"] for g in r["lever_gain"]] == [kv[b] / own[b] for b in (1, 2)]
        cells = " | ".join(f"{g['gain']:.2f}x" for g in r["lever_gain"])
        assert f"| {name} | {cells} |" in report_md.split("## What each lever buys")[1]


def test_a_lever_gain_is_taken_at_the_batch_sizes_both_rungs_measured(bench: InferBench,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A rung that ran out of memory at batch 2 keeps its batch-1 gain; nothing is compared with a batch it lacks.
    def result(name: str, rates: dict[int, float]) -> infer_rungs.InferResult:
        return infer_rungs.InferResult(name=name, what="", decode_tokens_per_s=rates[1],
                                 batch_sweep=[{"batch_size": b, "tokens_per_s": t} for b, t in rates.items()])

    kv, short, long = result("kv", {1: 30.0, 2: 50.0}), result("kv-repeat-kv", {1: 20.0}), \
        result("kv-plain-weights", {1: 15.0, 2: 40.0, 4: 60.0})
    monkeypatch.setattr(bench, "results", [kv, short, long])
    bench._compare()
    assert short.lever_gain == [{"batch_size": 1, "gain": 1.5}]
    assert long.lever_gain == [{"batch_size": 1, "gain": 2.0}, {"batch_size": 2, "gain": 1.25}]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, None, 1.0), (0.6, 3, 1.0), (1.0, None, 0.9), (1.3, 4, 0.8)])
def test_the_transformers_sampler_rung_draws_what_gptopts_sampler_draws(temperature: float, top_k: int | None,
                                                                       top_p: float,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # kv-hf-sampling times transformers' draws against gptopt's: a fair race only over the same distribution, and
    # only if the draws are transformers' (multinomial over its warpers' scores; gptopt's sampler never calls it).
    pytest.importorskip("transformers")
    torch.manual_seed(11)
    drawn_by = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: drawn_by.append(1) or multinomial(*a, **k))
    gen = HFSamplingGenerator(GPT(preset("debug")), resolve("cpu"), max_batch_size=1)
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0])
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)] * 1000
    counts = torch.zeros(len(logits))
    for _ in range(20):
        drawn = gen.sample(logits.repeat(len(params), 1), params, [[]] * len(params), [None] * len(params))
        counts += torch.bincount(torch.tensor(drawn), minlength=len(logits)).float()
    assert len(drawn_by) == 20
    assert_draws_follow(counts, exact_distribution(logits, temperature, top_k, top_p))


def test_the_repeat_kv_rung_attends_every_query_head_its_own_copy_and_decodes_the_same_logits(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # What kv-repeat-kv takes away: its prefill and decode forwards see the cache's 2 key/value heads repeated to
    # the 4 query heads, and give the plain Generator's logits.
    torch.manual_seed(12)
    model = GPT(preset("llama-tiny", vocab_size=512)).eval()
    plan = resolve("cpu")
    plain = Generator(model, plan, max_batch_size=2, max_len=32)
    repeated = RepeatedKVGenerator(model, plan, max_batch_size=2, max_len=32)
    heads: list[int] = []
    update = levers._RepeatedLayer.update

    def spy(self: levers._RepeatedLayer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = update(self, k, v)
        heads.append(k.shape[1])
        return k, v

    monkeypatch.setattr(levers._RepeatedLayer, "update", spy)
    prompt = torch.randint(0, 512, (12,)).tolist()
    with torch.no_grad():
        want = [plain.prefill(0, prompt), plain.decode([0], [5], [12])]
        got = [repeated.prefill(0, prompt), repeated.decode([0], [5], [12])]
    assert heads == [4] * (2 * model.config.n_layer)  # every layer, in the prefill and in the decode
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_lever_rung_that_has_nothing_to_take_away_here_says_why(train_data: Path, tmp_path: Path) -> None:
    # debug's attention has a key/value head per query head, and greedy decoding samples nothing.
    assert cli.main(infer_args(train_data, tmp_path / "b", "levers")) == 0
    rungs = {r["name"]: r for r in json.loads((tmp_path / "b" / "infer_results.json").read_text())["rungs"]}
    assert rungs["kv-hf-sampling"]["status"] == "skipped" and "with --temperature" in rungs["kv-hf-sampling"]["note"]
    assert rungs["kv-repeat-kv"]["status"] == "skipped" and "key/value head per query head" in \
        rungs["kv-repeat-kv"]["note"]
    assert rungs["kv-plain-weights"]["status"] == "ok" and rungs["kv-plain-weights"]["lever_gain"]
    for name in ("kv-stacked", "kv-unfused"):  # GPT-2's blocks: no SwiGLU, no RMSNorm, no rotary
        assert rungs[name]["status"] == "skipped" and "GPT-2's blocks have neither" in rungs[name]["note"]
    # without kv beside it a lever rung has no gain to give, and says how to get one
    assert cli.main(infer_args(train_data, tmp_path / "c", "kv-plain-weights")) == 0
    alone = json.loads((tmp_path / "c" / "infer_results.json").read_text())["rungs"][0]
    assert alone["status"] == "ok" and alone["lever_gain"] == [] and "--rungs levers" in alone["note"]


def test_the_fp32_lever_rung_measures_bf16_weights_where_the_cpu_has_native_bf16(
        train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the CPU has native bf16, kv runs bf16 weights (generate's and serve's default) and kv-fp32 the fp32 ones
    # it would run without: the same text on these wide random weights for the first tokens, and a gain to report.
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    args = infer_args(train_data, tmp_path / "b", "kv,kv-fp32")
    args[args.index("debug")] = "llama-tiny"
    assert cli.main(args) == 0
    kv, fp32 = json.loads((tmp_path / "b" / "infer_results.json").read_text())["rungs"]
    assert (kv["dtype"], fp32["dtype"]) == ("bfloat16", "float32") and fp32["status"] == "ok"
    assert fp32["max_logit_diff"] < 1e-3 < kv["max_logit_diff"] < 0.5  # bf16's rounding, and only that
    assert [g["batch_size"] for g in fp32["lever_gain"]] == [1, 2]


@pytest.mark.parametrize(("flags", "want", "label"), [
    (("--temperature", "1"), Sampling(1.0), "sampled at temperature 1 (top_p 1, no top_k)"),
    (("--temperature", "0.7", "--top_k", "50", "--top_p", "0.9"), Sampling(0.7, 50, 0.9),
     "sampled at temperature 0.7 (top_k 50, top_p 0.9)")])
def test_temperature_samples_the_timed_generations_and_still_checks_greedy_tokens(
    flags: tuple[str, ...], want: Sampling, label: str, train_data: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # --temperature (what OpenAI's clients send: no top_k), or with --top_k and --top_p, reaches every rung's timed
    # generations, so the figures carry the sampler's cost; the check against the baseline stays greedy.
    pytest.importorskip("transformers")
    asked: dict[str, list[Sampling]] = {"hf": [], "kv": []}
    for name, cls in (("hf", infer_rungs.HFRunner), ("kv", GptoptRunner)):
        def spy(self: object, prompts: list[list[int]], n: int, sampling: Sampling = GREEDY, _name: str = name,
                _real: object = cls.generate) -> list[list[int]]:
            asked[_name].append(sampling)
            return _real(self, prompts, n, sampling)  # type: ignore[operator]
        monkeypatch.setattr(cls, "generate", spy)
    out = tmp_path / "b"
    assert cli.main(infer_args(train_data, out, "hf,kv,onnxruntime", *flags)) == 0
    results = json.loads((out / "infer_results.json").read_text())
    hf, kv, ort = results["rungs"]
    assert Sampling(results["temperature"], results["top_k"], results["top_p"]) == want
    assert hf["status"] == kv["status"] == "ok"
    assert kv["tokens_match"] == 1.0 and kv["tokens"] == hf["tokens"]  # the greedy check, as without --temperature
    for name in ("hf", "kv"):
        assert asked[name][0] == GREEDY and asked[name].count(want) >= len(asked[name]) - 1, (name, asked[name])
    assert ort["status"] == "skipped" and "without --temperature" in ort["note"]
    assert label in (out / "infer_report.md").read_text()


@pytest.mark.parametrize(("fields", "reason"), [
    (dict(mode="train", temperature=1.0), "--temperature, --top_k and --top_p belong to the generation ladder"),
    (dict(mode="train", top_p=0.9), "--temperature, --top_k and --top_p belong to the generation ladder"),
    (dict(mode="infer", top_k=50), "add --temperature"),
    (dict(mode="infer", temperature=1.0, top_p=0.0), "top_p"),
    (dict(mode="infer", temperature=1.0, top_k=0), "top_k"),
])
def test_sampling_flags_out_of_place_or_range_are_refused_by_name(fields: dict, reason: str) -> None:
    with pytest.raises(UserError, match=reason):
        BenchConfig(**fields)


def test_without_the_hf_extra_hf_is_skipped_and_kv_is_the_baseline(
    bench: InferBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(infer_ladder, "has", lambda module: module != "transformers" and extras.has(module))
    monkeypatch.setattr(bench, "results", [])
    summary = bench.run(select_rungs("hf,kv"))
    hf, kv = summary["rungs"]
    assert hf["status"] == "skipped" and "pip install 'gptopt[hf]'" in hf["note"]
    assert summary["baseline"] == "kv"
    assert kv["status"] == "ok" and kv["speedup_vs_baseline"] == 1.0 and kv["tokens_match"] == 1.0
    assert "pip install 'gptopt[hf]'" in report.infer_table(summary)


def test_each_rung_gets_the_same_weights_with_lm_head_tied_to_the_embedding(bench: InferBench) -> None:
    """Built without init work (slow for gpt2-xl on a CPU): the stored weights, tied as GPT-2 ties
    them, so the embedding is read, and counted in bytes per token, once."""
    a, b = bench._model(torch.float32), bench._model(torch.float32)
    for model in (a, b):
        assert model.lm_head.weight is model.transformer.wte.weight
        assert all(torch.equal(v, bench.init_state[k].cpu()) for k, v in model.state_dict().items())
    assert a.transformer.wte.weight.data_ptr() != b.transformer.wte.weight.data_ptr()  # a rung may change its own


def test_int8_runs_on_a_cpu_or_says_why_not(bench: InferBench, monkeypatch: pytest.MonkeyPatch) -> None:
    # The ladder's int8 rung is compiled (the slow test runs it so); eager here keeps this test quick.
    int8 = dataclasses.replace(RUNG["int8"], compile=False)
    res = bench.run_rung(int8)
    if not extras.has("torchao"):
        assert res.status == "skipped" and "pip install 'gptopt[quant]'" in res.note
    else:
        assert res.status == "ok", res.note
        assert res.dtype == "int8" and 0 < res.max_logit_diff < math.inf
        # int8 weights: fewer bytes read per decoded token than the same model in fp32
        assert res.bytes_per_token < bench.run_rung(RUNG["kv"]).bytes_per_token
    monkeypatch.setattr(infer_ladder, "has", lambda module: module != "torchao" and extras.has(module))
    res = bench.run_rung(int8)
    assert res.status == "skipped" and res.note == "needs the 'quant' extra: pip install 'gptopt[quant]'"


def test_rungs_list_names_int4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(infer_args(tmp_path, tmp_path / "o", "list")) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "torchao int4 weight-only" in lines["int4"]


def test_int4_on_a_cpu_is_skipped_with_the_reason_and_exits_0(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # tinygemm's int4 kernel needs sm_80+ CUDA: a CPU bench reports why, it does not fail
    assert cli.main(infer_args(train_data, tmp_path / "b", "int4", "--json")) == 0
    out = capsys.readouterr().out
    (int4,) = last_json_line(out)["rungs"]
    assert int4["name"] == "int4" and int4["status"] == "skipped" and int4["dtype"] == "int4"
    assert "needs an NVIDIA GPU of compute capability 8.0 or newer" in int4["note"] and "this cpu" in int4["note"]
    assert "compute capability 8.0" in out.split("\n{")[0]  # the printed table says so too


def test_int4_weights_are_counted_by_their_packed_bytes() -> None:
    # bytes per token counts what a decode step reads: tinygemm's packed int4 and its scales, not bf16's
    tile = pytest.importorskip("torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor")
    n, k, group = 64, 1024, 128  # tinygemm pads the input width to 1024: this one needs none
    qdata = torch.zeros(n // 8, k // 128, 32, 4, dtype=torch.int32)  # 8 int4 per int32: n * k / 2 bytes
    scale_and_zero = torch.zeros(k // group, n, 2, dtype=torch.bfloat16)
    weight = tile.Int4TilePackedTo4dTensor(qdata, scale_and_zero, [1, group], torch.Size([n, k]))
    layer = torch.nn.Linear(k, n, bias=False)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert weight_bytes(layer) == n * k // 2 + (k // group) * n * 2 * 2  # not n * k * 2 (bf16)


@pytest.mark.cuda
def test_int4_runs_on_an_sm80_gpu(train_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torchao's int4 kernel needs compute capability 8.0+")
    gpu = InferBench(BenchConfig(mode="infer", preset="tiny", seq_len=32, batch_size=2, warmup=1, device="cuda",
                                 data_dir=str(train_data), output_dir=str(tmp_path)))
    res = gpu.run_rung(dataclasses.replace(RUNG["int4"], compile=False))  # eager: quick; test_quantize compiles
    assert res.status == "ok", res.note
    assert res.dtype == "int4" and 0 < res.max_logit_diff < math.inf and res.decode_tokens_per_s > 0
    assert [p["batch_size"] for p in res.batch_sweep] == [1, 2] and res.bytes_per_token > 0


def test_bf16_is_skipped_where_the_device_has_no_native_bf16(bench: InferBench,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    no_bf16 = dataclasses.replace(bench.plan, amp_dtype=None, reason="device cpu: CPU without native bf16 matmul")
    monkeypatch.setattr(bench, "plan", no_bf16)
    res = bench.run_rung(RUNG["bf16"])
    assert res.status == "skipped" and "no native bf16" in res.note


def test_onnxruntime_is_skipped_with_the_install_line_without_the_onnx_extra(
    bench: InferBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(infer_ladder, "has", lambda module: module != "onnxruntime" and extras.has(module))
    res = bench.run_rung(RUNG["onnxruntime"])
    assert res.status == "skipped" and res.note == "needs the 'onnx' extra: pip install 'gptopt[onnx]'"


@pytest.mark.slow
def test_onnxruntime_decodes_the_same_tokens_as_gptopt(bench: InferBench) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    ort, kv = bench.run_rung(RUNG["onnxruntime"]), bench.run_rung(RUNG["kv"])
    assert ort.status == "ok", ort.note
    assert ort.dtype == "float32" and ort.max_logit_diff < 1e-3 and ort.tokens == kv.tokens
    assert [p["batch_size"] for p in ort.batch_sweep] == [1, 2] and ort.decode_tokens_per_s > 0


def test_a_trained_model_is_benched_with_its_draft(model_dir: Path, train_data: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--model benches that model's weights (not the preset's); the speculative rung drafts with --draft_model
    (here the model itself, so every draft is kept) and decodes the kv rung's tokens."""
    args = ["bench", "--mode", "infer", "--model", str(model_dir), "--draft_model", str(model_dir), "--seq_len", "32",
            "--batch_size", "2", "--warmup", "1", "--device", "cpu", "--data_dir", str(train_data), "--output_dir",
            str(tmp_path / "b"), "--rungs", "kv,speculative", "--json"]
    assert cli.main(args) == 0
    rungs = {r["name"]: r for r in last_json_line(capsys.readouterr().out)["rungs"]}
    assert rungs["speculative"]["status"] == "ok" and rungs["speculative"]["tokens"] == rungs["kv"]["tokens"]
    assert rungs["speculative"]["note"].startswith("100% of ")
    assert rungs["kv"]["max_logit_diff"] < 1e-4  # the model's own weights: its fp32 logits are the reference's
    with pytest.raises(SystemExit):
        cli.main(["bench", "--model", str(model_dir)])  # the training ladder has no --model
    assert "add --mode infer" in capsys.readouterr().err


def test_the_sweep_stops_at_the_first_batch_that_does_not_fit(
    bench: InferBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = GptoptRunner.generate

    def generate(self: GptoptRunner, prompts: list[list[int]], n: int, sampling: Sampling = GREEDY) -> list[list[int]]:
        if len(prompts) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, prompts, n, sampling)

    monkeypatch.setattr(GptoptRunner, "generate", generate)
    res = bench.run_rung(RUNG["kv"])
    assert res.status == "ok" and res.note == "out of memory at batch 2"
    assert [p["batch_size"] for p in res.batch_sweep] == [1] and res.decode_tokens_per_s > 0


@pytest.mark.slow
def test_the_default_ladder_runs_end_to_end_with_its_compiled_rungs(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    assert cli.main(infer_args(train_data, tmp_path / "b", "default", "--json")) == 0
    results = last_json_line(capsys.readouterr().out)
    rungs = {r["name"]: r for r in results["rungs"]}
    assert list(rungs) == ["hf", "kv", "graphs", "compiled", "bf16", "int8", "int4", "onnxruntime", "speculative"]
    assert rungs["speculative"]["tokens_match"] == 1.0 and "draft tokens kept" in rungs["speculative"]["note"]
    assert rungs["graphs"]["status"] == "skipped" and "NVIDIA GPU" in rungs["graphs"]["note"]
    assert rungs["compiled"]["status"] == "ok", rungs["compiled"]["note"]
    # compiling the decode step over a static cache changes the speed, not the tokens
    assert rungs["compiled"]["tokens_match"] == 1.0
    assert [p["batch_size"] for p in rungs["compiled"]["batch_sweep"]] == [1, 2]
    assert rungs["int4"]["status"] == "skipped" and "compute capability 8.0" in rungs["int4"]["note"]
    for name in ("bf16", "int8", "onnxruntime"):
        r = rungs[name]
        assert r["status"] in ("ok", "skipped"), r["note"]
        if r["status"] == "ok":
            assert 0 <= r["tokens_match"] <= 1 and r["max_logit_diff"] > 0 and r["decode_tokens_per_s"] > 0


def test_ctrl_c_keeps_the_rungs_measured_so_far(train_data: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped by Ctrl-C (or a time limit's SIGINT) mid-sweep: the report still holds the batch sizes done."""
    pytest.importorskip("transformers")
    real = GptoptRunner.generate

    def stop_at_batch_2(self: GptoptRunner, prompts: list[list[int]], n: int,
                        sampling: Sampling = GREEDY) -> list[list[int]]:
        if len(prompts) == 2:
            raise KeyboardInterrupt
        return real(self, prompts, n, sampling)

    monkeypatch.setattr(GptoptRunner, "generate", stop_at_batch_2)
    out = tmp_path / "b"
    assert cli.main(infer_args(train_data, out, "hf,kv")) == 130
    rungs = {r["name"]: r for r in json.loads((out / "infer_results.json").read_text())["rungs"]}
    for r in rungs.values():
        assert r["status"] == "ok" and r["decode_tokens_per_s"] > 0 and r["tokens_match"] == 1.0
        assert [p["batch_size"] for p in r["batch_sweep"]] == [1]
        assert r["note"] == "swept up to batch 1: bench was stopped (Ctrl-C)"


def test_ctrl_c_while_the_rungs_are_set_up_marks_every_rung_not_measured(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep times the rungs side by side once all are set up: a rung set up before the stop has no figures
    real = InferBench._set_up

    def stop_at_compiled(self: InferBench, rung: InferRung) -> object:
        if rung.name == "compiled":
            raise KeyboardInterrupt
        return real(self, rung)

    monkeypatch.setattr(InferBench, "_set_up", stop_at_compiled)
    out = tmp_path / "b"
    assert cli.main(infer_args(train_data, out, "kv,compiled,int8")) == 130
    rungs = json.loads((out / "infer_results.json").read_text())["rungs"]
    assert [r["name"] for r in rungs] == ["kv", "compiled", "int8"]
    assert all(r["status"] == "skipped" and r["note"] == STOPPED and r["batch_sweep"] == [] for r in rungs)


def two_eager_rungs(monkeypatch: pytest.MonkeyPatch) -> tuple[list[InferRung], list[GptoptRunner]]:
    """kv twice, as two rungs; the runners in the order they were built (the rungs')."""
    built: list[GptoptRunner] = []
    real = GptoptRunner.__init__

    def init(self: GptoptRunner, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(self)

    monkeypatch.setattr(GptoptRunner, "__init__", init)
    return [RUNG["kv"], dataclasses.replace(RUNG["kv"], name="kv2")], built


def test_the_rungs_are_timed_side_by_side_batch_size_by_batch_size(
    bench: InferBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow minute of a shared machine must fall on every rung alike: within one batch size the rungs'
    generations take turns, round by round, instead of one rung's whole sweep after another's."""
    rungs, built = two_eager_rungs(monkeypatch)
    calls: list[tuple[int, int]] = []  # (rung, batch size) of every generation, in order
    real = GptoptRunner.generate

    def generate(self: GptoptRunner, prompts: list[list[int]], n: int, sampling: Sampling = GREEDY) -> list[list[int]]:
        calls.append((built.index(self), len(prompts)))
        return real(self, prompts, n, sampling)

    monkeypatch.setattr(GptoptRunner, "generate", generate)
    monkeypatch.setattr(bench, "results", [])
    summary = bench.run(rungs)
    assert all(r["status"] == "ok" and len(r["batch_sweep"]) == 2 for r in summary["rungs"]), summary["rungs"]
    at_2 = [rung for rung, b in calls if b == 2]
    first_2 = calls.index((at_2[0], 2))
    assert all(b == 2 for _, b in calls[first_2:])  # batch 1 done by every rung before batch 2 begins
    switches = sum(a != b for a, b in zip(at_2, at_2[1:], strict=False))
    assert switches >= bench.repeats  # one rung after the other would switch once
    assert at_2.count(0) == at_2.count(1) == 2 * (1 + bench.repeats)  # T(1) and T(N): a warm-up, then each round
    assert "side by side" in report.infer_markdown(summary, None)


def test_an_oom_in_one_rung_leaves_the_others_batch_sizes(bench: InferBench, monkeypatch: pytest.MonkeyPatch) -> None:
    rungs, built = two_eager_rungs(monkeypatch)
    real = GptoptRunner.generate

    def generate(self: GptoptRunner, prompts: list[list[int]], n: int, sampling: Sampling = GREEDY) -> list[list[int]]:
        if len(prompts) == 2 and self is built[1]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, prompts, n, sampling)

    monkeypatch.setattr(GptoptRunner, "generate", generate)
    monkeypatch.setattr(bench, "results", [])
    kv, kv2 = bench.run(rungs)["rungs"]
    assert kv["status"] == "ok" and kv["note"] == "" and [p["batch_size"] for p in kv["batch_sweep"]] == [1, 2]
    # the memory ran out with the other rung held beside it: the note says so, and how to find its own limit
    assert kv2["status"] == "ok" and kv2["note"] == ("out of memory at batch 2, with 1 other rung held beside it: "
                                                     "bench it alone (--rungs kv2) for its own limit")
    assert [p["batch_size"] for p in kv2["batch_sweep"]] == [1] and kv2["decode_tokens_per_s"] > 0
    assert built[1].gen is None  # its caches went at once, for the rungs still going


def test_batch_sizes_choose_the_sweep_and_batch_1_is_always_in_it(train_data: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def sweep_args(out: Path, *sizes: str) -> list[str]:
        args = infer_args(train_data, out, "kv")
        i = args.index("--batch_size")
        return [*args[:i], *args[i + 2:], *sizes]

    out = tmp_path / "b"
    assert cli.main(sweep_args(out, "--batch_sizes", "3")) == 0
    results = json.loads((out / "infer_results.json").read_text())
    assert results["batch_sizes"] == [1, 3]  # batch 1's figures head every rung
    assert [row["batch_size"] for row in results["rungs"][0]["batch_sweep"]] == [1, 3]
    for bad, says in ((["--batch_sizes", "0,8"], "1..65536"),
                      (["--batch_sizes", "8", "--batch_size", "8"], "not both")):
        with pytest.raises(SystemExit) as e:
            cli.main(sweep_args(tmp_path / "c", *bad))
        assert e.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--batch_sizes", "1,8"])  # the training ladder has no sweep
    assert "--mode infer" in capsys.readouterr().err


def test_a_reference_that_fails_leaves_the_matmul_precision_as_it_was(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ladder computes its reference in exact fp32; a reference that fails (out of memory, Ctrl-C) still gives
    the command back its own setting (TF32 where the device plan chose it)."""

    def out_of_memory(self: GptoptRunner, prompt: list[int]) -> torch.Tensor:
        raise torch.OutOfMemoryError("no room for the reference")

    monkeypatch.setattr(GptoptRunner, "last_logits", out_of_memory)
    had = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with pytest.raises(torch.OutOfMemoryError):
            InferBench(BenchConfig(mode="infer", preset="debug", seq_len=32, batch_size=2, warmup=1, device="cpu",
                                   data_dir=str(train_data), output_dir=str(tmp_path / "o")))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(had)
