#!/usr/bin/env python3
"""Compare OpenAI-compatible servers on this machine: each started in turn, measured with `gptopt loadtest`.

    python benchmarks/serve_compare.py --model /work/bench/tiny-hf2 --runs 5 --concurrency 16,1 \\
        --requests 64 --max_tokens 32 --tokenizer /work/bench/tiny-hf2 --output_dir cmp \\
        --server "gptopt=gptopt serve --model {model} --port {port}" \\
        --server "hf=transformers serve --continuous-batching --device cpu --port {port} {model}"

For each concurrency, for each run, for each server in the order given (A B A B ...): start the server
(a process group of its own, its output in OUTPUT_DIR), wait until GET /v1/models answers 200, send a
warm-up loadtest of other prompts (not recorded), then the measured `gptopt loadtest ... --json`, then stop it (SIGINT;
SIGTERM and SIGKILL to the group if it lingers) and wait until its port is free. Alternating the
servers run by run spreads the drift of a shared machine (other jobs, heat, frequency) over all of
them alike; one server's runs back to back would charge the drift to that server.

OUTPUT_DIR gets results.json (every run, rewritten after each, so a run cut off from outside keeps
what it measured), report.md (every run, then per concurrency and server the median, min and max of
output tokens/s with the max/min spread, the median TTFT p50, and the first server's median over
each other's) and the logs. Ctrl-C stops the current server, writes what was measured and exits 130.
Exit status 0 when every run completed without a request error, 1 otherwise, 2 for a bad argument.

Standard library only: it drives the servers and `gptopt loadtest` as commands and reads loadtest's
--json summary line, never gptopt's internals, so the same script times any server and any build.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a server's name is part of its log files' names
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU flags of native bf16 arithmetic
POLL_S = 0.25
KILL_WAIT_S = 10.0  # after SIGTERM, before SIGKILL
PORT_FREE_TIMEOUT_S = 60.0
EXIT_STOPPED = 130  # as a shell reports a command stopped by SIGINT


class Stop(Exception):
    """The comparison cannot go on (a server that never answered); the message names its log."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the script."""


# --- arguments -------------------------------------------------------------------------------------


def parse_server(spec: str) -> tuple[str, str]:
    """NAME=COMMAND, the command a template with {port} (and optionally {model}) in it."""
    name, sep, command = spec.partition("=")
    name, command = name.strip(), command.strip()
    if not sep or not NAME.match(name) or not command:
        raise argparse.ArgumentTypeError(f"--server wants NAME=COMMAND with NAME of letters, digits, _ . -; "
                                         f"got {spec!r}")
    if "{port}" not in command:
        raise argparse.ArgumentTypeError(f"--server {name}: the command must hold {{port}}, where the server is "
                                         "told its port")
    try:
        command.format(model="M", port=1)
    except (KeyError, IndexError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--server {name}: only {{model}} and {{port}} may stand in braces "
                                         f"({e!r}); double a literal brace: {{{{ }}}}") from None
    return name, command


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a whole number of 1 or more; got {text!r}")
    return value


