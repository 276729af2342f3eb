"""Bench output: the terminal table, report.md, results.json / .csv, PNG plots and best.toml; and the
same for the inference ladder (`--mode infer`): infer_report.md, infer_results.json / .csv, a sweep plot.

    python -c "import json, gptopt.bench.report as r; print(r.table(json.load(open('bench_out/results.json'))))"
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from gptopt.config.sampling import describe
from gptopt.outputs import check_output, replacing
from gptopt.utils.extras import has
from gptopt.utils.tables import fmt, md_table, text_table, toml_text

log = logging.getLogger("gptopt")

CSV_FIELDS = ["name", "status", "batch_size", "tokens_per_s", "step_time_s", "step_time_p10_s", "step_time_p90_s",
              "compile_s", "tflops", "mfu", "peak_mem_bytes", "reserved_mem_bytes", "loss", "loss_ok",
              "speedup_vs_baseline", "speedup_vs_previous", "note"]


# What each ladder writes into --output_dir: on --overwrite these, and only these, are replaced. Each mode
# replaces only its own, so bench_out holds both ladders' reports side by side.
TRAIN_FILES = ("results.json", "results.csv", "best.toml", "report.md", "throughput.png", "memory.png",
               "step_times.png")
INFER_FILES = ("infer_results.json", "infer_results.csv", "infer_report.md", "infer_batch_sweep.png")
QUALITY_FILES = ("quality_results.json", "quality_report.md", "quality.png", "quality_best.toml")
KIND = "bench"  # the outputs mark of a folder bench wrote into


def check_output_dir(out: Path, mode: str, overwrite: bool) -> None:
    """Refused before any work: an --output_dir that is a file or cannot be written, one holding this mode's
    report of an earlier run without --overwrite, and with it one gptopt did not mark as a bench output."""
    ours = {"infer": INFER_FILES, "quality": QUALITY_FILES}.get(mode, TRAIN_FILES)
    check_output(out, kind=KIND, overwrite=overwrite, ours=ours)


COLUMNS = [("rung", "name", "str"), ("tokens/s", "tokens_per_s", "int"), ("step ms (p10-p90)", None, "range"),
           ("first step s", "compile_s", "s"), ("MFU", "mfu", "pct"), ("peak MiB", "peak_mem_bytes", "mib"),
           ("loss", "loss", "f"), ("loss ok", "loss_ok", "str"), ("vs baseline", "speedup_vs_baseline", "x"),
           ("vs previous", "speedup_vs_previous", "x"), ("status", "status", "str")]


def rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in summary["rungs"]:
        row = []
        for _, key, kind in COLUMNS:
            if kind == "range":
                row.append("-" if r["step_time_s"] is None else
                           f"{r['step_time_s'] * 1e3:,.1f} "
                           f"({r['step_time_p10_s'] * 1e3:,.0f}-{r['step_time_p90_s'] * 1e3:,.0f})")
            else:
                row.append(fmt(r[key], kind))
        out.append(row)
    return out


def table(summary: dict[str, Any]) -> str:
    head = [c[0] for c in COLUMNS]
    body = rows(summary)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    notes = [f"  {r['name']}: {r['note']}" for r in summary["rungs"] if r.get("note")]
    title = (f"{summary['preset']} @ {summary['seq_len']} tokens x {summary['batch_size']}; MFU against "
             f"{summary['peak_source']}")
    return "\n".join([title, line(head), line(["-" * w for w in widths]), *map(line, body), *notes])


def markdown(summary: dict[str, Any], plots: list[str], best_toml: str | None) -> str:
    head = [c[0] for c in COLUMNS]
    md = [f"# gptopt bench: {summary['preset']}", ""]
    env = summary["environment"]
    md += [f"- device: {env.get('device_name', env.get('device'))} ({summary['device_policy']})",
           f"- torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}, gptopt {env['gptopt']}",
           f"- model: {summary['params'] / 1e6:.2f}M parameters, {summary['flops_per_token'] / 1e6:.1f} MFLOP/token "
           f"(6N + 12LdT); sequence {summary['seq_len']}, micro-batch {summary['batch_size']}",
           f"- {summary['warmup']} warm-up + {summary['steps']} timed steps per rung, device-synchronised; "
           f"MFU against {summary['peak_source']}", ""]
    md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(r) + " |" for r in rows(summary)]
    md += ["", "## What each rung changes", ""]
    md += [f"- **{r['name']}**: {r['what']}" + (f" — {r['note']}" if r.get("note") else "") for r in summary["rungs"]]
    md += ["", "## Recommendation", ""]
    best = next((r for r in summary["rungs"] if r["name"] == summary["best"]), None)
    if best is None:
        md.append("No rung finished with a matching loss; see the notes above.")
    else:
        s = best["config"]
        flags = ["--use_amp" if s["use_amp"] else "", "--compile" if s["compile"] else "",
                 f"--attention {s['attention']}", f"--batch_size {s['batch_size']}"]
        md.append(f"Fastest rung with a matching loss: **{best['name']}**, {best['tokens_per_s']:,.0f} tokens/s, "
                  f"{best['speedup_vs_baseline']:.2f}x the baseline ({summary['baseline']}), MFU {best['mfu']:.1%}.")
        md.append(f"Train with it: `gptopt train --config best.toml` (or `{' '.join(f for f in flags if f)}`).")
        if best_toml:
            md += ["", "```toml", best_toml.rstrip(), "```"]
    if plots:
        md += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    if summary.get("monitor"):
        md += ["", "## Monitor", "", summary["monitor"]]
    return "\n".join(md) + "\n"


BEST_TOML_HEADER = ("# written by `gptopt bench`: the fastest rung whose loss matched the baseline",
                    "# gptopt train --config best.toml")


def plot(summary: dict[str, Any], out: Path) -> list[str]:
    """PNG plots (plot extra): tokens/s and speedup, peak memory, step-time distribution per rung."""
    if not has("matplotlib"):
        log.info("plots skipped: pip install 'gptopt[plot]'")
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    ok = [r for r in summary["rungs"] if r["status"] in ("ok", "failed") and r["tokens_per_s"]]
    if not ok:
        return []
    names = [r["name"] for r in ok]
    files = []
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(names, [r["tokens_per_s"] for r in ok], color=["#c44" if r["status"] != "ok" else "#4a7" for r in ok])
    for b, r in zip(bars, ok, strict=True):
        ax.annotate(f"{r['speedup_vs_baseline']:.2f}x" if r["speedup_vs_baseline"] else "",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{summary['preset']}: throughput per rung (speedup vs {summary['baseline']})")
    plt.xticks(rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    files.append("throughput.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, [(r["peak_mem_bytes"] or 0) / 2**20 for r in ok], color="#47a")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory per rung")
    plt.xticks(rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    files.append("memory.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.boxplot([[t * 1e3 for t in r["step_times_s"]] for r in ok])
    ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right")
    ax.set_ylabel("step time (ms)")
    ax.set_title("step-time distribution")
    fig.tight_layout()
    fig.savefig(out / "step_times.png", dpi=110)
    files.append("step_times.png")
    plt.close(fig)
    return files


def write_all(summary: dict[str, Any], out: Path, best_opts: dict[str, Any] | None) -> None:
    # No file list in the mark: each mode's files are known by name, so one mode's rerun never claims the other's.
    with replacing(out, kind=KIND, ours=TRAIN_FILES, list_files=False):
        _write_all(summary, out, best_opts)


def _write_all(summary: dict[str, Any], out: Path, best_opts: dict[str, Any] | None) -> None:
    (out / "results.json").write_text(json.dumps(summary, indent=2, default=str))
    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(summary["rungs"])
    best_toml = toml_text(best_opts, BEST_TOML_HEADER) if best_opts else None
    if best_toml:
        (out / "best.toml").write_text(best_toml)
    plots = plot(summary, out)
    (out / "report.md").write_text(markdown(summary, plots, best_toml))


# ----------------------------------------------------------------------------------------------
# `gptopt bench --mode infer` (bench/infer_ladder.py): infer_report.md, infer_results.json / .csv, sweep plot

INFER_COLUMNS = [("rung", "name", "str"), ("prefill ms", "prefill_s", "ms"), ("TTFT ms", "ttft_s", "ms"),
                 ("decode tok/s", "decode_tokens_per_s", "int"), ("GB/s", "bandwidth_gbs", "s"),
                 ("of peak", "bandwidth_util", "pct"), ("tokens match", "tokens_match", "pct"),
                 ("max logit diff", "max_logit_diff", "f"), ("vs baseline", "speedup_vs_baseline", "x"),
                 ("status", "status", "str")]


def _infer_rows(summary: dict[str, Any]) -> list[list[str]]:
    return [[fmt(r[key], kind) for _, key, kind in INFER_COLUMNS] for r in summary["rungs"]]


def _sweep_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["rung"] + [f"b{b}" for b in summary["batch_sizes"]]
    body = []
    for r in summary["rungs"]:
        tps = {p["batch_size"]: p["tokens_per_s"] for p in r["batch_sweep"]}
        body.append([r["name"]] + [fmt(tps.get(b), "int") for b in summary["batch_sizes"]])
    return head, body


def _bandwidth_bound(summary: dict[str, Any]) -> str:
    if summary["peak_bandwidth"]:
        return f"bandwidth against {summary['bandwidth_source']}"
    return f"achieved GB/s only: the bound is unknown ({summary['bandwidth_source']})"


def _decoding(summary: dict[str, Any]) -> str:
    """How the timed generations chose their tokens (reports written before --temperature were greedy, before
    --top_k and --top_p sampled the whole vocabulary)."""
    return describe(summary.get("temperature") or 0.0, summary.get("top_k"), summary.get("top_p", 1.0))


def infer_table(summary: dict[str, Any]) -> str:
    title = (f"{summary['preset']} ({summary['dtype']}): prompt {summary['prompt_len']} tokens, "
             f"{summary['max_new_tokens']} new, {_decoding(summary)}; {_bandwidth_bound(summary)}")
    notes = [f"  {r['name']}: {r['note']}" for r in summary["rungs"] if r["note"]]
    sweep = text_table(*_sweep_rows(summary))
    return "\n".join([title, text_table([c[0] for c in INFER_COLUMNS], _infer_rows(summary)), *notes,
                      "", f"decode tokens/s by batch size (the rungs side by side, {summary['repeats']} rounds)",
                      sweep])


def infer_markdown(summary: dict[str, Any], plot_file: str | None) -> str:
    env, s = summary["environment"], summary
    md = [f"# gptopt bench --mode infer: {s['preset']}", "",
          f"- device: {env.get('device_name', env.get('device'))} ({s['device_policy']})",
          f"- torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}, gptopt {env['gptopt']}",
          f"- model: {s['params'] / 1e6:.2f}M parameters, random weights (std 0.5: greedy text varies), "
          f"{s['dtype']} unless the rung says otherwise",
          f"- {s['prompt_len']}-token prompts from the val split, {s['max_new_tokens']} new tokens, {_decoding(s)}; "
          f"{s['warmup']} untimed warm-up run(s), then medians of {s['steps']} (prefill, TTFT) and "
          f"{s['repeats']} (generations), device-synchronised",
          f"- the batch sweep's rungs timed side by side: at each batch size, {s['repeats']} rounds of every "
          "rung's generations in turn (the order reversed every other round), so a slow spell falls on all",
          "- decode tokens/s leave prefill out; bytes per token = weights + KV cache read at batch 1; "
          + _bandwidth_bound(s),
          f"- tokens match: the first {s['agree_tokens']} greedy tokens against the baseline "
          f"({s['baseline']}); max logit diff: against fp32 gptopt on the same prompt", ""]
    md += md_table([c[0] for c in INFER_COLUMNS], _infer_rows(s))
    md += ["", "## Decode tokens/s by batch size", "", *md_table(*_sweep_rows(s))]
    levers = [r for r in s["rungs"] if r.get("lever_gain")]
    if levers:
        head = ["lever taken away"] + [f"b{b}" for b in s["batch_sizes"]]
        rows = [[r["name"]] + [fmt({g["batch_size"]: g["gain"] for g in r["lever_gain"]}.get(b), "x")
                               for b in s["batch_sizes"]] for r in levers]
        md += ["", "## What each lever buys: kv's decode tokens/s over the rung without it", "", *md_table(head, rows)]
    md += ["", "## What each rung changes", ""]
    md += [f"- **{r['name']}**: {r['what']}" + (f" — {r['note']}" if r["note"] else "") for r in s["rungs"]]
    md += ["", f"![batch sweep]({plot_file})"] if plot_file else []
    return "\n".join(md) + "\n"


def infer_plot(summary: dict[str, Any], out: Path) -> str | None:
    """infer_batch_sweep.png (plot extra): decode tokens/s against batch size, one line per rung."""
    curves = [r for r in summary["rungs"] if r["batch_sweep"]]
    if not has("matplotlib") or not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in curves:
        sweep = r["batch_sweep"]
        ax.plot([p["batch_size"] for p in sweep], [p["tokens_per_s"] for p in sweep], "o-", label=r["name"])
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s",
           title=f"{summary['preset']}: decode throughput by batch size")
    ax.set_xticks(summary["batch_sizes"], [str(b) for b in summary["batch_sizes"]])
    ax.xaxis.set_minor_locator(plt.NullLocator())  # the batch sizes alone label the axis
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "infer_batch_sweep.png", dpi=110)
    plt.close(fig)
    return "infer_batch_sweep.png"


def write_infer(summary: dict[str, Any], out: Path) -> None:
    with replacing(out, kind=KIND, ours=INFER_FILES, list_files=False):
        _write_infer(summary, out)


def _write_infer(summary: dict[str, Any], out: Path) -> None:
    (out / "infer_results.json").write_text(json.dumps(summary, indent=2, default=str))
    fields = [key for _, key, _ in INFER_COLUMNS] + ["bytes_per_token", "dtype", "note"]
    with open(out / "infer_results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields + [f"tokens_per_s_b{b}" for b in summary["batch_sizes"]],
                           extrasaction="ignore")
        w.writeheader()
        for r in summary["rungs"]:
            sweep = {f"tokens_per_s_b{p['batch_size']}": p["tokens_per_s"] for p in r["batch_sweep"]}
            w.writerow({**r, **sweep})
    (out / "infer_report.md").write_text(infer_markdown(summary, infer_plot(summary, out)))
