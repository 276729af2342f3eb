"""Load test an OpenAI-compatible /v1/completions server with streaming requests.

    gptopt loadtest --url http://127.0.0.1:8000 --requests 200 --concurrency 16 --json
    gptopt loadtest --rate 5 --requests 100          # open loop: Poisson arrivals, 5 per second
    gptopt loadtest --tokenizer out --prompt_tokens 128 --max_tokens 128   # prompts of exactly 128 tokens

Closed loop (--concurrency) keeps that many requests in flight, which measures capacity; open loop
(--rate) sends on a Poisson schedule whatever the server's speed, which shows queueing. Reported:
request and output-token throughput, time to first token (TTFT), time per output token after the
first (TPOT), the gaps between streamed chunks (ITL), and errors by HTTP status (or 'timeout',
'connect', 'stream'). Only cfg.url is contacted; every request ends within cfg.timeout seconds. A server
that cannot be reached, or that refuses the key sent (or its absence), is refused before the load starts.
A stream succeeds at `data: [DONE]`, or where the server closes it once every choice has its finish_reason
(transformers serve sends no [DONE]); one that ends before that, or sends an error, is a 'stream' error.

Prompts: with --tokenizer, random token ids of that tokenizer decoded to text, as vLLM's `bench serve
--dataset-name random` makes them, then made exact (TokenPrompts): each encodes to exactly
--prompt_tokens tokens, none of them special, so runs against servers on different machines send the
same load, token for token. Without it, windows of a fixed text, one word per requested token: only
approximately as many tokens, and how many depends on the tokenizer.

Where the server's /metrics has `process_resident_memory_bytes` (gptopt serve does, on Linux), its
resident memory is sampled through the run: growth after the warm-up tenth of the requests is how a
leak shows. A server on CUDA also exports its device memory (`gptopt_device_memory_*_bytes`: allocated,
reserved, peak allocated), sampled the same way: on a GPU that is the memory that runs out.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from gptopt.config import LoadtestConfig
from gptopt.data.tokenizer import eot_id, load_tokenizer
from gptopt.utils.errors import UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Prompts are windows of this text, one word per requested token: every request differs, none is empty.
TEXT = (
    "The quick brown fox jumps over the lazy dog while the compiler checks every type and the kernel "
    "schedules threads across cores so that memory bandwidth is used well and the model answers fast "
    "a function returns a value a class defines methods and a module groups related code into one file "
    "tests prove behaviour numbers are measured never guessed and every benchmark warms up first"
).split()


@dataclass
class Sample:
    """One request's outcome; times in seconds from its start."""

    status: str = "ok"  # "ok", an HTTP status code, "timeout", "connect" or "stream"
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between successive text chunks


# The server's memory figures sampled from its /metrics (gptopt serve's names; any server may have them)
RSS = "process_resident_memory_bytes"  # prometheus_client's process collector, Linux
DEVICE_ALLOCATED = "gptopt_device_memory_allocated_bytes"  # gptopt serve on CUDA: torch.cuda.memory_allocated
DEVICE_RESERVED = "gptopt_device_memory_reserved_bytes"  # torch.cuda.memory_reserved
DEVICE_PEAK = "gptopt_device_memory_peak_allocated_bytes"  # torch.cuda.max_memory_allocated, since it started
MEMORY_METRICS = (RSS, DEVICE_ALLOCATED, DEVICE_RESERVED, DEVICE_PEAK)
MEMORY_INTERVAL_S = 1.0
# an unlabelled sample: NAME VALUE [TIMESTAMP]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*$", re.MULTILINE)


def metric_values(text: str, names: tuple[str, ...] = MEMORY_METRICS) -> dict[str, float]:
    """The unlabelled samples of `names` in a Prometheus text exposition; a name it lacks is left out."""
    out: dict[str, float] = {}
    for m in _SAMPLE.finditer(text):
        if m.group(1) in names:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                continue
    return out


async def server_memory(client: Any, base: str) -> dict[str, float]:
    """The server's memory figures (MEMORY_METRICS) from `base`/metrics; empty if it says none."""
    import aiohttp

    try:
        async with client.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=10.0)) as r:
            return metric_values(await r.text()) if r.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
        return {}


# The fix for a server that answers 401 or 403: said before the load (preflight) and under its errors line
KEY_FIX = "pass --api_key KEY, the key the server was started with"