def concurrencies(text: str) -> list[int]:
    values = [positive_int(part.strip()) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--concurrency lists a value twice: {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve_compare.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", required=True, help="the model directory: {model} in the commands, and the "
                   "model field of every request")
    p.add_argument("--server", dest="servers", action="append", type=parse_server, required=True,
                   metavar="NAME=COMMAND", help="a server to measure (give two or more); COMMAND holds {port} "
                   "and may hold {model}. The first is the one the ratios are of")
    p.add_argument("--output_dir", required=True, help="where results.json, report.md and the logs go "
                   "(new, or empty)")
    p.add_argument("--runs", type=positive_int, default=5, help="measured runs of each server at each "
                   "concurrency (default 5)")
    p.add_argument("--concurrency", type=concurrencies, default=[16, 1], help="comma-separated client "
                   "counts (default 16,1)")
    p.add_argument("--requests", type=positive_int, default=64, help="requests of each measured run (default 64)")
    p.add_argument("--max_tokens", type=positive_int, default=32, help="max_tokens of each request (default 32)")
    p.add_argument("--prompt_tokens", type=positive_int, default=32, help="prompt length of each request "
                   "(default 32): tokens of --tokenizer, else words (approximately as many tokens)")
    p.add_argument("--tokenizer", help="the served model's tokenizer.json, or its model directory, passed to every "
                   "loadtest: each prompt is then exactly --prompt_tokens of its tokens")
    p.add_argument("--warmup_requests", type=int, default=16, help="requests of the unrecorded warm-up "
                   "before each measured run, at its concurrency (default 16; 0: none)")
    p.add_argument("--loadtest", default="gptopt loadtest", help="the loadtest command (default: gptopt "
                   "loadtest; e.g. 'python -m gptopt loadtest')")
    p.add_argument("--startup_timeout", type=float, default=300.0, help="seconds a server has to answer "
                   "GET /v1/models (default 300)")
    p.add_argument("--stop_grace", type=float, default=30.0, help="seconds after SIGINT before SIGTERM "
                   "(default 30)")
    p.add_argument("--loadtest_timeout", type=float, default=3600.0, help="seconds one loadtest may take "
                   "(default 3600)")
    p.add_argument("--settle", type=float, default=0.0, help="seconds to wait after a server stops before the "
                   "next starts: one that held gigabytes (vLLM's KV cache) can leave the machine slower for a "
                   "while after it exits, which the next server's run would pay (default 0)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    names = [name for name, _ in args.servers]
    if len(set(names)) != len(names):
        p.error(f"two --server share a name ({', '.join(names)}); give each its own")
    if args.warmup_requests < 0:
        p.error("--warmup_requests must be 0 or more")
    if not 0 <= args.settle < 1e6:
        p.error("--settle must be a number of seconds, 0 or more")
    for flag in ("startup_timeout", "stop_grace", "loadtest_timeout"):
        if not 0 < getattr(args, flag) < 1e6:
            p.error(f"--{flag} must be a number of seconds above 0")
    try:
        refuse_output_dir(Path(args.output_dir))
    except ValueError as e:
        p.error(str(e))
    if args.tokenizer is not None and not Path(args.tokenizer).expanduser().exists():
        p.error(f"--tokenizer {args.tokenizer}: no such file or folder; give the served model's tokenizer.json or "
                "its model directory")
    if not shlex.split(args.loadtest):
        p.error("--loadtest is empty; give the loadtest command, e.g. 'gptopt loadtest'")
    return args


def refuse_output_dir(path: Path) -> None:
    """Results never land among other files: every figure in OUTPUT_DIR is this comparison's."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--output_dir {path} is a file; give a new or empty directory")
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"--output_dir {path} already holds files; give a new or empty directory "
                         "(nothing there is replaced)")


# --- the machine -----------------------------------------------------------------------------------


def cpu_info(cpuinfo: str) -> dict[str, Any]:
    """The CPU's model name and its native bf16 flags, from the text of /proc/cpuinfo."""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    have = set(flags.group(1).split()) if flags else set()
    return {"model": model.group(1).strip() if model else platform.processor() or "unknown",
            "bf16_flags": [f for f in BF16_FLAGS if f in have], "logical_cpus": os.cpu_count()}


def read_cpu_info() -> dict[str, Any]:
    try:
        return cpu_info(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        return cpu_info("")


# --- servers ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def server_argv(template: str, model: str, port: int) -> list[str]:
    return shlex.split(template.format(model=shlex.quote(model), port=port))


class Server:
    """One server process in a process group of its own, its output in `log`."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        self.started = time.perf_counter()
        self._out = log.open("wb")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            self._out.close()
            raise Stop(f"{name}: cannot start {shlex.join(argv)}: {e}") from None

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start until GET /v1/models answered 200."""
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while True:
            if self.proc.poll() is not None:
                raise Stop(f"{self.name} exited with status {self.proc.returncode} before it answered; "
                           f"its log: {self.log}")
            try:
                with urllib.request.urlopen(url, timeout=5.0) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or not ready (an HTTPError is a URLError)
            if time.perf_counter() - self.started > timeout:
                raise Stop(f"{self.name} did not answer GET /v1/models within {timeout:g} s "
                           f"(--startup_timeout); its log: {self.log}")
            time.sleep(POLL_S)

    def stop(self, grace: float) -> None:
        """SIGINT (a server's graceful stop), then SIGTERM and SIGKILL to the whole group; then its port free."""
        with signals_held():  # a second Ctrl-C must not leave this server running
            self._stop(grace)

    def _stop(self, grace: float) -> None:
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, KILL_WAIT_S), (signal.SIGKILL, KILL_WAIT_S)):
            if self.proc.poll() is not None:
                break
            _signal_group(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        # helpers the server started (a resource tracker, workers) leave with it or not at all
        deadline = time.perf_counter() + KILL_WAIT_S
        while _group_alive(self.proc.pid) and time.perf_counter() < deadline:
            time.sleep(POLL_S)
        if _group_alive(self.proc.pid):
            _signal_group(self.proc.pid, signal.SIGKILL)
        self._out.close()
        deadline = time.perf_counter() + PORT_FREE_TIMEOUT_S
        while port_open(self.port):
            if time.perf_counter() > deadline:
                progress(f"  warning: port {self.port} still answers {PORT_FREE_TIMEOUT_S:g} s after "
                         f"{self.name} stopped")
                break
            time.sleep(POLL_S)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (they arrive afterwards) while a server is stopped or the report written."""
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone (PermissionError: macOS, for a group of zombies)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# --- loadtest --------------------------------------------------------------------------------------


# The warm-up's prompts are drawn with another seed than the measured run's: a server that caches prompt prefixes
# meets the measured prompts as new ones, not as the warm-up's again
WARMUP_SEED = 1


def loadtest_argv(args: argparse.Namespace, port: int | str, concurrency: int | str, requests: int | str,
                  seed: int = 0) -> list[str]:
    return [*shlex.split(args.loadtest), "--url", f"http://127.0.0.1:{port}", "--requests", str(requests),
            *(["--seed", str(seed)] if seed else []),
            "--concurrency", str(concurrency), "--max_tokens", str(args.max_tokens),
            "--prompt_tokens", str(args.prompt_tokens), *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
            "--model", args.model, "--json"]


def last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        return obj if isinstance(obj, dict) else None
    return None


def run_loadtest(argv: list[str], log: Path, timeout: float) -> tuple[int, dict[str, Any] | None]:
    """Its exit status and --json summary (None without one); its output goes to `log`."""
    with log.open("w") as err:
        err.write(f"$ {shlex.join(argv)}\n")
        err.flush()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                    text=True, start_new_session=True)
        except OSError as e:
            raise Stop(f"cannot start the loadtest {shlex.join(argv)}: {e} (--loadtest)") from None
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            err.write(f"\nkilled after {timeout:g} s (--loadtest_timeout)\n")
            return -9, None
        finally:
            if proc.poll() is None:  # interrupted: the loadtest goes with the run
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        err.write(out)
    return proc.returncode, last_json(out)


def record(server: str, concurrency: int, run: int, ready_s: float | None, status: int | None,
           summary: dict[str, Any] | None, logs: dict[str, str]) -> dict[str, Any]:
    """One run's row of results.json (figures None where loadtest gave no summary)."""
    s = summary or {}
    ttft, tpot = s.get("ttft_s") or {}, s.get("tpot_s") or {}
    return {"server": server, "concurrency": concurrency, "run": run, "ready_s": ready_s,
            "output_tokens_per_s": s.get("output_tokens_per_s"), "ttft_p50_s": ttft.get("p50"),
            "ttft_p99_s": ttft.get("p99"), "tpot_p50_s": tpot.get("p50"),
            "requests": s.get("requests"), "completed": s.get("completed"), "output_tokens": s.get("output_tokens"),
            "errors": s.get("errors") if summary is not None else {"no summary": 1},
            "loadtest_exit": status, "logs": logs, "summary": summary}


# --- the report ------------------------------------------------------------------------------------


def aggregate(runs: list[dict[str, Any]], servers: list[str]) -> list[dict[str, Any]]:
    """Per concurrency (in the order run) and server (in the order given): the spread of its runs."""
    out = []
    for c in dict.fromkeys(r["concurrency"] for r in runs):
        for name in servers:
            mine = [r for r in runs if r["concurrency"] == c and r["server"] == name]
            tps = [r["output_tokens_per_s"] for r in mine if r["output_tokens_per_s"] is not None]
            ttft = [r["ttft_p50_s"] for r in mine if r["ttft_p50_s"] is not None]
            if not mine:
                continue
            out.append({"concurrency": c, "server": name, "runs": len(tps),
                        "median_tokens_per_s": statistics.median(tps) if tps else None,
                        "min_tokens_per_s": min(tps) if tps else None, "max_tokens_per_s": max(tps) if tps else None,
                        # the fastest run over the slowest: how far one run can be trusted
                        "max_over_min": max(tps) / min(tps) if tps and min(tps) > 0 else None,
                        "median_ttft_p50_s": statistics.median(ttft) if ttft else None,
                        "errors": sum(sum(r["errors"].values()) for r in mine)})
    return out


def ratios(rows: list[dict[str, Any]], servers: list[str]) -> list[dict[str, Any]]:
    """Per concurrency: the first server's median output tokens/s over each other server's."""
    out = []
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        median = {r["server"]: r["median_tokens_per_s"] for r in rows if r["concurrency"] == c}
        first = median.get(servers[0])
        for other in servers[1:]:
            if other in median:
                theirs = median[other]
                ok = first is not None and theirs
                out.append({"concurrency": c, "first": servers[0], "other": other,
                            "ratio": first / theirs if ok else None})
    return out


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "none"


def render_report(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    servers = list(meta["servers"])
    cpu = meta["cpu"]
    bf16 = f"yes ({', '.join(cpu['bf16_flags'])})" if cpu["bf16_flags"] else "no (no avx512_bf16, amx_bf16)"
    lines = ["# Server comparison", "",
             f"- date: {meta['date']}",
             f"- CPU: {cpu['model']}, {cpu['logical_cpus']} logical CPUs; native bf16: {bf16}",
             f"- command: `{meta['command']}`"]
    lines += [f"- server {name}: `{template}`" for name, template in meta["servers"].items()]
    tokens = meta["tokenizer"]
    lines += [f"- measured with: `{meta['loadtest']}`",
              f"- prompts: {meta['prompt_tokens']} " + (f"tokens each, of `{tokens}`" if tokens else
                                                         "words each (approximately as many tokens; no --tokenizer)"),
              f"- each run: start, GET /v1/models until 200 (ready s), warm-up of {meta['warmup_requests']} other "
              "requests (not recorded), the measured loadtest, stop"
              + (f", {meta['settle_s']:g} s idle" if meta.get("settle_s") else "") + "; servers alternate run by run"]
    if meta.get("stopped"):
        lines += ["", f"**Incomplete: {meta['stopped']}**"]
    lines += ["", "## Every run", "",
              # output tokens: servers that stop at different places (one honours end-of-text, one not)
              # are not doing the same work, whatever their tokens/s
              "| concurrency | run | server | output tok/s | output tokens | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
              "| errors | ready s |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in runs:
        lines.append(f"| {r['concurrency']} | {r['run']} | {r['server']} | {_num(r['output_tokens_per_s'], '.1f')} | "
                     f"{_num(r['output_tokens'], '.0f')} | {_num(r['ttft_p50_s'], '.1f', 1e3)} | "
                     f"{_num(r['ttft_p99_s'], '.1f', 1e3)} | "
                     f"{_num(r['tpot_p50_s'], '.2f', 1e3)} | {_errors(r['errors'])} | {_num(r['ready_s'], '.1f')} |")
    rows = aggregate(runs, servers)
    lines += ["", "## Per concurrency and server", "",
              "| concurrency | server | runs | median tok/s | min | max | max/min | median TTFT p50 ms | errors |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a in rows:
        lines.append(f"| {a['concurrency']} | {a['server']} | {a['runs']} | {_num(a['median_tokens_per_s'], '.1f')} | "
                     f"{_num(a['min_tokens_per_s'], '.1f')} | {_num(a['max_tokens_per_s'], '.1f')} | "
                     f"{_num(a['max_over_min'], '.2f')} | {_num(a['median_ttft_p50_s'], '.1f', 1e3)} | "
                     f"{a['errors']} |")
    pairs = ratios(rows, servers)
    if pairs:
        lines += ["", f"## {servers[0]} over each other server (median output tokens/s)", "",
                  "| concurrency | ratio |", "|---:|---|"]
        lines += [f"| {p['concurrency']} | {p['first']} / {p['other']} = {_num(p['ratio'], '.2f')} |" for p in pairs]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """results.json and report.md, each written whole (a sibling, then renamed over the old one)."""
    for name, text in (("results.json", json.dumps({**meta, "runs": runs}, indent=1) + "\n"),
                       ("report.md", render_report(meta, runs))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


# --- the comparison --------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def compare(args: argparse.Namespace, out: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Every run, in order; each appended to `runs` and written out as soon as it is measured."""
    total = len(args.concurrency) * args.runs * len(args.servers)
    step = 0
    for c in args.concurrency:
        for run in range(1, args.runs + 1):
            for name, template in args.servers:
                step += 1
                stem = f"c{c}-run{run}-{name}"
                port = free_port()
                progress(f"[{step}/{total}] concurrency {c}, run {run}/{args.runs}, {name}: starting on port {port}")
                server = Server(name, server_argv(template, args.model, port), port, out / f"{stem}.server.log")
                try:
                    ready = server.wait_ready(args.startup_timeout)
                    progress(f"  ready in {ready:.1f} s")
                    if args.warmup_requests:
                        status, summary = run_loadtest(loadtest_argv(args, port, c, args.warmup_requests,
                                                                     WARMUP_SEED),
                                                       out / f"{stem}.warmup.log", args.loadtest_timeout)
                        if status != 0:
                            progress(f"  warning: the warm-up exited {status}; see {out / f'{stem}.warmup.log'}")
                    status, summary = run_loadtest(loadtest_argv(args, port, c, args.requests),
                                                   out / f"{stem}.loadtest.log", args.loadtest_timeout)
                finally:
                    server.stop(args.stop_grace)
                    time.sleep(args.settle)
                r = record(name, c, run, ready, status, summary,
                           {"server": server.log.name, "loadtest": f"{stem}.loadtest.log"})
                runs.append(r)
                write_outputs(out, meta, runs)
                progress(f"  {_num(r['output_tokens_per_s'], '.1f')} output tokens/s, TTFT p50 "
                         f"{_num(r['ttft_p50_s'], '.1f', 1e3)} ms, errors: {_errors(r['errors'])}; stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": read_cpu_info(),
        "command": shlex.join(["python", "benchmarks/serve_compare.py", *(sys.argv[1:] if argv is None else argv)]),
        "servers": dict(args.servers),
        # placeholders shlex leaves unquoted, so the command reads as the one run, braces and all
        "loadtest": shlex.join(loadtest_argv(args, "@PORT@", "@CONCURRENCY@", args.requests))
        .replace("@PORT@", "{port}").replace("@CONCURRENCY@", "{concurrency}"),
        "model": args.model, "runs_each": args.runs, "concurrency": args.concurrency, "requests": args.requests,
        "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "tokenizer": args.tokenizer,
        "warmup_requests": args.warmup_requests,
        "settle_s": args.settle,
        "stopped": None,
    }
    runs: list[dict[str, Any]] = []
    write_outputs(out, meta, runs)
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0

    def done() -> str:
        return f"{len(runs)} run{'' if len(runs) == 1 else 's'}"

    try:
        compare(args, out, meta, runs)
    except Interrupted as e:
        meta["stopped"], code = f"stopped by {e} after {done()}", EXIT_STOPPED
    except Stop as e:
        meta["stopped"], code = f"{e} (after {done()})", 1
    finally:
        with signals_held():  # a second Ctrl-C must not cut the report short
            write_outputs(out, meta, runs)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if meta["stopped"]:
        progress(f"serve_compare.py: {meta['stopped']}")
    progress(f"wrote {out / 'report.md'} and {out / 'results.json'}")
    if code:
        return code
    return 0 if all(not r["errors"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
