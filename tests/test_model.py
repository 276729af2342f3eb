"""The GPT model: presets, shapes, loss, attention paths, caching, padding, checkpointing.

    pytest -q tests/test_model.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import graph_ops

from gptopt.config import (
    DEFAULT_PRESET,
    PRESETS,
    GPTConfig,
    PrepareConfig,
    TrainConfig,
    preset,
    preset_for_data,
)
from gptopt.models.flops import non_embedding_params
from gptopt.models.gpt import CAUSAL_SPLIT_MIN, GPT, TanhGELU

# Pinned so that a change to the architecture shows up here; GPT-2's published sizes are
# 124M / 355M / 774M / 1558M (tied lm_head counted once).
EXPECTED_PARAMS = {
    "debug": 136_960,
    "tiny": 5_322_240,
    "tiny-draft": 1_478_144,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-tiny": 4_999_424,
    # the published models': transformers' own count of the same shapes (test_families checks it)
    "smollm2-135m": 134_515_008,
    "qwen3-0.6b": 596_049_920,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts(name: str) -> None:
    with torch.device("meta"):  # no memory, no init cost: gpt2-xl is 6 GB in fp32
        model = GPT(preset(name))
    assert model.num_params() == EXPECTED_PARAMS[name]
    # MFU counts FLOPs from the config alone; it must count the model's own weights, less the position table.
    wpe = model.transformer.wpe.weight.numel() if "wpe" in model.transformer else 0
    assert non_embedding_params(model.config) == model.num_params() - wpe


def test_the_default_model_fits_the_default_data_unchanged() -> None:
    """`gptopt train` with no options trains the default preset on the default corpus: sized for that
    corpus's tokenizer, it is the preset as documented, not a resized variant."""
    name = TrainConfig().preset or DEFAULT_PRESET
    assert preset_for_data(name, PrepareConfig().vocab_size) == preset(name)


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as e:
        preset("gpt5")
    for name in PRESETS:
        assert name in str(e.value)


def test_bad_config_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="attention"):
        GPTConfig(attention="flash3")


def test_logits_shape_and_loss_is_mean_cross_entropy(debug_model: GPT) -> None:
    idx = torch.randint(0, 512, (3, 17))
    targets = torch.randint(0, 512, (3, 17))
    logits = debug_model(idx)
    assert logits.shape == (3, 17, 512)
    loss = debug_model(idx, targets)
    assert loss.shape == ()
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 512), targets.reshape(-1)))
    # a fresh model predicts close to uniform: loss ~ ln(vocab)
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5


def test_ignore_index_targets_are_skipped(debug_model: GPT) -> None:
    idx = torch.randint(0, 512, (2, 8))
    targets = torch.randint(0, 512, (2, 8))
    masked = targets.clone()
    masked[:, :4] = -100
    logits = debug_model(idx)
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 512), targets[:, 4:].reshape(-1))
    torch.testing.assert_close(debug_model(idx, masked), expected)


def test_lm_head_is_tied_to_token_embedding(debug_model: GPT) -> None:
    assert debug_model.lm_head.weight.data_ptr() == debug_model.transformer.wte.weight.data_ptr()


