"""The GPU check's figures: each step's few numbers worth a row, read from what its command wrote.

    pytest -q tests/test_gpu_check.py -k figures
    python3 .ci/gpu_check.py run DIR --only bench   # the runner reads a step's figures when it ends

Only the commands' own outputs (--json, run.json's summary, metrics.jsonl, the logs, serve's /metrics), never gptopt's
internals: the check runs before gptopt is installed. FIGURES names each step's reader.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_check_plan import INFER_FAMILY_STEPS, RANDOM_WEIGHTS, SIZES, larger_step


def _json(path: Path) -> Any:
    """A command's --json output: the whole file, or its last line (logs may precede it)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for candidate in (text, *text.strip().splitlines()[-1:]):
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


def _r(x: Any, nd: int = 1) -> Any:
    return round(x, nd) if isinstance(x, float) else x


def _gib(x: Any) -> Any:
    return round(x / 2**30, 2) if isinstance(x, (int, float)) else None


def fig_doctor(out: Path, _log: str) -> dict[str, Any]:
    d = _json(out / "doctor.json") or {}
    facts, gpus = d.get("facts", {}), d.get("facts", {}).get("gpus") or [{}]
    gpu = gpus[0] if isinstance(gpus[0], dict) else {}
    return {"gpu": gpu.get("name"), "gpu_memory_gib": _gib(gpu.get("memory_total")),
            "capability": gpu.get("capability"), "torch": facts.get("torch_version"), "cuda": facts.get("torch_cuda"),
            "driver": facts.get("driver"), "nccl": facts.get("nccl"), "device_policy": facts.get("device_reason"),
            "checks": d.get("summary"), "smoke": d.get("smoke")}


def fig_prepare(out: Path, _log: str) -> dict[str, Any]:
    meta = _json(out / "data" / "meta.json") or {}
    return {k: meta.get(k) for k in ("train_tokens", "val_tokens", "vocab_size") if k in meta}


