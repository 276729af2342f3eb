"""Hugging Face GPT-2 checkpoints <-> gptopt: config mapping, Conv1D transpose, shape checks, export.

gptopt keeps GPT-2's parameter names, so the conversion is small: HF's Conv1D layers store their
weights (in, out) and nn.Linear wants (out, in); HF's causal-mask buffers are dropped; lm_head is
tied to wte on both sides. Local directories need only safetensors and torch; the `hf` extra
(transformers, huggingface-hub) is needed to download a hub name and to export.

    python -c "from gptopt.models.hf import load_pretrained; print(load_pretrained('gpt2'))"   # online or cached
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gptopt.config import GPTConfig
from gptopt.models.checkpoint import META, check_state, is_gptopt_dir, load_model
from gptopt.models.gpt import GPT
from gptopt.models.hf_files import CHAT_FILES, GENERATION_CONFIG, HF_CONFIG, token_ids
from gptopt.models.hub import offline as hub_offline
from gptopt.outputs import check_output, staged_dir
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require
from gptopt.utils.paths import looks_local

__all__ = [
    "config_from_hf",
    "export_hf",
    "gptopt_state_to_hf",
    "hf_state_to_gptopt",
    "load_hf_dir",
    "load_pretrained",
]

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
EXPORT_KIND = "export-hf"  # the outputs mark of a directory export_hf wrote: the only kind its overwrite replaces
PT_BIN = "pytorch_model.bin"
PT_BIN_INDEX = "pytorch_model.bin.index.json"

# HF's Conv1D layers: weight stored (in, out), transposed once here for nn.Linear's (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# HF GPT-2 checkpoints may carry the causal mask and its fill value as buffers; they are not weights.
_MASK_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")
# What the hub accepts as a repo id ("gpt2", "openai-community/gpt2"); anything else is a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# Settings that do not live in the weights; every other GPTConfig field is fixed by the checkpoint.
OVERRIDABLE = ("vocab_pad_multiple", "dropout", "attention", "gradient_checkpointing", "loss")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # the two HF names of model.py's GELU(approximate="tanh")


# ----------------------------------------------------------------------------------------------
# Config


def config_from_hf(hf: dict[str, Any], *, where: str = HF_CONFIG) -> GPTConfig:
    """A GPTConfig from a Hugging Face GPT-2 config.json; refuse what gptopt cannot represent exactly.

    Missing keys take GPT2Config's defaults (old config.json files omit the newer flags).
    Dropout is not copied: gptopt's default (0) holds unless the caller overrides it.
    """

    def refuse(reason: str) -> None:
        raise UserError(f"{where}: {reason}; gptopt's GPT-2 cannot represent this model exactly")

    if not isinstance(hf, dict):
        raise UserError(f"{where}: expected a JSON object of settings, got {type(hf).__name__}; "
                         "give the config.json of a Hugging Face GPT-2")
    if hf.get("model_type") != "gpt2":
        refuse(f"model_type is {hf.get('model_type')!r}, not 'gpt2'")
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        refuse(f"activation_function is {act!r}, gptopt uses the tanh GELU ({' / '.join(_GELU_TANH)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag, False):
            refuse(f"{flag} is true")
    if not hf.get("scale_attn_weights", True):
        refuse("scale_attn_weights is false (attention without the 1/sqrt(head_dim) scale)")
    if not hf.get("tie_word_embeddings", True):
        refuse("tie_word_embeddings is false (a separate lm_head), gptopt ties lm_head to wte")
    try:  # GPTConfig checks each value's type and range
        config = GPTConfig(
            n_layer=hf.get("n_layer", 12),
            n_head=hf.get("n_head", 12),
            n_embd=hf.get("n_embd", 768),
            block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),  # n_ctx: very old configs
            vocab_size=hf.get("vocab_size", 50257),
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {e}; the file is damaged or not a GPT-2 config.json") from None
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * config.n_embd:
        refuse(f"n_inner is {n_inner!r}, gptopt's MLP is 4 * n_embd = {4 * config.n_embd} wide")
    return config


# Llama-shaped families transformers names by model_type: rotary, RMSNorm, SwiGLU, grouped-query attention, no
# biases; Qwen3 adds an RMSNorm over each head's queries and keys, and may size its heads apart from the width.
LLAMA_FAMILIES = ("llama", "qwen3")
# A block's weights: transformers' Llama / Qwen3 names -> gptopt's (q, k and v are joined into c_attn apart)
LLAMA_NAMES = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attn.o_proj": "attn.c_proj",
               "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm", "mlp.gate_proj": "mlp.c_gate",
               "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
GPTOPT_NAMES = {v: k for k, v in LLAMA_NAMES.items()}


def config_from_llama(hf: dict[str, Any], *, where: str = HF_CONFIG) -> GPTConfig:
    """A GPTConfig from a Hugging Face Llama or Qwen3 config.json; refuse what gptopt cannot represent exactly."""

    def refuse(reason: str) -> None:
        raise UserError(f"{where}: {reason}; gptopt cannot represent this model exactly")

    kind = hf.get("model_type")
    # a missing size would take transformers' default (Llama 7B's) and build a model nobody asked for
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in hf]
    if missing:
        raise UserError(f"{where}: lacks {', '.join(missing)}; the file is damaged or not a {kind} config.json")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act is {hf.get('hidden_act')!r}, not the SwiGLU's 'silu'")
    # transformers (5.x) takes a rope_scaling that is set in place of rope_parameters, theta and all
    # (PreTrainedConfig.convert_rope_params_to_dict): a config holding both rotates as its rope_scaling says
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{where}: rope_scaling / rope_parameters must be an object, not {rope!r}; fix the file")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(f"rope type {rope.get('rope_type', rope.get('type'))!r} (scaled rotary) is not supported, only plain "
               "rotary positions")
    if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
        refuse("attention_bias or mlp_bias is true; gptopt's Llama-shaped blocks have no biases")
    if kind == "qwen3" and hf.get("use_sliding_window", False):
        refuse("use_sliding_window is true")
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or width // heads
    kv = hf.get("num_key_value_heads") or heads
    try:
        return GPTConfig(
            n_layer=hf["num_hidden_layers"], n_head=heads, n_embd=width,
            n_kv_head=kv if kv != heads else None, head_size=head_dim if head_dim * heads != width else None,
            block_size=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
            layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6), bias=False, positions="rope",
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), norm="rmsnorm", mlp="swiglu",
            intermediate_size=hf.get("intermediate_size", 4 * width), qk_norm=kind == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {e}; the file is damaged or not a {kind} config.json") from None


def llama_state_to_gptopt(state: dict[str, torch.Tensor], config: GPTConfig, *,
                          where: str = "Hugging Face Llama state") -> dict[str, torch.Tensor]:
    """A HF LlamaForCausalLM / Qwen3ForCausalLM state dict as gptopt's GPT(config) keys: q, k and v joined into
    c_attn, gate_proj / up_proj / down_proj as c_gate / c_fc / c_proj, padded vocabulary rows zero. Every key and
    shape is checked (ValueError naming the first bad one)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if key.startswith("model.layers."):
            i, rest = key.removeprefix("model.layers.").split(".", 1)
            part = rest.removesuffix(".weight")
            if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault(int(i), {})[part[-6]] = tensor
                continue
            out[f"transformer.h.{i}.{LLAMA_NAMES.get(part, part)}.weight"] = tensor
        elif key == "model.embed_tokens.weight":
            out["transformer.wte.weight"] = tensor
        elif key == "model.norm.weight":
            out["transformer.ln_f.weight"] = tensor
        elif key == "lm_head.weight":
            if not config.tie_embeddings:
                out["lm_head.weight"] = tensor
        else:
            out[key] = tensor  # unknown: check_state names it
    for i, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise UserError(f"{where}: layer {i} lacks some of q_proj, k_proj, v_proj")
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    with torch.device("meta"):
        ref = GPT(dataclasses.replace(config, vocab_pad_multiple=1))
    check_state({k: v for k, v in ref.state_dict().items() if not config.tie_embeddings or k != "lm_head.weight"},
                out, where)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        if name in out:
            out[name] = _pad_rows(out[name], config.padded_vocab_size)
    return out


