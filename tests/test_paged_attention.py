"""The CPU decode attention that reads the KV blocks in place: the same output as SDPA over the gathered blocks, in
fp32 and bf16 pools, under grouped-query attention, for rows of different lengths; and a Generator decodes the same
tokens with it and without it.

    pytest -q tests/test_paged_attention.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_varied_model

from gptopt.infer import paged_attention
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.runtime.device import resolve

needs_kernel = pytest.mark.skipif(paged_attention.kernel() is None, reason="the kernel could not be built here")


def gathered(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
             ) -> torch.Tensor:
    """SDPA over each row's blocks gathered in table order, row by row: the reference."""
    B, nh, _, hs = q.shape
    nkv = kp.shape[2]
    out = []
    for b in range(B):
        S = int(lengths[b])
        k = kp[tables[b]].reshape(-1, nkv, hs)[:S].transpose(0, 1).float()
        v = vp[tables[b]].reshape(-1, nkv, hs)[:S].transpose(0, 1).float()
        out.append(F.scaled_dot_product_attention(q[b].reshape(nkv, nh // nkv, hs), k, v).reshape(nh, 1, hs))
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("nh", "nkv", "hs"), [(6, 2, 64), (4, 4, 32), (16, 8, 128)])
def test_the_kernel_gives_sdpas_output_over_the_gathered_blocks(dtype: torch.dtype, nh: int, nkv: int, hs: int) -> None:
    torch.manual_seed(0)
    bs, W, N = 8, 6, 30
    kp, vp = torch.randn(N, bs, nkv, hs).to(dtype), torch.randn(N, bs, nkv, hs).to(dtype)
    tables = torch.randperm(N - 1)[: 3 * W].view(3, W) + 1  # blocks anywhere in the pool, in no order
    lengths = torch.tensor([W * bs, 1, 19])  # a full table, one key, a block and a bit
    q = torch.randn(3, nh, 1, hs)
    got = paged_attention.decode_attention(q, kp, vp, tables, lengths)
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got, gathered(q, kp, vp, tables, lengths), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_generator_decodes_the_same_tokens_with_the_kernel_and_with_the_gather(monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    model = make_varied_model(320, "llama")  # grouped-query attention, rotary positions
    prompts = [[5, 9, 11] * 7, [2, 3], list(range(40, 70))]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    cpu = resolve("cpu", quiet=True)
    calls = []
    kernel = paged_attention.decode_attention

    def counted(*args: object) -> object:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_attention, "decode_attention", counted)
    in_place = generate(Generator(model, cpu, max_batch_size=3, max_len=64, block_size=8), prompts, params)
    assert calls  # the decode steps did read the blocks in place
    monkeypatch.setattr(paged_attention, "kernel", lambda: None)
    assert generate(Generator(model, cpu, max_batch_size=3, max_len=64, block_size=8), prompts, params) == in_place
