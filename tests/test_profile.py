"""`gptopt profile`: real CPU traces that show each bottleneck, the diagnosis rules, the command's outputs.

    pytest -q tests/test_profile.py
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from gptopt import cli
from gptopt.commands import profile
from gptopt.commands.profile import STEP_RANGE, Finding, OpRecord, TraceSummary, diagnose, figures
from gptopt.config import ProfileConfig, TrainConfig
from gptopt.data import loader as data
from gptopt.infer.generator import Generator
from gptopt.models.gpt import GPT
from gptopt.runtime import device, memory_check
from gptopt.train import wrap

# Few, small steps: every real trace below takes a few seconds on a 2-core CPU.
FAST = dict(preset="debug", seq_len=32, batch_size=4, device="cpu", wait=1, warmup=1, active=2, row_limit=5)


def profiled(data_dir: Path, out: Path, **kw: Any) -> tuple[TraceSummary, set[str]]:
    cfg = ProfileConfig(data_dir=str(data_dir), output_dir=str(out), **{**FAST, **kw})
    threads = torch.get_num_threads()
    # One intra-op thread: on a shared 2-core machine a parallel op otherwise waits for a descheduled
    # sibling thread, and its time then says more about the neighbours than about its work.
    torch.set_num_threads(1)
    try:
        summary, table = profile.profile_steps(cfg)
    finally:
        torch.set_num_threads(threads)
    rows = table.split("Self CPU time total")[0]
    assert "aten::" in rows and STEP_RANGE not in rows and ".py(" not in rows  # operators only
    return summary, {f.name for f in diagnose(summary)}


@pytest.fixture(autouse=True)
def _bf16_is_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fp32 rule only speaks where autocast pays; pretend this CPU has AMX/AVX512-BF16 so the
    # tests mean the same on every machine.
    monkeypatch.setattr(profile, "amp_speeds_matmuls", lambda plan: True)


@pytest.fixture(scope="module")
def clean_run(train_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TraceSummary, set[str]]:
    """AMP on, the real (fast) loader, nothing read back: what a well-set-up run looks like."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profile, "amp_speeds_matmuls", lambda plan: True)
        return profiled(train_data, tmp_path_factory.mktemp("clean"), use_amp=True, amp_dtype="bf16", active=5)


# ----------------------------------------------------------------------------------------------
# Real traces on the CPU, one per problem


def test_a_clean_run_raises_no_data_sync_fp32_or_memory_alarm(clean_run: tuple[TraceSummary, set[str]]) -> None:
    summary, names = clean_run
    assert not names & {"data_wait", "host_sync", "fp32_matmul", "memory", "graph_breaks"}
    f = figures(summary)
    assert f.steps == 5 and f.syncs_per_step == 0
    assert f.fp32_matmul_share is not None and f.fp32_matmul_share < 0.05  # bf16 matmuls were seen, not none
    assert f.memory_share is not None and 0 < f.memory_share < profile.MEMORY_SHARE  # real RSS vs real RAM


def test_fp32_matmuls_are_found_without_amp(train_data: Path, tmp_path: Path) -> None:
    summary, names = profiled(train_data, tmp_path)
    assert "fp32_matmul" in names
    assert figures(summary).fp32_matmul_share == pytest.approx(1.0)
    # The matmuls are work units (addmm, though it calls copy_ for the bias), views and wrappers (linear) are not.
    kernel_names = {o.name for o in summary.ops if o.kernel}
    assert {"aten::addmm", "aten::mm"} <= kernel_names
    assert not kernel_names & (profile.CPU_METADATA_OPS | {"aten::linear"})
    fix = next(f.fix for f in diagnose(summary) if f.name == "fp32_matmul")
    assert "--use_amp" in fix


