"""Sampling's bounds hold alike wherever a setting arrives: the CLI's options, the HTTP schemas and the sampler.

    pytest -q tests/test_sampling_bounds.py
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")  # the serve extra: the HTTP schemas

from pydantic import ValidationError  # noqa: E402

from gptopt.config import GenerateConfig, LoadtestConfig  # noqa: E402
from gptopt.infer.sampling import SamplingParams  # noqa: E402
from gptopt.serve.protocol import ChatRequest, CompletionRequest, GenerateRequest  # noqa: E402

# (option, a value each side of its range refuses, a value at each edge it takes)
CASES = [
    ("temperature", [-0.1, 2.01], [0.0, 2.0]),
    ("top_p", [0.0, 1.01], [1e-6, 1.0]),
    ("top_k", [0], [1]),
    ("repetition_penalty", [0.0, 10.5], [0.01, 10.0]),
    ("presence_penalty", [-2.5, 2.5], [-2.0, 2.0]),
    ("frequency_penalty", [-2.5, 2.5], [-2.0, 2.0]),
]
CLI_OPTIONS = {"temperature", "top_p", "top_k", "repetition_penalty"}  # what generate takes as flags


def _http(option: str, value: Any) -> None:
    CompletionRequest(prompt="x", **{option: value})
    ChatRequest(messages=[{"role": "user", "content": "x"}], **{option: value})


@pytest.mark.parametrize(("option", "refused", "taken"), CASES, ids=[c[0] for c in CASES])
def test_the_cli_the_http_schemas_and_the_sampler_refuse_and_take_the_same_values(
        option: str, refused: list[float], taken: list[float]) -> None:
    for value in refused:
        with pytest.raises(ValueError, match=option):
            SamplingParams(**{option: value})
        with pytest.raises(ValidationError):
            _http(option, value)
        if option in CLI_OPTIONS:
            with pytest.raises(ValueError, match=f"--{option}"):
                GenerateConfig(**{option: value})
    for value in taken:
        SamplingParams(**{option: value})
        _http(option, value)
        if option in CLI_OPTIONS:
            GenerateConfig(**{option: value})


def test_a_logit_bias_out_of_openais_range_is_refused_by_the_schema_and_the_sampler() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", logit_bias={"3": 101})
    SamplingParams(logit_bias=((3, -100.0),))
    CompletionRequest(prompt="x", logit_bias={"3": -100})


def test_the_playbooks_generate_route_and_the_load_tester_take_the_same_temperatures() -> None:
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="x", temperature=2.5)
    with pytest.raises(ValueError, match="--temperature"):
        LoadtestConfig(temperature=2.5)
    GenerateRequest(prompt="x", temperature=2.0)
    LoadtestConfig(temperature=2.0)
