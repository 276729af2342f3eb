"""`gptopt tune` output: the terminal table, tune_report.md, tune_results.json / .csv, tune.png and tune.toml.

    python -c "import json, gptopt.commands.tune_report as r; print(r.table(json.load(open('tune_results.json'))))"
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from gptopt.outputs import check_output, replacing
from gptopt.utils.extras import has
from gptopt.utils.tables import fmt, md_table, text_table, toml_text

log = logging.getLogger("gptopt")

# What tune writes into --output_dir: on --overwrite these, and only these, are replaced.
FILES = ("tune.toml", "tune_report.md", "tune_results.json", "tune_results.csv", "tune.png")
KIND = "tune"  # the outputs mark of a folder tune wrote into
TUNE_TOML_HEADER = ("# written by `gptopt tune`: the fastest candidate whose loss matched the fp32 reference",
                    "# gptopt train --config tune.toml")
CSV_FIELDS = ["index", "stage", "name", "settings", "status", "batch_size", "gradient_accumulation_steps",
              "tokens_per_s", "step_time_s", "compile_s", "mfu", "peak_mem_bytes", "reserved_mem_bytes",
              "data_wait_frac", "loss", "loss_ok", "speedup_vs_baseline", "note"]
HEAD = ["#", "stage", "candidate", "settings", "tokens/s", "step ms", "first step s", "MFU", "peak MiB", "loss",
        "loss check", "vs defaults", "status"]


def _head(summary: dict[str, Any]) -> list[str]:
    # on a CPU the process's peak resident memory: its growth within one candidate says little
    return [("RSS MiB" if h == "peak MiB" and summary["memory_column"] == "reserved_mem_bytes" else h) for h in HEAD]


def label(c: dict[str, Any]) -> str:
    """A candidate's settings (its TrainConfig, and the model) in one short line: attention dtype micro-batch x
    accumulation, then the switches."""
    s = c["config"]
    parts = ["hf" if c["hf"] else s["attention"], s["amp_dtype"] if s["use_amp"] else "fp32",
             f"{s['batch_size']}x{s['gradient_accumulation_steps']}"]
    if s["fused_optimizer"]:
        parts.append("fused")
    if s["gradient_checkpointing"]:
        parts.append("ckpt")
    if s.get("num_workers"):
        parts.append(f"{s['num_workers']}w/prefetch {s.get('prefetch_factor')}")
    if s.get("pin_memory"):
        parts.append("pinned")
    if s["compile"]:
        parts.append("compile" if s["compile_mode"] == "default" else f"compile {s['compile_mode']}")
    return " ".join(parts)


def _loss_check(c: dict[str, Any]) -> str:
    return {True: "ok", False: "departs"}.get(c["loss_ok"], "-")


def rows(summary: dict[str, Any]) -> list[list[str]]:
    win = summary["best"]["index"]
    out = []
    for c in summary["candidates"]:
        out.append([str(c["index"]) + (" *" if c["index"] == win else ""), c["stage"], c["name"], label(c),
                    fmt(c["tokens_per_s"], "int"), fmt(c["step_time_s"], "ms"), fmt(c["compile_s"], "s"),
                    fmt(c["mfu"], "pct"), fmt(c[summary["memory_column"]], "mib"), fmt(c["loss"], "f"), _loss_check(c),
                    fmt(c["speedup_vs_baseline"], "x"), c["status"]])
    return out


def _title(summary: dict[str, Any]) -> str:
    return (f"{summary['preset']} @ {summary['seq_len']} tokens, global batch {summary['global_batch']} sequences "
            f"({summary['global_batch_tokens']:,} tokens per optimizer step); MFU against {summary['peak_source']}")


def _notes(summary: dict[str, Any]) -> list[str]:
    return [f"#{c['index']} {c['name']}: {c['status']}: {c['note']}" for c in summary["candidates"] if c["note"]]


def _gains(summary: dict[str, Any]) -> list[str]:
    best, ref = summary["best"], summary["defaults"]
    lines = [f"{summary['gain_vs_defaults']:.2f}x gptopt's defaults (#{ref['index']}, "
             f"{ref['tokens_per_s']:,.0f} tokens/s)"]
    if summary["hf"]:
        hf = summary["hf"]
        lines.append(f"{summary['gain_vs_hf']:.2f}x the Hugging Face baseline (#{hf['index']}, "
                     f"{hf['tokens_per_s']:,.0f} tokens/s)")
    else:
        lines.append(f"the Hugging Face baseline was not measured: {summary['hf_note']}")
    if summary["bench_all"]:
        ba = summary["bench_all"]
        lines.append(f"{best['tokens_per_s'] / ba['tokens_per_s']:.2f}x gptopt bench's `all` rung on the same settings "
                     f"(#{ba['index']}, {ba['tokens_per_s']:,.0f} tokens/s)")
    return lines


def table(summary: dict[str, Any]) -> str:
    notes = ["  " + n for n in _notes(summary)]
    return "\n".join([_title(summary), text_table(_head(summary), rows(summary)), *notes, "", "winner (*):",
                      *("  " + g for g in _gains(summary))])


def markdown(summary: dict[str, Any], plot_file: str | None, tune_toml: str) -> str:
    env, s, best = summary["environment"], summary, summary["best"]
    win = next(c for c in s["candidates"] if c["index"] == best["index"])
    md = [f"# gptopt tune: {s['preset']}", "",
          f"- device: {env.get('device_name', env.get('device'))} ({s['device_policy']})",
          f"- torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}, gptopt {env['gptopt']}",
          f"- model: {s['params'] / 1e6:.2f}M parameters, {s['flops_per_token'] / 1e6:.1f} MFLOP/token (6N + 12LdT); "
          f"sequence {s['seq_len']}; global batch {s['global_batch']} sequences = {s['global_batch_tokens']:,} tokens "
          "per optimizer step (micro-batch x accumulation)",
          f"- every candidate: the same weights and batches, {s['warmup']} warm-up + {s['steps']} timed steps "
          f"(median), device-synchronised; its loss after them within {s['loss_tolerance']:.0%} of the fp32 "
          "reference's (gptopt's defaults), or it is rejected",
          f"- budgets: {s['time_budget_s']:.0f} s of wall time ({s['elapsed_s']:.0f} s used); memory "
          f"{s['memory_budget']:.0%} ({s['memory_limit_bytes'] / 2**20:,.0f} MiB); axes searched: "
          f"{', '.join(s['axes'])}",
          "", "## Winner", "",
          f"**#{best['index']} {best['name']}** ({label(win)}): "
          f"{best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}, "
          f"peak {fmt(win[s['memory_column']], 'mib')} MiB.", ""]
    md += [f"- {g}" for g in _gains(s)]
    md += ["", "Train with it: `gptopt train --config tune.toml`", "", "```toml", tune_toml.rstrip(), "```",
           "", "## Every candidate", "", _title(s) + "; * marks the winner.", "", *md_table(_head(s), rows(s)), ""]
    md += [f"- {n}" for n in _notes(s)]
    md += ["", "## How the search goes", "",
           "1. reference: gptopt train's defaults (fp32), halved with more accumulation until it fits; then the "
           "Hugging Face baseline on the same micro-batch.",
           "2. eager axes, cheap to measure: attention kernel x autocast dtype, the fused AdamW, DataLoader settings "
           "(pruned when the data wait is below what they could save).",
           "3. micro-batch: doubled while it fits the memory budget and gets faster, accumulation keeping the global "
           "batch; a smaller one where no larger helps; activation checkpointing only where memory ran out.",
           "4. torch.compile modes on the best eager settings, and bench's `all` rung; a compile whose estimated "
           "cost (from the first compile) exceeds the remaining budget is not started.",
           "5. confirmation: the two fastest valid candidates measured again, back to back; they rank by "
           "those figures.", "",
           "Candidates stop early when even their fastest step is 1.25x the best's p90 step (they cannot win; "
           "not while another process holds the CPU) or when the budget runs out."]
    if plot_file:
        md += ["", "## Plot", "", f"![tokens/s per candidate]({plot_file})"]
    return "\n".join(md) + "\n"


def plot(summary: dict[str, Any], out: Path) -> str | None:
    """tune.png (plot extra): tokens/s of every candidate that ran, coloured by its outcome."""
    ran = [c for c in summary["candidates"] if c["tokens_per_s"]]
    if not has("matplotlib") or not ran:
        if not has("matplotlib"):
            log.info("plot skipped: pip install 'gptopt[plot]'")
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    colour = {"ok": "#4a7", "rejected": "#c44", "pruned": "#aaa", "over budget": "#ccc", "oom": "#c84"}
    win = summary["best"]["index"]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(ran) + 1.5))
    names = [f"#{c['index']} {c['name']}" for c in ran][::-1]
    bars = ax.barh(names, [c["tokens_per_s"] for c in ran][::-1],
                   color=["#185" if c["index"] == win else colour.get(c["status"], "#888") for c in ran][::-1])
    for b, c in zip(bars, ran[::-1], strict=True):
        ax.annotate(f" {c['status']}" + (" (winner)" if c["index"] == win else ""),
                    (b.get_width(), b.get_y() + b.get_height() / 2), va="center", fontsize=7)
    ax.axvline(summary["defaults"]["tokens_per_s"], color="#47a", ls="--", lw=1, label="gptopt defaults")
    if summary["hf"]:
        ax.axvline(summary["hf"]["tokens_per_s"], color="#a47", ls=":", lw=1, label="Hugging Face baseline")
    ax.set_xlabel("tokens/s (pruned and over-budget bars: the steps they ran)")
    ax.set_title(f"gptopt tune, {summary['preset']}: winner #{win}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # outside: bars fill the axes
    fig.tight_layout()
    fig.savefig(out / "tune.png", dpi=110)
    plt.close(fig)
    return "tune.png"


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refused before any work: an --output_dir that is a file or cannot be written, one holding an earlier
    tune's files without --overwrite, and with it one gptopt did not mark as a tune output."""
    check_output(out, kind=KIND, overwrite=overwrite, ours=FILES)


def write_all(summary: dict[str, Any], out: Path) -> None:
    """Write the report files into out beside the user's own; an earlier tune's files there (check_output_dir
    allowed their replacement before the search began) stay until the new ones are written."""
    with replacing(out, kind=KIND, ours=FILES):
        _write(summary, out)


def _write(summary: dict[str, Any], out: Path) -> None:
    (out / "tune_results.json").write_text(json.dumps(summary, indent=2, default=str))
    with open(out / "tune_results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for c in summary["candidates"]:
            w.writerow({**c, "settings": label(c),
                        "gradient_accumulation_steps": c["config"]["gradient_accumulation_steps"]})
    tune_toml = toml_text(summary["train_config"], TUNE_TOML_HEADER)
    (out / "tune.toml").write_text(tune_toml)
    (out / "tune_report.md").write_text(markdown(summary, plot(summary, out), tune_toml))