async def preflight(client: Any, cfg: LoadtestConfig, base: str) -> None:
    """Refuse a run that could only fail, before its first request: a server that cannot be reached, or one
    that wants an API key this run does not send (or another one). One GET of /v1/models, which OpenAI-
    compatible servers answer behind their key; a server without that route is load tested as it is."""
    import aiohttp

    wait = min(cfg.timeout, 30.0)
    try:
        async with client.get(f"{base}/v1/models", allow_redirects=False,
                              timeout=aiohttp.ClientTimeout(total=wait)) as r:
            status = r.status
            await r.read()
    except asyncio.TimeoutError:
        raise UserError(f"--url {cfg.url}: no answer to GET /v1/models within {wait:g} s; check that a server "
                        "is listening there and is not stuck") from None
    except (aiohttp.ClientError, OSError) as e:
        raise UserError(f"--url {cfg.url}: cannot connect ({e}); start a server (gptopt serve --model DIR) "
                        "or give --url of a running one") from None
    if status in (401, 403):
        why = "it refused --api_key" if cfg.api_key else "it wants an API key"
        raise UserError(f"--url {cfg.url} answered {status} (not authorised): {why}; {KEY_FIX}")


@dataclass
class MemoryTrace:
    """(completed requests, bytes) samples of one of the server's memory figures over a run."""

    samples: list[tuple[int, float]] = field(default_factory=list)

    def summary(self, requests: int) -> dict[str, float] | None:
        if len(self.samples) < 2:
            return None
        warm = next((rss for done, rss in self.samples if done >= max(1, requests // 10)), self.samples[-1][1])
        rss = [v for _, v in self.samples]
        return {"start_bytes": rss[0], "after_warmup_bytes": warm, "end_bytes": rss[-1], "peak_bytes": max(rss),
                "growth_after_warmup_bytes": rss[-1] - warm, "samples": len(rss)}


def make_prompt(rng: random.Random, n_words: int) -> str:
    start = rng.randrange(len(TEXT))
    return " ".join(TEXT[(start + i) % len(TEXT)] for i in range(n_words))


# Rounds of re-encoding and cutting or extending one prompt before the run is refused (vLLM's retries)
PROMPT_TRIES = 10


def prompt_tokenizer(path: str) -> Tokenizer:
    """--tokenizer: a tokenizer.json, a folder holding one, or a model directory as --model takes it (its
    tokenizer found as generate and serve find it: inference.find_tokenizer)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"--tokenizer {path}: no such file or folder; give the served model's tokenizer.json or "
                         "its model directory")
    if p.is_file():
        return load_tokenizer(p)
    from gptopt.infer.load import find_tokenizer, has_tokenizer, model_source

    if has_tokenizer(p):
        return load_tokenizer(p)
    try:
        source = model_source(str(p))
    except ValueError:
        raise UserError(f"--tokenizer {path}: no tokenizer.json in this folder, and no model whose tokenizer it "
                         "could be; give the served model's tokenizer.json or its model directory") from None
    return find_tokenizer(source)


class TokenPrompts:
    """Prompts of exactly n tokens of `tok`, none special: random ids decoded to text (vLLM's random data set),
    then re-encoded and cut or extended until the text encodes to n tokens.

    Decoded ids need not encode back to themselves: a lone byte of a multi-byte character decodes to U+FFFD
    (so only ids that decode to text on their own are drawn), neighbours merge, and pieces may spell a
    special token. Counted without the tokenizer's added BOS/EOS, as vLLM counts."""

    def __init__(self, tok: Tokenizer, rng: np.random.Generator) -> None:
        self.tok, self.rng = tok, rng
        eot = eot_id(tok)
        self.special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special} | (
            set() if eot is None else {eot})
        ids = [i for i in range(tok.get_vocab_size()) if i not in self.special]
        pieces = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        self.ids = np.asarray([i for i, piece in zip(ids, pieces, strict=True) if piece and "\ufffd" not in piece])
        if not len(self.ids):
            raise UserError("no token of it decodes to text on its own; give the served model's tokenizer.json")

    def _draw(self, n: int) -> str:
        return self.tok.decode(self.rng.choice(self.ids, n).tolist(), skip_special_tokens=False)

    def __call__(self, n: int, prefix: str = "") -> str:
        """A text of n tokens after `prefix` (one of these prompts), whose tokens begin with the prefix's own."""
        head = self.tok.encode(prefix, add_special_tokens=False).ids if prefix else []
        total = len(head) + n
        text = prefix + self._draw(n)
        for _ in range(PROMPT_TRIES):
            enc = self.tok.encode(text, add_special_tokens=False)
            ids, offsets = enc.ids, enc.offsets
            special = next((k for k, i in enumerate(ids) if i in self.special), None)
            if ids[: len(head)] != head:  # what follows merged with the prefix's last token: draw it again
                text = prefix + self._draw(n)
            elif special is not None:  # the pieces spelled a special token: keep the text before it
                text = text[:offsets[special][0]]
            elif len(ids) == total:
                return text
            elif len(ids) > total:
                # Cut before token n+1, and without trailing whitespace: a pre-tokenizer splits a run of
                # spaces one way at the end of a text and another before what is appended next.
                text = text[:offsets[total][0]].rstrip()
            else:
                text += self._draw(total - len(ids))
        raise UserError(f"no text of exactly {n} of its tokens in {PROMPT_TRIES} tries of random tokens; try "
                         "another --prompt_tokens or --seed")


def make_prompts(cfg: LoadtestConfig, rng: random.Random) -> list[str]:
    """cfg.requests prompts: exactly cfg.prompt_tokens tokens of cfg.tokenizer, or as many words of TEXT, each
    after the cfg.shared_prefix tokens (words) all of them begin with."""
    if cfg.tokenizer is None:
        head = make_prompt(rng, cfg.shared_prefix) + " " if cfg.shared_prefix else ""
        return [head + make_prompt(rng, cfg.prompt_tokens) for _ in range(cfg.requests)]
    tok = prompt_tokenizer(cfg.tokenizer)
    try:
        prompt = TokenPrompts(tok, np.random.default_rng(cfg.seed))
        head = prompt(cfg.shared_prefix) if cfg.shared_prefix else ""
        return [prompt(cfg.prompt_tokens, head) for _ in range(cfg.requests)]
    except ValueError as e:
        raise UserError(f"--tokenizer {cfg.tokenizer}: {e}") from None


def prompt_kind(cfg: LoadtestConfig) -> dict[str, Any]:
    """What --prompt_tokens counted: tokens of --tokenizer (exact), or words (approximate tokens)."""
    return {"kind": "words" if cfg.tokenizer is None else "tokens", "length": cfg.prompt_tokens,
            "shared_prefix": cfg.shared_prefix,
            "tokenizer": cfg.tokenizer}


async def one_request(client: Any, cfg: LoadtestConfig, prompt: str, url: str) -> Sample:
    """Send one streaming request to `url`, the server's /v1/completions; never raises: failures come back
    as the Sample's status."""
    import aiohttp
    from aiohttp.http_exceptions import HttpProcessingError

    t0 = time.perf_counter()
    try:
        s = await asyncio.wait_for(_stream(client, cfg, prompt, url, t0), cfg.timeout)  # the whole request
    except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11 on; aiohttp's timeouts are one too
        s = Sample(status="timeout")
    except (aiohttp.ClientError, OSError):
        s = Sample(status="connect")
    # A chunk not of the completions shape, or not UTF-8 (ValueErrors), or a line longer than the read
    # buffer allows: aiohttp's LineTooLong (an HttpProcessingError), a ValueError before aiohttp 3.10.
    except (KeyError, TypeError, AttributeError, ValueError, HttpProcessingError):
        s = Sample(status="stream")
    s.e2e = time.perf_counter() - t0
    return s


async def _stream(client: Any, cfg: LoadtestConfig, prompt: str, url: str, t0: float) -> Sample:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.model:
        body["model"] = cfg.model
    s, chunks, last = Sample(), 0, t0
    seen: set[int] = set()  # the choices the stream has spoken of, and those it has finished
    finished: set[int] = set()
    async with client.post(url, json=body, allow_redirects=False) as r:
        if r.status != 200:
            await r.read()
            return Sample(status=str(r.status))
        async for raw in r.content:  # one line a step, its end of line included
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data:"):
                continue
            data = line[5:].removeprefix(" ")  # SSE: the space after the colon is optional
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if not isinstance(obj, dict) or "error" in obj:  # gptopt sends an object there, transformers a string
                return Sample(status="stream")
            if obj.get("usage"):  # its own chunk (choices []) or on the last one
                s.tokens = obj["usage"]["completion_tokens"]
            choices = obj.get("choices") or ()
            for c in choices:
                seen.add(c.get("index", 0))
                if c.get("finish_reason") is not None:
                    finished.add(c.get("index", 0))
            if any(c.get("text") for c in choices):
                now = time.perf_counter()
                if s.ttft is None:
                    s.ttft = now - t0
                else:
                    s.gaps.append(now - last)
                last, chunks = now, chunks + 1
        else:
            # Closed without [DONE]: OpenAI sends it, but some compatible servers (transformers serve)
            # end the stream after the finish and usage chunks. Cut short before every choice finished
            # is still a failure.
            if not seen or not finished >= seen:
                return Sample(status="stream")
    s.tokens = s.tokens or chunks  # a server without usage in its stream: one token per chunk
    return s


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def device_memory(traces: dict[str, MemoryTrace], requests: int) -> dict[str, float] | None:
    """The server's device memory over the run: allocated as MemoryTrace.summary reports it, plus the
    server's own peak (which sees allocations between two samples, and those since it started) and
    the allocator's reserved memory at the start and the end. None where /metrics has no device figures."""
    out = traces[DEVICE_ALLOCATED].summary(requests)
    peak, reserved = traces[DEVICE_PEAK].samples, traces[DEVICE_RESERVED].samples
    if out is None:
        return None
    return {**out, "peak_since_start_bytes": peak[-1][1] if peak else None,
            "reserved_start_bytes": reserved[0][1] if reserved else None,
            "reserved_end_bytes": reserved[-1][1] if reserved else None}


def summarize(samples: list[Sample], wall: float, cfg: LoadtestConfig,
              memory: dict[str, MemoryTrace] | None = None) -> dict[str, Any]:
    """The run's figures; memory: a MemoryTrace per MEMORY_METRICS name (None: the server has no /metrics)."""
    traces = memory or {name: MemoryTrace() for name in MEMORY_METRICS}
    ok = [s for s in samples if s.status == "ok"]
    tokens = sum(s.tokens for s in ok)
    return {
        "url": cfg.url, "mode": f"rate {cfg.rate}/s" if cfg.rate else f"concurrency {cfg.concurrency}",
        "prompt": prompt_kind(cfg),
        "requests": len(samples), "completed": len(ok), "duration_s": wall, "output_tokens": tokens,
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": tokens / wall,
        "ttft_s": distribution([s.ttft for s in ok if s.ttft is not None]),
        # the first token's wait is TTFT's; TPOT is the pace after it
        "tpot_s": distribution([(s.e2e - s.ttft) / (s.tokens - 1) for s in ok if s.ttft is not None and s.tokens > 1]),
        "itl_s": distribution([g for s in ok for g in s.gaps]),
        "e2e_s": distribution([s.e2e for s in ok]),
        "errors": dict(collections.Counter(s.status for s in samples if s.status != "ok")),
        "server_memory": traces[RSS].summary(len(samples)),
        "server_device_memory": device_memory(traces, len(samples)),
    }


async def run(cfg: LoadtestConfig) -> dict[str, Any]:
    """Send cfg.requests requests and summarise them."""
    import aiohttp

    rng = random.Random(cfg.seed)
    prompts = make_prompts(cfg, rng)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    in_flight = cfg.concurrency if cfg.rate is None else min(cfg.requests, 1000)
    base = cfg.url.rstrip("/")
    # One connection more than requests in flight: the memory sampler's own. Sharing theirs, a scrape
    # waited for a stream to end, and the next request (its TTFT clock running) for the scrape: a cost
    # only servers with /metrics paid.
    connector = aiohttp.TCPConnector(limit=in_flight + 1)
    # aiohttp, not httpx: the clients share the machine with the server they measure, and httpx took
    # more of its CPU per streamed token (benchmarks/2026-12-04-serving-vs-transformers.md, "Where the
    # 16-client server's time went, and the load generator's share"). read_bufsize: a stream's line (a
    # chunk with log-probabilities) may be long; lines up to twice it are read. total=None: wait_for in
    # one_request bounds each whole request, and aiohttp's own 300 s would cut a longer --timeout short.
    session = aiohttp.ClientSession(headers=headers, connector=connector, read_bufsize=2**20,
                                    timeout=aiohttp.ClientTimeout(total=None))
    samples: list[Sample] = []
    bar = tqdm(total=cfg.requests, desc="requests", unit="req", file=sys.stderr, leave=False)
    async with session as client:

        async def send(prompt: str) -> None:
            samples.append(await one_request(client, cfg, prompt, f"{base}/v1/completions"))
            bar.update()

        await preflight(client, cfg, base)
        memory = {name: MemoryTrace() for name in MEMORY_METRICS}

        async def sample_memory(done: int) -> bool:
            figures = await server_memory(client, base)
            for name, value in figures.items():
                memory[name].samples.append((done, value))
            return bool(figures)

        sampler = None
        if await sample_memory(0):

            async def sample_memory_often() -> None:
                while True:
                    await asyncio.sleep(MEMORY_INTERVAL_S)
                    await sample_memory(len(samples))

            sampler = asyncio.create_task(sample_memory_often())
        t0 = time.perf_counter()
        if cfg.rate is None:  # closed loop: each worker sends its next request when the last one ends
            queue = collections.deque(prompts)

            async def worker() -> None:
                while queue:
                    await send(queue.popleft())

            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, cfg.requests))))
        else:  # open loop: exponential gaps between arrivals make a Poisson process
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(send(prompt)))
                await asyncio.sleep(rng.expovariate(cfg.rate))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        if sampler is not None:
            sampler.cancel()
            await sample_memory(len(samples))
    bar.close()
    return summarize(samples, wall, cfg, memory if sampler is not None else None)


