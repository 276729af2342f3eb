"""The inference ladder's rungs: each one's name, what it runs and its switches (RUNGS, the default ladder; LEVERS,
the lever rungs), --rungs' groups, a rung's result, and the runners of the rungs gptopt's Generator does not run:
Hugging Face `generate` (the baseline) and onnxruntime on the ONNX export.

    gptopt bench --mode infer --rungs list

A new generation rung is a line of RUNGS plus what its switch changes in infer_ladder.InferBench._runner. A
rung is what generate or serve would run, never a copy of it.
"""

from __future__ import annotations

import inspect
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from gptopt.infer.measure import GREEDY, GptoptRunner, Sampling
from gptopt.infer.onnx_decoder import ONNX_FILE, OrtDecoder, export_onnx
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

AGREE_TOKENS = 32  # tokens compared with the baseline's: greedy paths may part later on near-ties
# What a lever rung does the other way (LEVERS): the textbook sampler, the grouped-query attention, the CPU weight
# layout, bf16 weights (fp32 instead, where the CPU has native bf16), gate and up (stacked as one product, which
# the default leaves apart), the fused block kernels
Lever = Literal["sampler", "gqa", "layout", "bf16", "stack", "fuse"]


@dataclass(frozen=True)
class InferRung:
    name: str
    what: str
    hf: bool = False
    compile: bool = False
    cuda_graphs: bool = False  # the eager decode recorded as CUDA graphs (infer.decode_graphs.GraphedDecode): CUDA only
    bf16: bool = False  # bf16 weights instead of the device's inference dtype
    int8: bool = False
    int4: bool = False  # torchao int4 weight-only (tinygemm), bf16: sm_80+ CUDA only
    onnx: bool = False  # the model exported by `gptopt export`, run by onnxruntime
    speculate: bool = False  # speculative decoding: n-gram drafts, or --draft_model's
    without: Lever | None = None  # a lever rung: the kv rung with this lever done the textbook way (LEVERS)


RUNGS: list[InferRung] = [
    InferRung("hf", "Hugging Face generate (dynamic KV cache, SDPA) in the device's dtype: the baseline",
              hf=True),
    InferRung("kv", "gptopt Generator: preallocated KV cache, prefill + decode, eager"),
    InferRung("graphs", "+ the eager decode step recorded as a CUDA graph per batch size (GPUs only)",
              cuda_graphs=True),
    InferRung("compiled", "+ torch.compile of the decode step over a static cache (CUDA graphs on GPUs)",
              compile=True),
    InferRung("bf16", "compiled, bf16 weights", compile=True, bf16=True),
    InferRung("int8", "compiled, torchao int8 weight-only Linear layers", compile=True, int8=True),
    InferRung("int4", "compiled, torchao int4 weight-only (tinygemm), bf16", compile=True, int4=True),
    InferRung("onnxruntime", "onnxruntime (CPU) on the ONNX export: KV cache as graph inputs and outputs",
              onnx=True),
    InferRung("speculative", "kv + speculative decoding: n-gram prompt lookup (or --draft_model) drafts, the model "
              "checks k + 1 tokens a forward; random weights keep few drafts (bench a trained --model)",
              speculate=True),
]


# The levers of the eager decode, each taken away in a rung of its own (levers.py); kv keeps them all, so each
# lever's gain is kv's rate over its rung's. Not in the default ladder: `--rungs levers` (with kv) or `all`.
LEVERS: list[InferRung] = [
    InferRung("kv-hf-sampling", "kv with transformers' sampler (its temperature, top-k and top-p warpers, top-p "
              "sorting the whole vocabulary; softmax, multinomial): what gptopt's sampler buys", without="sampler"),
    InferRung("kv-repeat-kv", "kv with the cached keys and values repeated to every query head each step (the "
              "textbook repeat_kv): what attending a grouped-query cache as stored buys", without="gqa"),
    InferRung("kv-plain-weights", "kv with the weights in the layout they load in: what the CPU weight layouts "
              "buy (oneDNN-packed products in fp32 and bf16, fp32 ones column-major; CPUs only)", without="layout"),
    InferRung("kv-fp32", "kv with fp32 weights: what the default bf16 weights buy on a CPU with native bf16",
              without="bf16"),
    InferRung("kv-stacked", "kv with a SwiGLU MLP's gate and up stacked as one packed product (vLLM's "
              "gate_up_proj): what keeping them apart buys (Llama/Qwen3 on CPUs)", without="stack"),
    InferRung("kv-unfused", "kv with the blocks' RMSNorm, residual adds and rotary as aten calls: what the fused "
              "kernels buy (Llama/Qwen3 on CPUs)", without="fuse"),
]
GROUPS = {"default": [r.name for r in RUNGS], "levers": ["kv", *(r.name for r in LEVERS)],
          "all": [r.name for r in RUNGS + LEVERS]}


