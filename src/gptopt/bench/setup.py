"""What both bench ladders (training, bench/ladder.py; inference, bench/infer.py) resolve the same
way from a BenchConfig: the device plan, the preset, the data, the model config, the sequence length.

    python -c "from gptopt.bench.setup import Setup; from gptopt.config import BenchConfig; print(Setup.from_config(BenchConfig()))"
"""

from __future__ import annotations

from dataclasses import dataclass

from gptopt import data
from gptopt.config import BenchConfig, GPTConfig, TrainConfig, preset_for_data
from gptopt.device import DevicePlan, resolve


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
        plan = resolve(cfg.device)
        gpu = plan.device.type == "cuda"
        name = cfg.preset or ("gpt2" if gpu else "tiny")  # the embedded defaults
        tokens = data.open_data(cfg.data_dir)
        # the vocabulary padded as `gptopt train` pads it: best.toml then trains this very model
        model_config = preset_for_data(name, tokens.model_vocab_size, vocab_pad_multiple=TrainConfig().vocab_pad_multiple)
        tokens.check_vocab(model_config.vocab_size)
        seq_len = min(cfg.seq_len or (1024 if gpu else 256), model_config.block_size)
        return cls(plan, name, tokens, model_config, seq_len)
