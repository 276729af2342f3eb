"""The GPU check's record: summary.txt (results.json as text), a run's rows added to docs/gpu-results.md,
and which folders a run may write into.

    python3 .ci/gpu_check.py record DIR             # DIR/results.json -> rows of docs/gpu-results.md
    pytest -q tests/test_gpu_check.py -k record
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from gpu_check_figures import _json


def summary_text(doc: dict[str, Any]) -> str:
    lines = [f"gptopt GPU check, {doc.get('gpu') or doc['target']}: started {doc['started']}, "
             f"planned {doc['planned_s']}s of a {doc['budget_s']}s budget"
             + (f", took {doc['seconds']}s" if "seconds" in doc else ""), f"({doc['weights']})", ""]
    for r in doc["steps"]:
        took = f"{r['seconds']:>6.1f}s" if "seconds" in r else "      -"
        lines.append(f"{r['name']:<17} {r['status']:<8} {took} / {r['limit_s']}s  {r['what']}")
        if r.get("note"):
            lines.append(f"{'':<17} note: {r['note']}")
        if r.get("figures"):
            lines.append(f"{'':<17} {json.dumps(r['figures'], default=str)}")
        if r.get("error_tail"):
            lines += [f"{'':<17} | {line}" for line in r["error_tail"].splitlines()[-8:]]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


RECORD_START = "<!-- gpu-check rows: `python3 .ci/gpu_check.py record DIR` adds a run here -->"
# The marker is found by its opening words: a doc whose marker names this script where it used to live
# (scripts/) still takes a run's rows.
RECORD_MARK = re.compile(r"^<!-- gpu-check rows:.*-->$", re.MULTILINE)


def rows(doc: dict[str, Any]) -> list[str]:
    date = (doc.get("started") or "")[:10]
    gpu = (doc.get("gpu") or "?").split(",")[0]
    out = []
    for r in doc["steps"]:
        if r["status"] == "planned":
            continue
        took = f"{r.get('seconds', '-')} s of {r['limit_s']}"
        result = r["status"] + (f": {r['note']}" if r.get("note") else "")
        figures = json.dumps(r.get("figures") or {}, default=str, separators=(", ", ": "))
        cell = f"{result}; {figures}" if r.get("figures") else result
        out.append(f"| {date} | {gpu} | `{r['name']}` | {took} | {cell.replace('|', '/')} |")
    return out


def record(out: Path, doc_path: Path) -> list[str]:
    doc = json.loads((out / "results.json").read_text())
    if doc.get("target") != "gpu":
        raise SystemExit(f"{out}/results.json is a {doc.get('target')} run; only GPU runs are recorded")
    new = rows(doc)
    if not new:
        raise SystemExit(f"{out}/results.json holds no step that ran (a dry run?): nothing to record")
    text = doc_path.read_text()
    mark = RECORD_MARK.search(text)
    if mark is None:
        raise SystemExit(f"{doc_path} lacks the line {RECORD_START!r} that marks where runs go")
    head = (f"\n#### {doc['started']} — {doc.get('gpu', '?')}; {doc.get('cpu', '')}; commit {doc.get('commit')}, "
            f"{doc.get('seconds', '?')} s of a {doc['budget_s']} s budget\n\n"
            "| date | GPU | step | seconds | result and figures |\n|---|---|---|---|---|\n")
    write_atomic(doc_path, text[:mark.end()] + "\n" + head + "\n".join(new) + "\n" + text[mark.end():])
    return new


def unfit_folder(folder: Path) -> str | None:
    """Why the run may not write into `folder`, or None: it writes results.json, summary.txt and a log per
    step there without asking, so only a new or empty folder, or one an earlier run of this script wrote."""
    if not folder.exists():
        return None
    if not folder.is_dir():
        return "is a file; give a folder"
    if not any(folder.iterdir()):
        return None
    earlier = _json(folder / "results.json")
    if isinstance(earlier, dict) and "steps" in earlier and "target" in earlier:
        return None
    return "holds files that an earlier GPU check did not write; choose a new or empty folder"
