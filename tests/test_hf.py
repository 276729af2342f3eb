"""Hugging Face GPT-2 <-> gptopt: logits parity through the real converter, safe loading, clear errors.

    pytest -q tests/test_hf.py

No network: every HF model is a tiny random GPT2LMHeadModel saved into tmp_path.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import gptopt.models  # noqa: E402
from gptopt.config import GPTConfig, preset  # noqa: E402
from gptopt.models import hf  # noqa: E402
from gptopt.models.checkpoint import save_model  # noqa: E402
from gptopt.models.gpt import GPT  # noqa: E402
from gptopt.utils.extras import MissingExtra  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=128)


def hf_model(**config: object) -> transformers.GPT2LMHeadModel:
    # bos/eos unset: GPT-2's 50256 lies outside a 128-token vocabulary and transformers warns about it.
    cfg = transformers.GPT2Config(**{**TINY, **config}, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg).eval()


def save_hf(model: transformers.GPT2LMHeadModel, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def tokens(vocab_size: int, T: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, T))


@torch.no_grad()
def hf_logits(model: transformers.GPT2LMHeadModel, idx: torch.Tensor) -> torch.Tensor:
    return model(idx).logits


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_safetensors_dir_gives_hf_logits(tmp_path: Path, attention: str) -> None:
    ref = hf_model()
    directory = save_hf(ref, tmp_path / "hf")
    model = hf.load_pretrained(str(directory), attention=attention).eval()
    assert model.config.attention == attention
    assert (model.config.n_layer, model.config.block_size, model.config.vocab_size) == (2, 64, 128)
    idx = tokens(128)
    with torch.no_grad():
        got = model(idx)
    assert got.dtype == torch.float32
    assert (got - hf_logits(ref, idx)).abs().max().item() <= 1e-5


def test_pytorch_bin_in_legacy_layout_loads_with_weights_only(tmp_path: Path) -> None:
    # The layout of the original hub gpt2 pytorch_model.bin: no `transformer.` prefix, the causal-mask
    # buffers stored as if they were weights, and the tied lm_head saved as its own copy.
    ref = hf_model()
    directory = tmp_path / "hf"
    ref.config.save_pretrained(directory)
    state = {k.removeprefix("transformer."): v.clone() for k, v in ref.state_dict().items()}
    for i in range(ref.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    assert "lm_head.weight" in state
    torch.save(state, directory / "pytorch_model.bin")
    assert not (directory / "model.safetensors").exists()

    model = hf.load_pretrained(str(directory)).eval()
    idx = tokens(128)
    with torch.no_grad():
        assert (model(idx) - hf_logits(ref, idx)).abs().max().item() <= 1e-5


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def test_pytorch_bin_with_code_is_refused_without_running_it(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    ref = hf_model()
    ref.config.save_pretrained(directory)
    marker = tmp_path / "code-ran"
    state = dict(ref.state_dict(), payload=_RunsCodeWhenUnpickled(marker))
    torch.save(state, directory / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refused to unpickle"):
        hf.load_pretrained(str(directory))
    assert not marker.exists()


def test_export_round_trip_through_transformers(tmp_path: Path, debug_model: GPT) -> None:
    out = hf.export_hf(debug_model, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [".gptopt-output.json", "config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
    idx = tokens(debug_model.config.vocab_size)
    with torch.no_grad():
        expected = debug_model(idx)
    assert (hf_logits(loaded, idx) - expected).abs().max().item() <= 1e-5
    # ... and back into gptopt from the exported directory: the same model again.
    back = hf.load_pretrained(str(out)).eval()
    with torch.no_grad():
        assert (back(idx) - expected).abs().max().item() <= 1e-5


def test_vocab_padding_on_load_and_export(tmp_path: Path) -> None:
    ref = hf_model(vocab_size=100)
    directory = save_hf(ref, tmp_path / "hf")
    model = hf.load_pretrained(str(directory), vocab_pad_multiple=64).eval()
    wte = model.transformer.wte.weight
    assert wte.shape == (128, 64)
    assert torch.count_nonzero(wte[100:]) == 0  # padded rows are inert zeros, not random init
    idx = tokens(100)
    with torch.no_grad():
        got = model(idx)
    assert got.shape == (2, 16, 100)
    assert (got - hf_logits(ref, idx)).abs().max().item() <= 1e-5

    # Export drops the padding again: HF sees the real 100-token vocabulary.
    out = hf.export_hf(model, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 100
    assert load_file(str(out / "model.safetensors"))["transformer.wte.weight"].shape == (100, 64)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert (hf_logits(loaded, idx) - got).abs().max().item() <= 1e-5


def test_gptopt_dir_through_load_pretrained(tmp_path: Path, debug_model: GPT) -> None:
    directory = save_model(debug_model, tmp_path / "model")
    idx = tokens(debug_model.config.vocab_size)
    with torch.no_grad():
        expected = debug_model(idx)
        assert torch.equal(hf.load_pretrained(str(directory)).eval()(idx), expected)
        padded = hf.load_pretrained(str(directory), attention="eager", vocab_pad_multiple=384).eval()
        assert padded.config.attention == "eager"
        assert padded.transformer.wte.weight.shape[0] == 768
        assert torch.count_nonzero(padded.transformer.wte.weight[512:]) == 0
        assert (padded(idx) - expected).abs().max().item() <= 1e-5


def test_overrides_cannot_change_what_the_weights_fix(tmp_path: Path) -> None:
    directory = save_hf(hf_model(), tmp_path / "hf")
    assert hf.load_pretrained(str(directory), n_layer=2).config.n_layer == 2  # repeating is fine
    with pytest.raises(ValueError, match="fixes n_layer=2"):
        hf.load_pretrained(str(directory), n_layer=4)
    with pytest.raises(ValueError, match="unknown model setting"):
        hf.load_pretrained(str(directory), n_layers=2)


# ----------------------------------------------------------------------------------------------
# Bad input


def test_directory_without_config_or_weights(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        hf.load_pretrained(str(empty))

    weights_only = save_hf(hf_model(), tmp_path / "no-config")
    (weights_only / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        hf.load_pretrained(str(weights_only))

    config_only = save_hf(hf_model(), tmp_path / "no-weights")
    (config_only / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights: expected model.safetensors .* or pytorch_model.bin"):
        hf.load_pretrained(str(config_only))

    with pytest.raises(ValueError, match="is a file, not a model directory"):
        hf.load_pretrained(str(config_only / "config.json"))


@pytest.fixture
def hf_state() -> tuple[dict[str, torch.Tensor], GPTConfig]:
    ref = hf_model()
    return dict(ref.state_dict()), hf.config_from_hf(ref.config.to_dict())


def test_state_with_missing_key_names_it(hf_state: tuple[dict[str, torch.Tensor], GPTConfig]) -> None:
    state, config = hf_state
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(
        ValueError, match=r"missing weight 'transformer.h.1.mlp.c_fc.bias' \(expected shape \(256,\)\)"
    ):
        hf.hf_state_to_gptopt(state, config)


def test_state_with_wrong_shape_names_key_and_both_shapes(
    hf_state: tuple[dict[str, torch.Tensor], GPTConfig],
) -> None:
    state, config = hf_state
    state["transformer.h.0.attn.c_attn.weight"] = torch.zeros(192, 64)  # nn.Linear layout, not Conv1D
    with pytest.raises(
        ValueError,
        match=r"'transformer.h.0.attn.c_attn.weight' has shape \(192, 64\), the config needs \(64, 192\)",
    ):
        hf.hf_state_to_gptopt(state, config)


def test_state_with_untied_lm_head_is_refused(hf_state: tuple[dict[str, torch.Tensor], GPTConfig]) -> None:
    state, config = hf_state
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight differs from wte"):
        hf.hf_state_to_gptopt(state, config)


def test_truncated_weights_file(tmp_path: Path) -> None:
    directory = save_hf(hf_model(), tmp_path / "hf")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        hf.load_pretrained(str(directory))


def test_conversion_functions_are_inverse(hf_state: tuple[dict[str, torch.Tensor], GPTConfig]) -> None:
    state, config = hf_state
    converted = hf.hf_state_to_gptopt(state, config)
    # Conv1D (in, out) -> nn.Linear (out, in)
    assert converted["transformer.h.0.mlp.c_fc.weight"].shape == (256, 64)
    assert torch.equal(
        converted["transformer.h.0.mlp.c_fc.weight"], state["transformer.h.0.mlp.c_fc.weight"].t()
    )
    model = GPT(config)
    model.load_state_dict(converted, strict=False)
    back = hf.gptopt_state_to_hf(model)
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("activation_function", "relu", "activation_function is 'relu'"),
        ("n_inner", 100, "n_inner is 100"),
        ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx is true"),
        ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn is true"),
        ("tie_word_embeddings", False, "tie_word_embeddings is false"),
        ("model_type", "gpt_neo", "model_type is 'gpt_neo'"),
    ],
)
def test_unsupported_config_is_refused_with_the_reason(field: str, value: object, reason: str) -> None:
    config = {**hf_model().config.to_dict(), field: value}
    with pytest.raises(ValueError, match=f"{reason}.*cannot represent this model exactly"):
        hf.config_from_hf(config)


def test_unsupported_config_dir_is_refused(tmp_path: Path) -> None:
    directory = save_hf(hf_model(activation_function="relu"), tmp_path / "hf")
    with pytest.raises(ValueError, match="config.json: activation_function is 'relu'"):
        hf.load_pretrained(str(directory))


def test_export_refuses_non_empty_dir_and_overwrites_only_its_own_export(tmp_path: Path, debug_model: GPT) -> None:
    target = tmp_path / "export"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty and is not marked as gptopt's .*; nothing was written"):
        hf.export_hf(debug_model, target)
    with pytest.raises(ValueError, match="not marked as gptopt's"):  # a folder of the user's is never replaced
        hf.export_hf(debug_model, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]  # untouched

    (target / "notes.txt").unlink()
    hf.export_hf(debug_model, target)
    hf.export_hf(debug_model, target, overwrite=True)  # gptopt's own export: replaced
    assert sorted(p.name for p in target.iterdir()) == [".gptopt-output.json", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp or old dirs left


def test_export_refuses_model_without_biases(tmp_path: Path) -> None:
    model = GPT(preset("debug", bias=False))
    with pytest.raises(ValueError, match="bias=False"):
        hf.export_hf(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_hub_name_offline_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)  # so "gpt2" is not a local directory
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # An empty cache, whatever this machine's real cache holds.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="'gpt2' is not a local directory.*HF_HUB_OFFLINE is set"):
        hf.load_pretrained("gpt2")


def test_a_hub_model_cached_with_its_weights_alone_loads_offline(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot cached by an earlier download of config.json and the weights only, whose repository also has a
    tokenizer_config.json (now fetched with them): offline it still loads, with the same weights, although
    huggingface_hub finds the snapshot incomplete for the files now asked for."""
    import huggingface_hub.constants

    tree = pytest.importorskip("huggingface_hub._tree_cache")
    model = hf_model()
    repo = save_hf(model, tmp_path / "repo")
    storage = tmp_path / "cache" / "models--org--tiny"
    sha = "0" * 40
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(sha)
    (storage / "snapshots" / sha).mkdir(parents=True)
    for name in (hf.HF_CONFIG, hf.SAFETENSORS):
        (storage / "snapshots" / sha / name).write_bytes((repo / name).read_bytes())
    listing = {name: tree.TreeCacheEntry(size=1, blob_id="1" * 40)
               for name in (hf.HF_CONFIG, hf.SAFETENSORS, "tokenizer_config.json")}
    tree.write_tree_cache(str(storage), sha, listing)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    idx = tokens(TINY["vocab_size"])
    with torch.no_grad():
        got = hf.load_pretrained("org/tiny").eval()(idx)
    assert (got - hf_logits(model, idx)).abs().max().item() <= 1e-5


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such model directory"):
        hf.load_pretrained(str(tmp_path / "nope"))