def apply_overrides(config: GPTConfig, overrides: dict[str, Any], where: str) -> GPTConfig:
    """The checkpoint's config with run-time settings replaced; shape-defining fields must not change."""
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"unknown model setting(s) {unknown}; overridable: {', '.join(OVERRIDABLE)}")
    for name, value in overrides.items():
        # Repeating the checkpoint's own value is harmless (callers may pass a whole config).
        if name not in OVERRIDABLE and value != getattr(config, name):
            raise UserError(
                f"{where} fixes {name}={getattr(config, name)!r}, it cannot be changed to {value!r}; "
                f"overridable: {', '.join(OVERRIDABLE)}"
            )
    return dataclasses.replace(config, **overrides)


def family(config: GPTConfig) -> str:
    """The transformers model a gptopt config is: "gpt2", "llama" or "qwen3" (ValueError for a mix none is)."""
    if (config.positions, config.norm, config.mlp, config.qk_norm) == ("learned", "layernorm", "gelu", False) \
            and config.kv_heads == config.n_head and config.head_size is None and config.tie_embeddings:
        return "gpt2"
    if (config.positions, config.norm, config.mlp, config.bias) == ("rope", "rmsnorm", "swiglu", False):
        return "qwen3" if config.qk_norm else "llama"
    raise UserError("this model mixes GPT-2's block with Llama's (positions, norm, mlp, biases): no Hugging Face "
                     "model has its shape, so it cannot be exported")


