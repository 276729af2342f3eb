"""Memory is estimated before it is allocated: the estimate against a measured peak, what the device
has free (cgroup, ulimit), and train / profile / serve refusing a run that cannot fit with exit 2.

    pytest -q tests/test_memory.py

Nothing here allocates more than a few hundred MiB: absurd runs are refused before they allocate.
"""

from __future__ import annotations

import dataclasses
import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptopt import cli
from gptopt.config import TrainConfig, preset
from gptopt.infer import generator_memory, paged_attention
from gptopt.infer.generator import Generator
from gptopt.infer.generator_memory import inference_bytes
from gptopt.models import flops
from gptopt.models.gpt import GPT
from gptopt.runtime import memory_check
from gptopt.runtime.device import resolve
from gptopt.runtime.memory_check import Estimate
from gptopt.train import step_memory
from gptopt.train.step_memory import train_step_bytes
from gptopt.utils.errors import UserError

ABSURD = 10_000_000  # sequences: terabytes for any preset
BIG = 4096  # within every static limit (config.MAX_BATCH, MAX_SLOTS): only the memory check refuses it
SMALL_RAM = 64 * 2**20  # what the command tests pretend is free, so that BIG cannot fit


@pytest.mark.parametrize("name,overrides", [("debug", {}), ("tiny", {"vocab_pad_multiple": 64}),
                                            ("gpt2", {"bias": False}), ("gpt2-xl", {})])
def test_param_count_is_the_models(name: str, overrides: dict[str, object]) -> None:
    cfg = preset(name, **overrides)
    with torch.device("meta"):  # no memory: only the shapes
        model = GPT(cfg)
    assert flops.param_count(cfg) == model.num_params()


# A script's lines that sample its process's resident memory every millisecond from there on, into peak[0]
# (rss0: the memory then), until done is set; the scripts below start them where what they measure begins.
SAMPLE_RSS = """
proc = psutil.Process()
rss0 = proc.memory_info().rss
peak, done = [rss0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.001)
sampler = threading.Thread(target=sample)
sampler.start()
"""

# A fresh process, its resident memory sampled every millisecond while it takes two steps (so that AdamW's
# state exists at the second one's peak): the step's growth over the memory before it, with no earlier
# test's memory in the way. Not ru_maxrss: importing torch can peak above the step and hide it.
MEASURE = """
import json, sys, threading, time, psutil, torch
from gptopt.config import TrainConfig, preset
from gptopt.runtime.device import resolve
from gptopt.models.gpt import GPT
from gptopt.train.step import TrainStep
B, T, amp, attention, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
cfg = preset("tiny", attention=attention, gradient_checkpointing=ckpt, vocab_pad_multiple=64)
plan = resolve("cpu", amp, quiet=True)
model = GPT(cfg).train()
step = TrainStep(model, model, plan, TrainConfig(preset="tiny"))
x = torch.randint(0, cfg.vocab_size, (B, T))
""" + SAMPLE_RSS + """for i in range(2):
    step(i, lambda micro: (x, x))
done.set()
sampler.join()
print(json.dumps(peak[0] - rss0))
"""


@pytest.mark.parametrize("B,T,amp,attention,ckpt", [(8, 128, "fp32", "eager", False), (8, 128, "bf16", "sdpa", True)])
def test_the_estimate_is_within_a_small_factor_of_the_measured_peak(
    B: int, T: int, amp: str, attention: str, ckpt: bool
) -> None:
    env = {"PYTHONPATH": str(Path(memory_check.__file__).parents[2]), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(B), str(T), amp, attention, str(int(ckpt))],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    grown = json.loads(out.splitlines()[-1])
    cfg = preset("tiny", attention=attention, gradient_checkpointing=ckpt, vocab_pad_multiple=64)
    dtype = torch.bfloat16 if amp == "bf16" else None
    est = train_step_bytes(cfg, B, T, amp_dtype=dtype).without("weights")  # the model was built before rss0
    # an upper-ish bound: not far below what the step took (the refusal keeps a tenth in hand), nor far above
    assert 0.8 * grown <= est.total <= 3 * grown, (est.describe(), grown)