def test_local_dirs_load_without_the_hf_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = save_hf(hf_model(), tmp_path / "hf")
    # None in sys.modules makes `import transformers` fail, as if the extra were not installed.
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    # Re-import gptopt.models.hf fresh; monkeypatch puts the original module back afterwards (in sys.modules
    # and as the package attribute) so later tests see one gptopt.models.hf.
    monkeypatch.delitem(sys.modules, "gptopt.models.hf")
    monkeypatch.setattr(gptopt.models, "hf", hf)
    import gptopt.models.hf as fresh  # the module itself imports without the extra

    model = fresh.load_pretrained(str(directory))
    assert model.config.vocab_size == 128
    with pytest.raises(MissingExtra, match=r"pip install 'gptopt\[hf\]'"):
        fresh.export_hf(model, tmp_path / "export")
    with pytest.raises(MissingExtra, match=r"pip install 'gptopt\[hf\]'"):
        fresh.load_pretrained("openai-community/gpt2")


def test_safetensors_without_prefix_and_with_mask_buffers(tmp_path: Path) -> None:
    # Hub safetensors files of GPT-2 drop the `transformer.` prefix and may keep the mask buffers.
    ref = hf_model()
    directory = tmp_path / "hf"
    ref.config.save_pretrained(directory)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in ref.state_dict().items()}
    del state["lm_head.weight"]
    state["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model = hf.load_pretrained(str(directory)).eval()
    idx = tokens(128)
    with torch.no_grad():
        assert (model(idx) - hf_logits(ref, idx)).abs().max().item() <= 1e-5
