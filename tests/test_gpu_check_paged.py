"""The GPU check's steps of the paged engine (issue 55): serve's start-up line and KV-cache figures read back as
serve writes them, and serve_preempt, a server whose KV cache is too small for its clients.

    pytest -q tests/test_gpu_check_paged.py              # the figures and the plan (seconds)
    pytest -q -m slow tests/test_gpu_check_paged.py      # serve_preempt rehearsed on the CPU (minutes)
"""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

from gptopt.infer.generator_memory import KVPlan
from gptopt.serve.metrics import ServeMetrics

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "gpu_check.py"

gc = load_script("gpu_check")
gc_plan, gc_figures = (importlib.import_module(f"gpu_check_{part}") for part in ("plan", "figures"))


def test_the_start_up_line_is_read_back_as_serve_writes_it() -> None:
    plan = KVPlan(num_blocks=80, block_size=16, block_bytes=16 * 36864, max_batch_size=16, max_len=384, forward=0,
                  source="--kv_cache_memory 0.045")
    log = f"INFO gptopt.serve.startup: {plan.line()}\nINFO warm-up: a prefill of 384 tokens\n"
    assert gc_figures.kv_plan(log) == {"gib": round(plan.bytes / 2**30, 2), "source": "--kv_cache_memory 0.045",
                                       "tokens": 1280, "blocks": 80, "block_size": 16, "max_batch_size": 16,
                                       "max_len": 384}
    lowered = KVPlan(num_blocks=65536, block_size=16, block_bytes=36864, max_batch_size=7, max_len=40960, forward=0,
                     source="default: 0.9 of the device's 79.1 GiB less the weights and a forward",
                     batch_note=" (the most whose forwards fit the memory)")
    got = gc_figures.kv_plan(lowered.line())
    assert (got["tokens"], got["blocks"], got["max_len"]) == (1048576, 65536, 40960)  # thousands separators read
    assert got["source"].startswith("default: 0.9") and got["batch_note"] == "the most whose forwards fit the memory"
    assert gc_figures.kv_plan("a log of a server that never planned one") == {}


def test_the_kv_figures_are_read_from_serves_metrics_as_it_renders_them() -> None:
    """Usage (at its peak where it was sampled), and the preemptions and prefix-cache hits a load caused: the
    difference of two scrapes, so what earlier loads did is not counted again."""
    now = {"usage": 0.0, "preemptions": 2}
    metrics = ServeMetrics(http=False)
    metrics.bind_kv_cache(lambda: now["usage"], lambda: now["preemptions"])
    before = gc_figures.metric_samples(metrics.render().decode())
    metrics.prefix_queries.inc(400)
    metrics.prefix_hits.inc(100)
    now.update(usage=0.25, preemptions=7)
    after = gc_figures.metric_samples(metrics.render().decode())
    assert after["gptopt_kv_cache_usage_perc"] == 0.25 and after["gptopt_num_preemptions_total"] == 7
    assert gc_figures.kv_metrics(after, before, peak=0.9) == {"kv_cache_usage_peak": 0.9, "preemptions": 5,
                                                              "prefix_cache_hit_share": 0.25}
    assert gc_figures.kv_metrics(after) == {"kv_cache_usage": 0.25, "preemptions": 7, "prefix_cache_hit_share": 0.25}
    assert gc_figures.kv_metrics({}) == {}  # a server without the series: nothing made up


def test_serve_preempt_fails_unless_it_preempted_and_every_request_completed() -> None:
    check = gc_plan.preempted_and_completed
    ok = {"requests": 32, "completed": 32, "errors": {}}
    assert check({"kv_cache": {}, "clients_16": {**ok, "preemptions": 3}, "shared_prefix_16": ok}) is None
    assert "no request was preempted" in check({"clients_16": {**ok, "preemptions": 0}})
    failed = {**ok, "completed": 30, "errors": {"500": 2}, "preemptions": 3}
    assert "shared_prefix_16" in check({"clients_16": {**ok, "preemptions": 3}, "shared_prefix_16": failed})


def test_serve_preempt_runs_more_clients_than_its_kv_cache_holds_in_the_default_run(tmp_path: Path) -> None:
    assert gc.main(["dry-run", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    step = next(r for r in doc["steps"] if r["name"] == "serve_preempt")
    gpu = gc_plan.SIZES["gpu"]
    serve = shlex.split(step["command"])
    flag = {a: serve[i + 1] for i, a in enumerate(serve[:-1]) if a.startswith("--")}
    max_len = int(flag["--max_len"])
    # gpt2 in bf16: 36 KiB of keys and values a token; the pool is what the start-up line will say
    blocks = int(float(flag["--kv_cache_memory"]) * 2**30) // (int(flag["--block_size"]) * 36864) - 1
    assert -(-max_len // int(flag["--block_size"])) <= blocks  # one sequence of --max_len fits: not refused
    request = gpu.prompt_tokens + gpu.serve_tokens
    assert blocks * int(flag["--block_size"]) < gpu.preempt_clients * request // 2  # under half the clients fit
    plain, shared = (shlex.split(lt) for lt in step["loadtests"])
    assert "--shared_prefix" not in plain and shared[shared.index("--shared_prefix") + 1] == str(gpu.prompt_tokens)
    assert all(lt[lt.index("--concurrency") + 1] == str(gpu.preempt_clients) for lt in (plain, shared))
    assert max_len >= 2 * gpu.prompt_tokens + gpu.serve_tokens  # the shared prefix's requests are admitted
    assert doc["planned_s"] < 540


@pytest.mark.slow
def test_serve_preempt_runs_on_the_cpu(tmp_path: Path) -> None:
    """The rehearsal of serve_preempt: the debug model's server preempts, every request completes, and the
    shared-prefix load is served from the prefix cache."""
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path), "--target", "cpu", "--only",
                           "prepare,train,serve_preempt"], capture_output=True, text=True, timeout=3600)
    by = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["steps"]}
    assert by["serve_preempt"]["status"] == "ok", done.stdout[-3000:]
    fig, cpu = by["serve_preempt"]["figures"], gc_plan.SIZES["cpu"]
    assert fig["kv_cache"]["source"] == f"--kv_cache_memory {cpu.preempt_kv_gib:g}"
    assert fig["kv_cache"]["block_size"] == cpu.preempt_block
    c = cpu.preempt_clients
    plain, shared = fig[f"clients_{c}"], fig[f"shared_prefix_{c}"]
    assert plain["preemptions"] > 0 and plain["completed"] == plain["requests"] == 2 * c and not plain["errors"]
    assert shared["completed"] == 2 * c and shared["prefix_cache_hit_share"] > 0
    assert fig["kv_at_end"]["preemptions"] == plain["preemptions"] + shared["preemptions"]