# The families at sizes a test runs quickly: GPT-2's block (tiny), Llama's (llama-tiny: grouped-query attention,
# SwiGLU, RMSNorm, rotary) and Qwen3-0.6B's own block (heads sized apart from the width, QK-norm), two layers of it
FAMILIES = {"gpt2": preset("tiny", vocab_size=512, block_size=512),
            "llama": preset("llama-tiny", vocab_size=512, block_size=512),
            "qwen3": dataclasses.replace(preset("qwen3-0.6b"), n_layer=2, vocab_size=512, block_size=512)}


def _saved_activations(model: GPT, x: torch.Tensor, amp: torch.dtype | None) -> int:
    """The bytes a training forward saves for backward, but the weights, their autocast copies and the loss's
    (log-softmax) rows: what train_step_bytes counts as activations and attention scores."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {p.numel() for p in model.parameters() if p.dim() == 2}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        copy = amp is not None and t.dtype == amp and t.dim() == 2 and t.numel() in sizes
        rows = t.dim() >= 2 and t.shape[-1] in (model.config.vocab_size, model.config.padded_vocab_size)
        if storage.data_ptr() not in weights and not copy and not rows:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        model(x, x)
    return sum(kept.values())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_training_estimate_of_each_family_is_within_15_percent_of_what_its_step_saves(
        family: str, attention: str, amp: torch.dtype | None) -> None:
    """What a step keeps for backward follows the model's real shapes: the MLP's width (SwiGLU's four tensors of
    it), the heads' width apart from the model's, grouped-query attention's repeated keys and values, QK-norm,
    RMSNorm. A GPT-2-shaped count put Qwen3-0.6B's at about half."""
    config = dataclasses.replace(FAMILIES[family], attention=attention)
    torch.manual_seed(0)
    model = GPT(config)
    B, T = 2, 48
    est = train_step_bytes(config, B, T, amp_dtype=amp)
    backward_scores = 3 * 4 * B * config.n_head * T * T if attention == "eager" else 0  # not saved: backward's own
    counted = est.parts["activations"] + est.parts["attention scores"] - backward_scores
    real = _saved_activations(model, torch.randint(0, config.vocab_size, (B, T)), amp)
    assert 0.85 * real <= counted <= 1.15 * real, (counted, real)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_plan_of_each_family_is_the_pool_a_generator_allocates_and_within_15_percent_of_its_forwards(
        family: str, attention: str, dtype: torch.dtype) -> None:
    """The pool exactly; the largest forwards within 15% of the tensors they allocate at their peak: a prefill
    chunk of several rows, one at the end of a long prompt (every row reads its blocks to that one's length),
    and a decode step of every row, one of them max_len long."""
    from conftest import LiveBytes

    config = dataclasses.replace(FAMILIES[family], attention=attention)
    torch.manual_seed(0)
    model = GPT(config).eval().to(dtype)
    rows, T, chunk, bs = 4, 128, 32, 16
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=rows, max_len=T, kv_blocks=rows * T // bs,
                    block_size=bs)
    assert gen.cache.nbytes() == generator_memory.pool_bytes(config, gen.num_blocks, bs, dtype)
    slots = [gen.alloc() for _ in range(rows)]
    width = chunk // rows
    with torch.no_grad():
        gen.prefill(slots[0], list(range(1, T - width)))
        for slot in slots[1:]:
            gen.prefill(slot, [1, 2])
        with LiveBytes() as prefill:
            gen.extend(slots, [[3] * width] * rows, [T - width - 1] + [2] * (rows - 1))
        with LiveBytes() as decode:
            gen.decode(slots, [1] * rows, [T - 1] + [2 + width] * (rows - 1))
    planned = generator_memory.prefill_bytes(config, chunk, T, rows=rows, dtype=dtype)
    assert 0.85 * prefill.peak <= planned <= 1.15 * prefill.peak, (planned, prefill.peak)
    # on a CPU the decode's attention reads the blocks in place where the kernel is built (paged_attention.py)
    in_place = paged_attention.kernel() is not None
    planned = generator_memory.decode_bytes(config, rows, T, dtype=dtype, in_place=in_place)
    assert 0.85 * decode.peak <= planned <= 1.15 * decode.peak, (planned, decode.peak, in_place)


