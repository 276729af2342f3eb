"""The GPU check's runner: the steps in order, each within its time limit, results.json saved after each.

    python3 .ci/gpu_check.py run DIR --only bench   # the runner, through the command line
    pytest -q tests/test_gpu_check.py -k "hanging or stopped or unused"

A step past its limit gets SIGINT, then SIGTERM and SIGKILL to its group (GRACE_S apart); time a step
leaves unused goes to the later ones; a SIGTERM to the runner (a lease ending) stops every running step,
marks it `cut off`, and saves. The serve steps are driven here: bench's decode, gptopt serve under
loadtest (its /metrics scraped while each runs), then transformers serve alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpu_check_figures import (
    DECODE_GRAPHS,
    FIGURES,
    _gib,
    _json,
    _r,
    compared,
    decode_rates,
    kv_metrics,
    kv_plan,
    metric_samples,
)
from gpu_check_plan import (
    CPU_LIMIT_S,
    MODEL_FROM,
    RANDOM_WEIGHTS,
    ROOT,
    Ctx,
    Step,
    loadtests,
    phases,
    planned,
    resolve,
    step_loadtests,
)
from gpu_check_procs import _env, _free_port, _get, _gone, _killpg, _start, _stop, _tail
from gpu_check_record import summary_text, write_atomic

# What a GPU image may lack, by import name -> the wheels to carry (pip names); see .ci/gpu_check.sh.
NEEDED = {"fastapi": "fastapi starlette pydantic pydantic-core annotated-types typing-inspection",
          "uvicorn": "uvicorn", "torchao": "torchao", "prometheus_client": "prometheus-client",
          "regex": "regex", "httpx": "httpx", "transformers": "transformers", "pynvml": "nvidia-ml-py",
          "aiohttp": "aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna",
          "psutil": "psutil", "tqdm": "tqdm", "pytest": "pytest",
          # transformers serve, the serve step's peer: its serving extra's client types import openai's client
          "openai": "openai httpx2 httpcore2 truststore jiter sniffio"}


GRACE_S = (5, 5)  # after a step's limit: SIGINT to its leader, then SIGTERM and SIGKILL to its group this long apart


class CutOff(BaseException):
    """The runner itself was told to stop (SIGTERM, or Ctrl-C at a terminal). A BaseException, like
    KeyboardInterrupt: the runner's own `except Exception` (polling /ready, reading figures) must not
    swallow it."""


def _cut_off(signum: int, _frame: object) -> None:
    raise CutOff(signal.Signals(signum).name)


def _model_dir(out: Path) -> Path | None:
    for name in MODEL_FROM:
        if (out / name / "latest").is_file():
            return out / name
    return None


@dataclasses.dataclass
class Live:
    step: Step
    proc: subprocess.Popen[bytes]
    start: float
    limit: float
    stage: int = 0  # 0 running; 1 SIGINT sent; 2 SIGTERM; 3 SIGKILL
    since: float = 0.0


class Runner:
    def __init__(self, ctx: Ctx, steps: list[Step], budget_s: int, order: list[str] | None = None,
                 report: Path | None = None) -> None:
        self.ctx, self.steps, self.budget_s, self.report = ctx, steps, budget_s, report
        self.order = order or [s.name for s in steps]  # the whole plan's: results.json lists steps in it
        self.t0 = time.monotonic()
        self.results: dict[str, dict[str, Any]] = {s.name: planned(s, ctx) for s in steps}
        self.header: dict[str, Any] = {"started": _now(), "target": ctx.target, "budget_s": budget_s,
                                       "planned_s": sum(max(self.own(s) for s in p) for p in phases(steps)),
                                       "python": ctx.python, "repo": str(ROOT),
                                       "commit": _git_commit(), "weights": RANDOM_WEIGHTS}
        self.earlier: dict[str, dict[str, Any]] = {}  # steps an earlier run into DIR ran and this one does not
        self.live: list[Live] = []

    def keep_earlier(self) -> None:
        """A rerun of some steps (--only) into the same DIR keeps the other steps' results."""
        old = _json(self.ctx.out / "results.json")
        if not isinstance(old, dict) or old.get("target") != self.ctx.target:
            return
        self.earlier = {r["name"]: r for r in old.get("steps", []) if r.get("status") != "planned"
                        and r["name"] not in self.results}
        self.header["earlier_run"] = {k: old.get(k) for k in ("started", "commit", "seconds")}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def own(self, step: Step) -> int:
        return step.limit if self.ctx.target == "gpu" else CPU_LIMIT_S

    def run(self) -> dict[str, Any]:
        self.keep_earlier()
        self.header.update(_machine(self.ctx))
        self.save()
        old = {sig: signal.signal(sig, _cut_off) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            todo = phases(self.steps)
            for i, phase in enumerate(todo):
                # Time a step leaves unused goes to the later ones: each may use its own limit plus what the
                # budget holds beyond the limits of the steps still to come (this phase's included).
                rest = sum(max(self.own(s) for s in p) for p in todo[i:])
                self.run_phase(phase, extra=max(0.0, self.left() - rest))
                if phase[0].name == "install":  # what is still missing once gptopt and the wheels are in
                    self.header.update(missing_after_install=_missing(self.ctx.python))
                self.save()
        except CutOff as e:
            for live in self.live:
                _killpg(live.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    live.proc.wait(5)
                self.finish(live.step, "cut off", live.proc.returncode, time.monotonic() - live.start,
                            f"the run was stopped from outside ({e})")
            self.header["cut_off"] = str(e)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        self.header["finished"] = _now()
        self.header["seconds"] = round(time.monotonic() - self.t0, 1)
        return self.save()

    def run_phase(self, phase: list[Step], extra: float = 0.0) -> None:
        for step in phase:
            own = self.own(step)
            limit = min(own + extra, self.left())
            res = self.results[step.name]
            if limit < min(own, 15):  # too little left even to import torch and start
                res.update(status="skipped", note="out of time: the run's budget is spent")
                _say(f"-- {step.name}: skipped, out of time")
                continue
            if step.model:
                model = _model_dir(self.ctx.out)
                if model is None:
                    res.update(status="skipped", note=f"no model: none of {', '.join(MODEL_FROM)} saved a checkpoint")
                    _say(f"-- {step.name}: skipped, no model")
                    continue
                res["model"] = str(model)
            res["limit_s"] = round(limit)
            if step.serve:
                self.run_serve(step, limit)
                continue
            argv = resolve(step.argv, res.get("model"))
            _say(f"== {step.name} (limit {limit:.0f}s): {shlex.join(argv)}")
            log = self.ctx.out / f"{step.name}.log"
            log.unlink(missing_ok=True)
            try:
                proc = _start(argv, log, self.ctx.out / step.stdout if step.stdout else None)
            except OSError as e:
                self.finish(step, "failed", None, 0.0, f"could not start: {e}")
                continue
            self.live.append(Live(step, proc, time.monotonic(), limit))
        while self.live:
            now = time.monotonic()
            for live in list(self.live):
                rc = live.proc.poll()
                if rc is not None:
                    _killpg(live.proc.pid, signal.SIGKILL)  # its leftovers: workers, ranks, compile pools
                    self.live.remove(live)
                    if live.stage:
                        self.finish(live.step, "timeout", rc, now - live.start,
                                    f"stopped at its limit of {live.limit:.0f}s")
                    else:
                        self.finish(live.step, "ok" if rc == 0 else "failed", rc, now - live.start)
                elif live.stage == 0 and now - live.start >= live.limit:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(live.proc.pid, signal.SIGINT)
                    live.stage, live.since = 1, now
                elif 0 < live.stage < 3 and now - live.since >= GRACE_S[live.stage - 1]:
                    _killpg(live.proc.pid, signal.SIGTERM if live.stage == 1 else signal.SIGKILL)
                    live.stage, live.since = live.stage + 1, now
            time.sleep(0.2)

    def finish(self, step: Step, status: str, rc: int | None, seconds: float, note: str = "") -> None:
        res, log = self.results[step.name], self.ctx.out / f"{step.name}.log"
        res.update(status=status, rc=rc, seconds=round(seconds, 1))
        if note:
            res["note"] = note
        if step.name in FIGURES:
            try:
                text = log.read_text(errors="replace") if log.exists() else ""
                res["figures"] = FIGURES[step.name](self.ctx.out, text)
            except Exception as e:  # a figure that cannot be read must not cost the rest of the run
                res["figures"] = {"unreadable": f"{type(e).__name__}: {e}"}
        if step.drop_checkpoints:
            for ckpt in (self.ctx.out / step.name).glob("ckpt-*"):
                shutil.rmtree(ckpt, ignore_errors=True)
        if status != "ok":
            res["error_tail"] = _tail(log)
        _say(f"   {step.name}: {status} (rc {rc}) in {seconds:.1f}s {json.dumps(res.get('figures', {}))[:300]}")

    def run_serve(self, step: Step, limit: float) -> None:
        """bench's decode at the loadtests' batch sizes; the server in the background, /ready polled, loadtest at
        each client count, /metrics; stopped; then the peer server alike. One process of them at a time."""
        res = self.results[step.name]
        start = time.monotonic()
        deadline = start + limit
        figures: dict[str, Any] = {}
        res["figures"] = figures
        for name in ("", "_loadtest", "_decode", "_peer"):
            (self.ctx.out / f"{step.name}{name}.log").unlink(missing_ok=True)
        _say(f"== {step.name} (limit {limit:.0f}s)")
        status, note, rc = "ok", "", None
        try:
            if step.decode:
                # at most half the limit: a bench that hangs must leave the server its time
                figures["decode"] = self._decode(step.decode, min(deadline, start + limit / 2))
            status, note, rc = self._serve(step, deadline, figures)
            if step.peer and status == "failed":
                figures["peer_transformers"] = {"status": "skipped", "note": "gptopt serve failed: nothing to compare"}
            elif step.peer:
                figures["peer_transformers"] = peer = self._peer(step, deadline)
                if peer["status"] not in ("ok", "skipped"):
                    note = "; ".join(filter(None, [note, f"transformers serve: {peer['status']}: {peer.get('note')}"]))
        except CutOff:  # run() stops the steps in self.live; the servers and the bench are this method's own
            res["figures"] = compared(figures)
            self.finish(step, "cut off", None, time.monotonic() - start, "the run was stopped from outside")
            raise
        res["figures"] = compared(figures)
        self.finish(step, status, rc, time.monotonic() - start, note)

    def _decode(self, argv: list[str], deadline: float) -> dict[str, Any]:
        """bench --mode infer, its JSON on DIR/serve_decode.json: the decode rung's tokens/s per batch size."""
        _say(f"   decode: {shlex.join(argv)}")
        t0 = time.monotonic()
        out = self.ctx.out / "serve_decode.json"
        try:
            proc = _start(argv, self.ctx.out / "serve_decode.log", out)
        except OSError as e:
            return {"status": "failed", "note": f"could not start: {e}"}
        try:
            proc.wait(max(deadline - t0, 1.0))
            stopped = False
        except subprocess.TimeoutExpired:
            _stop(proc, GRACE_S)  # SIGINT first: bench writes the batch sizes it measured
            stopped = True
        except BaseException:
            _killpg(proc.pid, signal.SIGKILL)
            raise
        _killpg(proc.pid, signal.SIGKILL)  # its leftovers
        rung = self.ctx.sizes.decode_rung
        fig = decode_rates(_json(self.ctx.out / "serve_decode" / "infer_results.json") or _json(out), rung)
        fig["seconds"] = round(time.monotonic() - t0, 1)
        if stopped:
            fig["note"] = "; ".join(filter(None, [f"stopped at its limit of {deadline - t0:.0f}s", fig.get("note")]))
        elif proc.returncode != 0:
            fig.update(status="failed", rc=proc.returncode, tail=_tail(self.ctx.out / "serve_decode.log", 5)[-400:])
        return fig

    def _serve(self, step: Step, deadline: float, figures: dict[str, Any]) -> tuple[str, str, int | None]:
        """gptopt serve: start to /ready, the decode's warm-up line, memory, loadtest at each client count."""
        res, log = self.results[step.name], self.ctx.out / f"{step.name}.log"
        start = time.monotonic()
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = resolve(step.argv, res.get("model"), port)
        _say(f"   server: {shlex.join(argv)}")
        try:
            server = _start(argv, log)
        except OSError as e:
            return "failed", f"could not start: {e}", None
        status, note = "ok", ""
        try:
            while _get(f"{url}/ready") != 200:
                if server.poll() is not None:
                    status, note = "failed", f"the server exited with {server.returncode} before /ready"
                    break
                if time.monotonic() > deadline:
                    status, note = "timeout", f"not ready within {deadline - start:.0f}s"
                    break
                time.sleep(0.25)
            else:
                figures["ready_s"] = round(time.monotonic() - start, 1)
                text = log.read_text(errors="replace") if log.exists() else ""
                if plan := kv_plan(text):  # the start-up line: the KV cache's memory, tokens and blocks
                    figures["kv_cache"] = plan
                graphs = DECODE_GRAPHS.search(text)
                if graphs:  # the engine's warm-up line: the compiled decode's buckets and their build time
                    figures["decode_buckets"], figures["decode_graphs_s"] = graphs[1], float(graphs[2])
                figures["memory_at_ready"] = _server_memory(url)
                for key, lt in step_loadtests(self.ctx, step, url, res.get("model") or "MODEL"):
                    left = deadline - time.monotonic()
                    if left < 3:
                        status, note = "timeout", f"no time left for {key}"
                        break
                    with _KVWatch(url) as kv:  # the KV cache's usage at its peak, preemptions and prefix hits
                        row = self._loadtest(lt, left, key, log=step.name)
                    figures[key] = {**row, **kv.figures}
                    if row.get("status") != "ok":
                        status = "failed"
                figures["memory_at_end"] = _server_memory(url)
                figures["kv_at_end"] = kv_metrics(_scrape(url))
                if status == "ok" and step.check and (why := step.check(figures)):
                    status, note = "failed", why
        except BaseException:
            _killpg(server.pid, signal.SIGKILL)
            raise
        _stop(server, GRACE_S)
        _gone(server.pid)  # its device memory is the peer's next
        return status, note, server.returncode

    def _peer(self, step: Step, deadline: float) -> dict[str, Any]:
        """transformers serve on serve_export's folder: start to GET /v1/models, a warm-up loadtest (its engine
        and cache are made at the first request), then loadtest at each of peer_clients; stopped. Skipped, with
        the reason, where it cannot run here (its serving extra missing) or the folder is missing."""
        assert step.peer is not None
        folder = Path(step.peer[-1])
        if not (folder / "config.json").is_file():
            return {"status": "skipped", "note": f"no Hugging Face folder at {folder} (the serve_export step's)"}
        missing = _peer_missing(self.ctx.python)
        if missing:
            return {"status": "skipped", "note": missing}
        start = time.monotonic()
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = resolve(step.peer, None, port)
        log = self.ctx.out / "serve_peer.log"
        _say(f"   peer: {shlex.join(argv)}")
        out: dict[str, Any] = {"status": "ok", "command": shlex.join(argv)}
        if deadline - start < 10:
            return {**out, "status": "timeout", "note": "no time left in the step's limit"}
        try:
            server = _start(argv, log)
        except OSError as e:
            return {**out, "status": "failed", "note": f"could not start: {e}"}
        try:
            while _get(f"{url}/v1/models") != 200:
                if server.poll() is not None:
                    return {**out, **_peer_exit(server.returncode, _tail(log, 40))}
                if time.monotonic() > deadline:
                    return {**out, "status": "timeout", "note": f"no answer on /v1/models in {deadline - start:.0f}s"}
                time.sleep(0.25)
            out["ready_s"] = round(time.monotonic() - start, 1)
            model = self.results[step.name].get("model") or "MODEL"
            [(c, warm)] = loadtests(self.ctx, url, (min(self.ctx.sizes.peer_clients),), model)
            warm[warm.index("--requests") + 1] = str(c)  # one request per client: the engine made, not measured
            t0 = time.monotonic()
            row = self._loadtest(warm, max(deadline - t0, 1.0), c, "transformers serve warm-up")
            out["warmup_s"] = round(time.monotonic() - t0, 1)
            if row.get("status") != "ok":
                return {**out, "status": "failed", "note": f"the warm-up: {row}"[:300]}
            for clients, lt in loadtests(self.ctx, url, self.ctx.sizes.peer_clients, model):
                left = deadline - time.monotonic()
                if left < 3:
                    out.update(status="timeout", note=f"no time left for {clients} clients")
                    break
                out[f"clients_{clients}"] = row = self._loadtest(lt, left, clients, "transformers serve")
                if row.get("status") != "ok":
                    out["status"] = "failed"
            return out
        finally:  # nothing of it is needed after the loadtests: no graceful stop to wait for
            _killpg(server.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(10)
            _gone(server.pid)

    def _loadtest(self, argv: list[str], limit: float, clients: int | str, server: str = "gptopt serve",
                  log: str = "serve") -> dict[str, Any]:
        """One loadtest's figures (status "failed" where it exited non-zero: its summary kept, if it printed one)."""
        label = f"{clients} clients" if isinstance(clients, int) else clients
        _say(f"   loadtest {label} ({server}): {shlex.join(argv)}")
        try:
            done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"status": "timeout"}
        with open(self.ctx.out / f"{log}_loadtest.log", "ab") as f:
            f.write(b"\n--- loadtest %s, %s\n" % (label.encode(), server.encode()) + done.stderr + done.stdout)
        summary = None
        for line in reversed(done.stdout.decode(errors="replace").splitlines()):
            try:
                summary = json.loads(line)
                break
            except ValueError:
                continue
        if not isinstance(summary, dict):
            return {"status": "failed", "rc": done.returncode, "tail": done.stderr.decode(errors="replace")[-400:]}
        keep = ("requests", "completed", "errors", "output_tokens", "requests_per_s", "output_tokens_per_s", "ttft_s",
                "tpot_s", "server_memory", "server_device_memory")
        row: dict[str, Any] = {"status": "ok"} if done.returncode == 0 else {"status": "failed", "rc": done.returncode}
        for k in keep:
            v = summary.get(k)
            if isinstance(v, dict) and k.startswith("server_"):  # bytes -> GiB
                v = {q.removesuffix("_bytes") + "_gib": _gib(x) for q, x in v.items() if q.endswith("_bytes")}
            elif isinstance(v, dict):
                v = {q: _r(x, 4) for q, x in v.items()
                     if q in ("p50", "p90", "p99", "mean") or not isinstance(x, float)}
            if v is not None:
                row[k] = _r(v, 1)
        return row

    def save(self) -> dict[str, Any]:
        both = {**self.earlier, **self.results}
        rank = {name: i for i, name in enumerate(self.order)}
        doc = {**self.header, "steps": sorted(both.values(), key=lambda r: rank.get(r["name"], len(rank)))}
        text = summary_text(doc)
        write_atomic(self.ctx.out / "results.json", json.dumps(doc, indent=2, default=str) + "\n")
        write_atomic(self.ctx.out / "summary.txt", text)
        if self.report is not None:  # a few small files, for a machine that returns only a few
            self.report.mkdir(parents=True, exist_ok=True)
            write_atomic(self.report / "results.json", json.dumps(doc, indent=2, default=str) + "\n")
            write_atomic(self.report / "summary.txt", text)
            tails = [f"===== {r['name']} ({r['status']})\n{_tail(self.ctx.out / (r['name'] + '.log'), 60)}\n"
                     for r in doc["steps"] if r["status"] != "planned"]
            write_atomic(self.report / "logs.txt", "\n".join(tails))
        return doc


def _say(text: str) -> None:
    print(text, flush=True)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _missing(python: str) -> dict[str, str]:
    """The imports the steps need that `python` lacks, each with the wheels to carry."""
    try:
        probe = subprocess.run([python, "-c", "import importlib.util, json, sys; print(json.dumps("
                                "[m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))", *NEEDED],
                               capture_output=True, text=True, timeout=60)
        missing = json.loads(probe.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    if missing:
        _say(f"!! missing here: {', '.join(missing)}; carry these wheels: {' '.join(NEEDED[m] for m in missing)}")
    return {m: NEEDED[m] for m in missing}


def _machine(ctx: Ctx) -> dict[str, Any]:
    """The GPU (nvidia-smi), the CPU, and which imports the steps need are missing (with the wheels to carry)."""
    info: dict[str, Any] = {}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        (ctx.out / "nvidia-smi.txt").write_text(smi.stdout + smi.stderr)
        if smi.returncode == 0 and smi.stdout.strip():
            info["gpu"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)
        info["cpu"] = f"{cpu}, {os.cpu_count()} logical cores"
    except OSError:
        pass
    missing = _missing(ctx.python)
    if missing:
        info["missing"] = missing
    return info


# What transformers serve needs beyond transformers: its serving extra, and accelerate for its model loading
# (a device map). A GPU image may have transformers without them: the peer is then skipped, with the reason.
PEER_NEEDS = ("fastapi", "uvicorn", "pydantic", "openai", "accelerate")
# Lines of a peer's log that say it exited for something missing here, not for a fault of its own
PEER_MISSING = ("No module named", "Missing dependencies", "requires `accelerate`")
PEER_PROBE = """import importlib.util as u, json, sys
missing = [m for m in sys.argv[1:] if u.find_spec(m) is None]
if "transformers" not in missing and u.find_spec("transformers.cli.transformers") is None:
    missing.append("transformers.cli.transformers (a transformers with `transformers serve`)")
print(json.dumps(missing))"""


def _peer_missing(python: str) -> str | None:
    """Why transformers serve cannot run under `python`, or None (also where the probe itself fails: the
    server's start then says why)."""
    try:
        done = subprocess.run([python, "-c", PEER_PROBE, "transformers", *PEER_NEEDS], capture_output=True,
                              text=True, timeout=60, env=_env())
        missing = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if not missing:
        return None
    return (f"transformers serve cannot run here: {', '.join(missing)} missing "
            "(pip install 'transformers[serving]' accelerate)")


def _peer_exit(rc: int | None, tail: str) -> dict[str, Any]:
    """A peer that exited before it answered: skipped where its log names something missing here, else failed."""
    why = next((line.strip() for line in reversed(tail.splitlines()) if any(m in line for m in PEER_MISSING)), None)
    if why:
        return {"status": "skipped", "note": f"transformers serve cannot run here: {why}"[:300]}
    return {"status": "failed", "note": f"exited with {rc} before /v1/models answered", "tail": tail[-400:]}


def _scrape(url: str) -> dict[str, float]:
    """The server's /metrics, each unlabelled sample by name ({} where it cannot be read)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            return metric_samples(r.read().decode())
    except Exception:
        return {}


def _server_memory(url: str) -> dict[str, Any]:
    """The server's resident memory and, on a GPU, its device memory, from /metrics."""
    samples = _scrape(url)
    if not samples:
        return {"unreadable": f"no /metrics at {url}"}
    return {name.removesuffix("_bytes") + "_gib": _gib(v) for name, v in samples.items()
            if name == "process_resident_memory_bytes" or name.startswith("gptopt_device_memory")}


class _KVWatch:
    """/metrics scraped while a loadtest runs: the KV cache's usage at its peak (the gauge reads the blocks requests
    hold now, and they are freed when the load ends), and the preemptions and prefix-cache hits it caused."""

    # a scrape is a small request beside the load's: a few a second cannot move its figures (a load shorter than
    # this may end between two, and its peak reads 0)
    EVERY_S = 0.2

    def __init__(self, url: str) -> None:
        self.url, self.peak, self.figures = url, None, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _KVWatch:
        self.before = _scrape(self.url)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.EVERY_S):
            usage = _scrape(self.url).get("gptopt_kv_cache_usage_perc")
            if usage is not None:
                self.peak = max(self.peak or 0.0, usage)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.figures = kv_metrics(_scrape(self.url), self.before, self.peak)