def fig_pytest(out: Path, log: str) -> dict[str, Any]:
    try:
        root = ET.parse(out / "cuda_tests.xml").getroot()
    except (OSError, ET.ParseError):  # stopped before its report: the -v lines of the tests that ran
        seen = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", log, flags=re.M)
        started = re.findall(r"^(\S+::\S+)", log, flags=re.M)
        out: dict[str, Any] = {"ran": len(seen), "failed": [t for t, r in seen if r in ("FAILED", "ERROR")],
                               "passed": sum(r == "PASSED" for _, r in seen)} if seen else {}
        if started and started[-1] not in {t for t, _ in seen}:
            out["running_at_stop"] = started[-1]  # the test that hung, most likely
        return out
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    failed = [c.get("name") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = {c.get("name"): (c.find("skipped").get("message") or "")[:120] for c in suite.iter("testcase")
               if c.find("skipped") is not None}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed": failed, "skipped_why": skipped}


def _train(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        run = _json(out / name / "run.json") or {}
        summary, cfg = run.get("summary") or {}, run.get("config") or {}
        records = []
        try:
            records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
        except (OSError, ValueError):
            pass
        steps = [r for r in records if "loss" in r]
        median = summary.get("median_step_s")
        res = {"steps": summary.get("step"), "median_step_ms": _r(median * 1e3) if median else None,
               "tokens_per_s": _r(summary.get("tokens_per_s"), 0), "mfu": _r(summary.get("mfu"), 3),
               "peak": summary.get("peak_source"), "first_step_s": _r(summary.get("first_step_s")),
               "peak_memory_gib": _gib(summary.get("peak_memory_bytes")),
               "loss_first_last": [_r(steps[0]["loss"], 3), _r(steps[-1]["loss"], 3)] if steps else None,
               "micro_batch_x_accumulation": [cfg.get("batch_size"), cfg.get("gradient_accumulation_steps")],
               # the memory plan as it ran: the loss auto settled on, recomputation, FSDP, offload
               "plan": {"loss": (run.get("model") or {}).get("loss"), **{
                   k: cfg.get(k) for k in ("gradient_checkpointing", "fsdp", "cpu_offload", "fp8") if cfg.get(k)}},
               "amp": (run.get("environment") or {}).get("amp_dtype")}
        scales = [r["loss_scale"] for r in steps if "loss_scale" in r]
        if scales:
            res["loss_scale_first_last"] = [scales[0], scales[-1]]
        monitor = _json(out / name / "monitor.json") or {}  # NVML, sampled through the run
        if monitor.get("gpu_available"):
            res["nvml"] = {k.removeprefix("gpu0_"): _r(v.get("mean" if "pct" in k or "power" in k else "max"), 1)
                           for k, v in monitor.items() if k.startswith("gpu0_") and isinstance(v, dict)
                           and any(t in k for t in ("util_pct", "power_w", "sm_clock", "temp_c"))}
        elif monitor.get("gpu_reason"):
            res["nvml"] = monitor["gpu_reason"]
        return {k: v for k, v in res.items() if v not in (None, [None, None])}
    return figures


def _rung(r: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    out = {"status": r.get("status")}
    out.update({k: _r(r.get(k), 3) for k in keys if r.get(k) is not None})
    if r.get("note"):
        out["note"] = r["note"][:160]
    return out


def fig_bench_at(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        d = _json(out / name / "results.json") or _json(out / f"{name}.json") or {}
        rungs = {r["name"]: _rung(r, ("tokens_per_s", "mfu", "speedup_vs_baseline", "compile_s", "loss_ok"))
                 for r in d.get("rungs", [])}
        return {"best": d.get("best"), "peak": d.get("peak_source") or d.get("peak"), "rungs": rungs} if rungs else {}
    return figures


fig_bench = fig_bench_at("bench")


def _infer(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        d = _json(out / name / "infer_results.json") or _json(out / f"{name}.json") or {}
        rungs = {}
        for r in d.get("rungs", []):
            row = _rung(r, ("decode_tokens_per_s", "bandwidth_gbs", "bandwidth_util", "speedup_vs_baseline",
                            "ttft_s", "tokens_match"))
            sweep = r.get("batch_sweep") or []
            if sweep:
                row["top_batch"] = [sweep[-1]["batch_size"], _r(sweep[-1]["tokens_per_s"], 0)]
            if r.get("lever_gain"):  # a lever rung's: kv's rate over its own, [batch size, gain] at each
                row["lever_gain"] = [[g["batch_size"], _r(g["gain"], 3)] for g in r["lever_gain"]]
            rungs[r["name"]] = row
        if not rungs:
            return {}
        peak = d.get("peak_bandwidth")
        return {"weights": RANDOM_WEIGHTS, "peak_bandwidth_gbs": _r(peak / 1e9) if peak else None,
                "bandwidth_source": d.get("bandwidth_source"), "temperature": d.get("temperature", 0.0),
                "rungs": rungs}
    return figures


def fig_generate(_out: Path, log: str) -> dict[str, Any]:
    """generate --compile's decode rate after the compile; the whole-run rate (mostly compile) beside it."""
    whole = re.search(r"gptopt generate: (\d+) tokens in ([\d.]+) s: ([\d,.]+) tokens/s", log)
    after = re.search(r"compiled decode after the first \d+ tokens \(([\d.]+) s\): ([\d,.]+) tokens/s", log)
    out: dict[str, Any] = {}
    if whole:
        out.update(tokens=int(whole[1]), whole_run_s=float(whole[2]))
    if after:
        out.update(compile_and_warmup_s=float(after[1]), tokens_per_s=float(after[2].replace(",", "")))
    elif whole:
        out["note"] = "no compiled decode rate: too few tokens came after the compile (an early end of text?)"
    return out


def _compress(name: str) -> Callable[[Path, str], dict[str, Any]]:
    def figures(out: Path, _log: str) -> dict[str, Any]:
        d = _json(out / name / "results.json") or _json(out / f"{name}.json") or {}
        if not d:
            return {}
        orig, comp = d.get("original") or {}, d.get("compressed") or {}
        res: dict[str, Any] = {"method": d.get("method")}
        for key in ("disk_bytes", "memory_bytes"):
            if orig.get(key) and comp.get(key):
                res[f"{key.split('_')[0]}_ratio"] = _r(comp[key] / orig[key], 3)
        res["decode_tokens_per_s"] = {name: {b: _r(v, 0) for b, v in (m.get("decode_tokens_per_s") or {}).items()}
                                      for name, m in (("original", orig), ("compressed", comp))}
        res["perplexity"] = [_r(orig.get("perplexity"), 3), _r(comp.get("perplexity"), 3)]
        res["kl"] = _r(comp.get("kl_divergence"), 5)
        return res
    return figures


def fig_profile(out: Path, _log: str) -> dict[str, Any]:
    d = _json(out / "profile.json") or {}
    if not d:
        return {}
    figures = {k: _r(v, 3) for k, v in (d.get("figures") or {}).items() if isinstance(v, (int, float))}
    return {"figures": figures, "findings": [f"{f.get('name')}: {f.get('figure')} -> {f.get('fix')}"
                                             for f in d.get("findings") or []][:4]}


# serve's log line after its warm-up (serve/engine.py): "compiled the decode for batches of 1, 2, 4 in S s",
# or without --compile on a GPU "recorded CUDA graphs of the decode for batches of ..."
DECODE_GRAPHS = re.compile(r"(?:compiled|recorded CUDA graphs of) the decode for batches of ([\d, ]+) in ([\d.]+) s")


# serve's start-up line (infer/generator_memory.KVPlan.line): the KV cache's memory, where it came from, its tokens
# and blocks, the requests decoded at once (and why fewer than the default, if so), the longest sequence
KV_LINE = re.compile(r"KV cache: ([\d.]+) GiB \((.*?)\), ([\d,]+) tokens in ([\d,]+) blocks of (\d+); up to (\d+) "
                     r"requests at once(.*?), each up to ([\d,]+) tokens")


def kv_plan(log: str) -> dict[str, Any]:
    """The KV cache serve planned, from its start-up line ({} where the log has none)."""
    m = KV_LINE.search(log)
    if not m:
        return {}
    n = [int(x.replace(",", "")) for x in (m[3], m[4], m[5], m[6], m[8])]
    out: dict[str, Any] = {"gib": float(m[1]), "source": m[2], "tokens": n[0], "blocks": n[1], "block_size": n[2],
                           "max_batch_size": n[3], "max_len": n[4]}
    if m[7].strip():
        out["batch_note"] = m[7].strip(" ()")
    return out


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text (serve's /metrics): each unlabelled sample's value by its name. (loadtest reads its figures
    with its own parser; the check imports nothing of gptopt's: it runs before the install.)"""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name and not name.startswith("#") and "{" not in name:
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def kv_metrics(now: dict[str, float], before: dict[str, float] | None = None,
               peak: float | None = None) -> dict[str, Any]:
    """The paged KV cache's figures from two scrapes of serve's /metrics (names as vLLM's, gptopt_ for vllm:):
    its usage now, or at its peak where it was sampled between them; the preemptions and the share of prompt
    tokens the prefix cache served, since `before` (or since the start)."""
    before = before or {}

    def since(name: str) -> float | None:
        return now[name] - before.get(name, 0.0) if name in now else None

    out: dict[str, Any] = {}
    if peak is not None:
        out["kv_cache_usage_peak"] = round(peak, 3)
    elif "gptopt_kv_cache_usage_perc" in now:
        out["kv_cache_usage"] = round(now["gptopt_kv_cache_usage_perc"], 3)
    preempted = since("gptopt_num_preemptions_total")
    if preempted is not None:
        out["preemptions"] = int(preempted)
    queries, hits = since("gptopt_prefix_cache_queries_total"), since("gptopt_prefix_cache_hits_total")
    if queries and hits is not None:
        out["prefix_cache_hit_share"] = round(hits / queries, 3)
    return out


def decode_rates(doc: Any, rung: str) -> dict[str, Any]:
    """bench --mode infer's JSON -> the rung's status and its decode tokens/s at each batch size of its sweep."""
    if not isinstance(doc, dict):
        return {"status": "failed", "note": "bench wrote no results"}
    r = next((r for r in doc.get("rungs") or [] if r.get("name") == rung), None)
    if r is None:
        return {"status": "failed", "note": f"bench's results hold no rung {rung}"}
    out: dict[str, Any] = {"rung": rung, "status": r.get("status"), "prompt_tokens": doc.get("prompt_len"),
                           "new_tokens": doc.get("max_new_tokens"),
                           "tokens_per_s": {str(b["batch_size"]): _r(b["tokens_per_s"], 1)
                                            for b in r.get("batch_sweep") or []}}
    if r.get("note"):
        out["note"] = r["note"][:160]
    return out


def compared(figures: dict[str, Any]) -> dict[str, Any]:
    """The serve step's figures with issue 35's comparisons added (a new dict; `figures` is left as it was):
    beside each client count C, bench's decode tokens/s at batch C and the share (serve's output tokens/s over
    it); and at each client count the peer ran, gptopt's output tokens/s over transformers serve's
    (vs_transformers). A comparison whose either side is missing is left out."""
    out = dict(figures)
    decode = (figures.get("decode") or {}).get("tokens_per_s") or {}
    peer = figures.get("peer_transformers") or {}
    ratios = {}
    for key, row in figures.items():
        if not key.startswith("clients_") or not isinstance(row, dict):
            continue
        ours = row.get("output_tokens_per_s")
        if not isinstance(ours, (int, float)):
            continue
        rate = decode.get(key.removeprefix("clients_"))
        if isinstance(rate, (int, float)) and rate > 0:
            out[key] = {**row, "decode_tokens_per_s": rate, "share": round(ours / rate, 3)}
        theirs = (peer.get(key) or {}).get("output_tokens_per_s")
        if isinstance(theirs, (int, float)) and theirs > 0:
            ratios[key] = round(ours / theirs, 2)
    if ratios:
        out["vs_transformers"] = ratios
    return out


def fig_train_fp8(out: Path, log: str) -> dict[str, Any]:
    """train_fp8's own figures, and beside train's bf16 run of the same steps: the tokens/s ratio and the
    largest relative gap between the two loss curves at the steps both logged."""
    res = _train("train_fp8")(out, log)

    def curve(name: str) -> dict[int, float]:
        try:
            lines = (out / name / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return {}
        return {r["step"]: r["loss"] for r in map(json.loads, filter(None, lines)) if "loss" in r}

    fp8, bf16 = curve("train_fp8"), curve("train")
    both = sorted(set(fp8) & set(bf16))
    if both:
        res["vs_bf16_loss_max_rel_gap"] = _r(max(abs(fp8[k] - bf16[k]) / abs(bf16[k]) for k in both), 4)
    theirs = _train("train")(out, log).get("tokens_per_s")
    if res.get("tokens_per_s") and theirs:
        res["vs_bf16_tokens_per_s"] = _r(res["tokens_per_s"] / theirs, 3)
    return res


def fig_train_modern(out: Path, log: str) -> dict[str, Any]:
    """train_modern's own figures, and its tokens/s over train's of the same model, batch and steps: what the
    modern block and Muon cost per step (their losses differ by design, so no curve is set beside train's)."""
    res = _train("train_modern")(out, log)
    theirs = _train("train")(out, log).get("tokens_per_s")
    if res.get("tokens_per_s") and theirs:
        res["vs_train_tokens_per_s"] = _r(res["tokens_per_s"] / theirs, 3)
    return res


FIGURES: dict[str, Callable[[Path, str], dict[str, Any]]] = {
    "doctor": fig_doctor, "prepare": fig_prepare, "cuda_tests": fig_pytest, "bench": fig_bench,
    "bench_levers": fig_bench_at("bench_levers"), "train_fp8": fig_train_fp8, "train_modern": fig_train_modern,
    "train_smollm2": _train("train_smollm2"), "train_qwen3": _train("train_qwen3"), "generate_llama": fig_generate,
    **{larger_step(m): _train(larger_step(m)) for size in SIZES.values() for m in size.larger},
    "bench_infer": _infer("bench_infer"), "decode_large": _infer("decode_large"), "generate": fig_generate,
    "speculative": _infer("speculative"),
    **{n: _infer(n) for n in INFER_FAMILY_STEPS},
    "profile": fig_profile,
    **{n: _train(n) for n in ("train", "train_fp16", "train_ckpt", "train_auto_batch", "train_ddp", "train_fsdp")},
    **{n: _compress(n) for n in ("compress_int8", "compress_int4", "compress_2_4")},
}