def select_rungs(spec: str) -> list[InferRung]:
    by_name = {r.name: r for r in RUNGS + LEVERS}
    valid = ", ".join([*by_name, *GROUPS])
    names: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part not in by_name and part not in GROUPS:
            raise UserError(f"unknown rung {part!r} for --mode infer; valid rungs: {valid}")
        names += GROUPS.get(part, [part])
    if not names:  # nothing to measure: refused before a report with no rungs is written
        raise UserError(f"--rungs {spec!r} names no rung for --mode infer; valid rungs: {valid}")
    return [by_name[n] for n in dict.fromkeys(names)]


@dataclass
class InferResult:
    name: str
    what: str
    status: str = "ok"  # ok | oom | skipped | failed
    note: str = ""
    dtype: str = ""
    prefill_s: float | None = None  # the prompt's forward alone, batch 1
    ttft_s: float | None = None  # prefill + the first token on the host, batch 1
    decode_tokens_per_s: float | None = None  # batch 1, prefill excluded
    batch_sweep: list[dict[str, Any]] = field(default_factory=list)  # {batch_size, tokens_per_s}
    bytes_per_token: int | None = None  # weights + KV cache read per decode step at batch 1
    bandwidth_gbs: float | None = None
    bandwidth_util: float | None = None
    tokens_match: float | None = None  # share of the first AGREE_TOKENS equal to the baseline's
    max_logit_diff: float | None = None  # against fp32 gptopt on the same prompt (last position)
    speedup_vs_baseline: float | None = None
    lever_gain: list[dict[str, Any]] = field(default_factory=list)  # a lever rung's: {batch_size, gain}, kv / it
    tokens: list[int] = field(default_factory=list)


class HFRunner:
    """The baseline: transformers' GPT2LMHeadModel.generate, greedy, as a user would call it."""

    def __init__(self, model: GPT, plan: DevicePlan, dtype: torch.dtype) -> None:
        from gptopt.models.hf import to_hf_model

        transformers = require("transformers", "hf", "the Hugging Face baseline")
        self.model = to_hf_model(model, attn_implementation="sdpa").to(plan.device, dtype).eval()
        self.device = plan.device
        self.config = transformers.GenerationConfig
        # Only the last position's logits, as generate's own prefill asks for (transformers >= 4.50).
        keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.forward_kw = {"logits_to_keep": 1} if keep else {}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = GREEDY) -> list[list[int]]:
        ids = torch.tensor(prompts, device=self.device)
        # No end-of-text id: min_new_tokens would mask it until token n and change argmaxes gptopt's
        # generator (run without stop ids) keeps; without one, max_new_tokens fixes every length.
        # Sampled: top_k 0 turns off generate's default of 50 when none is asked, as gptopt's has none.
        sample = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
        cfg = self.config(**sample, use_cache=True, max_new_tokens=n, min_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        return out[:, ids.shape[1]:].tolist()

    @torch.no_grad()
    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt], device=self.device)
        return self.model(input_ids=ids, use_cache=True, **self.forward_kw).logits[0, -1].float()


class OnnxRunner:
    """`gptopt bench --mode infer`'s onnxruntime rung: the model exported (and checked) into a temporary
    directory, decoded greedily through onnxruntime. The bench's runner interface: generate, last_logits."""

    def __init__(self, model: GPT) -> None:
        self.model = model  # the bench counts its weight bytes
        self._dir = tempfile.TemporaryDirectory(prefix="gptopt-onnx-")
        path = Path(self._dir.name) / "export"
        export_onnx(model, path)
        self.decoder = OrtDecoder(path / ONNX_FILE, block_size=model.config.block_size)

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = GREEDY) -> list[list[int]]:
        assert sampling.greedy, "the onnxruntime rung decodes greedily (InferBench._skip)"
        return self.decoder.greedy(prompts, n)

    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.decoder.prefill([prompt])[0][0, -1]).float()


Runner = GptoptRunner | HFRunner | OnnxRunner  # each: generate(prompts, n, sampling), last_logits(prompt), model