def _fmt(d: dict[str, float | None], scale: float = 1000.0) -> str:
    return "  ".join(f"{k} {'-' if v is None else f'{v * scale:.1f}'}" for k, v in d.items())


def _device_extra(mem: dict[str, Any], mib: int) -> str:
    """The device line's tail: the server's own peak allocated, and the allocator's reserved memory."""
    since = mem["peak_since_start_bytes"]
    reserved = mem["reserved_end_bytes"]
    return ("" if since is None else f" ({since / mib:.1f} since the server started)") + \
        ("" if reserved is None else f"; reserved {mem['reserved_start_bytes'] / mib:.1f} -> {reserved / mib:.1f} MiB")


def main(cfg: LoadtestConfig) -> int:
    """`gptopt loadtest`: 0 when every request succeeded, 1 otherwise (the summary says which failed)."""
    from gptopt.utils.extras import require

    require("aiohttp", "serve", "gptopt loadtest")
    summary = asyncio.run(run(cfg))
    print(f"{cfg.url}: {summary['completed']}/{summary['requests']} requests in {summary['duration_s']:.2f} s "
          f"({summary['mode']})")
    prompt = summary["prompt"]
    shared = f"{prompt['shared_prefix']} shared + " if prompt["shared_prefix"] else ""
    print(f"  prompts      {shared}{prompt['length']} " + (f"tokens of {prompt['tokenizer']}" if prompt["tokenizer"]
                                                            else "words (approximate tokens; --tokenizer makes them "
                                                            "exact)"))
    print(f"  throughput   {summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tokens/s")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "latency")):
        print(f"  {name:<12} ms: {_fmt(summary[key])}")
    mib = 2**20
    for key, name in (("server_memory", "server RSS"), ("server_device_memory", "server GPU")):
        mem = summary[key]
        if mem:
            print(f"  {name:<12} start {mem['start_bytes'] / mib:.1f} MiB, after warm-up "
                  f"{mem['after_warmup_bytes'] / mib:.1f}, end {mem['end_bytes'] / mib:.1f} "
                  f"({mem['growth_after_warmup_bytes'] / mib:+.1f} after warm-up), peak {mem['peak_bytes'] / mib:.1f}"
                  + ("" if key == "server_memory" else _device_extra(mem, mib)))
    if summary["errors"]:
        print("  errors       " + ", ".join(f"{k}: {v}" for k, v in sorted(summary["errors"].items())))
        if {"401", "403"} & summary["errors"].keys():  # /v1/models was open, the completions route is not
            print(f"  (401/403: the server wants an API key; {KEY_FIX})")
    if cfg.json:
        print(json.dumps(summary))
    return 0 if not summary["errors"] else 1