def hf_config(config: GPTConfig, dtype: torch.dtype = torch.float32, *, eot: int | None = None,
              bos: int | None = None, eos: int | list[int] | None = None) -> Any:
    """The transformers config (GPT2Config, LlamaConfig or Qwen3Config) that describes a gptopt model; eot: the
    end-of-text id of its tokenizer (tokenizer.eot_id), written as both bos and eos where bos / eos (a model's
    own: an id, eos a list too) are not given. None leaves them unset."""
    transformers = require("transformers", "hf", "exporting to Hugging Face format")
    bos = eot if bos is None else bos
    eos = eot if eos is None else eos
    for what, i in [("beginning-of-text", bos), *(("end-of-sequence", e) for e in (eos if isinstance(eos, list)
                                                                                      else [eos]))]:
        if i is not None and not 0 <= i < config.vocab_size:
            raise UserError(f"{what} id {i} is outside the model's vocabulary of {config.vocab_size}: "
                             "the tokenizer does not belong to the model")
    kind = family(config)
    if kind != "gpt2":
        make = transformers.Qwen3Config if kind == "qwen3" else transformers.LlamaConfig
        return make(
            vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.mlp_hidden,
            num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
            num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
            max_position_embeddings=config.block_size, rms_norm_eps=config.layer_norm_epsilon,
            rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings, attention_bias=False,
            bos_token_id=bos, eos_token_id=eos,
            architectures=["Qwen3ForCausalLM" if kind == "qwen3" else "LlamaForCausalLM"],
            torch_dtype=str(dtype).removeprefix("torch."),
        )
    return transformers.GPT2Config(
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        n_positions=config.block_size,
        vocab_size=config.vocab_size,
        layer_norm_epsilon=config.layer_norm_epsilon,
        activation_function="gelu_new",
        n_inner=None,
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        architectures=["GPT2LMHeadModel"],
        torch_dtype=str(dtype).removeprefix("torch."),  # accepted by transformers 4.x and 5.x
    )