def test_each_suggested_fix_makes_the_step_smaller() -> None:
    cfg = preset("tiny", vocab_pad_multiple=64, attention="eager")
    base = train_step_bytes(cfg, 64, 256).total
    assert train_step_bytes(cfg, 32, 256).total < 0.6 * base  # half the micro-batch (accumulation keeps the global)
    ckpt = preset("tiny", vocab_pad_multiple=64, attention="eager", gradient_checkpointing=True)
    assert train_step_bytes(ckpt, 64, 256).total < base
    assert train_step_bytes(cfg, 64, 128).total < 0.6 * base
    assert train_step_bytes(cfg, 64, 256, amp_dtype=torch.bfloat16).total < base
    # the eager path's T x T scores are what SDPA does not keep
    sdpa = preset("tiny", vocab_pad_multiple=64, attention="sdpa")
    assert train_step_bytes(sdpa, 64, 256).parts["attention scores"] == 0 < train_step_bytes(cfg, 64, 256).parts[
        "attention scores"]
    fix = step_memory.train_fix(TrainConfig(batch_size=64, gradient_accumulation_steps=2), 256)
    assert "--batch_size 32 --gradient_accumulation_steps 4" in fix and "--gradient_checkpointing" in fix
    assert "--seq_len 128" in fix


def test_fsdp_shards_and_cpu_offload_take_the_state_off_the_device() -> None:
    cfg = preset("gpt2")
    one = step_memory.for_training(cfg, TrainConfig(batch_size=1), 1024, torch.bfloat16)
    eight = step_memory.for_training(cfg, TrainConfig(batch_size=1, fsdp=True), 1024, torch.bfloat16, world_size=8)
    assert eight.parts["AdamW state"] * 8 == pytest.approx(one.parts["AdamW state"], abs=8)
    off = step_memory.for_training(cfg, TrainConfig(batch_size=1, fsdp=True, cpu_offload=True), 1024, torch.bfloat16)
    assert "weights" not in off.parts and "AdamW state" not in off.parts and off.parts["activations"] > 0


def test_inference_counts_the_kv_cache_per_slot() -> None:
    cfg = preset("gpt2")
    one = inference_bytes(cfg, 1, 1024, dtype=torch.bfloat16)
    eight = inference_bytes(cfg, 8, 1024, dtype=torch.bfloat16)
    # 2 (k, v) x 12 layers x 1024 positions x 768 x 2 bytes per slot
    assert one.parts["KV cache"] == 2 * 12 * 1024 * 768 * 2
    assert eight.parts["KV cache"] == 8 * one.parts["KV cache"]
    assert one.parts["weights"] == flops.param_count(cfg) * 2


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b"])
def test_the_pool_estimate_is_the_generators_cache_of_the_key_value_heads(name: str) -> None:
    """Grouped-query attention caches its key/value heads only (SmolLM2: 3 of 9), each head_dim wide (Qwen3: not
    the width over the heads), in blocks and the null block: what serve budgets is what the Generator allocates."""
    from gptopt.infer.kv_cache import PagedKVCache

    cfg = preset(name)
    cache = PagedKVCache(cfg, 64 + 1, 16, device="meta", dtype=torch.bfloat16)
    assert generator_memory.pool_bytes(cfg, 64, 16, torch.bfloat16) == cache.nbytes()
    assert generator_memory.kv_bytes_per_token(cfg, torch.bfloat16) * 16 * 65 == cache.nbytes()


# -- what the device has free ------------------------------------------------------------------


