"""GPU checks: device policy, table peak, bf16 step, flash attention; fp16 loss scaling, DDP and FSDP2
over NCCL, activation checkpointing, auto batch size under a real CUDA OOM, CUDA-graph decode (compiled and eager),
the paged KV cache through preemption and prefix hits against the CPU, torchao int8 weight-only, NVML monitoring.
Small models only, one torch.compile in all.

    pytest -q -m cuda tests/test_cuda.py     # skipped without an NVIDIA GPU
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import make_varied_model

from gptopt.config import TrainConfig, preset
from gptopt.infer import paged_attention
from gptopt.infer.decode_graphs import GraphedDecode
from gptopt.infer.generator import Generator
from gptopt.infer.load import optimize_for_inference
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import Scheduler, generate
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan, gpu_spec, measured_matmul_flops, peak_flops, resolve
from gptopt.runtime.monitor import Monitor
from gptopt.train.auto_batch import find_batch_size
from gptopt.train.distributed import DistInfo, no_sync, wrap_ddp, wrap_fsdp
from gptopt.train.step import TrainStep

pytestmark = pytest.mark.cuda


def test_default_plan_runs_on_the_gpu_in_a_dtype_it_computes_natively() -> None:
    plan = resolve()
    assert plan.device.type == "cuda"
    assert torch.cuda.get_device_name(plan.device) in plan.reason
    a = torch.randn(256, 256, device=plan.device)
    with plan.autocast():
        assert (a @ a).dtype == plan.amp_dtype  # the matmuls really run in 16 bits
    # torch's own answer, not gptopt's rule: bf16 only where the GPU has it, else fp16 with loss scaling
    if torch.cuda.is_bf16_supported(including_emulation=False):
        assert plan.amp_dtype == torch.bfloat16 and not plan.use_grad_scaler
    else:
        assert plan.amp_dtype == torch.float16 and plan.use_grad_scaler


def test_the_peak_is_a_ceiling_a_real_matmul_stays_under() -> None:
    plan = resolve()
    dtype = plan.amp_dtype or torch.float32
    flops, source = peak_flops(plan)
    achieved = measured_matmul_flops(str(plan.device), dtype)  # 8192^3 matmuls for half a second
    if gpu_spec(torch.cuda.get_device_name(plan.device)) is not None:
        assert "table peak" in source
        assert 0.1 * flops < achieved <= flops  # MFU against the table stays under 100%, and the row is this GPU's
    else:
        assert source.startswith("measured matmul peak") and flops == achieved


def test_bf16_step_on_gpu_matches_fp32_loss() -> None:
    plan = resolve()
    model = GPT(preset("tiny")).to(plan.device)
    idx = torch.randint(0, 8192, (4, 256), device=plan.device)
    with torch.no_grad():
        ref = model(idx, idx).item()
        with plan.autocast():
            amp = model(idx, idx).item()
    assert abs(ref - amp) < 0.05 * ref
    with plan.autocast():
        loss = model(idx, idx)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_flash_attention_kernel_runs_and_matches_eager() -> None:
    plan = resolve()
    if plan.amp_dtype != torch.bfloat16:
        pytest.skip("flash attention needs sm_80+")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = GPT(preset("tiny")).to(plan.device).eval()
    eager = GPT(preset("tiny", attention="eager")).to(plan.device).eval()
    eager.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 8192, (2, 256), device=plan.device)
    with torch.no_grad(), plan.autocast():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = sdpa(idx).float()
        ref = eager(idx).float()
    assert (out - ref).abs().max().item() < 0.1


# ----------------------------------------------------------------------------------------------
# The GPU paths of training: fp16 loss scaling, DDP and FSDP2 over NCCL, activation checkpointing,
# the auto batch size against the real allocator


def _batch(plan: DevicePlan, batch: int = 4, seq: int = 64, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, vocab, (batch, seq), device=plan.device)
    return x, torch.randint(0, vocab, (batch, seq), device=plan.device)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fp16_training_scales_the_loss_and_an_inf_gradient_skips_the_update_not_the_weights() -> None:
    """GPUs before sm_80 train in fp16: the GradScaler must let steps through, and turn an overflow
    into a skipped step with a lower scale, never into inf/NaN weights."""
    plan = resolve(amp_dtype="fp16")
    assert plan.amp_dtype == torch.float16 and plan.use_grad_scaler
    model = GPT(preset("debug")).to(plan.device)
    step = TrainStep(model, model, plan, TrainConfig(preset="debug", warmup_steps=0, max_steps=100))
    assert step.scaler is not None and step.scaler.is_enabled()
    x, y = _batch(plan)

    def batch(_micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x, y

    first = [step(i, batch) for i in range(3)]
    assert all(r.finite and math.isfinite(r.loss) for r in first)
    assert first[-1].loss < first[0].loss  # the same batch three times: the updates were applied
    scale = step.scaler.get_scale()
    assert 1.0 <= scale <= 2.0**16  # GradScaler's initial scale, or halved by an overflow early on

    before = _weights(model)
    hook = model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    try:
        bad = step(3, batch)
    finally:
        hook.remove()
    assert math.isfinite(bad.loss) and math.isinf(bad.grad_norm)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # skipped: no weight moved
    assert step.scaler.get_scale() == scale * step.scaler.get_backoff_factor()

    after = step(4, batch)
    assert after.finite and math.isfinite(after.grad_norm) and after.loss < first[0].loss
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # and training goes on


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistInfo]:
    """A one-process NCCL group (a file store: no port to find), as torchrun's ranks each join one."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield DistInfo(rank=0, local_rank=0, world_size=1, enabled=True)
    finally:
        dist.destroy_process_group()


