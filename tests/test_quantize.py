"""Compression transforms and the compressed checkpoint format: pruning patterns, the integers on
disk, loading every method back as generate and serve do, and refusals with the reason.

    pytest -q tests/test_quantize.py

Every model is the debug preset (fp32, CPU); the cuda-marked tests run in .ci/gpu_check.sh.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from gptopt.config import parse_prune
from gptopt.data.tokenizer import TOKENIZER
from gptopt.infer import quantize as q
from gptopt.infer.generator import Generator
from gptopt.infer.load import load_for_inference
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models import checkpoint, hf
from gptopt.models import compressed as fmt
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve
from gptopt.utils.extras import quiet_torchao

CPU = resolve("cpu", quiet=True)
GREEDY = SamplingParams(temperature=0, top_k=None, max_new_tokens=8)
PROMPT = [5, 17, 99, 4, 200, 31, 8]


def write(model: GPT, directory: Path, record: dict[str, Any], tokenizer: Path) -> Path:
    """A compressed checkpoint as gptopt compress writes it (without the report)."""
    directory.mkdir()
    checkpoint.write_model_files(model.config, fmt.pack_state(model, record), directory, {"compression": record})
    (directory / TOKENIZER).write_bytes(tokenizer.read_bytes())
    return directory


@pytest.fixture
def tokenizer_file(train_data: Path) -> Path:
    return train_data / TOKENIZER


# ----------------------------------------------------------------------------------------------
# Pruning


def test_2_4_mask_keeps_the_two_largest_magnitudes_of_every_group_of_four() -> None:
    w = torch.randn(16, 32)
    mask = q.mask_2_4(w)
    groups, kept = w.abs().view(-1, 4), mask.view(-1, 4)
    assert (kept.sum(-1) == 2).all()
    # Every kept magnitude is at least every dropped one in its group.
    smallest_kept = groups.masked_fill(~kept, float("inf")).amin(-1)
    largest_dropped = groups.masked_fill(kept, -1.0).amax(-1)
    assert (smallest_kept >= largest_dropped).all()
    assert q.mask_2_4(-w).equal(mask)  # magnitude, not sign
    assert q.mask_2_4(torch.zeros(2, 8)).view(-1, 4).tolist() == [[True, True, False, False]] * 4  # ties: lower index
    with pytest.raises(ValueError, match="divisible by 4"):
        q.mask_2_4(torch.randn(4, 6))


def test_2_4_pruning_holds_the_pattern_in_every_block_linear_and_leaves_no_hooks(debug_model: GPT) -> None:
    keys = set(debug_model.state_dict())
    wte = debug_model.transformer.wte.weight.clone()
    q.prune_2_4(debug_model)
    assert set(debug_model.state_dict()) == keys  # no weight_orig / weight_mask left behind
    layers = fmt.block_linears(debug_model)
    assert len(layers) == 4 * debug_model.config.n_layer
    for layer in layers.values():
        assert ((layer.weight.view(-1, 4) != 0).sum(-1) == 2).all()
        assert not layer._forward_pre_hooks
    assert debug_model.transformer.wte.weight.equal(wte)  # the tied embedding / lm_head is not pruned


def test_magnitude_pruning_zeros_the_smallest_share_of_each_layer(debug_model: GPT) -> None:
    before = {n: m.weight.detach().clone() for n, m in fmt.block_linears(debug_model).items()}
    q.prune_magnitude(debug_model, 0.3)
    for name, layer in fmt.block_linears(debug_model).items():
        w, old = layer.weight.detach(), before[name]
        zero = w == 0
        assert zero.sum().item() == round(0.3 * w.numel())
        assert old[~zero].abs().min() >= old[zero].abs().max()  # the smallest went, the rest are unchanged
        assert w[~zero].equal(old[~zero])


@pytest.mark.parametrize("spec", ["0", "1", "1.5", "-0.2", "nan", "half", "2:8"])
def test_prune_must_be_a_fraction_in_the_open_unit_interval_or_2_4(spec: str) -> None:
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\)"):
        parse_prune(spec)
    assert parse_prune("0.5") == 0.5 and parse_prune("2:4") == "2:4"


# ----------------------------------------------------------------------------------------------
# Integers


def test_int8_per_channel_is_within_half_a_step_and_idempotent() -> None:
    w = torch.randn(8, 32)
    w[3] = 0  # a pruned-away row keeps a finite scale
    ints, scale = fmt.int8_per_channel(w)
    assert ints.dtype == torch.int8 and ints.abs().max() == 127 and torch.isfinite(scale).all()
    back = ints.float() * scale[:, None]
    assert ((back - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    again, scale2 = fmt.int8_per_channel(back)
    assert again.equal(ints) and torch.allclose(scale2, scale, rtol=1e-6)


def test_int4_groups_pack_two_per_byte_and_stay_within_half_a_step() -> None:
    w = torch.randn(6, 128)
    ints, scale, lo = fmt.int4_groupwise(w, 32)
    assert ints.max() <= 15 and scale.shape == lo.shape == (6, 4)
    packed = fmt.pack_int4(ints)
    assert packed.shape == (6, 64) and packed.dtype == torch.uint8 and fmt.unpack_int4(packed).equal(ints)
    back = lo.repeat_interleave(32, 1) + ints.float() * scale.repeat_interleave(32, 1)
    assert ((back - w).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all()


def test_packed_state_holds_integers_and_dequantises_onto_the_grid(debug_model: GPT) -> None:
    record = q.compress_model(debug_model, "int8-dynamic", None)
    state = fmt.pack_state(debug_model, record)
    assert state["transformer.h.0.mlp.c_fc.weight"].dtype == torch.int8
    assert state["transformer.wte.weight"].dtype == torch.int8  # lm_head's integers, through the tie
    assert "lm_head.weight" not in state and state["transformer.h.0.ln_1.weight"].dtype == torch.float32
    fp = fmt.unpack_state(state, record, "test")
    assert set(fp) == {k for k in debug_model.state_dict() if k != "lm_head.weight"}
    w = debug_model.transformer.h[0].mlp.c_fc.weight
    ints, scale = fmt.int8_per_channel(w)
    assert fp["transformer.h.0.mlp.c_fc.weight"].equal(ints.float() * scale[:, None])


# ----------------------------------------------------------------------------------------------
# Loading each method back, as generate and serve do


def _dequantised(directory: Path) -> GPT:
    return hf.load_pretrained(directory).eval()  # the plain fp32 GPT on the stored grid


@pytest.mark.parametrize(("method", "prune"), [("int8-dynamic", None), ("int8-weight", None), (None, 0.5),
                                               ("int8-dynamic", 0.5), (None, "2:4"), ("int4-weight", None)])
def test_every_method_writes_a_checkpoint_that_loads_and_generates(
        varied_model: GPT, tokenizer_file: Path, tmp_path: Path, method: str | None, prune: float | str | None,
        caplog: pytest.LogCaptureFixture) -> None:
    if method in ("int8-weight",):
        pytest.importorskip("torchao")
    record = q.compress_model(varied_model, method, prune)
    directory = write(varied_model, tmp_path / "c", record, tokenizer_file)
    assert json.loads((directory / checkpoint.META).read_text())["compression"]["quantize"] == method
    with caplog.at_level("WARNING", logger="gptopt"):
        model, tok = load_for_inference(str(directory), tokenizer=None, plan=CPU, dtype="fp32")
    assert tok.get_vocab_size() == varied_model.config.vocab_size
    out = generate(Generator(model, CPU), [PROMPT], GREEDY)[0]
    assert len(out) == GREEDY.max_new_tokens
    with torch.no_grad():
        x = torch.tensor([PROMPT])
        ref = _dequantised(directory)(x)
        diff = (model(x) - ref).abs().max().item() / ref.abs().max().item()
    # int8-dynamic rounds the activations too (per tensor, 7 bits on fbgemm: coarse on these wide random
    # weights); the other paths compute with exactly the stored weights.
    assert diff < (0.15 if method == "int8-dynamic" else 1e-5)
    if method == "int8-dynamic":
        assert type(model.transformer.h[0].attn.c_attn).__name__ == "Linear" and \
            type(model.transformer.h[0].attn.c_attn).__module__.startswith("torch.ao")
        assert model.lm_head is not model.transformer.wte  # the head is quantised, the embedding stays fp32
    if method == "int8-weight":
        assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    if prune == "2:4" or method == "int4-weight":
        assert "no speed gain" in caplog.text or "no int4 speed" in caplog.text


def test_int8_checkpoint_is_smaller_on_disk(varied_model: GPT, tokenizer_file: Path, tmp_path: Path) -> None:
    plain = checkpoint.save_model(varied_model, tmp_path / "plain")
    record = q.compress_model(varied_model, "int8-weight", None)
    small = write(varied_model, tmp_path / "int8", record, tokenizer_file)
    ratio = (small / checkpoint.WEIGHTS).stat().st_size / (plain / checkpoint.WEIGHTS).stat().st_size
    assert ratio < 0.35  # int8 and fp32 scales instead of fp32 everywhere but LayerNorm, biases, wpe


def test_quantize_flag_on_a_compressed_checkpoint_and_a_newer_format_are_refused(
        varied_model: GPT, tokenizer_file: Path, tmp_path: Path) -> None:
    directory = write(varied_model, tmp_path / "c", q.compress_model(varied_model, "int8-dynamic", None),
                      tokenizer_file)
    with pytest.raises(ValueError, match="already compressed .*drop --quantize"):
        load_for_inference(str(directory), tokenizer=None, plan=CPU, quantize="int8-weight")
    with pytest.raises(ValueError, match="fp32 activations"):
        load_for_inference(str(directory), tokenizer=None, plan=CPU, dtype="bf16")
    meta = json.loads((directory / checkpoint.META).read_text())
    meta["compression"]["format"] = fmt.FORMAT + 1
    (directory / checkpoint.META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="newer gptopt"):
        load_for_inference(str(directory), tokenizer=None, plan=CPU)


@pytest.mark.parametrize(("method", "prune", "message"), [
    ("int4-weight", None, "int4-weight needs an NVIDIA GPU of compute capability 8.0"),
    (None, "2:4", "2:4 needs an NVIDIA GPU .* no speed gain; use --prune FRACTION"),
    ("int8-dynamic", "2:4", "not supported"),
    ("int3", None, "unknown --quantize"),
])
def test_what_a_cpu_cannot_run_is_refused_with_the_reason(method: str, prune: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        q.check_supported(method, prune, CPU)


def test_int4_on_an_sm80_gpu_needs_bf16_weights_and_is_refused_before_loading(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # One rule for compress, generate, serve and bench: the device, then the dtype tinygemm takes.
    assert "int4-weight needs an NVIDIA GPU of compute capability 8.0" in q.int4_unsupported(CPU, torch.bfloat16, "x")
    monkeypatch.setattr(q, "_sm80", lambda plan: True)  # as on an A100 / H100
    assert q.int4_unsupported(CPU, torch.bfloat16, "x") is None and q.int4_unsupported(CPU, None, "x") is None
    assert q.int4_unsupported(CPU, torch.float16, "x") == ("int4-weight runs bf16 weights (torchao's tinygemm "
                                                            "kernel), not float16; use --dtype auto or bf16")
    # the dtype is checked before --model is even looked at (it does not exist here)
    with pytest.raises(ValueError, match="runs bf16 weights .*not float32; use --dtype auto or bf16"):
        load_for_inference(str(tmp_path / "nothing"), tokenizer=None, plan=CPU, dtype="fp32", quantize="int4-weight")


# ----------------------------------------------------------------------------------------------
# GPU paths (.ci/gpu_check.sh)


@pytest.mark.cuda
@pytest.mark.parametrize(("method", "prune"), [("int8-weight", None), ("int8-dynamic", None),
                                               ("int4-weight", None), (None, "2:4")])
def test_gpu_methods_load_and_match_the_dequantised_model(
        tokenizer_file: Path, tmp_path: Path, method: str | None, prune: str | None) -> None:
    pytest.importorskip("torchao")
    gpu = resolve("cuda", quiet=True)
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("int4 and 2:4 kernels need compute capability 8.0+")
    torch.manual_seed(0)
    from gptopt.config import preset

    model = GPT(preset("tiny", vocab_size=320)).eval()  # widths the sparse and int4 kernels take
    directory = write(model, tmp_path / "c", q.compress_model(model, method, prune), tokenizer_file)
    loaded, _ = load_for_inference(str(directory), tokenizer=None, plan=gpu)
    if prune == "2:4":
        assert type(loaded.transformer.h[0].mlp.c_fc.weight).__name__.startswith("SparseSemiStructuredTensor")
    ref = _dequantised(directory).to("cuda", torch.bfloat16)
    x = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        want = ref(x).float()
        assert (loaded(x).float() - want).abs().max().item() <= 0.05 * want.abs().max().item()
    assert len(generate(Generator(loaded, gpu), [PROMPT], GREEDY)[0]) == GREEDY.max_new_tokens


@pytest.mark.cuda
def test_int4_on_the_fly_runs_tinygemm_on_an_int4_grid_of_the_weights_compiled_too() -> None:
    # generate / serve / bench --quantize int4-weight: prepare quantises the bf16 block Linears itself
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torchao's int4 kernel needs compute capability 8.0+")
    from gptopt.config import preset
    from gptopt.infer.load import optimize_for_inference

    gpu = resolve("cuda", quiet=True)
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=320)).eval()
    original = {n: m.weight.detach().to("cuda", torch.bfloat16).float() for n, m in fmt.block_linears(model).items()}
    int4 = optimize_for_inference(model, gpu, dtype=torch.bfloat16, quantize="int4-weight")
    g = fmt.int4_group_size(int4)
    assert int4.lm_head.weight is int4.transformer.wte.weight and int4.lm_head.weight.dtype == torch.bfloat16
    for name, layer in fmt.block_linears(int4).items():
        assert type(layer.weight).__name__ == "Int4TilePackedTo4dTensor", name
        eye = torch.eye(layer.in_features, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # x = I gives back the weights the kernel multiplies by, (out, in)
            ran = torch.nn.functional.linear(eye, layer.weight).float().T
        w = original[name].view(layer.out_features, -1, g)
        step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
        # within a step of rounding (bf16 scales and zeros move it a little past half), on at most 16 levels a group
        assert ((ran.view_as(w) - w).abs() <= 0.75 * step).all(), name
        levels = ran.reshape(-1, g).sort(-1).values
        assert (1 + (levels[:, 1:] != levels[:, :-1]).sum(-1)).max().item() <= 16, name
    for compile_ in (False, True):  # the compiled decode (CUDA graphs) is what bench's int4 rung runs
        tokens = generate(Generator(int4, gpu, compile=compile_), [PROMPT], GREEDY)[0]
        assert len(tokens) == GREEDY.max_new_tokens, compile_


def test_module_swap_keeps_every_other_parameter(varied_model: GPT, tokenizer_file: Path, tmp_path: Path) -> None:
    directory = write(varied_model, tmp_path / "c", q.compress_model(varied_model, "int8-dynamic", None),
                      tokenizer_file)
    model, _ = load_for_inference(str(directory), tokenizer=None, plan=CPU)
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert not plain  # every Linear, lm_head included, runs int8
    ref = _dequantised(directory)
    assert model.transformer.wte.weight.equal(ref.transformer.wte.weight)
    assert model.transformer.h[1].ln_2.weight.equal(ref.transformer.h[1].ln_2.weight)


@pytest.mark.parametrize("method", ["int8-weight", "int8-dynamic"])
def test_quantising_leaves_inductors_settings_for_the_rest_of_the_process(
        varied_model: GPT, tokenizer_file: Path, tmp_path: Path, method: str) -> None:
    """torchao would switch on coordinate-descent tuning process-wide: every later compile (bench's
    next rungs, say) would tune each kernel and compare differently compiled code."""
    pytest.importorskip("torchao")
    import copy

    from torch._inductor import config as inductor

    from gptopt.infer.load import optimize_for_inference

    before = (inductor.coordinate_descent_tuning, inductor.coordinate_descent_check_all_directions)
    optimize_for_inference(copy.deepcopy(varied_model), CPU, dtype=torch.float32, quantize="int8-weight")
    directory = write(varied_model, tmp_path / "c", q.compress_model(copy.deepcopy(varied_model), method, None),
                      tokenizer_file)
    load_for_inference(str(directory), tokenizer=None, plan=CPU)
    assert (inductor.coordinate_descent_tuning, inductor.coordinate_descent_check_all_directions) == before


@pytest.mark.parametrize("command", ["generate", "export"])
def test_torchaos_import_noise_is_not_printed_and_its_other_records_are(
        command: str, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """gptopt generate --quantize int8-weight and export --format hf import torchao (the latter through
    transformers): neither torchao's messages about its compiled kernels that do not load here nor torch's
    deprecation of how torchao registers its enums reach stderr (they read like errors, and are none). Only those:
    another record of the same loggers still passes."""
    if importlib.util.find_spec("torchao") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("needs torchao and transformers (the quant and hf extras)")
    args = {"generate": ["--device", "cpu", "--quantize", "int8-weight", "--max_new_tokens", "2", "hi"],
            "export": ["--format", "hf", "--output_dir", str(tmp_path / "hf")]}[command]
    run = subprocess.run([sys.executable, "-m", "gptopt", command, "--model", str(model_dir), *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for noise in ("Failed to load", "_C", ".so", "Enum subclass", "_pytree", "register_constant"):
        assert noise not in run.stderr, run.stderr

    quiet_torchao()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load what the user asked for")
        logging.getLogger("torch.utils._pytree").warning("%s is an Enum subclass ...", logging.Logger)
    assert [r.getMessage() for r in caplog.records] == ["Failed to load what the user asked for",
                                                        "<class 'logging.Logger'> is an Enum subclass ..."]
