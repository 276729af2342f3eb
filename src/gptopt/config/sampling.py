"""Sampling's options and their bounds, declared once: the CLI's flags (SamplingConfig), the HTTP schemas
(serve/protocol.py) and the sampler (infer/sampling.py's SamplingParams) all take their ranges from here.

    python -c "from gptopt.config.sampling import TEMPERATURE; TEMPERATURE.check('temperature', 3.0)"
"""

from __future__ import annotations

from dataclasses import dataclass

from gptopt.config.fields import MAX_NEW_TOKENS, MAX_SEED, MAX_VOCAB, check_fields, opt, range_text
from gptopt.utils.errors import UserError


@dataclass(frozen=True)
class Bound:
    """A sampling option's allowed values: >= ge or > gt, and <= le or < lt (None: no bound on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    @property
    def limits(self) -> dict[str, float]:
        """The bounds as keyword arguments: config.opt's and pydantic's Field's (ge, gt, le, lt)."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt)) if v is not None}

    def holds(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def check(self, name: str, value: float) -> None:
        """ValueError naming the option, its range and the value, when the value is out of range (or NaN)."""
        if not self.holds(value):
            raise UserError(f"{name} must be {range_text(self.limits)}, got {value!r}")


def describe(temperature: float, top_k: int | None = None, top_p: float = 1.0) -> str:
    """How tokens are chosen, in words: "greedy", or "sampled at temperature T (top_k K, top_p P)" (OpenAI's
    clients send neither: "top_p 1, no top_k")."""
    if not temperature:
        return "greedy"
    cut = ", ".join([*([f"top_k {top_k}"] if top_k is not None else []), *([f"top_p {top_p:g}"] if top_p < 1 else [])])
    return f"sampled at temperature {temperature:g} ({cut or 'top_p 1, no top_k'})"


# OpenAI's ranges where OpenAI has the option (temperature, top_p, the presence and frequency penalties,
# logit_bias); the extensions' (top_k, repetition_penalty) as vLLM accepts them.
TEMPERATURE = Bound(ge=0.0, le=2.0)  # 0: greedy
TOP_P = Bound(gt=0.0, le=1.0)
TOP_K = Bound(ge=1, le=MAX_VOCAB)
REPETITION_PENALTY = Bound(gt=0.0, le=10.0)  # HF's rule: a seen token's logit / p if positive, * p if negative
PRESENCE_PENALTY = Bound(ge=-2.0, le=2.0)
FREQUENCY_PENALTY = Bound(ge=-2.0, le=2.0)
LOGIT_BIAS = Bound(ge=-100.0, le=100.0)  # a value added to one token's logit
SEED = Bound(ge=0, le=MAX_SEED)


@dataclass(kw_only=True)
class SamplingConfig:
    """Sampling options shared by generate and serve (serve takes them per request)."""

    max_new_tokens: int = opt(128, "tokens to generate per prompt", ge=1, le=MAX_NEW_TOKENS)
    temperature: float = opt(0.8, "softmax temperature; 0 = greedy", **TEMPERATURE.limits)
    top_k: int | None = opt(50, "sample from the k most likely tokens (none = all)", **TOP_K.limits)
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches p", **TOP_P.limits)
    repetition_penalty: float = opt(1.0, "divide the logits of tokens already present by this (> 1 discourages "
                                    "repeats)", **REPETITION_PENALTY.limits)
    seed: int | None = opt(None, "seed: the same seed and prompt give the same sample", **SEED.limits)
    stop: str | None = opt(None, "stop when this text appears (\\n escapes allowed); it is not included")

    def __post_init__(self) -> None:
        check_fields(self)  # every field, a subclass's too