def test_eager_attention_matches_sdpa(debug_config: GPTConfig) -> None:
    sdpa = GPT(debug_config).eval()
    eager = GPT(GPTConfig(**{**debug_config.to_dict(), "attention": "eager"})).eval()
    eager.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 512, (2, 33))
    torch.testing.assert_close(eager(idx), sdpa(idx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [CAUSAL_SPLIT_MIN - 1, CAUSAL_SPLIT_MIN, 97, 128])
def test_split_eager_attention_matches_sdpa_forward_and_backward(T: int) -> None:
    # From CAUSAL_SPLIT_MIN on, eager attention computes two query blocks and skips the masked
    # quarter; odd T gives blocks of unequal length.
    config = preset("debug", block_size=128)
    sdpa = GPT(config)
    eager = GPT(GPTConfig(**{**config.to_dict(), "attention": "eager"}))
    eager.load_state_dict(sdpa.state_dict())
    idx, targets = torch.randint(0, 512, (2, T)), torch.randint(0, 512, (2, T))
    losses = []
    for model in (sdpa, eager):
        loss = model(idx, targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(sdpa.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_tanh_gelu_is_the_sigmoid_form_when_compiled() -> None:
    gelu = TanhGELU()
    x = torch.linspace(-8, 8, 4001)
    torch.testing.assert_close(gelu(x), F.gelu(x, approximate="tanh"), atol=0, rtol=0)  # eager: F.gelu itself
    ops, out = graph_ops(gelu, x)
    assert "sigmoid" in ops and "gelu" not in ops
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh"), atol=1e-6, rtol=1e-5)
    xb = x.to(torch.bfloat16)  # computed in fp32 as F.gelu does, then rounded once: within one bf16 step
    _, out = graph_ops(gelu, xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.gelu(xb, approximate="tanh"), atol=1e-4, rtol=2**-7)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_is_causal(attention: str) -> None:
    model = GPT(preset("debug", attention=attention)).eval()
    idx = torch.randint(0, 512, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 512
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(idx)[:, 10:], model(changed)[:, 10:])


def test_sequence_longer_than_context_is_an_error(debug_model: GPT) -> None:
    with pytest.raises(ValueError, match="context"):
        debug_model(torch.zeros(1, 65, dtype=torch.long))


class GrowingCache:
    """A minimal per-layer cache: concatenates keys/values (the real one preallocates)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_incremental_decoding_with_a_cache_equals_the_full_forward(attention: str) -> None:
    model = GPT(preset("debug", attention=attention)).eval()
    idx = torch.randint(0, 512, (2, 12))
    full = model(idx)
    caches = [GrowingCache() for _ in range(model.config.n_layer)]
    # prefill 7 tokens, then a chunk of 3 (exercises the bottom-right causal mask), then 1 and 1
    outs, start = [], 0
    for n in (7, 3, 1, 1):
        pos = torch.arange(start, start + n)
        outs.append(model(idx[:, start : start + n], pos=pos, kv_cache=caches))
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


def test_last_only_returns_the_final_position(debug_model: GPT) -> None:
    idx = torch.randint(0, 512, (2, 9))
    last = debug_model(idx, last_only=True)
    assert last.shape == (2, 1, 512)
    torch.testing.assert_close(last, debug_model(idx)[:, -1:])


def test_vocab_padding_keeps_the_contract_shape() -> None:
    cfg = preset("debug", vocab_size=500, vocab_pad_multiple=64)
    assert cfg.padded_vocab_size == 512
    model = GPT(cfg).eval()
    assert model.transformer.wte.weight.shape == (512, 64)
    idx = torch.randint(0, 500, (2, 8))
    assert model(idx).shape == (2, 8, 500)
    # loss only over the real vocabulary: padded rows cannot absorb probability mass
    logits = model(idx)
    torch.testing.assert_close(model(idx, idx), F.cross_entropy(logits.reshape(-1, 500), idx.reshape(-1)))


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(debug_config: GPTConfig) -> None:
    plain = GPT(debug_config).train()
    ckpt = GPT(GPTConfig(**{**debug_config.to_dict(), "gradient_checkpointing": True})).train()
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 512, (2, 16))
    losses = []
    for m in (plain, ckpt):
        loss = m(idx, idx)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p1), (_, p2) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad, msg=name)


def test_dropout_is_active_only_in_training() -> None:
    model = GPT(preset("debug", dropout=0.2))
    idx = torch.randint(0, 512, (2, 16))
    model.train()
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_bf16_autocast_forward_backward_on_cpu(debug_model: GPT) -> None:
    debug_model.train()
    idx = torch.randint(0, 512, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = debug_model(idx, idx)
    assert loss.dtype == torch.float32  # cross-entropy is computed in fp32 under autocast
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in debug_model.parameters())


def test_presets_sized_for_a_corpus() -> None:
    from gptopt.config import preset_for_data

    # GPT-2 sizes keep GPT-2's embedding (their FLOPs are GPT-2's); small presets take the corpus' vocab
    assert preset_for_data("gpt2", 8192).vocab_size == 50257
    assert preset_for_data("gpt2", 60000).vocab_size == 60000
    assert preset_for_data("tiny", 320).vocab_size == 320