def _cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **files: str) -> None:
    for name, text in files.items():
        (tmp_path / name.replace("_", ".", 1)).write_text(text)
    monkeypatch.setattr(memory_check, "CGROUP_V2", tmp_path)
    monkeypatch.setattr(memory_check, "CGROUP_V1", tmp_path / "v1")


def test_a_cgroup_v2_limit_bounds_what_is_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cgroup(tmp_path, monkeypatch, memory_max=f"{2**30}\n", memory_current=f"{600 * 2**20}\n",
            memory_stat=f"anon 1\ninactive_file {100 * 2**20}\n")
    assert memory_check.cgroup_free() == (2**30 - 500 * 2**20, 2**30)  # the page cache is reclaimed before a kill
    free, source = memory_check.available_bytes(torch.device("cpu"))  # the machine itself has more than that free
    assert free == 2**30 - 500 * 2**20 and "left under the container's 1.00 GiB memory limit" == source


def test_no_cgroup_limit_leaves_ram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cgroup(tmp_path, monkeypatch, memory_max="max\n")
    assert memory_check.cgroup_free() is None
    (tmp_path / "v1").mkdir()
    (tmp_path / "memory.max").unlink()
    (tmp_path / "v1" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory_check.cgroup_free() is None
    (tmp_path / "v1" / "memory.limit_in_bytes").write_text(f"{4 * 2**30}\n")
    (tmp_path / "v1" / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    assert memory_check.cgroup_free() == (3 * 2**30, 4 * 2**30)


def test_an_address_space_limit_bounds_what_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    vms = psutil.Process().memory_info().vms
    monkeypatch.setattr(memory_check.resource, "getrlimit", lambda which: (vms + 2**30, resource.RLIM_INFINITY))
    free, source = memory_check.available_bytes(torch.device("cpu"))
    assert free <= 2**30 and "ulimit -v" in source


# -- the check --------------------------------------------------------------------------------


def test_default_sizes_pass_and_an_absurd_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    # bench's and train's CPU default: tiny at 256 tokens x 16, eager attention, either precision
    tiny = preset("tiny", vocab_pad_multiple=64, attention="eager")
    for dtype in (None, torch.bfloat16):
        assert memory_check.shortfall(train_step_bytes(tiny, 16, 256, amp_dtype=dtype), cpu) is None
    # the GPU default, gpt2 at 1024 x 16 in bf16, fits an 80 GB card and a 40 GB one with room to spare
    gpt2 = preset("gpt2", vocab_pad_multiple=64)
    for gb in (80, 40):
        monkeypatch.setattr(memory_check, "available_bytes", lambda device, gb=gb: (gb * 10**9, "free on cuda:0"))
        assert memory_check.shortfall(train_step_bytes(gpt2, 16, 1024, amp_dtype=torch.bfloat16), cpu) is None
    # serving gpt2 with 8 slots of 1024 tokens
    assert memory_check.shortfall(inference_bytes(gpt2, 8, 1024, dtype=torch.bfloat16), cpu) is None
    short = memory_check.shortfall(train_step_bytes(tiny, ABSURD, 256), cpu)
    assert short is not None and "free on cuda:0" in short and "GiB" in short
    with pytest.raises(ValueError, match=r"will not fit in memory: it needs about .* GiB .* but 37 GiB is free on "
                                         r"cuda:0; use --batch_size"):
        memory_check.require(train_step_bytes(tiny, ABSURD, 256), cpu, "a step", "use --batch_size 1")


def test_the_refusal_names_the_largest_parts() -> None:
    est = Estimate({"activations": 3 * 2**30, "logits": 2**30, "batch": 1})
    assert est.total == 4 * 2**30 + 1
    assert est.describe() == "4.00 GiB (activations 3.00 GiB, logits 1.00 GiB)"
    assert "activations" not in est.without("activations").parts


# -- the commands refuse before they allocate -------------------------------------------------


def test_train_refuses_a_batch_that_cannot_fit_with_the_fixes(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (SMALL_RAM, "available RAM"))
    args = ["train", "--preset", "debug", "--data_dir", str(train_data), "--output_dir", str(tmp_path / "o"),
            "--device", "cpu", "--max_steps", "1", "--batch_size", str(BIG), "--no-tensorboard"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([line for line in err.splitlines() if "error:" in line]) == 1
    assert f"gptopt train: error: a training step of micro-batch {BIG} x 64 tokens will not fit in memory" in err
    assert "available RAM" in err and "--gradient_checkpointing" in err and "--seq_len 32" in err
    # the largest micro-batch that fits, at the same global batch
    b, accum = map(int, re.search(r"--batch_size (\d+) --gradient_accumulation_steps (\d+)", err).groups())
    assert b * accum == BIG and 1 <= b < BIG
    # nothing trained, nothing left: the folder the run made for itself goes; one the user made stays, empty
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    assert cli.main(args) == 2 and list((tmp_path / "o").iterdir()) == []


def test_the_refusal_names_the_largest_micro_batch_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = preset("debug", vocab_pad_multiple=64)
    train = TrainConfig(batch_size=16, gradient_accumulation_steps=2)

    def at(b: int) -> Estimate:
        return step_memory.for_training(cfg, train, 64, None, batch_size=b)

    free = int(at(5).total / memory_check.REFUSE_ABOVE) + 2  # 5 fits, 6 does not: 4 is the largest that divides 32
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (free, "test RAM"))
    assert memory_check.largest_batch(at, torch.device("cpu"), 15) == 5
    with pytest.raises(ValueError, match=r"use --batch_size 4 --gradient_accumulation_steps 8 "
                                         r"\(the same global batch\), "
                                         r"or --gradient_checkpointing, or --seq_len 32$"):
        step_memory.require_training(at, torch.device("cpu"), train, 64)
    # not even one sequence fits: the batch is not the fix
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (1, "test RAM"))
    with pytest.raises(ValueError, match=r"; use --gradient_checkpointing, or --seq_len 32$"):
        step_memory.require_training(at, torch.device("cpu"), train, 64)


def test_auto_batch_size_skips_sizes_the_estimate_rules_out(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gptopt.train import auto_batch

    tried: list[int] = []
    real = auto_batch.find_batch_size

    def spy(try_batch, global_batch, largest, fits=None):  # type: ignore[no-untyped-def]
        return real(lambda b: (tried.append(b), try_batch(b))[1], global_batch, largest, fits)

    monkeypatch.setattr(auto_batch, "find_batch_size", spy)
    # the free memory fits micro-batch 4 of the debug model at 64 tokens, not 8
    cfg = preset("debug", vocab_size=320, vocab_pad_multiple=64, attention="eager")  # train_data's vocabulary
    four = step_memory.for_training(cfg, TrainConfig(batch_size=4), 64, None).without("weights").total
    free = int(1.2 * four / memory_check.REFUSE_ABOVE)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (free, "test RAM"))
    args = ["train", "--preset", "debug", "--data_dir", str(train_data), "--output_dir", str(tmp_path / "o"),
            "--device", "cpu", "--max_steps", "1", "--batch_size", "16", "--auto_batch_size", "--attention", "eager",
            "--eval_interval", "0", "--no-tensorboard", "--sample_tokens", "0"]
    assert cli.main(args) == 0
    assert tried == [4]  # 16 and 8 were never allocated
    run = json.loads((tmp_path / "o" / "run.json").read_text())
    assert run["config"]["batch_size"] == 4 and run["config"]["gradient_accumulation_steps"] == 4


def test_profile_refuses_before_it_allocates(train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (SMALL_RAM, "available RAM"))
    for mode in ("train", "generate"):
        args = ["profile", "--preset", "debug", "--mode", mode, "--batch_size", str(BIG), "--device", "cpu",
                "--data_dir", str(train_data), "--output_dir", str(tmp_path / mode)]
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert f"profiling {mode} steps at batch {BIG} x 64 tokens will not fit in memory" in err
        assert "Traceback" not in err


@pytest.mark.parametrize("flags,told", [
    (["--kv_cache_memory", "1"], "a KV cache of 1.00 GiB (--kv_cache_memory 1) and the largest forward's"),
    (["--kv_cache_memory", "0.00001"], "fewer than one sequence of --max_len 64 needs"),
    ([], "one sequence of --max_len 64 tokens needs")])
def test_serve_refuses_a_kv_cache_that_cannot_fit_with_the_numbers(
        model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str],
        told: str) -> None:
    """Exit 2 before the pool is allocated: a budget beyond the free memory, one too small for a sequence of
    --max_len (the model's context, 64 tokens), and a machine whose free memory cannot hold even that."""
    free = 1 if not flags else SMALL_RAM
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (free, "available RAM"))
    pytest.importorskip("fastapi")
    # in this process: the check runs where the engine is built, and the stand-in free memory is this process's
    args = ["serve", "--model", str(model_dir), "--device", "cpu", "--port", "0", "--no-engine_process", *flags]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert told in err and "Traceback" not in err
    assert re.search(r"\d\.\d\d GiB", err)  # the figures, not only words


