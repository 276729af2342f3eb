"""The inference ladder: Hugging Face `generate` against gptopt's Generator, CUDA graphs, compiled, bf16, int8, int4,
onnxruntime.

    gptopt bench --mode infer                       # tiny on a CPU, gpt2 on a GPU
    gptopt bench --mode infer --rungs hf,kv,compiled --batch_size 8 --json

Every rung decodes the same real prompts (windows of the val split) with the same weights, greedily,
so its tokens can be compared with the baseline's; --temperature T makes the timed generations sample
(top_p 1, no top_k: what OpenAI's clients send; or --top_k and --top_p), so the sampler's cost is in the
figures, while the check stays greedy. --seq_len bounds prompt + completion: the prompt
is min(seq_len // 2, 128) tokens, then up to 64 (CPU) / 256 (GPU) new ones. --batch_size is the
largest batch of the sweep (default 16 on a CPU, 64 on a GPU); --warmup runs come first.

Each rung is set up in turn: its runner built, its logits and greedy tokens checked, its prefill and
first token timed at batch 1 (--steps times each). The batch sweep then times the rungs side by side,
their runners alive together: at each batch size every rung's generations take turns in
max(3, steps // 3) rounds, the order reversed every other round, and each rung's figure is its median
(measure.interleaved). On a shared machine a slow minute then falls on every rung alike, not on the
one that ran in it, so the verdict between two rungs holds from one run to the next. A rung that runs
out of memory at a batch size stops there; the others go on.

A rung this device cannot run is `skipped` with the reason in its note (int4 off sm_80+ CUDA, a
missing extra): the default ladder is every rung, so a report shows what was left out and why.

The lever rungs are apart from the ladder (`--rungs levers`: kv and them; `all`: the ladder and them; levers.py):
each is the kv rung with one lever done the textbook way instead (transformers' sampler, the grouped-query cache
repeated to every head, the weights as loaded). Each one's `lever_gain` is kv's decode rate over its own at every
batch size both measured: what that lever buys here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from gptopt.bench import report
from gptopt.bench.infer_rungs import (
    AGREE_TOKENS,
    GROUPS,
    LEVERS,
    RUNGS,
    HFRunner,
    InferResult,
    InferRung,
    OnnxRunner,
    Runner,
    select_rungs,
)
from gptopt.bench.levers import HFSamplingGenerator, RepeatedKVGenerator
from gptopt.bench.setup import Setup
from gptopt.config import BenchConfig
from gptopt.infer import speculative
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference, optimize_for_inference, weights_dtype
from gptopt.infer.measure import STOPPED, GptoptRunner, Sampling, free_memory, interleaved, timed, weight_bytes
from gptopt.infer.quantize import int4_unsupported
from gptopt.infer.speculative import Speculator
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan, environment, memory_bandwidth
from gptopt.runtime.memory_check import is_oom
from gptopt.runtime.signals import CTRL_C_EXIT
from gptopt.runtime.torch_private import recompile_limit_for, reset_dynamo
from gptopt.utils.errors import UserError
from gptopt.utils.extras import EXTRAS, has
from gptopt.utils.tables import to_json

log = logging.getLogger("gptopt")


@dataclass
class _Live:
    """A rung set up and checked, its runner kept for the side-by-side sweep."""

    rung: InferRung
    res: InferResult
    runner: Runner
    kv_dtype: torch.dtype


def _add_note(res: InferResult, part: str) -> None:
    res.note = f"{res.note}; {part}" if res.note else part


def _release(runner: Runner, plan: DevicePlan) -> None:
    if isinstance(runner, GptoptRunner):
        runner.release()  # one Generator per rung at most: built again for the next batch size
    else:
        free_memory(plan)


class InferBench:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)  # the timed generations'
        setup = Setup.from_config(cfg)
        self.plan, self.preset, self.data = setup.plan, setup.preset, setup.data
        self.model_config, seq_len = setup.model_config, setup.seq_len
        gpu = self.plan.device.type == "cuda"
        loaded = None
        self.tokenizer: Any = None  # --model's: a --draft_model must share it
        if cfg.model is not None:  # a trained model: its own weights, read in fp32 as the preset's are made
            loaded, self.tokenizer = load_for_inference(cfg.model, tokenizer=None, plan=self.plan, dtype="fp32",
                                                        layout=False)
            self.data.check_vocab(loaded.config.vocab_size)
            self.model_config, self.preset, context = loaded.config, cfg.model, loaded.config.block_size
            if cfg.seq_len is not None and cfg.seq_len > context:
                raise UserError(f"--seq_len {cfg.seq_len} exceeds the context of --model {cfg.model} ({context})")
            seq_len = cfg.seq_len or min(1024 if gpu else 256, context)
        if seq_len < 4:
            raise UserError(f"--seq_len must be >= 4 in --mode infer (prompt + 2 new tokens), got {seq_len}")
        self.prompt_len = min(seq_len // 2, 128)
        self.new_tokens = min(256 if gpu else 64, seq_len - self.prompt_len)
        self.max_len = self.prompt_len + self.new_tokens
        self.speculators: list[Speculator] = []  # the speculative rung's, one per Generator: their drafts add up
        top = cfg.batch_size or (64 if gpu else 16)
        self.batch_sizes = cfg.sweep() or [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < top] + [top]
        self.repeats = max(3, cfg.steps // 3)
        self.base_dtype = weights_dtype("auto", self.plan)  # the device's inference dtype, as generate and serve load
        self.prompts = self._prompts(self.batch_sizes[-1])
        torch.manual_seed(cfg.seed)
        if loaded is not None:
            init = loaded
        else:
            # initialised where it runs: a GPU initialises gpt2-xl far sooner than the host's CPU would
            with torch.device(self.plan.device):
                init = GPT(self.model_config)
            # GPT-2's 0.02 init makes a random model repeat its last prompt token, so any two
            # implementations would agree trivially; wide weights make greedy text change every token.
            with torch.no_grad():
                for p in init.parameters():
                    if p.dim() == 2:
                        p.normal_(0.0, 0.5)
        self.params = init.num_params()
        # kept on the host: the device's memory is for the rungs (their batch sweeps stop where it runs out)
        self.init_state = {k: v.detach().to("cpu", copy=True) for k, v in init.state_dict().items()}
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # the reference in true fp32, not TF32
        try:  # the command's own setting back, however the reference ends (out of memory, Ctrl-C)
            ref = GptoptRunner(self._model(torch.float32), self.plan, self.max_len, compile=False)
            self.ref_logits = ref.last_logits(self.prompts[0]).cpu()
        finally:
            torch.set_float32_matmul_precision(precision)
        self.peak_bandwidth, self.bandwidth_source = memory_bandwidth(self.plan)
        self.results: list[InferResult] = []
        self.stopped = False  # Ctrl-C ended the ladder early

    def _prompts(self, n: int) -> list[list[int]]:
        """n real windows of prompt_len tokens, evenly spread over the val split (train if val is short)."""
        tokens = self.data.tokens("val")
        if len(tokens) < self.prompt_len + n:
            tokens = self.data.tokens("train")
        starts = torch.linspace(0, len(tokens) - self.prompt_len, n).long().tolist()
        return [tokens[s : s + self.prompt_len].astype("int64").tolist() for s in starts]

    def _model(self, dtype: torch.dtype) -> GPT:
        with torch.device("meta"):  # shapes only: the weights come from init_state, so no init work
            model = GPT(self.model_config)
        model = model.to_empty(device=self.plan.device)
        model.init_buffers()  # the rotary frequencies: not weights, so not in init_state
        if self.model_config.tie_embeddings:  # to_empty gives each its own tensor: tie them again
            model.lm_head.weight = model.transformer.wte.weight
        model.load_state_dict(self.init_state)
        return model.to(dtype=dtype).eval()

    def _skip(self, rung: InferRung) -> str | None:
        if rung.without == "sampler" and self.sampling.greedy:  # first: installing the extra would not change it
            return "greedy decoding takes the argmax with either sampler: bench this rung with --temperature"
        if (rung.hf or rung.without == "sampler") and not has("transformers"):
            return "needs the 'hf' extra: pip install 'gptopt[hf]'"
        if rung.int4:  # the device first: installing torchao would not make int4 run on a CPU
            problem = int4_unsupported(self.plan, torch.bfloat16, "bench this rung on such a GPU (--device cuda)")
            if problem:
                return problem
        if (rung.int8 or rung.int4) and not has("torchao"):
            return "needs the 'quant' extra: pip install 'gptopt[quant]'"
        if rung.onnx and not self.sampling.greedy:  # first: installing the extra would not make it sample
            return "the ONNX export's decoder here decodes greedily: bench this rung without --temperature"
        if rung.onnx and not all(has(m) for m in EXTRAS["onnx"]):
            return "needs the 'onnx' extra: pip install 'gptopt[onnx]'"
        if rung.onnx and self.plan.device.type != "cpu":
            return "onnxruntime runs on the CPU here (the 'onnx' extra is its CPU build): bench it with --device cpu"
        if rung.cuda_graphs and self.plan.device.type != "cuda":
            return "CUDA graphs need an NVIDIA GPU (--device cuda); on a CPU see the compiled rung"
        if rung.bf16 and self.base_dtype == torch.bfloat16:
            return "the weights are already bf16 on this device: see the kv and compiled rungs"
        if rung.bf16 and self.plan.amp_dtype != torch.bfloat16:
            return f"no native bf16 here, it would be emulated and slower ({self.plan.reason})"
        if rung.without == "gqa" and self.model_config.kv_heads == self.model_config.n_head:
            return "this model has a key/value head per query head: nothing is repeated (bench a grouped-query one)"
        if rung.without in ("layout", "stack", "fuse") and self.plan.device.type != "cpu":
            return "GPUs keep the weights as loaded in every rung (their products read either layout at full speed)"
        if rung.without == "bf16" and (self.plan.device.type != "cpu" or self.base_dtype != torch.bfloat16):
            return f"the weights are {str(self.base_dtype).removeprefix('torch.')} here already: the lever is bf16 " \
                   "weights on a CPU with native bf16"
        if rung.without in ("stack", "fuse") and self.model_config.norm != "rmsnorm":
            return "GPT-2's blocks have neither (a Llama- or Qwen3-shaped model's lever)"
        return None

    # -- one rung set up, then every rung side by side -----------------------------------------

    def _set_up(self, rung: InferRung) -> tuple[InferResult, _Live | None]:
        """The rung's runner, built and checked (logits against fp32, greedy tokens), its prefill and TTFT
        timed at batch 1. The runner is returned alive for the sweep; none where it is skipped or failed."""
        dtype = torch.bfloat16 if rung.bf16 or rung.int4 else torch.float32 if rung.without == "bf16" else \
            self.base_dtype
        label = "int8" if rung.int8 else "int4" if rung.int4 else str(dtype).removeprefix("torch.")
        res = InferResult(name=rung.name, what=rung.what, dtype=label)
        skip = self._skip(rung)
        if skip:
            res.status, res.note = "skipped", skip
            return res, None
        try:
            return res, self._checked(rung, dtype, res)
        except Exception as e:
            self._fail(res, e)
        free_memory(self.plan)  # after the except: its traceback held what the rung built
        return res, None

    def _checked(self, rung: InferRung, dtype: torch.dtype, res: InferResult) -> _Live:
        plan, cfg, p0 = self.plan, self.cfg, self.prompts[0]
        runner, kv_dtype = self._runner(rung, dtype)
        res.max_logit_diff = (runner.last_logits(p0).cpu() - self.ref_logits).abs().max().item()
        res.tokens = runner.generate([p0], self.new_tokens)[0][:AGREE_TOKENS]  # also a warm-up (compiles)
        res.prefill_s = timed(lambda: runner.last_logits(p0), plan, cfg.warmup, cfg.steps)
        res.ttft_s = timed(lambda: runner.generate([p0], 1, self.sampling), plan, cfg.warmup, cfg.steps)
        return _Live(rung, res, runner, kv_dtype)

    def _runner(self, rung: InferRung, dtype: torch.dtype) -> tuple[Runner, torch.dtype]:
        """The rung's runner and the dtype of its KV cache."""
        if rung.hf:
            return HFRunner(self._model(torch.float32), self.plan, dtype), dtype
        if rung.onnx:
            return OnnxRunner(self._model(torch.float32)), torch.float32
        # The transforms generate and serve apply, in their order (dtype, int8 or int4, layout).
        quantize = "int8-weight" if rung.int8 else "int4-weight" if rung.int4 else "none"
        model = optimize_for_inference(self._model(dtype), self.plan, dtype=dtype, quantize=quantize,
                                       layout=rung.without != "layout", stack=rung.without == "stack",
                                       fuse=rung.without != "fuse")
        build = {"sampler": HFSamplingGenerator, "gqa": RepeatedKVGenerator}.get(rung.without or "", Generator)
        runner = GptoptRunner(model, self.plan, self.max_len, compile=rung.compile, cuda_graphs=rung.cuda_graphs,
                              speculate=self._speculator(dtype) if rung.speculate else None, build=build)
        return runner, model.transformer.wte.weight.dtype  # the Generator's cache takes the embedding's

    def _speculator(self, dtype: torch.dtype) -> Callable[[Generator], Speculator]:
        """The speculative rung's Speculator for each Generator the runner builds; each one's drafts and kept
        tokens add up in self.spec_counts."""
        k = self.cfg.num_speculative_tokens
        draft = None
        if self.cfg.draft_model is not None:
            name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
            draft, tok = load_for_inference(self.cfg.draft_model, tokenizer=None, plan=self.plan, dtype=name,
                                            option="--draft_model")
            if self.tokenizer is not None:
                speculative.same_tokenizer(self.tokenizer, tok, f"--draft_model {self.cfg.draft_model}")
        made: list[Speculator] = self.speculators

        def build(gen: Generator) -> Speculator:
            drafter = speculative.NgramDrafter() if draft is None else speculative.ModelDrafter(
                Generator(draft, self.plan, max_batch_size=gen.max_batch_size,
                          max_len=min(draft.config.block_size, gen.max_len)))
            made.append(Speculator(drafter, k))
            return made[-1]

        return build

    def _fail(self, res: InferResult, e: Exception) -> None:
        res.status = "oom" if is_oom(e) else "failed"
        res.note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        res.batch_sweep = []  # a failed rung has no figures (an out-of-memory batch only ends the sweep)
        log.warning(f"rung {res.name} {res.status}: {res.note}")

    def _sweep(self, live: list[_Live]) -> None:
        """Decode tokens/s per batch size: B * (N - 1) new tokens over T(N tokens) - T(1 token), so prefill
        and the first token are left out. Batch size by batch size, every rung's two generations are timed
        side by side (measure.interleaved: rounds in alternating order, medians per rung), so a slow spell
        of a shared machine falls on all of them. A rung stops at its first batch that does not fit (or
        that fails); the others go on."""
        n, going = self.new_tokens, list(live)
        try:
            for b in self.batch_sizes:
                prompts = self.prompts[:b]
                fns: dict[str, Callable[[], object]] = {}
                owner: dict[str, _Live] = {}
                for lv in going:
                    first, every = f"{lv.rung.name} 1", f"{lv.rung.name} {n}"
                    fns[first] = lambda r=lv.runner, p=prompts: r.generate(p, 1, self.sampling)
                    fns[every] = lambda lv=lv, p=prompts: self._generate(lv, p)
                    owner[first] = owner[every] = lv
                ended: dict[str, Exception] = {}

                def drop(key: str, e: Exception, owner: dict[str, _Live] = owner,
                         ended: dict[str, Exception] = ended) -> set[str]:
                    lv = owner[key]
                    ended[lv.rung.name] = e
                    _release(lv.runner, self.plan)  # its memory is for the rungs still going
                    return {k for k, o in owner.items() if o is lv}

                warmup = self.cfg.warmup if b == 1 else 1  # batch 1 warmed clocks and caches; a new batch compiles
                t = interleaved(fns, self.plan, warmup, self.repeats, drop=drop)
                for lv in going:
                    name, res = lv.rung.name, lv.res
                    if name in ended:
                        self._end(res, b, ended[name], beside=len(going) - 1)
                        continue
                    t_first, t_all = t[f"{name} 1"], t[f"{name} {n}"]
                    decode = t_all - t_first if t_all > t_first else t_all  # noise guard: never a negative time
                    res.batch_sweep.append({"batch_size": b, "tokens_per_s": b * (n - 1) / decode})
                going = [lv for lv in going if lv.rung.name not in ended]
                for lv in going:
                    _release(lv.runner, self.plan)  # this batch's caches go before the next batch's are built
        except KeyboardInterrupt:
            for lv in going:
                sweep = lv.res.batch_sweep
                if sweep and sweep[-1]["batch_size"] != self.batch_sizes[-1]:
                    lv.res.note = f"swept up to batch {sweep[-1]['batch_size']}: bench was stopped (Ctrl-C)"
            raise

    def _generate(self, lv: _Live, prompts: list[list[int]]) -> None:
        tokens = lv.runner.generate(prompts, self.new_tokens, self.sampling)
        if len(prompts) == 1 and self.sampling.greedy:
            # The tokens compared with the baseline's are those of the timed decode, with the other rungs'
            # models, caches and compiled graphs alive beside it: the speed and the check are of one run.
            lv.res.tokens = tokens[0][:AGREE_TOKENS]

    def _end(self, res: InferResult, b: int, e: Exception, beside: int = 0) -> None:
        """beside: the other rungs whose models and caches were held at the same time (side-by-side
        timing): the memory ran out for them all, so the limit is this rung's only when it ran alone."""
        if not is_oom(e):
            self._fail(res, e)
            return
        res.status = "oom" if not res.batch_sweep else res.status
        res.note = f"out of memory at batch {b}" + ("" if res.batch_sweep else "; nothing fits")
        if beside:
            res.note += (f", with {beside} other rung{'s' * (beside > 1)} held beside it: bench it alone "
                         f"(--rungs {res.name}) for its own limit")
        log.warning(f"rung {res.name}: {res.note}")

    def _rates(self, lv: _Live) -> None:
        """Batch 1's decode rate as the rung's own, and the memory bandwidth it achieves."""
        res, rung = lv.res, lv.rung
        if res.status != "ok" or not res.batch_sweep:
            return
        proposed = sum(sp.proposed for sp in self.speculators)
        if rung.speculate and proposed:
            kept = sum(sp.accepted for sp in self.speculators)
            source = f"--draft_model {self.cfg.draft_model}" if self.cfg.draft_model else "n-gram lookup"
            res.note = f"{kept / proposed:.0%} of {proposed} draft tokens kept ({source}, k = " \
                       f"{self.cfg.num_speculative_tokens})"
        res.decode_tokens_per_s = res.batch_sweep[0]["tokens_per_s"]
        res.bytes_per_token = self._bytes_per_token(lv.runner.model, lv.kv_dtype,
                                                    static=rung.compile or rung.cuda_graphs)
        res.bandwidth_gbs = res.bytes_per_token * res.decode_tokens_per_s / 1e9
        if self.peak_bandwidth:
            res.bandwidth_util = res.bandwidth_gbs * 1e9 / self.peak_bandwidth

    def _bytes_per_token(self, model: nn.Module, kv_dtype: torch.dtype, *, static: bool) -> int:
        # A static (compiled) cache attends over all max_len positions every step; a dynamic one over
        # the tokens so far: prompt + N/2 on average over the decode steps. Quantised weights count
        # their stored tensors (measure.tensor_bytes): int8 or packed int4 integers plus their scales
        # (int4 also the zero points, and tinygemm's padding of the input width to 1024: the kernel reads it).
        # The cache holds the key/value heads only (fewer than the query heads under grouped-query attention).
        c = self.model_config
        keys = self.max_len if static else self.prompt_len + self.new_tokens // 2
        kv = 2 * c.n_layer * c.kv_heads * c.head_dim * keys * torch.empty((), dtype=kv_dtype).element_size()
        return weight_bytes(model) + kv

    # -- the ladder ------------------------------------------------------------------------

    def run(self, rungs: list[InferRung]) -> dict[str, Any]:
        try:
            self._ladder(rungs, self.results)
        except KeyboardInterrupt:  # what was measured is reported; the rest say why they have no figures
            self.stopped = True
            done = {r.name for r in self.results}
            self.results += [InferResult(name=r.name, what=r.what, status="skipped", note=STOPPED)
                             for r in rungs if r.name not in done]
        self._compare()
        return self.summary()

    def run_rung(self, rung: InferRung) -> InferResult:
        """One rung alone: set up, checked and swept (a ladder of one), not compared with a baseline."""
        results: list[InferResult] = []
        self._ladder([rung], results)
        return results[0]

    def _ladder(self, rungs: list[InferRung], results: list[InferResult]) -> None:
        """Every rung set up in turn (its result appended to `results`), then the batch sweep with the rungs
        side by side: their runners (models, Generators, compiled graphs) live together until it returns."""
        live: list[_Live] = []
        # Nothing is reset between live rungs: the compiled ones' graphs (several per Generator: one per
        # batch size, a first static then a symbolic attention length on CPUs) share the decode's code.
        limit = max(64, 4 * len(self.batch_sizes) * sum(r.compile for r in rungs))
        try:
            with recompile_limit_for(limit):
                for rung in rungs:
                    log.info(f"bench --mode infer: rung {rung.name}")
                    res, lv = self._set_up(rung)
                    results.append(res)
                    live += [lv] if lv else []
                log.info(f"bench --mode infer: {len(live)} rungs side by side, {self.repeats} rounds per batch size")
                try:
                    self._sweep(live)
                finally:  # Ctrl-C included: the batch sizes measured are figures
                    for lv in live:
                        self._rates(lv)
        except KeyboardInterrupt:
            for lv in live:
                if lv.res.status == "ok" and not lv.res.batch_sweep:
                    lv.res.status, lv.res.note = "skipped", STOPPED
            raise
        finally:
            live.clear()  # the runners go, and with them their device memory
            free_memory(self.plan)
            reset_dynamo()  # a later ladder compiles afresh

    def _compare(self) -> None:
        ok = [r for r in self.results if r.status == "ok"]
        if not ok:
            return
        base = ok[0]
        for r in ok:
            r.speedup_vs_baseline = r.decode_tokens_per_s / base.decode_tokens_per_s
            same = sum(a == b for a, b in zip(r.tokens, base.tokens, strict=False))
            r.tokens_match = same / max(len(base.tokens), 1)
            if r.tokens_match < 1:
                pairs = enumerate(zip(r.tokens, base.tokens, strict=False))
                first = next((i for i, (a, b) in pairs if a != b), len(r.tokens))
                _add_note(r, f"greedy tokens part from {base.name}'s at token {first}")
        kv = next((r for r in self.results if r.name == "kv"), None)
        levers = {r.name for r in LEVERS}
        for r in ok:
            if r.name not in levers:
                continue
            if kv is None or kv.status != "ok":
                _add_note(r, "its gain is kv's rate over its own: bench it beside kv (--rungs levers)" if kv is None
                          else f"no gain: the kv rung beside it is {kv.status}")
                continue
            mine = {p["batch_size"]: p["tokens_per_s"] for p in r.batch_sweep}
            r.lever_gain = [{"batch_size": p["batch_size"], "gain": p["tokens_per_s"] / mine[p["batch_size"]]}
                            for p in kv.batch_sweep if p["batch_size"] in mine]
            if r.lever_gain:
                gains = ", ".join(f"{g['gain']:.2f}x at batch {g['batch_size']}" for g in r.lever_gain)
                _add_note(r, f"the lever buys {gains} (kv's decode rate over this rung's)")

    def summary(self) -> dict[str, Any]:
        base = next((r for r in self.results if r.status == "ok"), None)
        return {
            "mode": "infer", "preset": self.preset, "model": self.model_config.to_dict(),
            "params": self.params, "prompt_len": self.prompt_len, "max_new_tokens": self.new_tokens,
            "batch_sizes": self.batch_sizes, "warmup": self.cfg.warmup, "repeats": self.repeats,
            "steps": self.cfg.steps, "agree_tokens": AGREE_TOKENS, "temperature": self.cfg.temperature,
            "top_k": self.cfg.top_k, "top_p": self.cfg.top_p,
            "dtype": str(self.base_dtype).removeprefix("torch."), "device_policy": self.plan.reason,
            "peak_bandwidth": self.peak_bandwidth, "bandwidth_source": self.bandwidth_source,
            "baseline": base.name if base else None, "environment": environment(self.plan),
            "rungs": [dataclasses.asdict(r) for r in self.results],
        }


