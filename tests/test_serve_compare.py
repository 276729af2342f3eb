"""benchmarks/serve_compare.py: the report's figures from canned runs, its refusals, and whole comparisons
against two small fake servers (seconds; no model).

    pytest -q tests/test_serve_compare.py
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "serve_compare.py"


sc = load_script("serve_compare")

# A stand-in for an OpenAI-compatible server: /v1/models, and a streaming /v1/completions of four
# chunks, a finish chunk and a usage chunk, then [DONE] unless --no-done (transformers serve's way).
# --exit-at-once: a server whose command fails; --hang: one that never answers.
FAKE_SERVER = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[1])
flags = sys.argv[2:]
if "--pidfile" in flags:
    with open(flags[flags.index("--pidfile") + 1], "w") as f:
        f.write(str(os.getpid()))
if "--exit-at-once" in flags:
    print("fake: cannot load the model", flush=True)
    sys.exit(3)
if "--hang" in flags:
    time.sleep(3600)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        def send(obj):
            self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            self.wfile.flush()
        for i in range(4):
            send({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
        send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        send({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
        if "--no-done" not in flags:
            send(b"[DONE]")


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _run(server: str, concurrency: int, run: int, tps: float | None, ttft: float | None = 0.01,
         errors: dict[str, int] | None = None) -> dict[str, Any]:
    return {"server": server, "concurrency": concurrency, "run": run, "ready_s": 1.5, "output_tokens_per_s": tps,
            "ttft_p50_s": ttft, "ttft_p99_s": ttft and 2 * ttft, "tpot_p50_s": 0.002, "requests": 8, "completed": 8,
            "output_tokens": None if tps is None else 256,
            "errors": errors or {}, "loadtest_exit": 0, "logs": {}, "summary": None}


CANNED = [
    _run("a", 16, 1, 100.0, 0.010), _run("b", 16, 1, 50.0, 0.030),
    _run("a", 16, 2, 120.0, 0.020), _run("b", 16, 2, 40.0, 0.050),
    _run("a", 16, 3, 110.0, 0.040), _run("b", 16, 3, 60.0, 0.040),
    _run("a", 1, 1, 30.0), _run("b", 1, 1, None, None, {"no summary": 1}),  # a run loadtest gave nothing for
]
META = {"date": "2026-12-04 12:00 UTC", "cpu": {"model": "Test CPU @ 2.0GHz", "bf16_flags": ["amx_bf16"],
                                                "logical_cpus": 2},
        "command": "python benchmarks/serve_compare.py --model m ...", "servers": {"a": "a --port {port}",
                                                                               "b": "b --port {port} {model}"},
        "loadtest": "gptopt loadtest --url http://127.0.0.1:{port} ...", "warmup_requests": 4, "stopped": None,
        "prompt_tokens": 32, "tokenizer": None}


def test_medians_spread_and_ratios_from_canned_runs() -> None:
    rows = sc.aggregate(CANNED, ["a", "b"])
    a16, b16, a1, b1 = rows
    assert (a16["concurrency"], a16["server"], b1["server"]) == (16, "a", "b")
    assert a16["median_tokens_per_s"] == 110.0 and a16["min_tokens_per_s"] == 100.0
    assert a16["max_tokens_per_s"] == 120.0 and a16["max_over_min"] == pytest.approx(1.2)
    assert b16["median_tokens_per_s"] == 50.0 and b16["max_over_min"] == pytest.approx(1.5)
    assert a16["median_ttft_p50_s"] == 0.020 and b16["median_ttft_p50_s"] == 0.040
    assert a1["runs"] == 1 and b1["runs"] == 0 and b1["median_tokens_per_s"] is None and b1["errors"] == 1
    pairs = sc.ratios(rows, ["a", "b"])
    assert pairs[0] == {"concurrency": 16, "first": "a", "other": "b", "ratio": pytest.approx(2.2)}
    assert pairs[1]["ratio"] is None  # no figure of b at 1: no ratio made up


def test_the_report_lists_every_run_then_the_summary() -> None:
    text = sc.render_report(META, CANNED)
    assert "Test CPU @ 2.0GHz, 2 logical CPUs; native bf16: yes (amx_bf16)" in text
    assert "`python benchmarks/serve_compare.py --model m ...`" in text and "`b --port {port} {model}`" in text
    assert "| 16 | 2 | b | 40.0 | 256 | 50.0 | 100.0 | 2.00 | none | 1.5 |" in text
    assert "| 1 | 1 | b | - | - | - | - | 2.00 | no summary: 1 | 1.5 |" in text
    assert "| 16 | a | 3 | 110.0 | 100.0 | 120.0 | 1.20 | 20.0 | 0 |" in text
    assert "| 16 | a / b = 2.20 |" in text and "| 1 | a / b = - |" in text
    assert "Incomplete" not in text
    assert "- prompts: 32 words each (approximately as many tokens; no --tokenizer)" in text
    exact = sc.render_report({**META, "tokenizer": "m/tokenizer.json"}, CANNED)
    assert "- prompts: 32 tokens each, of `m/tokenizer.json`" in exact
    assert "**Incomplete: stopped by SIGINT after 8 runs**" in sc.render_report(
        {**META, "stopped": "stopped by SIGINT after 8 runs"}, CANNED)


def test_cpu_model_and_native_bf16_are_read_from_cpuinfo() -> None:
    info = sc.cpu_info("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                       "flags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+" and info["bf16_flags"] == ["avx512_bf16", "amx_bf16"]
    assert sc.cpu_info("model name : Old CPU\nflags : fpu avx2\n")["bf16_flags"] == []
    assert "native bf16: no" in sc.render_report({**META, "cpu": {**META["cpu"], "bf16_flags": []}}, [])


def _script(*args: str, cwd: Path, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_an_output_dir_holding_files_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    p = _script("--model", "m", "--server", "a=a --port {port}", "--output_dir", str(out), cwd=tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "already holds files" in err and "Traceback" not in err
    assert [f.name for f in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("server, problem", [
    ("a --port {port}", "NAME=COMMAND"), ("a=serve --port 8000", "{port}"), ("a=serve {port} {gpu}", "braces")])
def test_a_bad_server_spec_is_one_line_and_exit_2(tmp_path: Path, server: str, problem: str) -> None:
    p = _script("--model", "m", "--server", server, "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and problem in err.splitlines()[-1] and not (tmp_path / "out").exists()


def _fake(tmp_path: Path, *flags: str) -> str:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return shlex.join([sys.executable, str(script)]) + " {port} " + " ".join(flags)


LOADTEST = f"{shlex.quote(sys.executable)} -m gptopt loadtest"


def test_two_servers_alternate_and_every_run_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    p = _script("--model", "/models/tiny", "--runs", "1", "--concurrency", "2", "--requests", "6",
                "--max_tokens", "4", "--warmup_requests", "2", "--loadtest", LOADTEST,
                "--server", f"done={_fake(tmp_path)}", "--server", f"nodone={_fake(tmp_path, '--no-done')}",
                "--settle", "0.5", "--output_dir", str(out), cwd=tmp_path)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    results = json.loads((out / "results.json").read_text())
    assert [(r["server"], r["concurrency"], r["run"]) for r in results["runs"]] == [("done", 2, 1), ("nodone", 2, 1)]
    assert results["settle_s"] == 0.5 and "stop, 0.5 s idle; servers alternate" in (out / "report.md").read_text()
    for r in results["runs"]:
        assert r["errors"] == {} and r["completed"] == 6 and r["output_tokens"] == 24
        assert r["output_tokens_per_s"] > 0 and r["ttft_p50_s"] > 0 and r["ready_s"] > 0
        assert (out / r["logs"]["server"]).is_file() and (out / r["logs"]["loadtest"]).is_file()
    assert results["servers"]["nodone"].endswith("--no-done") and results["stopped"] is None
    # the command as it reruns from the repository's root
    assert results["command"].startswith("python benchmarks/serve_compare.py --model /models/tiny --runs 1 ")
    assert results["loadtest"] == (f"{LOADTEST} --url http://127.0.0.1:{{port}} --requests 6 --concurrency "
                                   "{concurrency} --max_tokens 4 --prompt_tokens 32 --model /models/tiny --json")
    report = (out / "report.md").read_text()
    assert "| 2 | done / nodone = " in report and "| 2 | 1 | nodone |" in report
    assert "[2/2] concurrency 2, run 1/1, nodone" in err  # progress on stderr


def test_a_server_that_never_answers_names_its_log(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    p = _script("--model", "m", "--runs", "1", "--concurrency", "1", "--loadtest", LOADTEST,
                "--server", f"broken={_fake(tmp_path, '--exit-at-once')}", "--output_dir", str(out), cwd=tmp_path)
    _, err = p.communicate(timeout=60)
    log = out / "c1-run1-broken.server.log"
    assert p.returncode == 1 and f"broken exited with status 3 before it answered; its log: {log}" in err
    assert "cannot load the model" in log.read_text() and "Traceback" not in err
    assert "Incomplete: broken exited" in (out / "report.md").read_text()


def test_ctrl_c_stops_the_current_server_and_keeps_what_was_measured(tmp_path: Path) -> None:
    out, pidfile = tmp_path / "cmp", tmp_path / "hang.pid"
    p = _script("--model", "m", "--runs", "1", "--concurrency", "1", "--requests", "2", "--max_tokens", "4",
                "--warmup_requests", "0", "--loadtest", LOADTEST, "--server", f"ok={_fake(tmp_path)}",
                "--server", f"hang={_fake(tmp_path, '--hang', '--pidfile', str(pidfile))}",
                "--output_dir", str(out), cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text():  # the first run is measured, the second server up
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    results = json.loads((out / "results.json").read_text())
    assert [r["server"] for r in results["runs"]] == ["ok"] and results["runs"][0]["errors"] == {}
    assert results["stopped"] == "stopped by SIGINT after 1 run"
    with pytest.raises(ProcessLookupError):  # the hanging server went with the comparison
        os.kill(int(pidfile.read_text()), 0)


def test_a_missing_tokenizer_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    p = _script("--model", "m", "--server", f"a={_fake(tmp_path)}", "--tokenizer", str(tmp_path / "nope.json"),
                "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and f"--tokenizer {tmp_path / 'nope.json'}: no such file" in err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_the_tokenizer_reaches_every_loadtest_and_the_report_names_the_prompts(tmp_path: Path,
                                                                               train_data: Path) -> None:
    out, tok = tmp_path / "cmp", str(train_data / "tokenizer.json")
    p = _script("--model", "m", "--runs", "1", "--concurrency", "1", "--requests", "2", "--max_tokens", "4",
                "--prompt_tokens", "8", "--warmup_requests", "1", "--loadtest", LOADTEST, "--tokenizer", tok,
                "--server", f"a={_fake(tmp_path)}", "--output_dir", str(out), cwd=tmp_path)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["tokenizer"] == tok and f"--prompt_tokens 8 --tokenizer {tok} " in results["loadtest"]
    (run,) = results["runs"]
    assert run["errors"] == {} and run["summary"]["prompt"] == {"kind": "tokens", "length": 8, "shared_prefix": 0,
                                                                    "tokenizer": tok}
    assert f"--tokenizer {tok}" in (out / "c1-run1-a.warmup.log").read_text().splitlines()[0]  # the warm-up's too
    assert f"- prompts: 8 tokens each, of `{tok}`" in (out / "report.md").read_text()