# -- the KV cache's block pool within a memory budget (generator_memory.plan_kv) ----------------------------


def _plan(monkeypatch: pytest.MonkeyPatch, free: int, *, name: str = "debug", max_len: int = 256,
          max_batch_size: int | None = 8, kv_cache_memory: float | None = None) -> generator_memory.KVPlan:
    """The pool a server of the preset gets with `free` bytes available (the RAM the plan sees, stood in)."""
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (free, "test RAM"))
    with torch.device("meta"):  # the shapes only
        model = GPT(preset(name))
    return generator_memory.plan_kv(model, torch.device("cpu"), max_len=max_len, max_batch_size=max_batch_size,
                                    prefill_chunk=64, block_size=16, kv_cache_memory=kv_cache_memory,
                                    dtype=torch.float32)


def test_a_cpu_servers_default_kv_cache_is_4_gib_where_ram_is_plenty(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _plan(monkeypatch, 10**13, name="smollm2-135m", max_len=8192, max_batch_size=64)
    assert kv.bytes <= 4 * 2**30 < kv.bytes + kv.block_bytes  # vLLM's CPU default, in whole blocks
    assert kv.tokens == kv.num_blocks * 16 and "default: 4 GiB" in kv.line()


def test_a_cpu_servers_default_kv_cache_is_half_the_free_ram_where_that_is_less(
        monkeypatch: pytest.MonkeyPatch) -> None:
    free = 4 * 2**30
    kv = _plan(monkeypatch, free, name="smollm2-135m", max_len=8192, max_batch_size=8)
    room = memory_check.REFUSE_ABOVE * free - kv.forward
    assert 0.49 * room <= kv.bytes <= 0.5 * room


def test_the_default_holds_no_more_than_max_batch_size_sequences_of_max_len(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model's 4 GiB would be millions of tokens that only finished prefixes could fill."""
    kv = _plan(monkeypatch, 10**13, max_len=256, max_batch_size=8)
    assert kv.tokens == 8 * 256 and kv.bytes < 2**30


def test_the_default_is_raised_to_hold_one_sequence_of_max_len_where_that_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-0.6B's 40,960 tokens take more than 4 GiB of fp32 keys and values: the default holds one of them,
    not a pool that would refuse the model's own context."""
    name, max_len = "qwen3-0.6b", 40960
    one = max_len * generator_memory.kv_bytes_per_token(preset(name), torch.float32)
    assert one > 4 * 2**30
    kv = _plan(monkeypatch, 3 * one, name=name, max_len=max_len)
    assert kv.tokens == max_len and "one sequence of --max_len" in kv.line()


def test_the_default_max_batch_size_is_lowered_to_the_most_requests_whose_forwards_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of a step is read to its longest row's length: 64 rows of Qwen3-0.6B's 40,960-token context do
    not fit 20 GiB beside one sequence's blocks, so the default decodes fewer together, and says so; asked for
    explicitly, 64 are refused with the numbers."""
    name, max_len, free = "qwen3-0.6b", 40960, 20 * 2**30
    kv = _plan(monkeypatch, free, name=name, max_len=max_len, max_batch_size=None)
    assert 1 <= kv.max_batch_size < 64 and "the most whose forwards fit the memory" in kv.line()
    one = generator_memory.pool_bytes(preset(name), max_len // 16, 16, torch.float32)
    more = generator_memory.forward_bytes(preset(name), prefill_chunk=64, max_batch_size=kv.max_batch_size + 1,
                                          max_len=max_len, dtype=torch.float32)
    assert more + one > memory_check.REFUSE_ABOVE * free  # one more request's step would not fit
    assert kv.bytes + kv.forward <= memory_check.REFUSE_ABOVE * free
    with pytest.raises(UserError, match=r"a step of 64 requests.*lower --max_batch_size"):
        _plan(monkeypatch, free, name=name, max_len=max_len, max_batch_size=64)


def test_a_default_that_cannot_hold_one_sequence_is_refused_with_the_max_len_that_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name, max_len = "qwen3-0.6b", 40960
    one = max_len * generator_memory.kv_bytes_per_token(preset(name), torch.float32)
    with pytest.raises(UserError) as e:
        _plan(monkeypatch, one // 2, name=name, max_len=max_len)
    text = str(e.value)
    assert "one sequence of --max_len 40,960 tokens needs" in text and "test RAM" in text
    fits = int(re.search(r"lower --max_len to ([\d,]+)", text).group(1).replace(",", ""))
    assert 0 < fits < max_len
    assert _plan(monkeypatch, one // 2, name=name, max_len=fits).tokens >= fits  # the fix it names fits


def test_a_kv_cache_memory_too_small_for_max_len_is_refused_as_vllm_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    per_block = 16 * generator_memory.kv_bytes_per_token(preset("debug"), torch.float32)
    gib = 11 * per_block / 2**30  # ten blocks and the null block: 160 tokens, fewer than --max_len 256
    with pytest.raises(UserError) as e:
        _plan(monkeypatch, 10**13, kv_cache_memory=gib)
    text = str(e.value)
    assert "holds 160 tokens (10 blocks of 16), fewer than one sequence of --max_len 256" in text
    assert "lower --max_len to 160 or less" in text and "raise --kv_cache_memory to" in text
    assert _plan(monkeypatch, 10**13, kv_cache_memory=gib, max_len=160).num_blocks == 10


def test_a_kv_cache_memory_beyond_the_free_memory_is_refused_with_what_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError) as e:
        _plan(monkeypatch, 2**30, kv_cache_memory=4.0)
    text = str(e.value)
    assert "a KV cache of 4.00 GiB (--kv_cache_memory 4) and the largest forward's" in text
    assert "1.00 GiB is test RAM" in text
    most = float(re.search(r"lower --kv_cache_memory to ([\d.]+)", text).group(1))
    assert _plan(monkeypatch, 2**30, kv_cache_memory=most).bytes <= most * 2**30


def test_the_start_up_line_says_memory_tokens_blocks_and_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    per_block = 16 * generator_memory.kv_bytes_per_token(preset("debug"), torch.float32)
    gib = 876 * per_block / 2**30  # 875 blocks and the null block
    kv = _plan(monkeypatch, 10**13, kv_cache_memory=gib)
    assert kv.line() == (f"KV cache: {gib:.2f} GiB (--kv_cache_memory {gib:g}), 14,000 tokens in 875 blocks of 16; "
                         "up to 8 requests at once, each up to 256 tokens")


# A fresh process serving a preset's shape with random weights as serve loads it (fp32, the CPU layout with its
# packed copies, the heap given back), its resident memory sampled every millisecond: the growth over the
# interpreter and torch, against the plan's weights, packed copies, pool and largest forward.
SERVE_RSS = """
import json, sys, threading, time, psutil, torch
from gptopt.config import preset
from gptopt.infer import generator_memory
from gptopt.infer.cpu_layout import inference_layout
from gptopt.infer.generator import Generator
from gptopt.infer.scheduler import generate
from gptopt.infer.sampling import SamplingParams
from gptopt.models.gpt import GPT
from gptopt.runtime.device import give_back_host_memory, resolve
name, max_len, rows, chunk, gib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
""" + SAMPLE_RSS + """torch.manual_seed(0)
with torch.no_grad():
    model = inference_layout(GPT(preset(name)).eval(), "cpu")
give_back_host_memory()
plan = resolve("cpu", quiet=True)
kv = generator_memory.plan_kv(model, plan.device, max_len=max_len, max_batch_size=rows, prefill_chunk=chunk,
                              block_size=16, kv_cache_memory=gib)
gen = Generator(model, plan, max_batch_size=rows, max_len=max_len, kv_blocks=kv.num_blocks, block_size=16)
for t in gen.cache.tensors:  # a pool's pages are mapped as its blocks are first written: all of them, as when full
    t.fill_(0)
prompts = [[(7 * i + j) % 1000 + 1 for j in range(chunk // rows)] for i in range(rows)]
generate(gen, prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
done.set()
sampler.join()
print(json.dumps({"grown": peak[0] - rss0, "plan": generator_memory.model_bytes(model).total + kv.bytes + kv.forward}))
"""


@pytest.mark.slow
def test_the_serving_plan_is_within_10_percent_of_the_resident_memory_it_takes() -> None:
    """SmolLM2-135M's shape on a CPU: the weights, their oneDNN-packed copies (as much again), a pool of 0.25 GiB
    and the largest forward, against the process's RSS (qwen3-0.6b's shape holds the same; it takes 6 GiB)."""
    env = {"PYTHONPATH": str(Path(memory_check.__file__).parents[2]), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", SERVE_RSS, "smollm2-135m", "1024", "8", "512", "0.25"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout.splitlines()[-1])
    assert 0.9 * figures["grown"] <= figures["plan"] <= 1.1 * figures["grown"], figures


@pytest.mark.cuda
def test_a_gpu_servers_default_pool_fills_0_9_of_the_device_and_then_runs() -> None:
    """What is left of 0.9 of the device after the weights and a measured forward, most of it taken (a batch
    large enough that the cap of --max_batch_size sequences does not bind); the pool allocated beside a
    forward of the chunk then runs without running out."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(preset("smollm2-135m")).to(device, torch.bfloat16).eval()
    kv = generator_memory.plan_kv(model, device, max_len=8192, max_batch_size=4096, prefill_chunk=512,
                                  block_size=16)
    total = torch.cuda.mem_get_info(device)[1]
    held = torch.cuda.memory_allocated(device) + kv.bytes + kv.forward
    assert 0.9 * total - 2 * 2**30 <= held <= 0.9 * total, (held, total, kv.line())
    pool = torch.empty(kv.bytes, dtype=torch.uint8, device=device)
    with torch.no_grad():
        model(torch.zeros(1, 512, dtype=torch.long, device=device))
    torch.cuda.synchronize(device)
    del pool


def test_a_cpu_pool_takes_its_memory_as_its_blocks_are_first_written() -> None:
    """A CPU pool of gigabytes is ready at once: its pages are mapped as its blocks are first written, so a
    long-context model's default pool does not hold its start-up for the seconds writing its zeros took."""
    import psutil

    from gptopt.infer.kv_cache import PagedKVCache

    proc = psutil.Process()
    before = proc.memory_info().rss
    cache = PagedKVCache(preset("debug"), 1 << 16, 16, device="cpu", dtype=torch.float32)
    assert cache.nbytes() >= 1 << 30 and proc.memory_info().rss - before < cache.nbytes() // 8
    assert not cache.k[0][:64].any() and not cache.v[-1][-64:].any()  # zeros all the same