def main(cfg: BenchConfig) -> int:
    if cfg.rungs.strip() == "list":
        for r in RUNGS + LEVERS:
            print(f"{r.name:<16} {r.what}")
        print("\ngroups: " + "; ".join(f"{g} = {','.join(names)}" for g, names in GROUPS.items()))
        return 0
    rungs = select_rungs(cfg.rungs)
    bench = InferBench(cfg)
    log.info(f"bench --mode infer: {bench.preset}, {bench.prompt_len}-token prompts + {bench.new_tokens} "
             f"new, batches {bench.batch_sizes}, {len(rungs)} rungs")
    summary = bench.run(rungs)
    out = Path(cfg.output_dir).expanduser()  # the folder bench/main.py checked
    report.write_infer(summary, out)
    print(report.infer_table(summary))
    print(f"\nreport: {out / 'infer_report.md'}")
    if cfg.json:
        print(to_json(summary))
    # 1: nothing measured though something should have been (a rung failed, or none fit); a ladder of
    # rungs this device cannot run (--rungs int4 on a CPU) is skipped with the reasons, not an error
    skipped = all(r["status"] == "skipped" for r in summary["rungs"])
    if bench.stopped:
        log.warning("bench --mode infer was stopped: the report holds the rungs measured before it")
        return CTRL_C_EXIT
    return 0 if summary["baseline"] or skipped else 1