def test_ddp_over_nccl_gives_the_plain_models_gradients_with_and_without_sync(nccl: DistInfo) -> None:
    """torchrun on GPUs wraps the model in DDP (wrap_ddp): its gradients, accumulated over a no_sync
    micro-step as TrainStep does, are the plain model's."""
    from torch.nn.parallel import DistributedDataParallel

    plan = resolve()
    model = GPT(preset("debug")).to(plan.device)
    plain = copy.deepcopy(model)
    ddp = wrap_ddp(model, plan.device)
    assert isinstance(ddp, DistributedDataParallel)
    batches = [_batch(plan), _batch(plan)]
    for micro, (x, y) in enumerate(batches):
        with no_sync(ddp, micro == 0):
            (ddp(x, y) / 2).backward()
        (plain(x, y) / 2).backward()
    ref = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        # the same kernels on the same inputs; only the attention backward's atomics may reorder sums
        assert (p.grad - ref[name].grad).norm() <= 1e-4 * ref[name].grad.norm() + 1e-8, name


def test_fsdp2_over_nccl_trains_like_the_unsharded_model(nccl: DistInfo) -> None:
    """train --fsdp on GPUs (wrap_fsdp: bf16 compute, fp32 reduction) through TrainStep: the losses and
    gradient norm (a DTensor gathered in step.update) of the plain model, within bf16 rounding."""
    plan = resolve()
    if plan.amp_dtype != torch.bfloat16:
        pytest.skip("FSDP2's bf16 mixed precision needs sm_80+")
    model = GPT(preset("debug")).to(plan.device)
    plain = copy.deepcopy(model)
    sharded = wrap_fsdp(model, param_dtype=plan.amp_dtype, cpu_offload=False)
    cfg = TrainConfig(preset="debug", warmup_steps=0, max_steps=100)
    fsdp_step, plain_step = TrainStep(sharded, sharded, plan, cfg, nccl), TrainStep(plain, plain, plan, cfg)
    x, y = _batch(plan)
    for i in range(2):  # the second loss is after one AdamW update of the sharded parameters
        got, want = fsdp_step(i, lambda _m: (x, y)), plain_step(i, lambda _m: (x, y))
        assert got.finite and got.loss == pytest.approx(want.loss, rel=2e-2), i
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=5e-2), i