# ----------------------------------------------------------------------------------------------
# Weights


def _expected_hf_shapes(config: GPTConfig) -> dict[str, torch.Tensor]:
    """Empty tensors with the shapes a HF GPT-2 state for this config has (real vocab, Conv1D layout)."""
    with torch.device("meta"):  # shapes only: no memory, no init time, even for gpt2-xl
        ref = GPT(dataclasses.replace(config, vocab_pad_multiple=1))
    return {
        k: (v.t() if k.endswith(CONV1D) else v) for k, v in ref.state_dict().items() if k != "lm_head.weight"
    }


def _pad_rows(wte: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows up to `rows`: padded ids are never real tokens, zeros keep them inert."""
    if wte.shape[0] == rows:
        return wte
    return torch.cat([wte, wte.new_zeros(rows - wte.shape[0], wte.shape[1])])


def hf_state_to_gptopt(
    state: dict[str, torch.Tensor], config: GPTConfig, *, where: str = "Hugging Face GPT-2 state"
) -> dict[str, torch.Tensor]:
    """A HF GPT-2 state dict (with or without the `transformer.` prefix) as gptopt's GPT(config) keys.

    Every key and shape is checked (ValueError naming the first bad one). lm_head.weight is left
    out: it is tied to wte. Conv1D weights come back as transposed views, not copies, so loading
    a large model does not hold a third copy in memory.
    """
    lm_head = state.get("lm_head.weight")
    hf: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key == "lm_head.weight":
            continue
        name = key if key.startswith("transformer.") else f"transformer.{key}"
        if not _MASK_BUFFER.fullmatch(name):
            hf[name] = tensor
    check_state(_expected_hf_shapes(config), hf, where)
    wte = hf["transformer.wte.weight"]
    if lm_head is not None and not torch.equal(lm_head, wte):
        raise UserError(
            f"{where}: lm_head.weight differs from wte; gptopt ties them, so it cannot load this model"
        )
    out = {k: (v.t() if k.endswith(CONV1D) else v) for k, v in hf.items()}
    out["transformer.wte.weight"] = _pad_rows(wte, config.padded_vocab_size)
    return out


def gptopt_state_to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights as its transformers model's state dict (GPT2LMHeadModel, LlamaForCausalLM or
    Qwen3ForCausalLM): contiguous CPU tensors, real vocab rows only."""
    config = model.config
    if family(config) != "gpt2":
        return _llama_state(model)
    if not config.bias:
        raise UserError(
            "the model has bias=False; Hugging Face GPT-2 always has biases, so it cannot be exported"
        )
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: HF re-ties it from wte on load, and safetensors refuses shared tensors
        tensor = tensor.detach()
        if name == "transformer.wte.weight":
            tensor = tensor[: config.vocab_size]  # padding rows are a gptopt speed detail
        if name.endswith(CONV1D):
            tensor = tensor.t()
        out[name] = tensor.cpu().contiguous()
    return out


def _llama_state(model: GPT) -> dict[str, torch.Tensor]:
    """llama_state_to_gptopt's inverse: c_attn split into q, k and v, the HF names, real vocab rows only."""
    config = model.config
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if name.startswith("transformer.h."):
            i, rest = name.removeprefix("transformer.h.").split(".", 1)
            part = rest.removesuffix(".weight")
            if part == "attn.c_attn":
                for key, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                    out[f"model.layers.{i}.self_attn.{key}.weight"] = t.contiguous()
                continue
            out[f"model.layers.{i}.{GPTOPT_NAMES[part]}.weight"] = tensor.contiguous()
        elif name == "transformer.wte.weight":
            out["model.embed_tokens.weight"] = tensor[: config.vocab_size].contiguous()
        elif name == "transformer.ln_f.weight":
            out["model.norm.weight"] = tensor.contiguous()
        elif name == "lm_head.weight" and not config.tie_embeddings:
            out["lm_head.weight"] = tensor[: config.vocab_size].contiguous()
    return out


def to_hf_model(model: GPT, attn_implementation: str = "eager") -> Any:
    """The transformers model (GPT2LMHeadModel, LlamaForCausalLM or Qwen3ForCausalLM) with the same weights: the
    baseline bench measures against."""
    transformers = require("transformers", "hf", "the Hugging Face baseline")
    make = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
            "qwen3": transformers.Qwen3ForCausalLM}[family(model.config)]
    hf = make._from_config(hf_config(model.config), attn_implementation=attn_implementation)
    missing, unexpected = hf.load_state_dict(gptopt_state_to_hf(model), strict=False)
    # a tied head loads through the embedding; GPT-2's causal-mask buffers are not weights
    leftover = [k for k in missing if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if leftover or unexpected:
        raise UserError(f"weights do not map onto {make.__name__}: missing {leftover[:3]}, "
                         f"unexpected {unexpected[:3]}")
    hf.tie_weights()
    return hf.to(model.transformer.wte.weight.device)


# ----------------------------------------------------------------------------------------------
# Loading


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise UserError(f"{path}: cannot read weights ({e}); the file is truncated or corrupt") from None


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    # weights_only: a .bin is a pickle, and a pickle from the internet can run code when loaded.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{path}: refused to unpickle, the file holds more than tensors ({first}); "
            f"convert it to {SAFETENSORS} with a tool you trust"
        ) from None
    except Exception as e:
        raise UserError(
            f"{path}: cannot read weights ({type(e).__name__}: {e}); the file is truncated or corrupt"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: not a state dict of tensors")
    return state


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of a HF directory: safetensors first, the pickle format only as a fallback."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PT_BIN, PT_BIN_INDEX)):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():  # a sharded checkpoint: the index maps each key to its file
            try:
                weight_map = json.loads((directory / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{directory / index}: not a weight index ({e})") from None
            files = [directory / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UserError(f"{directory}: shard {missing[0]} listed in {index} is missing")
            return files
    raise UserError(
        f"{directory}: {HF_CONFIG} is there but no weights: expected {SAFETENSORS} (or {SAFETENSORS_INDEX} "
        f"with its shards) or {PT_BIN}"
    )


def read_hf_weights(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The raw HF state dict of a directory, read without pickle unless only a .bin is there."""
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(directory)):
        state.update(_read_safetensors(path) if path.suffix == ".safetensors" else _read_bin(path))
    return state


def _build(config: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
    model = GPT(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Shapes and keys were checked already; a tied lm_head loads through wte.
    assert missing == (["lm_head.weight"] if config.tie_embeddings else []) and not unexpected, (missing, unexpected)
    return model


def load_hf_dir(directory: str | os.PathLike[str], **overrides: Any) -> GPT:
    """A GPT from a local Hugging Face GPT-2 directory (config.json + safetensors or pytorch_model.bin)."""
    directory = Path(directory)
    config_path = directory / HF_CONFIG
    if not config_path.is_file():
        raise UserError(
            f"{directory}: not a model directory, {HF_CONFIG} is missing (a Hugging Face GPT-2 directory "
            f"has {HF_CONFIG} and {SAFETENSORS} or {PT_BIN}; a gptopt one has {META} and {SAFETENSORS})"
        )
    try:
        hf = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_path}: corrupt JSON ({e}); the download is damaged, fetch the model again") from None
    if isinstance(hf, dict):  # ids that are no ids are refused now, not skipped where a reply should end
        token_ids(config_path, hf, "bos_token_id", many=False)
        token_ids(config_path, hf, "eos_token_id")
    if isinstance(hf, dict) and hf.get("model_type") in LLAMA_FAMILIES:
        config = apply_overrides(config_from_llama(hf, where=str(config_path)), overrides, str(directory))
        return _build(config, llama_state_to_gptopt(read_hf_weights(directory), config, where=str(directory)))
    config = apply_overrides(config_from_hf(hf, where=str(config_path)), overrides, str(directory))
    state = hf_state_to_gptopt(read_hf_weights(directory), config, where=str(directory))
    return _build(config, state)


def _load_gptopt_dir(directory: Path, overrides: dict[str, Any]) -> GPT:
    model = load_model(directory)
    if not overrides:
        return model
    config = apply_overrides(model.config, overrides, str(directory))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_embeddings}
    # The stored padding may differ from the requested one: keep the real rows, re-pad with zeros.
    for key in ("transformer.wte.weight", "lm_head.weight"):
        if key in state:
            state[key] = _pad_rows(state[key][: config.vocab_size], config.padded_vocab_size)
    return _build(config, state)


# What a hub model's folder gives beside its weights: its config, and how it chats and ends its turns (the
# generation config's eos ids, the chat files), which a model fine-tuned from it carries (hf_files.carried).
# Small files; a repository without one of them simply has none.
HUB_FILES = [HF_CONFIG, GENERATION_CONFIG, *CHAT_FILES]


def hub_folder(name: str, *, fetched: bool = False) -> Path:
    """The local folder of hub model `name` in the HF cache: HUB_FILES and the weights (safetensors; the .bin only
    if there is none), downloaded unless `fetched` (a folder this process fetched already, found without asking the
    Hub again) or HF_HUB_OFFLINE."""
    hub = require("huggingface_hub", "hf", f"downloading {name!r} from the Hugging Face Hub")
    from huggingface_hub import errors

    offline = hub_offline()
    # newer huggingface_hub refuses, offline, a cached snapshot that lacks a file the patterns name
    incomplete = getattr(errors, "IncompleteSnapshotError", ())

    def get(patterns: list[str]) -> Path:
        return Path(hub.snapshot_download(name, allow_patterns=patterns, local_files_only=fetched or offline,
                                          library_name="gptopt"))

    def fetch(weights: list[str]) -> Path:
        try:
            return get(HUB_FILES + weights)
        except incomplete:  # cached by a download of the config and weights alone: it loads, as it did
            return get([HF_CONFIG, *weights])

    try:
        folder = fetch([SAFETENSORS, SAFETENSORS_INDEX, "model-*-of-*.safetensors"])
        if not any((folder / f).is_file() for f in (SAFETENSORS, SAFETENSORS_INDEX)):
            folder = fetch([PT_BIN, PT_BIN_INDEX, "pytorch_model-*-of-*.bin"])
    except Exception as e:  # offline, unreachable, no such repo, gated: one clear message for all
        lines = str(e).strip().splitlines()
        cause = f"{type(e).__name__}: {lines[0] if lines else ''}"
        how = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache; unset HF_HUB_OFFLINE "
            "to download it once"
            if offline
            else "check the name and the network"
        )
        raise UserError(
            f"{name!r} is not a local directory, and fetching it from the Hugging Face Hub failed ({cause}); "
            f"{how}, or give a local model directory"
        ) from None
    return folder


def load_pretrained(name_or_path: str | os.PathLike[str], **overrides: Any) -> GPT:
    """A GPT from a gptopt model directory, a local HF GPT-2 directory, or a hub name (gpt2, ...).

    overrides set run-time fields (attention, dropout, gradient_checkpointing, loss, vocab_pad_multiple);
    the fields the weights fix may only be repeated. The model comes back on the CPU in fp32.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(
                f"{path} is a file, not a model directory; give the directory that holds {HF_CONFIG} "
                f"(Hugging Face) or {META} (gptopt)"
            )
        if is_gptopt_dir(path):
            return _load_gptopt_dir(path, overrides)
        return load_hf_dir(path, **overrides)
    name = str(name_or_path)
    if not _HUB_ID.fullmatch(name) or looks_local(name):
        raise UserError(f"{name}: no such model directory (and not a Hugging Face Hub name like 'gpt2')")
    return load_hf_dir(hub_folder(name), **overrides)


# ----------------------------------------------------------------------------------------------
# Export


def export_hf(model: GPT, directory: str | os.PathLike[str], *, overwrite: bool = False,
              eot: int | None = None, bos: int | None = None, eos: int | list[int] | None = None) -> Path:
    """Write a directory `transformers.GPT2LMHeadModel.from_pretrained` loads: config.json + model.safetensors,
    and with eot (the tokenizer's end-of-text id) or bos / eos generation_config.json.

    eot goes into both files as bos_token_id and eos_token_id (GPT-2 uses <|endoftext|> for both), so
    transformers' generate stops where the model ends a text; a model's own bos / eos (a Llama 3 or Qwen3
    folder's: eos a list, its chat's end of turn among them) take their places. Without any, no ids are
    written: the id is the tokenizer's, and a guessed one would stop generation at an ordinary token.
    Staged (outputs.staged_dir) and marked as gptopt's export: a crash never leaves half a directory.
    overwrite=True replaces only an earlier export of gptopt's that holds nothing else; never a folder
    gptopt did not write (a downloaded model looks just like an export).
    """
    target = Path(directory)
    check_output(target, kind=EXPORT_KIND, overwrite=overwrite, whole=True, flag="export directory")
    state = gptopt_state_to_hf(model)  # refuses what HF cannot hold before anything is written
    hf_cfg = hf_config(model.config, model.transformer.wte.weight.dtype, eot=eot, bos=bos, eos=eos)
    with staged_dir(target, replace=overwrite, kind=EXPORT_KIND) as tmp:
        hf_cfg.to_json_file(str(tmp / HF_CONFIG))
        if hf_cfg.bos_token_id is not None or hf_cfg.eos_token_id is not None:  # the ids only: sampling settings
            generation = require("transformers", "hf", "exporting to Hugging Face format").GenerationConfig(
                bos_token_id=hf_cfg.bos_token_id, eos_token_id=hf_cfg.eos_token_id)  # are the user's
            generation.to_json_file(str(tmp / GENERATION_CONFIG))
        # transformers refuses safetensors files without the "format" metadata.
        save_file(state, str(tmp / SAFETENSORS), metadata={"format": "pt"})
    return target


def peft_adapter(config: GPTConfig, lora: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """LoRA adapters (models.lora, gptopt's names) as peft writes them for this model's Hugging Face family: the
    tensors of adapter_model.safetensors and adapter_config.json. Llama and Qwen3 split c_attn into q_proj, k_proj
    and v_proj: each takes the shared A and its rows of B, which is the same update; GPT-2's Conv1D layers keep
    their names (peft's fan_in_fan_out)."""
    gpt2 = family(config) == "gpt2"
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for key, t in lora.items():
        module, _, which = key.rpartition(".")  # transformer.h.I.attn.c_attn, lora_A
        i, part = module.removeprefix("transformer.h.").split(".", 1)
        if gpt2:
            names = {f"transformer.h.{i}.{part}": t}
        elif part == "attn.c_attn":
            pieces = t.split([q, kv, kv]) if which == "lora_B" else (t, t, t)
            names = {f"model.layers.{i}.self_attn.{p}": x
                     for p, x in zip(("q_proj", "k_proj", "v_proj"), pieces, strict=True)}
        else:
            names = {f"model.layers.{i}.{GPTOPT_NAMES[part]}": t}
        for name, x in names.items():
            tensors[f"base_model.model.{name}.{which}.weight"] = x.detach().cpu().clone()  # q, k, v: one A each
            targets.add(name.rsplit(".", 1)[-1])
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                   "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": gpt2, "target_modules": sorted(targets),
                   "inference_mode": True, "base_model_name_or_path": None}
    return tensors, peft_config
