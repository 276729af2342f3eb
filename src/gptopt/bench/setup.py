"""What both bench ladders (training, bench/ladder.py; inference, bench/infer_ladder.py) resolve the same
way from a BenchConfig: the device plan, the preset, the data, the model config, the sequence length;
the recipe ladder (bench/quality.py) takes the preset from here too.

    python -c "import gptopt.bench.setup as s, gptopt.config as c; print(s.Setup.from_config(c.BenchConfig()))"
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gptopt.config import PRESETS, BenchConfig, GPTConfig, TrainConfig, check_seq_len, preset_for_data
from gptopt.data import loader as data
from gptopt.runtime.device import DevicePlan, resolve

log = logging.getLogger("gptopt")


@dataclass
class Setup:
    """What both ladders (training and inference) resolve the same way from a BenchConfig."""

    plan: DevicePlan
    preset: str
    data: data.TokenData
    model_config: GPTConfig
    seq_len: int

    @classmethod
    def from_config(cls, cfg: BenchConfig) -> Setup:
        plan = resolve(cfg.device, quiet=True)
        name = bench_preset(cfg, plan)  # first: the default corpus is prepared on first use
        log.info(plan.reason)
        gpu = plan.device.type == "cuda"
        tokens = data.open_data(cfg.data_dir)
        # the vocabulary padded as `gptopt train` pads it: best.toml then trains this very model
        model_config = preset_for_data(name, tokens.model_vocab_size,
                                       vocab_pad_multiple=TrainConfig().vocab_padding)
        tokens.check_vocab(model_config.vocab_size)
        seq_len = cfg.seq_len or min(1024 if gpu else 256, model_config.block_size)  # a default fits the model
        return cls(plan, name, tokens, model_config, seq_len)


def bench_preset(cfg: BenchConfig, plan: DevicePlan) -> str:
    """The preset every ladder runs: --preset, else the embedded default (gpt2 on a GPU, tiny elsewhere).
    A --seq_len beyond its context is refused here, before any work, as `gptopt train` refuses it: cut to
    the context, the ladder would measure (and write into best.toml) a length nobody asked for."""
    name = cfg.preset or ("gpt2" if plan.device.type == "cuda" else "tiny")
    if cfg.model is None:  # a --model: its own context
        check_seq_len(cfg.seq_len, PRESETS[name]["block_size"], name)
    return name