def test_gradient_checkpointing_gives_the_same_gradients_in_less_peak_memory() -> None:
    """--gradient_checkpointing trades compute for memory: a user relies on the memory really going
    down and the gradients staying the same (8 blocks, 8 x 512 tokens: ~0.5 GiB of fp32 activations)."""
    plan = resolve()
    x, y = _batch(plan, batch=8, seq=512)

    def run(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
        torch.manual_seed(0)  # the same weights both times
        model = GPT(preset("tiny", n_layer=8, block_size=512, vocab_size=512,
                           gradient_checkpointing=checkpointing)).to(plan.device)
        assert model.training  # recomputation happens in training mode only
        torch.cuda.synchronize(plan.device)
        torch.cuda.reset_peak_memory_stats(plan.device)
        start = torch.cuda.memory_allocated(plan.device)
        model(x, y).backward()  # fp32: recomputation reproduces the forward exactly
        torch.cuda.synchronize(plan.device)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None for g in grads.values())
        return grads, torch.cuda.max_memory_allocated(plan.device) - start

    # Without TF32 (which the plan turns on for fp32 matmuls): its rounding, met in another order by the
    # recomputed forward, moved wte's gradient by 1.07e-4 of its norm on an H200.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        plain, plain_peak = run(False)
        recomputed, recomputed_peak = run(True)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert plain.keys() == recomputed.keys()
    for name, g in plain.items():
        assert (recomputed[name] - g).norm() <= 1e-4 * g.norm() + 1e-8, name
    assert recomputed_peak < 0.5 * plain_peak, (recomputed_peak, plain_peak)


def test_auto_batch_size_backs_off_a_real_cuda_oom_to_a_batch_that_fits() -> None:
    """train --auto_batch_size on a GPU: the caching allocator's own out-of-memory error (not an injected
    one) makes find_batch_size try the next smaller divisor, and the failed tries leave nothing behind."""
    plan = resolve()
    dev = plan.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    # The limit counts reserved memory: 1 GiB above what this process holds now, whatever earlier tests left.
    limit = torch.cuda.memory_reserved(dev) + 2**30
    total = torch.cuda.mem_get_info(dev)[1]
    per_sequence = 96 * 2**20 // 4  # fp32 elements: each sequence of the batch needs 96 MiB, twice at the peak
    tried: list[int] = []

    def try_batch(b: int) -> None:  # explicit sizes, so which batches fit is certain: 4 (768 MiB) yes, 8 no
        tried.append(b)
        x = torch.ones(b, per_sequence, device=dev)
        (x * 2).sum().item()

    allocated = torch.cuda.memory_allocated(dev)
    torch.cuda.set_per_process_memory_fraction(limit / total, dev)
    try:
        b = find_batch_size(try_batch, 16, 16)
        assert (b, tried) == (4, [16, 8, 4])
        assert torch.cuda.memory_allocated(dev) == allocated  # nothing of the failed tries is held
        try_batch(b)  # and training at the size found runs, under the same limit
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# The GPU paths of inference: CUDA-graph decode, torchao int8, NVML monitoring


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_cuda_graph_decode_gives_the_eager_decodes_greedy_tokens(family: str) -> None:
    """Generator(compile=True) on a GPU (reduce-overhead: CUDA graphs over a static KV cache) must say
    what the eager Generator says, and really replay graphs. Two prompts of different lengths: each
    row decodes at its own position. fp32 without TF32, so both paths compute the same logits. The
    Llama and Qwen3 shapes: rotary angles from the graph's position buffer, a cache of the key/value heads."""
    from torch._dynamo.utils import counters

    plan = resolve()
    model = make_varied_model(512, family).to(plan.device)
    prompts = [[5, 17, 99, 4, 200, 31, 8], [3, 1, 4]]
    greedy = SamplingParams(max_new_tokens=24, temperature=0, top_k=None)
    precision = torch.get_float32_matmul_precision()
    skips = counters["inductor"]["cudagraph_skips"]
    torch.set_float32_matmul_precision("highest")
    try:
        want = generate(Generator(model, plan, max_batch_size=2, max_len=40), prompts, greedy)
        got = generate(Generator(model, plan, max_batch_size=2, max_len=40, compile=True), prompts, greedy)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert [len(t) for t in want] == [24, 24]
    assert len(set(want[0])) > 3  # varied text, so equal tokens are a real comparison
    assert got == want
    assert counters["inductor"]["cudagraph_skips"] == skips  # no step fell back from CUDA graphs


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_eager_cuda_graphs_give_the_eager_decodes_greedy_tokens_one_graph_per_bucket(family: str) -> None:
    """Generator(cuda_graphs=True), serve's default on a GPU: the eager decode recorded once per bucket
    (inference.GraphedDecode) and replayed must say what the eager Generator says, at a bucket wider
    than the rows asked for (3 sequences run the 4-row graph) and at a smaller bucket recorded later
    from the same memory pool; for the Llama and Qwen3 shapes too."""
    plan = resolve()
    model = make_varied_model(512, family).to(plan.device)
    prompts = [[5, 17, 99, 4, 200, 31, 8], [3, 1, 4], [9, 9, 2, 7, 300]]
    greedy = SamplingParams(max_new_tokens=24, temperature=0, top_k=None)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        want = generate(Generator(model, plan, max_batch_size=4, max_len=40), prompts, greedy)
        gen = Generator(model, plan, max_batch_size=4, max_len=40, cuda_graphs=True)
        got = generate(gen, prompts, greedy)
        got_one = generate(gen, prompts[:1], greedy)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert len(set(want[0])) > 3  # varied text, so equal tokens are a real comparison
    assert got == want
    assert got_one == want[:1]
    assert isinstance(gen._step, GraphedDecode) and sorted(gen._step.graphs) == [1, 4]  # recorded once each


