""".ci/gpu_check.py (and its gpu_check_*.py modules), the one prepared call a GPU lease runs: the plan
covers every GPU path within nine minutes, every command it will run parses, the runner never stops
early, and a run is recorded in one command.

    pytest -q tests/test_gpu_check.py                 # the dry run, the commands, the runner (seconds)
    pytest -q -m slow tests/test_gpu_check.py         # every step with a CPU meaning, run on the CPU (minutes)
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import load_script

from gptopt import cli

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "gpu_check.py"
NINE_MINUTES = 540


gc = load_script("gpu_check")
# the modules it imports (its folder is on sys.path now), the very ones it uses: a name is patched where it is defined
gc_plan, gc_figures, gc_runner, gc_record = (importlib.import_module(f"gpu_check_{part}")
                                             for part in ("plan", "figures", "runner", "record"))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("dry")
    done = subprocess.run(["bash", str(ROOT / ".ci" / "gpu_check.sh"), "--dry-run", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads((out / "results.json").read_text())


def _commands(doc: dict) -> dict[str, str]:
    return {r["name"]: " ".join([r["command"], *r.get("loadtests", []), r.get("decode", ""), r.get("peer", ""),
                                 *r.get("peer_loadtests", [])]) for r in doc["steps"]}


def test_dry_run_prints_each_step_with_its_command_and_limit_within_nine_minutes(dry_run: tuple[str, dict]) -> None:
    stdout, doc = dry_run
    assert doc["steps"] and all(r["status"] == "planned" for r in doc["steps"])
    for r in doc["steps"]:
        assert f"{r['name']:<17} {r['limit_s']:>4}s" in stdout  # the step and its limit
        assert r["command"] in stdout
    # the wall time at worst: steps of one group start together, every other step waits for the last
    phases: list[list[int]] = []
    for r, prev in zip(doc["steps"], [{}, *doc["steps"]], strict=False):
        if r.get("group") is not None and r.get("group") == prev.get("group"):
            phases[-1].append(r["limit_s"])
        else:
            phases.append([r["limit_s"]])
    # the install is the first step: it is inside the budget
    assert doc["planned_s"] == sum(max(p) for p in phases) < NINE_MINUTES
    assert doc["budget_s"] <= NINE_MINUTES


def test_the_plan_runs_every_gpu_path(dry_run: tuple[str, dict]) -> None:
    cmds = _commands(dry_run[1])
    every = " ".join(cmds.values())
    assert "--no-index --no-deps --no-build-isolation -e" in cmds["install"]  # offline; the machine's torch stays
    assert "doctor --smoke --json" in cmds["doctor"]
    assert "-m cuda" in cmds["cuda_tests"]
    train = cmds["train"]
    assert all(f in train for f in ("--preset gpt2 ", "--seq_len 1024", "--use_amp", "--compile ", "--max_steps 40"))
    assert "--amp_dtype fp16" in cmds["train_fp16"]
    assert "torch.distributed.run" in cmds["train_ddp"] and "--nproc_per_node 1" in cmds["train_ddp"]
    assert "--fsdp" in cmds["train_fsdp"] and "torch.distributed.run" in cmds["train_fsdp"]
    assert "--gradient_checkpointing" in cmds["train_ckpt"] and "--auto_batch_size" in cmds["train_auto_batch"]
    assert "--preset gpt2 " in cmds["bench"] and "--rungs" not in cmds["bench"]  # the default ladder
    infer = cmds["bench_infer"]
    assert "--mode infer" in infer and "--batch_sizes 1,64" in infer  # batch 1 to 64
    assert set("hf,kv,compiled,int8,int4".split(",")) <= set(infer.split("--rungs ")[1].split()[0].split(","))
    assert "--preset gpt2-xl" in cmds["decode_large"] and "--batch_sizes 1 " in cmds["decode_large"]
    assert "--compile" in cmds["generate"]
    assert "int8-weight" in cmds["compress_int8"] and "int4-weight" in cmds["compress_int4"]
    assert "--prune 2:4" in cmds["compress_2_4"]
    serve = next(r for r in dry_run[1]["steps"] if r["name"] == "serve")
    assert "--max_batch_size 256" in serve["command"]
    # issue 35: 1 to 256 clients, prompts of exactly 128 tokens of the served model's tokenizer, 128 new tokens
    assert [lt.split("--concurrency ")[1].split()[0] for lt in serve["loadtests"]] == ["1", "16", "64", "256"]
    assert all("--tokenizer MODEL --prompt_tokens 128 --max_tokens 128 " in lt for lt in serve["loadtests"])
    # beside them, bench's CUDA-graph decode at the same batch sizes, 128-token prompts and 128 new tokens
    decode = serve["decode"]
    assert all(f in decode for f in ("bench --preset gpt2 --mode infer", "--rungs graphs ",
                                     "--batch_sizes 1,16,64,256 ", "--seq_len 256 "))
    # the peer: transformers serve with continuous batching, in bf16, on the exported folder, same loadtests
    assert "transformers.cli.transformers serve --continuous-batching --dtype bfloat16" in serve["peer"]
    assert serve["peer"].endswith("/serve_hf") and "--output_dir " + serve["peer"].split()[-1] in cmds["serve_export"]
    assert "export --model MODEL --format hf" in cmds["serve_export"]
    assert serve["peer_loadtests"] == [lt for lt in serve["loadtests"] if any(
        f"--concurrency {c} " in lt for c in (16, 64))]
    assert all(f in cmds["profile"] for f in ("--preset gpt2 ", "--use_amp", "--json"))
    # nothing is downloaded: models come from presets (random weights), data from the stdlib corpus
    assert "--init_from" not in every and "--model_name" not in every and "--input" not in cmds["prepare"]


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_every_gptopt_command_of_the_plan_parses(target: str, tmp_path: Path) -> None:
    """A wrong flag or an out-of-range value is found here, not in the GPU lease."""
    ctx = gc_plan.Ctx(out=tmp_path, target=target, sizes=gc_plan.SIZES[target])
    argvs = []
    for step in gc_plan.plan(ctx):
        argvs.append(gc_plan.resolve(step.argv, str(tmp_path / "model"), 8000))
        if step.serve:
            argvs += [argv for _, argv in gc_plan.step_loadtests(ctx, step, "http://127.0.0.1:8000",
                                                                 model=str(tmp_path / "model"))]
        argvs += [step.decode] if step.decode else []
    parsed = 0
    for argv in argvs:
        if "gptopt" not in argv:
            continue
        verb, rest = argv[argv.index("gptopt") + 1], argv[argv.index("gptopt") + 2:]
        cls = cli._load(cli.COMMANDS[verb].config)
        cli.parse_config(verb, cls, rest, cli.build_parser(verb, cls))  # exits 2 on a bad flag or value
        parsed += 1
    assert parsed >= 16


def _fake_plan(marker: Path) -> list:
    py = sys.executable
    # a leader that ignores SIGINT and SIGTERM, with a child that ignores SIGINT: only SIGKILL to the group ends both
    stubborn = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import time; time.sleep(60)")
    sleeper = (f"import signal, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {stubborn!r}]); "
               f"open({str(marker)!r}, 'w').write(str(p.pid)); signal.signal(signal.SIGINT, signal.SIG_IGN); "
               "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    return [
        gc_plan.Step("hangs", 2, "a step past its limit, with a child process", [py, "-c", sleeper]),
        gc_plan.Step("breaks", 30, "a step that fails",
                     [py, "-c", "import sys; print('boom: the reason'); sys.exit(3)"]),
        gc_plan.Step("first", 30, "runs beside second", [py, "-c", "print('one')"], group="g"),
        gc_plan.Step("second", 30, "runs beside first", [py, "-c", "print('two')"], group="g"),
    ]


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody has reaped yet (its parent was killed)."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        time.sleep(0.1)  # the signal may still be on its way
    return True


def test_a_failing_or_hanging_step_costs_only_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "child.pid"
    monkeypatch.setattr(gc_plan, "plan", lambda ctx: _fake_plan(marker))
    monkeypatch.setattr(gc_runner, "GRACE_S", (0.5, 0.5))
    out = tmp_path / "run"
    assert gc.main(["run", str(out), "--budget", "62"]) == 1  # the plan's own limits: no time to spare
    doc = json.loads((out / "results.json").read_text())
    by = {r["name"]: r for r in doc["steps"]}
    assert [r["name"] for r in doc["steps"]] == ["hangs", "breaks", "first", "second"]
    assert by["hangs"]["status"] == "timeout" and by["hangs"]["seconds"] < 10  # SIGINT, SIGTERM, then SIGKILL
    assert not _alive(int(marker.read_text()))  # the step's whole process group was stopped, not only its head
    assert by["breaks"]["status"] == "failed" and by["breaks"]["rc"] == 3
    assert "boom: the reason" in by["breaks"]["error_tail"]
    assert by["first"]["status"] == by["second"]["status"] == "ok"  # the run went on after both
    summary = (out / "summary.txt").read_text()
    assert "breaks" in summary and "boom: the reason" in summary and "timeout" in summary

    # a rerun of one step after a fix keeps the others' results
    monkeypatch.setattr(gc_plan, "plan", lambda ctx: [
        _fake_plan(marker)[0], gc_plan.Step("breaks", 30, "fixed", [sys.executable, "-c", "pass"]),
        *_fake_plan(marker)[2:]])
    assert gc.main(["run", str(out), "--only", "breaks"]) == 0
    again = {r["name"]: r for r in json.loads((out / "results.json").read_text())["steps"]}
    assert again["breaks"]["status"] == "ok" and again["hangs"]["status"] == "timeout"


def test_a_run_stopped_from_outside_stops_its_steps_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "child.pid"
    monkeypatch.setattr(gc_plan, "plan", lambda ctx: _fake_plan(marker)[:1] + [
        gc_plan.Step("after", 30, "never starts", [sys.executable, "-c", "pass"])])
    out = tmp_path / "run"
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # what ends a lease
    assert gc.main(["run", str(out), "--report", str(tmp_path / "small")]) == 130
    by = {r["name"]: r for r in json.loads((out / "results.json").read_text())["steps"]}
    assert by["hangs"]["status"] == "cut off" and by["after"]["status"] == "planned"
    assert not _alive(int(marker.read_text()))  # nothing of it is left running on the machine
    assert json.loads((tmp_path / "small" / "results.json").read_text())["cut_off"] == "SIGTERM"
    assert "===== hangs (cut off)" in (tmp_path / "small" / "logs.txt").read_text()


def test_a_run_stopped_while_its_server_starts_stops_the_server_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "server.pid"
    never_ready = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    monkeypatch.setattr(gc_plan, "plan", lambda ctx: [gc_plan.Step("serve", 30, "a server that never gets ready",
                                                                   [sys.executable, "-c", never_ready], serve=True)])
    out = tmp_path / "run"
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert gc.main(["run", str(out)]) == 130
    serve = json.loads((out / "results.json").read_text())["steps"][0]
    assert serve["status"] == "cut off" and "ready_s" not in serve["figures"]
    assert not _alive(int(marker.read_text()))


def test_time_a_step_leaves_unused_goes_to_the_later_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    py = sys.executable
    monkeypatch.setattr(gc_plan, "plan", lambda ctx: [
        gc_plan.Step("quick", 20, "done at once", [py, "-c", "pass"]),
        gc_plan.Step("slow", 1, "needs 3 s, planned for 1", [py, "-c", "import time; time.sleep(3)"])])
    out = tmp_path / "run"
    assert gc.main(["run", str(out), "--budget", "21"]) == 0  # quick's spare seconds let slow finish
    by = {r["name"]: r for r in json.loads((out / "results.json").read_text())["steps"]}
    assert by["slow"]["status"] == "ok" and by["slow"]["limit_s"] > 3


def test_the_test_steps_figures_name_the_failing_tests_even_without_its_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tests = tmp_path / "test_paths.py"
    tests.write_text("def test_works():\n    pass\n\n\ndef test_breaks():\n    assert 1 == 2\n")
    monkeypatch.setattr(gc_plan, "plan", lambda ctx: [gc_plan.Step("cuda_tests", 60, "pytest", [
        sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--junitxml", ctx.path("cuda_tests.xml"),
        "-o", "addopts=", str(tests)])])
    out = tmp_path / "run"
    assert gc.main(["run", str(out)]) == 1
    figures = json.loads((out / "results.json").read_text())["steps"][0]["figures"]
    assert figures["tests"] == 2 and figures["failures"] == 1 and figures["failed"] == ["test_breaks"]
    # stopped at its limit, pytest writes no report: the log's lines still say what failed
    (out / "cuda_tests.xml").unlink()
    log = (out / "cuda_tests.log").read_text()
    again = gc_figures.fig_pytest(out, log)
    assert again["ran"] == 2 and again["passed"] == 1 and again["failed"][0].endswith("::test_breaks")
    assert "running_at_stop" not in again
    hung = gc_figures.fig_pytest(out, log + f"{tests}::test_hangs ")  # stopped while a third test ran
    assert hung["running_at_stop"] == f"{tests}::test_hangs"


def test_a_folder_of_someone_elses_files_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "summary.txt").write_text("my notes")
    for argv in (["run", str(theirs)], ["dry-run", str(theirs)],
                 ["run", str(tmp_path / "new"), "--report", str(theirs)]):
        with pytest.raises(SystemExit) as e:
            gc.main(argv)
        assert e.value.code == 2 and "earlier GPU check did not write" in capsys.readouterr().err
    assert (theirs / "summary.txt").read_text() == "my notes" and not (tmp_path / "new").exists()
    assert gc.main(["dry-run", str(tmp_path / "dry")]) == 0
    assert gc.main(["dry-run", str(tmp_path / "dry")]) == 0  # its own earlier output is fine


def test_unknown_step_names_are_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        gc.main(["run", str(tmp_path / "x"), "--only", "bench,nope"])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("marker", ["as the doc has it", "naming the script where it lives"])
def test_record_adds_a_runs_rows_to_the_results_doc(
        marker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_plan, "plan", lambda ctx: _fake_plan(tmp_path / "child.pid")[2:])
    out = tmp_path / "run"
    assert gc.main(["run", str(out)]) == 0
    doc = tmp_path / "gpu-results.md"
    shutil.copy(ROOT / "docs" / "gpu-results.md", doc)
    if marker != "as the doc has it":
        doc.write_text(gc_record.RECORD_MARK.sub(gc_record.RECORD_START, doc.read_text(), count=1))
    before = doc.read_text()
    assert gc.main(["record", str(out), "--doc", str(doc)]) == 0
    after = doc.read_text()
    mark = gc_record.RECORD_MARK.search(before)
    assert mark is not None and after.startswith(before[:mark.end()])  # what was there stays
    # earlier runs' rows stay; the new run's rows are the ones the doc did not have
    old_rows = [line for line in before.splitlines() if line.startswith("| 20")]
    rows = [line for line in after.splitlines() if line.startswith("| 20") and line not in old_rows]
    assert [row.split("|")[3].strip() for row in rows] == ["`first`", "`second`"]
    assert all(line in after for line in old_rows)
    # the newest run is listed first, right under the marker
    assert after.index(rows[0]) < min([after.index(line) for line in old_rows] or [len(after)])
    assert all("ok" in row for row in rows)
    # a dry run ran nothing: there is nothing to record, and the doc is left as it was
    assert gc.main(["dry-run", str(tmp_path / "dry")]) == 0
    with pytest.raises(SystemExit, match="nothing to record"):
        gc_record.record(tmp_path / "dry", doc)
    assert doc.read_text() == after


# bench --mode infer's JSON as it prints it (the keys the serve step reads), and serve's figures as the runner
# gathers them: output tokens/s at 1, 16, 64 and 256 clients, the peer at 16 and 64
BENCH_INFER = {"prompt_len": 128, "max_new_tokens": 128, "rungs": [
    {"name": "graphs", "status": "ok", "note": "", "batch_sweep": [
        {"batch_size": 1, "tokens_per_s": 1000.04}, {"batch_size": 16, "tokens_per_s": 16000.0},
        {"batch_size": 64, "tokens_per_s": 50000.0}, {"batch_size": 256, "tokens_per_s": 80000.0}]}]}
SERVE = {"ready_s": 14.0, "clients_1": {"status": "ok", "output_tokens_per_s": 500.0},
         "clients_16": {"status": "ok", "output_tokens_per_s": 4000.0},
         "clients_64": {"status": "ok", "output_tokens_per_s": 20000.0},
         "clients_256": {"status": "failed", "rc": 1},
         "peer_transformers": {"status": "ok", "clients_16": {"status": "ok", "output_tokens_per_s": 1600.0},
                               "clients_64": {"status": "timeout"}}}


def test_the_serve_steps_figures_set_each_client_count_beside_the_decode_at_that_batch_and_the_peer() -> None:
    decode = gc_figures.decode_rates(BENCH_INFER, "graphs")
    assert decode["status"] == "ok" and decode["prompt_tokens"] == decode["new_tokens"] == 128
    assert decode["tokens_per_s"] == {"1": 1000.0, "16": 16000.0, "64": 50000.0, "256": 80000.0}
    before = json.dumps(SERVE)
    out = gc_figures.compared({**SERVE, "decode": decode})
    assert json.dumps(SERVE) == before  # the figures given are left as they were
    # share: serve's output tokens/s over the decode's at the batch of its client count
    assert [(out[k]["decode_tokens_per_s"], out[k]["share"]) for k in ("clients_1", "clients_16", "clients_64")] == [
        (1000.0, 0.5), (16000.0, 0.25), (50000.0, 0.4)]
    assert "share" not in out["clients_256"]  # its loadtest failed: no figure to set beside the decode's
    # vs_transformers: at the client counts both servers measured
    assert out["vs_transformers"] == {"clients_16": 2.5}
    # without the decode's figures or the peer's, the serve figures stay as they are
    alone = gc_figures.compared({k: v for k, v in SERVE.items() if k != "peer_transformers"})
    assert "vs_transformers" not in alone and all("share" not in alone[k] for k in alone if k.startswith("clients_"))
    assert gc_figures.decode_rates(None, "graphs")["status"] == "failed"
    assert "no rung graphs" in gc_figures.decode_rates({"rungs": [{"name": "kv"}]}, "graphs")["note"]


def test_a_peer_that_cannot_run_here_is_skipped_with_the_reason_and_one_that_breaks_fails() -> None:
    missing = gc_runner._peer_exit(1, "Traceback ...\nImportError: Missing dependencies for serving. Install with "
                               "`pip install transformers[serving]`\n")
    assert missing["status"] == "skipped" and "transformers[serving]" in missing["note"]
    assert gc_runner._peer_exit(1, "ValueError: ... requires `accelerate`. You can install it")["status"] == "skipped"
    broken = gc_runner._peer_exit(1, "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert broken["status"] == "failed" and "illegal memory access" in broken["tail"]


def test_a_run_of_the_serve_step_alone_makes_its_peers_folder_too(tmp_path: Path) -> None:
    assert gc.main(["dry-run", str(tmp_path / "dry"), "--only", "serve"]) == 0
    names = [r["name"] for r in json.loads((tmp_path / "dry" / "results.json").read_text())["steps"]]
    assert names == ["install", "prepare", "serve_export", "serve"]


def test_a_recorded_serve_row_holds_the_shares_and_the_ratios(tmp_path: Path) -> None:
    doc = {"started": "2026-12-06T10:00:00+00:00", "target": "gpu", "gpu": "NVIDIA H200, 143771 MiB", "budget_s": 540,
           "steps": [{"name": "serve", "what": "serve", "status": "ok", "limit_s": 69, "seconds": 60.0,
                      "figures": gc_figures.compared({**SERVE,
                                                      "decode": gc_figures.decode_rates(BENCH_INFER, "graphs")})}]}
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(doc))
    target = tmp_path / "gpu-results.md"
    target.write_text(f"# GPU results\n\n{gc_record.RECORD_START}\n")
    [row] = gc_record.record(out, target)
    assert '"share": 0.25' in row and '"vs_transformers": {"clients_16": 2.5}' in row and '"peer_transformers"' in row
    assert '"share": 0.25' in gc_record.summary_text({**doc, "planned_s": 539, "weights": gc_plan.RANDOM_WEIGHTS})


@pytest.mark.slow
def test_every_step_with_a_cpu_meaning_runs_on_the_cpu(tmp_path: Path) -> None:
    """The rehearsal: the same commands with the debug preset, end to end, figures read back."""
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path), "--target", "cpu"],
                          capture_output=True, text=True, timeout=3600)
    doc = json.loads((tmp_path / "results.json").read_text())
    by = {r["name"]: r for r in doc["steps"]}
    assert {n: r["status"] for n, r in by.items() if r["status"] != "ok"} == {}, done.stdout[-3000:]
    assert done.returncode == 0
    assert set(by) == {s.name for s in gc_plan.plan(gc_plan.Ctx(tmp_path, "cpu", gc_plan.SIZES["cpu"]))
                       if s.cpu and s.default}
    for name in ("train", "train_ckpt", "train_auto_batch", "train_ddp", "train_fsdp"):
        assert by[name]["figures"]["tokens_per_s"] > 0 and by[name]["figures"]["steps"] > 0, name
    assert by["train_auto_batch"]["figures"]["micro_batch_x_accumulation"][0] * \
        by["train_auto_batch"]["figures"]["micro_batch_x_accumulation"][1] == 2 * 4  # the global batch kept
    assert by["bench"]["figures"]["rungs"]["hf"]["speedup_vs_baseline"] == 1.0
    infer = by["bench_infer"]["figures"]["rungs"]
    assert all(infer[r]["status"] == "ok" for r in ("hf", "kv", "compiled", "int8"))
    assert infer["int4"]["status"] == "skipped" and infer["int4"]["note"]  # a CPU has no int4 kernel
    assert "compiled decode after the first" in (tmp_path / "generate.log").read_text()
    assert by["generate"]["figures"]["tokens_per_s"] > 0
    assert by["compress_int8"]["figures"]["disk_ratio"] < 1
    serve = by["serve"]["figures"]
    assert serve["ready_s"] > 0 and serve["memory_at_end"]["process_resident_memory_gib"] > 0
    cpu = gc_plan.SIZES["cpu"]
    assert serve["decode"]["status"] == "ok" and serve["decode"]["rung"] == cpu.decode_rung
    assert serve["decode"]["prompt_tokens"] == cpu.prompt_tokens and serve["decode"]["new_tokens"] == cpu.serve_tokens
    for clients in cpu.clients:
        row = serve[f"clients_{clients}"]
        assert row["status"] == "ok" and row["requests"] > 0 and not row["errors"], row
        assert row["decode_tokens_per_s"] > 0 and row["share"] > 0, row
    # the peer runs where transformers serve can (its serving extra and accelerate installed), else says why not
    peer = serve["peer_transformers"]
    if peer["status"] == "skipped":
        assert "transformers serve cannot run here" in peer["note"], peer
    else:
        assert peer["status"] == "ok" and peer["ready_s"] > 0, peer
        for clients in cpu.peer_clients:
            assert peer[f"clients_{clients}"]["status"] == "ok" and not peer[f"clients_{clients}"]["errors"]
        assert set(serve["vs_transformers"]) == {f"clients_{c}" for c in cpu.peer_clients}
    assert (tmp_path / "serve_hf" / "config.json").is_file()
    assert by["profile"]["figures"]["figures"]["steps"] > 0
    assert shlex.split(by["doctor"]["command"])[-3:] == ["doctor", "--smoke", "--json"]
    assert by["doctor"]["figures"]["smoke"]["passed"] is True


def test_the_training_levers_steps_run_only_when_named(dry_run: tuple[str, dict], tmp_path: Path) -> None:
    """Issue 36's steps go past the default run's nine minutes: a lease runs them by name, beside `train`."""
    levers = {"bench_levers", "train_fp8", "train_gpt2_medium", "train_gpt2_large", "train_gpt2_xl"}
    assert not levers & {r["name"] for r in dry_run[1]["steps"]}
    assert gc.main(["dry-run", str(tmp_path), "--only", ",".join(["train", *sorted(levers)])]) == 0
    cmds = _commands(json.loads((tmp_path / "results.json").read_text()))
    assert set(cmds) == {"install", "prepare", "train", *levers}
    assert "--rungs default,chunked_loss,cudnn_attention,fp8 " in cmds["bench_levers"]
    # float8 trains what `train` trains, with --fp8 added
    assert cmds["train_fp8"].replace(" --fp8", "").replace("train_fp8", "train") == cmds["train"]
    for size in ("gpt2-medium", "gpt2-large", "gpt2-xl"):
        cmd = cmds[gc_plan.larger_step(size)]
        assert f"--preset {size} " in cmd and "--auto_batch_size" in cmd and "--compile" in cmd


def test_the_fp8_steps_figures_set_its_curve_and_speed_beside_trains_bf16_run(tmp_path: Path) -> None:
    for name, losses, tps in (("train", [10.0, 8.0, 6.0], 400_000.0), ("train_fp8", [10.0, 8.2, 6.0], 520_000.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": 10 * i + 1, "loss": x}) + "\n" for i, x in enumerate(losses)))
        (tmp_path / name / "run.json").write_text(json.dumps({
            "config": {"batch_size": 16, "gradient_accumulation_steps": 1, "fp8": name == "train_fp8"},
            "model": {"loss": "full"}, "summary": {"step": 21, "tokens_per_s": tps, "median_step_s": 0.04}}))
    fig = gc_figures.fig_train_fp8(tmp_path, "")
    assert fig["vs_bf16_loss_max_rel_gap"] == pytest.approx(0.025)  # 8.2 against 8.0
    assert fig["vs_bf16_tokens_per_s"] == pytest.approx(1.3)
    assert fig["plan"] == {"loss": "full", "fp8": True}


@pytest.mark.slow
def test_the_training_levers_steps_run_on_the_cpu(tmp_path: Path) -> None:
    """Issue 36's rehearsal: the levers' ladder (the GPU-only rungs skipped with the reason) and a larger-model run,
    whose checkpoints are deleted once its figures are read."""
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path), "--target", "cpu", "--only",
                           "prepare,train,bench_levers,train_debug"], capture_output=True, text=True, timeout=3600)
    by = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["steps"]}
    assert {n: r["status"] for n, r in by.items() if r["status"] != "ok"} == {}, done.stdout[-3000:]
    rungs = by["bench_levers"]["figures"]["rungs"]
    assert rungs["chunked_loss"]["status"] == "ok" and rungs["chunked_loss"]["loss_ok"]
    assert rungs["fp8"]["status"] == "skipped" and "compute capability 8.9" in rungs["fp8"]["note"]
    assert rungs["cudnn_attention"]["status"] == "skipped" and "CUDA kernels" in rungs["cudnn_attention"]["note"]
    larger = by["train_debug"]["figures"]
    assert larger["tokens_per_s"] > 0 and larger["plan"]["loss"] in ("full", "chunked")
    assert (tmp_path / "train_debug" / "run.json").is_file() and not list((tmp_path / "train_debug").glob("ckpt-*"))


FAMILY_STEPS = ("train_modern", "train_smollm2", "generate_llama", "train_qwen3")  # issue 37's, in the plan's order
LEASE_CALL_S = 480  # one lease call: the install and the data included, a rerun's start-up left over


def test_the_family_steps_run_only_when_named_within_one_lease_call(dry_run: tuple[str, dict], tmp_path: Path) -> None:
    """Issue 37's steps go past the default run's nine minutes: one lease call runs them by name, beside `train`."""
    assert not set(FAMILY_STEPS) & {r["name"] for r in dry_run[1]["steps"]}
    assert gc.main(["dry-run", str(tmp_path), "--only", ",".join(["train", *FAMILY_STEPS])]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    cmds = _commands(doc)
    assert list(cmds) == ["install", "prepare", "train", *FAMILY_STEPS]
    assert doc["planned_s"] == sum(r["limit_s"] for r in doc["steps"]) < LEASE_CALL_S
    # the modern recipe trains what `train` trains, with the speedrun block and Muon added
    modern = (" --arch positions=rope,qk_norm=true,mlp=relu2,tie_embeddings=false,zero_init=true --optimizer muon "
              "--muon_lr 6e-3 --learning_rate 8e-3 --warmup_steps 10")
    assert modern in cmds["train_modern"]
    assert cmds["train_modern"].replace(modern, "").replace("train_modern", "train") == cmds["train"]
    # the families train as `train` does, at its length, batch and steps, with their own presets
    for name, size in (("train_smollm2", "smollm2-135m"), ("train_qwen3", "qwen3-0.6b")):
        assert cmds[name].replace(f"--preset {size} ", "--preset gpt2 ").replace(name, "train") == cmds["train"]
    # the decode is the trained smollm2's, compiled
    assert cmds["generate_llama"].split("--model ")[1].split()[0] == str(tmp_path / "train_smollm2")
    assert "--compile" in cmds["generate_llama"]


def test_the_grouped_query_decode_steps_run_only_when_named_greedy_and_sampled(
    dry_run: tuple[str, dict], tmp_path: Path
) -> None:
    """Issue 46's steps: each family's decode against transformers on the GPU, greedy and as OpenAI's clients
    sample; one lease call runs the four by name."""
    names = gc_plan.INFER_FAMILY_STEPS
    assert not set(names) & {r["name"] for r in dry_run[1]["steps"]}
    assert gc.main(["dry-run", str(tmp_path), "--only", ",".join(names)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    cmds = _commands(doc)
    assert list(cmds) == ["install", "prepare", *names] and doc["planned_s"] < LEASE_CALL_S
    for family, size in (("llama", "smollm2-135m"), ("qwen3", "qwen3-0.6b")):
        greedy, sampled = cmds[f"infer_{family}_greedy"], cmds[f"infer_{family}_sampled"]
        assert f"--preset {size} " in greedy and "--mode infer" in greedy and "--rungs hf,levers,graphs " in greedy
        assert "--temperature" not in greedy
        assert sampled.replace(" --temperature 1", "").replace("_sampled", "_greedy") == greedy
    assert all(gc_figures.FIGURES[n] for n in names)  # each step's bench JSON is read into figures


def test_the_modern_steps_figures_set_its_speed_beside_trains(tmp_path: Path) -> None:
    for name, tps in (("train", 400_000.0), ("train_modern", 300_000.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 10.0}) + "\n")
        (tmp_path / name / "run.json").write_text(json.dumps({
            "config": {"batch_size": 16, "gradient_accumulation_steps": 1}, "model": {"loss": "full"},
            "summary": {"step": 40, "tokens_per_s": tps, "median_step_s": 0.04}}))
    fig = gc_figures.FIGURES["train_modern"](tmp_path, "")
    assert fig["tokens_per_s"] == 300_000.0 and fig["vs_train_tokens_per_s"] == pytest.approx(0.75)
    (tmp_path / "train" / "run.json").unlink()  # train did not run: no ratio, its own figures still
    assert "vs_train_tokens_per_s" not in gc_figures.FIGURES["train_modern"](tmp_path, "")


@pytest.mark.slow
def test_the_family_steps_run_on_the_cpu(tmp_path: Path) -> None:
    """Issue 37's rehearsal: llama-tiny stands in for smollm2 and qwen3, the modern block trains the debug preset."""
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path), "--target", "cpu", "--only",
                           ",".join(["prepare", "train", *FAMILY_STEPS])], capture_output=True, text=True,
                          timeout=3600)
    by = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["steps"]}
    assert {n: r["status"] for n, r in by.items() if r["status"] != "ok"} == {}, done.stdout[-3000:]
    assert set(by) == {"prepare", "train", *FAMILY_STEPS}
    for name in ("train_modern", "train_smollm2", "train_qwen3"):
        assert by[name]["figures"]["tokens_per_s"] > 0 and by[name]["figures"]["steps"] > 0, name
    assert by["train_modern"]["figures"]["vs_train_tokens_per_s"] > 0
    assert json.loads((tmp_path / "train_modern" / "run.json").read_text())["config"]["optimizer"] == "muon"
    assert "compiled decode after the first" in (tmp_path / "generate_llama.log").read_text()
    assert by["generate_llama"]["figures"]["tokens_per_s"] > 0
    assert not list((tmp_path / "train_qwen3").glob("ckpt-*"))  # its weights and AdamW state are deleted once read