def test_a_slow_loader_is_found_as_data_wait(train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetch = data.BatchDataset.__getitem__

    def slow(self: data.BatchDataset, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.2)  # slow storage: many times the debug model's step
        return fetch(self, step)

    monkeypatch.setattr(data.BatchDataset, "__getitem__", slow)
    summary, names = profiled(train_data, tmp_path, use_amp=True)
    assert "data_wait" in names
    assert all(w >= 0.2 for w in summary.data_wait_s)
    assert "--num_workers 2" in next(f.fix for f in diagnose(summary) if f.name == "data_wait")


def _forward_that_reads_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    forward = GPT.forward

    def reads_back(self: GPT, idx: torch.Tensor, targets: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        out = forward(self, idx, targets, **kw)
        if out.float().mean().item() < -1:  # a host read of a tensor's value, as logging code does
            print("impossible")
        return out

    monkeypatch.setattr(GPT, "forward", reads_back)


def test_host_reads_in_the_step_are_found_and_counted(train_data: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _forward_that_reads_the_loss(monkeypatch)
    summary, names = profiled(train_data, tmp_path, use_amp=True)
    assert "host_sync" in names
    f = figures(summary)
    # Exactly the one .item() per step: the fused AdamW kernel's internal reads are not the user's syncs.
    assert f.syncs_per_step == 1 and f.sync_calls == {"aten::item": 2}


def test_graph_breaks_of_a_compiled_model_are_counted_with_reasons(train_data: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Dynamo finds the breaks before any backend runs: the eager backend skips Inductor's slow code
    # generation on a CPU and breaks in exactly the same places.
    monkeypatch.setattr(wrap, "compile_model",
                        lambda model, mode="default", fullgraph=False: torch.compile(model, backend="eager"))
    _forward_that_reads_the_loss(monkeypatch)
    summary, names = profiled(train_data, tmp_path, compile=True)
    assert {"graph_breaks", "host_sync"} <= names
    assert summary.graph_breaks and sum(summary.graph_breaks.values()) >= 1
    assert any("item()" in reason for reason in summary.graph_breaks)
    finding = next(f for f in diagnose(summary) if f.name == "graph_breaks")
    assert "item()" in finding.figure and "capture_scalar_outputs" in finding.fix


@pytest.mark.slow
def test_the_plain_model_compiles_without_graph_breaks(train_data: Path, tmp_path: Path) -> None:
    summary, names = profiled(train_data, tmp_path, compile=True, use_amp=True)
    assert summary.graph_breaks == {} and "graph_breaks" not in names


def test_python_time_between_ops_is_found_as_idle(train_data: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    forward = GPT.forward

    def slow_python(self: GPT, *args: Any, **kw: Any) -> torch.Tensor:
        time.sleep(0.05)  # host work outside any aten op, as a Python-heavy forward does
        return forward(self, *args, **kw)

    monkeypatch.setattr(GPT, "forward", slow_python)
    summary, names = profiled(train_data, tmp_path, use_amp=True)
    assert "device_idle" in names
    assert figures(summary).idle_share > 0.5


def test_tiny_steps_are_found_launch_bound(train_data: Path, tmp_path: Path) -> None:
    summary, names = profiled(train_data, tmp_path, batch_size=1, seq_len=8)
    assert "launch_bound" in names
    f = figures(summary)
    assert f.kernels_per_step >= profile.LAUNCH_MIN_KERNELS
    assert f.median_kernel_us is not None and f.median_kernel_us < profile.LAUNCH_KERNEL_US
    assert f.kernel_share < profile.LAUNCH_KERNEL_SHARE


def test_memory_near_capacity_is_found(train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The peak (this process's max RSS) is real; the capacity is a machine with 10% more RAM than we use now.
    small = int(psutil.Process().memory_info().rss * 1.1)
    monkeypatch.setattr(memory_check, "capacity_bytes", lambda device: small)
    summary, names = profiled(train_data, tmp_path, use_amp=True)
    assert "memory" in names
    assert figures(summary).memory_share > profile.MEMORY_SHARE
    assert "--gradient_checkpointing" in next(f.fix for f in diagnose(summary) if f.name == "memory")


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_generation_profiles_the_generators_decode_steps(train_data: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, fast_bf16: bool) -> None:
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: fast_bf16)  # the CPU policy, both ways
    calls = {"prefill": 0, "decode": 0}
    for name in calls:
        real = getattr(Generator, name)

        def spy(self: Generator, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> torch.Tensor:
            calls[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(Generator, name, spy)
    summary, names = profiled(train_data, tmp_path, mode="generate", use_amp=True)
    # the prompts (a batch of 4) prefilled once, then one decode of the batch per step: 1 skipped + 1 + 2
    assert calls == {"prefill": 4, "decode": 4}
    assert summary.data_wait_s == [0.0, 0.0]
    # the tokens read back each step are the decode loop's own readout, not an avoidable sync
    assert any(o.matmul for o in summary.ops) and not any(o.sync for o in summary.ops)
    assert not names & {"data_wait", "host_sync"}
    # --use_amp: the weights take the dtype autocast resolves to; without native bf16 that is fp32
    share = figures(summary).fp32_matmul_share
    if fast_bf16:
        assert share is not None and share < profile.FP32_MATMUL_SHARE and "fp32_matmul" not in names
    else:
        assert share == 1.0


@pytest.mark.cuda
def test_cuda_traces_give_kernels_syncs_and_a_memory_snapshot(train_data: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    clean, clean_names = profiled(train_data, tmp_path / "clean", device="cuda", use_amp=True)
    f = figures(clean)
    assert f.kernels_per_step > 0 and f.idle_share is not None and f.median_kernel_us is not None
    assert f.syncs_per_step == 0  # the barrier that times each step is not counted
    assert not clean_names & {"host_sync", "fp32_matmul"}
    assert (tmp_path / "clean" / "memory_snapshot.pickle").stat().st_size > 0
    _forward_that_reads_the_loss(monkeypatch)
    fp32, names = profiled(train_data, tmp_path / "fp32", device="cuda")
    assert {"host_sync", "fp32_matmul"} <= names
    assert figures(fp32).sync_calls.get("cudaStreamSynchronize", 0) >= 2  # one .item() in each recorded step


def test_a_sequence_longer_than_the_context_is_refused(train_data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context 64"):
        profiled(train_data, tmp_path, seq_len=65)


def test_cli_writes_traces_and_the_diagnosis(train_data: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prof"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["profile", "--preset", "debug", "--data_dir", str(train_data), "--seq_len", "32", "--output_dir", str(out),
            "--device", "cpu", "--json"]
    assert cli.main(argv) == 0
    assert (out / "notes.txt").read_text() == "mine"
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("name") == STEP_RANGE for e in trace["traceEvents"])
    assert list((out / "tensorboard").glob("*.pt.trace.json"))
    diagnosis = json.loads((out / "diagnosis.json").read_text())
    assert diagnosis["figures"]["steps"] == ProfileConfig().active
    stdout = capsys.readouterr().out.strip().splitlines()
    assert json.loads(stdout[-1]) == diagnosis  # --json: the diagnosis is the last line
    assert "Self CPU" in "\n".join(stdout)  # the operator table, sorted by CPU time
    for finding in diagnosis["findings"]:
        assert f"[{finding['name']}]" in "\n".join(stdout)

    # Again into the same folder: refused before any work, then replaced on request, the user's file kept.
    first = (out / "trace.json").read_bytes()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass --overwrite" in err
    assert (out / "trace.json").read_bytes() == first
    assert cli.main([*argv, "--overwrite"]) == 0
    assert (out / "trace.json").read_bytes() != first and (out / "notes.txt").read_text() == "mine"
    assert len(list((out / "tensorboard").glob("*.pt.trace.json"))) == 1  # the old trace is gone, not beside the new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof"]


# ----------------------------------------------------------------------------------------------
# The rules on synthetic summaries: each fires above its threshold and stays quiet below it


def kernels(step: int, n: int, us: float, *, dtype: str = "c10::BFloat16",
            matmul_every: int = 10) -> Iterator[OpRecord]:
    """n back-to-back kernels of `us` each; every matmul_every-th one a matmul of the given dtype."""
    for k in range(n):
        mm = k % matmul_every == 0
        yield OpRecord(name="aten::mm" if mm else "aten::add", step=step, start_us=k * us, dur_us=us,
                       dtypes=(dtype, dtype) if mm else (), kernel=True, busy=True, matmul=mm)


def synthetic(steps: int = 4, step_ms: float = 10.0, wait_ms: float = 0.1, n: int = 150, kernel_us: float = 60.0,
              **kw: Any) -> TraceSummary:
    """A clean run by default: 90% of each step in 150 kernels of 60 us, bf16 matmuls, 10% memory."""
    ops = kw.pop("ops", None)
    if ops is None:
        ops = [o for i in range(steps) for o in kernels(i, n, kernel_us)]
    base = dict(device_type="cpu", step_s=[step_ms / 1e3] * steps, data_wait_s=[wait_ms / 1e3] * steps, ops=ops,
                peak_memory_bytes=1 << 30, memory_capacity_bytes=10 << 30, graph_breaks={}, compile=True)
    return TraceSummary(**{**base, **kw})


def names(s: TraceSummary) -> set[str]:
    return {f.name for f in diagnose(s)}


def test_the_clean_synthetic_run_has_no_finding() -> None:
    assert diagnose(synthetic()) == []


@pytest.mark.parametrize("rule, bad, good", [
    ("data_wait", dict(wait_ms=1.5), dict(wait_ms=0.8)),
    # a short step: 25% of it, but a sub-millisecond wait is DataLoader bookkeeping, not storage
    ("data_wait", dict(wait_ms=1.5), dict(step_ms=2.0, wait_ms=0.5, n=30)),
    ("device_idle", dict(n=100), dict(n=140)),  # 60% vs 84% of the step covered by kernels
    ("launch_bound", dict(kernel_us=5.0), dict(kernel_us=20.0)),
    ("launch_bound", dict(kernel_us=5.0), dict(kernel_us=5.0, n=50)),  # a handful of short kernels do not bind
    ("launch_bound", dict(kernel_us=5.0), dict(kernel_us=5.0, n=1800)),  # short kernels that keep the device busy
    ("memory", dict(peak_memory_bytes=9 << 30), dict(peak_memory_bytes=8 << 30)),
    ("memory", dict(peak_memory_bytes=9 << 30), dict(peak_memory_bytes=9 << 30, memory_capacity_bytes=None)),
    ("graph_breaks", dict(graph_breaks={"Unsupported Tensor.item() call": 2}), dict(graph_breaks=None)),
])
def test_each_rule_fires_above_its_threshold_only(rule: str, bad: dict[str, Any], good: dict[str, Any]) -> None:
    assert rule in names(synthetic(**bad))
    assert rule not in names(synthetic(**good))


def test_fp32_matmuls_count_by_time_and_only_where_low_precision_is_faster() -> None:
    def run(fp32_share: float, **kw: Any) -> TraceSummary:
        ops = [OpRecord("aten::addmm", 0, 0.0, 100 * fp32_share, dtypes=("float", "float", "float"), matmul=True),
               OpRecord("aten::addmm", 0, 50.0, 100 * (1 - fp32_share), dtypes=("c10::BFloat16",) * 3, matmul=True)]
        return synthetic(steps=1, ops=ops, **kw)

    assert figures(run(0.6)).fp32_matmul_share == pytest.approx(0.6)
    assert "fp32_matmul" in names(run(0.6))
    assert "fp32_matmul" not in names(run(0.4))
    assert "fp32_matmul" not in names(run(0.6, amp_speeds_matmuls=False))


def test_one_sync_in_any_step_is_found() -> None:
    sync = OpRecord("cudaStreamSynchronize", step=2, start_us=5.0, dur_us=300.0, sync=True)
    s = synthetic(ops=[*synthetic().ops, sync], device_type="cuda")
    finding = next(f for f in diagnose(s) if f.name == "host_sync")
    assert finding.value == 0.25 and "cudaStreamSynchronize x1" in finding.figure


def test_nested_busy_ops_are_not_counted_twice() -> None:
    # An op and its child (linear around addmm) cover 3 ms of a 10 ms step, not 5 ms.
    ops = [OpRecord("aten::linear", 0, 1000.0, 3000.0, busy=True),
           OpRecord("aten::addmm", 0, 1500.0, 2000.0, busy=True)]
    assert figures(synthetic(steps=1, wait_ms=0.0, ops=ops)).idle_share == pytest.approx(0.7)


def test_the_fixes_name_the_flags_that_apply() -> None:
    def fix(rule: str, **kw: Any) -> str:
        found: list[Finding] = [f for f in diagnose(synthetic(**kw)) if f.name == rule]
        assert found, rule
        return found[0].fix

    assert "--compile" in fix("launch_bound", kernel_us=5.0, compile=False)
    assert "reduce-overhead" in fix("launch_bound", kernel_us=5.0, device_type="cuda")
    assert "reduce-overhead" not in fix("launch_bound", kernel_us=5.0)  # CUDA graphs need CUDA
    assert "--batch_size 16" in fix("launch_bound", kernel_us=5.0, batch_size=8)
    assert "--pin_memory" in fix("data_wait", wait_ms=2.0, device_type="cuda", num_workers=2)
    assert "--pin_memory" not in fix("data_wait", wait_ms=2.0)  # pinned memory speeds CUDA copies only
    assert "--num_workers 4" in fix("data_wait", wait_ms=2.0, device_type="cuda", num_workers=2)
    train = fix("memory", peak_memory_bytes=9 << 30, batch_size=8)
    assert "--batch_size 4 --gradient_accumulation_steps 2" in train and "--gradient_checkpointing" in train
    assert "--gradient_checkpointing" not in fix("memory", peak_memory_bytes=9 << 30, mode="generate")


def test_a_summary_without_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="one data wait per step"):
        figures(synthetic(steps=0))


def test_the_trace_is_read_where_torch_does_not_flag_python_frames_or_keep_dtypes() -> None:
    """torch < 2.12 (2.11 is common on GPU images) has no FunctionEvent.is_python_function nor
    input_dtypes: the trace must still read (not end `gptopt profile` in an AttributeError after every
    step ran), with the dtypes taken from the kineto events, where that torch keeps them."""
    from torch.profiler import ProfilerActivity, record_function

    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        with record_function(STEP_RANGE):
            (x @ x).sum()
    events = prof.events()
    profile.attach_dtypes(prof, events)  # what profile does (nothing to do on torch >= 2.12)
    flagged = {e.name for e in events if getattr(e, "is_python_function", False)}
    want = {op.name: op.dtypes for op in profile.trace_ops(events) if op.matmul}
    assert want and all(dtypes for dtypes in want.values())
    for e in events:  # as torch 2.11 builds them
        for attr in ("is_python_function", "input_dtypes"):
            if hasattr(e, attr):
                delattr(e, attr)
    bare = profile.trace_ops(events)
    names = {op.name for op in bare}
    assert "aten::mm" in names
    assert not names & flagged - {"aten::mm"}  # no frame that this torch flags is counted as an operator
    assert all(op.dtypes is None for op in bare if op.matmul)  # unknown, not "not float32"
    profile.attach_dtypes(prof, events)
    assert {op.name: op.dtypes for op in profile.trace_ops(events) if op.matmul} == want


def test_profile_takes_every_compile_mode_train_takes() -> None:
    # a tune.toml's or best.toml's mode is one a profile of those settings can compile with too
    modes = next(f for f in dataclasses.fields(TrainConfig) if f.name == "compile_mode").metadata["choices"]
    assert "max-autotune-no-cudagraphs" in modes  # the mode tune measures on CPUs
    parser = cli.build_parser("profile", ProfileConfig)
    for mode in modes:
        cfg = cli.parse_config("profile", ProfileConfig, ["--compile", "--compile_mode", mode], parser)
        assert cfg.compile_mode == mode