def _paged_run(gen: Generator, prompts: list[list[int]],
               params: SamplingParams) -> tuple[list[list[int]], int, list[int]]:
    """Every prompt through a Scheduler over `gen`, as serve's engine steps it: the new tokens of each, the
    preemptions, and the prompt tokens each took from the prefix cache when first admitted."""
    sched = Scheduler(gen)
    seqs = [gen.new(p, params) for p in prompts]
    for s in seqs:
        sched.add(s)
    reused: dict[int, int] = {}
    while sched.busy:
        for s in sched.admit():
            reused.setdefault(id(s), s.reused)
        for step in (sched.prefill, sched.decode):
            for seq, tokens in step():
                for t in [tokens] if isinstance(tokens, int) else tokens or []:
                    if seq.add(t) is not None:
                        sched.finish(seq)
                        break
                if tokens is None:
                    sched.finish(seq)
    sched.check_idle()  # every block back in the pool
    return [s.tokens for s in seqs], sched.preemptions, [reused[id(s)] for s in seqs]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_the_paged_kv_cache_on_cuda_decodes_the_cpus_greedy_tokens_through_preemption_and_prefix_hits(
        graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged engine on a GPU (block tables and slot mapping on the device; serve's default records the eager
    decode as a CUDA graph per bucket over them): four requests sharing a two-block prefix in a pool too small
    for them all, so the newest are preempted and recomputed, and the later ones take the prefix's blocks by
    reference. Each request's greedy tokens are those the CPU decodes for it alone in a roomy cache. fp32
    without TF32 on both sides."""
    plan, cpu = resolve(), resolve("cpu", quiet=True)
    model = make_varied_model(512)
    rng = random.Random(5)
    prefix = [rng.randrange(512) for _ in range(16)]
    prompts = [prefix + [rng.randrange(512) for _ in range(n)] for n in (7, 3, 9, 5)]
    greedy = SamplingParams(max_new_tokens=20, temperature=0, top_k=None)
    # the CPU's gather path: building its in-place kernel would spend the GPU check's time on a compiler
    # (tests/test_paged_attention.py holds the two CPU paths to the same tokens)
    monkeypatch.setattr(paged_attention, "kernel", lambda: None)
    want = [generate(Generator(model, cpu, max_batch_size=1, max_len=48), [p], greedy)[0] for p in prompts]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        # 10 blocks of 8 tokens: one 45-token sequence needs 6, the four together about 22
        gen = Generator(copy.deepcopy(model), plan, max_batch_size=4, max_len=48, kv_blocks=10, block_size=8,
                        prefix_cache=True, cuda_graphs=graphs)
        got, preemptions, reused = _paged_run(gen, prompts, greedy)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert len(set(want[0])) > 3  # varied text, so equal tokens are a real comparison
    assert got == want
    assert preemptions > 0
    assert max(reused[1:]) == len(prefix)  # the shared prefix's two blocks, taken by reference
    assert gen.cache.k[0].device.type == "cuda"
    if graphs:
        assert isinstance(gen._step, GraphedDecode) and gen._step.graphs  # the decode replayed its graphs


def test_logprobs_on_cuda_graphs_equal_a_direct_forward() -> None:
    """Log-probabilities (sampled tokens' and an echoed prompt's, chunked) from the decode that serve runs
    on a GPU, recorded as CUDA graphs: the numbers a plain forward gives, each at its own position."""
    plan = resolve()
    model = make_varied_model(512).to(plan.device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        gen = Generator(model, plan, max_batch_size=4, max_len=40, cuda_graphs=True)
        prompt = [5, 17, 42, 99, 3, 250, 7]
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, top_k=None, logprobs=4, prompt_logprobs=2)
        (seq,), logits = gen.begin_many([prompt], params, chunk=3)
        while seq.finish is None:
            (token,) = gen.sample_next(logits, [seq])
            seq.add(token)
            if seq.finish is None:
                logits = gen.decode_next([seq])
        with torch.no_grad():
            lp = model(torch.tensor([seq.ids], device=plan.device))[0, :-1].float().log_softmax(-1).cpu()
    finally:
        torch.set_float32_matmul_precision(precision)
    assert isinstance(gen._step, GraphedDecode) and gen._step.graphs  # the decode replayed a graph
    assert len(seq.prompt_logprobs) == len(prompt) - 1 and len(seq.logprobs) == 6
    for pos, e in enumerate(seq.prompt_logprobs + seq.logprobs):  # entry pos predicts ids[pos + 1]
        assert e.token == seq.ids[pos + 1]
        assert e.logprob == pytest.approx(lp[pos, e.token].item(), abs=1e-4)
        assert [t for t, _ in e.top] == lp[pos].topk(len(e.top)).indices.tolist()


def test_int8_weight_only_on_the_fly_keeps_the_bf16_models_logits() -> None:
    """generate / serve --quantize int8-weight on a GPU (inference.prepare -> torchao int8 weight-only):
    every Linear holds torchao int8 weights, and the logits stay those of the bf16 model."""
    pytest.importorskip("torchao", reason="torchao is not installed (pip install 'gptopt[quant]')")
    plan = resolve()
    base = GPT(preset("debug")).eval()  # GPT-2's init: wide random weights would amplify any rounding
    ref = optimize_for_inference(copy.deepcopy(base), plan, dtype=torch.bfloat16)
    quant = optimize_for_inference(copy.deepcopy(base), plan, dtype=torch.bfloat16, quantize="int8-weight")
    linears = {n: m for n, m in quant.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head" in linears and all(type(m.weight).__module__.startswith("torchao") for m in linears.values())
    x = torch.randint(0, 512, (2, 32), device=plan.device)
    with torch.no_grad():
        want, got = ref(x).float(), quant(x).float()
    # per-channel int8 rounds each weight by at most half a step of 1/127 of its row's largest
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9


def test_the_monitor_samples_this_gpu_through_nvml() -> None:
    """bench and train record GPU figures from gptopt.runtime.monitor: on a GPU the samples carry this GPU's
    gpu{i}_* fields, with plausible values (memory in use within a total at least CUDA's, % in 0..100)."""
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install 'gptopt[gpu]')")
    plan = resolve()
    i = plan.device.index
    key = f"gpu{i}_"
    a = torch.randn(2048, 2048, device=plan.device)
    mon = Monitor(device_index=i, interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(key + "util_pct" in s for s in mon.samples()) < 3:
            a = torch.tanh(a @ a)  # keep the GPU busy while it is sampled
            plan.synchronize()
    finally:
        mon.stop()
    samples = [s for s in mon.samples() if key + "mem_total_bytes" in s]
    assert samples, mon.summary()["gpu_reason"]
    for s in samples:
        assert s[key + "mem_total_bytes"] >= 0.95 * torch.cuda.mem_get_info(plan.device)[1]
        assert 0 < s[key + "mem_used_bytes"] <= s[key + "mem_total_bytes"]  # this process's context at least
        assert 0 <= s[key + "util_pct"] <= 100 and 0 <= s[key + "mem_busy_pct"] <= 100
        assert 0 < s.get(key + "temp_c", 50) < 120 and s.get(key + "power_w", 1) > 0
    assert mon.summary()["gpu_available"]