@pytest.mark.slow
def test_the_grouped_query_decode_steps_run_on_the_cpu(tmp_path: Path) -> None:
    """Issue 46's rehearsal: llama-tiny stands in for both presets; the graphs rung is skipped with its reason, and
    so is transformers' sampler where nothing is sampled."""
    steps = ["prepare", "infer_llama_greedy", "infer_llama_sampled"]
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path), "--target", "cpu", "--only",
                           ",".join(steps)], capture_output=True, text=True, timeout=3600)
    by = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["steps"]}
    assert {n: r["status"] for n, r in by.items() if r["status"] != "ok"} == {}, done.stdout[-3000:]
    for name, temperature in (("infer_llama_greedy", 0.0), ("infer_llama_sampled", 1.0)):
        fig = by[name]["figures"]
        assert fig["temperature"] == temperature
        hf, kv, graphs = fig["rungs"]["hf"], fig["rungs"]["kv"], fig["rungs"]["graphs"]
        # the grouped-query rotary decode is transformers' token for token, and both have figures
        assert kv["tokens_match"] == 1.0 and kv["decode_tokens_per_s"] > 0 and hf["decode_tokens_per_s"] > 0
        assert graphs["status"] == "skipped" and "NVIDIA GPU" in graphs["note"]
        levers = ["kv-repeat-kv", "kv-plain-weights"] + (["kv-hf-sampling"] if temperature else [])
        for lever in levers:  # each lever's gain at both batch sizes, read into the figures
            assert [b for b, _ in fig["rungs"][lever]["lever_gain"]] == [1, 2], (lever, fig["rungs"][lever])
        if not temperature:
            assert fig["rungs"]["kv-hf-sampling"]["status"] == "skipped"
