"""A decode step's attention read from the KV blocks where they lie, on CPUs: one pass over each row's keys and
values, none gathered first.

    pytest -q tests/test_paged_attention.py

The generic path (kv_cache.py) gathers each row's blocks into one tensor and hands it to SDPA: a copy of every
attended key and value, each step. A decode step's attention is little arithmetic on many bytes, so that copy would
cost as much as the attention itself at long contexts, where the keys outweigh the weights. vLLM's CPU build and
llama.cpp read their blocks in place with kernels of their own; torch has none for CPUs outside a compiled
FlexAttention, so this is a small C++ kernel (one (row, key/value head) per task: its query heads' scores over the
row's positions, the softmax, the weighted values), built on first use with torch's cpp_extension and cached by CPU
kind. Where it cannot be built (no compiler, no ninja), `kernel()` is None and the generic path serves, after one
log line saying so and why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["decode_attention", "kernel"]

log = logging.getLogger("gptopt")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <vector>

template <typename T>
static inline const float* as_float(const T* x, float* buf, int64_t n) {
  for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<float>(x[d]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* x, float*, int64_t) { return x; }

// HS > 0: the head size known when compiled (its loops unrolled and vectorized), else hs at run time
template <typename T, int64_t HS>
static void decode(const float* q, const T* kp, const T* vp, const int64_t* tables, const int64_t* lengths,
                   float* out, int64_t B, int64_t nh, int64_t nkv, int64_t hs_, int64_t bs, int64_t W, float scale) {
  const int64_t hs = HS > 0 ? HS : hs_;
  const int64_t g = nh / nkv, row = nkv * hs;
  at::parallel_for(0, B * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(g * hs), buf(hs), inv(g);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / nkv, h = i % nkv, S = lengths[b];
      const float* qb = q + (b * nh + h * g) * hs;  // the head's g query heads, one after another
      const int64_t* table = tables + b * W;
      scores.resize(S * g);  // position-major: a position's g scores side by side
      float* sc = scores.data();
      for (int64_t blk = 0, s = 0; s < S; ++blk) {
        const T* k = kp + table[blk] * bs * row + h * hs;
        for (int64_t t = 0; t < bs && s < S; ++t, ++s, k += row) {
          const float* kf = as_float<T>(k, buf.data(), hs);
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = qb + j * hs;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < hs; ++d) dot += qj[d] * kf[d];
            sc[s * g + j] = dot * scale;
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float m = -INFINITY, sum = 0.f;
        for (int64_t s = 0; s < S; ++s) m = sc[s * g + j] > m ? sc[s * g + j] : m;
        for (int64_t s = 0; s < S; ++s) { const float e = std::exp(sc[s * g + j] - m); sc[s * g + j] = e; sum += e; }
        inv[j] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0, s = 0; s < S; ++blk) {
        const T* v = vp + table[blk] * bs * row + h * hs;
        for (int64_t t = 0; t < bs && s < S; ++t, ++s, v += row) {
          const float* vf = as_float<T>(v, buf.data(), hs);
          for (int64_t j = 0; j < g; ++j) {
            const float w = sc[s * g + j];
            float* a = acc.data() + j * hs;
#pragma omp simd
            for (int64_t d = 0; d < hs; ++d) a[d] += w * vf[d];
          }
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < hs; ++d) out[(b * nh + h * g + j) * hs + d] = acc[j * hs + d] * inv[j];
    }
  });
}

template <typename T>
static void dispatch(const float* q, const T* kp, const T* vp, const int64_t* tables, const int64_t* lengths,
                     float* out, int64_t B, int64_t nh, int64_t nkv, int64_t hs, int64_t bs, int64_t W, float scale) {
  if (hs == 64) decode<T, 64>(q, kp, vp, tables, lengths, out, B, nh, nkv, hs, bs, W, scale);
  else if (hs == 128) decode<T, 128>(q, kp, vp, tables, lengths, out, B, nh, nkv, hs, bs, W, scale);
  else decode<T, 0>(q, kp, vp, tables, lengths, out, B, nh, nkv, hs, bs, W, scale);
}

// q: (B, nh, hs) float32; k_pool, v_pool: (blocks, bs, nkv, hs) float32 or bfloat16; tables: (B, W) int64;
// lengths: (B,) int64, keys each row attends. Returns (B, nh, hs) float32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor tables,
                           torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous()
              && lengths.is_contiguous(), "paged_decode takes contiguous tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode's queries are float32");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2), bs = k_pool.size(1), nkv = k_pool.size(2);
  TORCH_CHECK(nh % nkv == 0 && k_pool.size(3) == hs, "paged_decode: heads do not match");
  auto out = torch::empty_like(q);
  if (k_pool.scalar_type() == at::kFloat) {
    dispatch<float>(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tables.data_ptr<int64_t>(),
                  lengths.data_ptr<int64_t>(), out.data_ptr<float>(), B, nh, nkv, hs, bs, tables.size(1), scale);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16, "paged_decode's pool is float32 or bfloat16");
    dispatch<c10::BFloat16>(q.data_ptr<float>(), k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>(),
                          tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<float>(), B, nh, nkv,
                          hs, bs, tables.size(1), scale);
  }
  return out;
}
"""

# Flags the build is tuned with: the machine's own instruction set, so the build is cached per CPU kind (a build
# for one CPU may not run on another: a copied cache, a home directory shared between machines).
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_kind() -> str:
    """A digest of the CPU's model and instruction sets (Linux), else of the platform's processor string."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=6).hexdigest()


@functools.cache
def kernel() -> Any:
    """The built kernel (paged_decode), or None where it cannot be built (logged once, with the reason)."""
    if os.environ.get("GPTOPT_PAGED_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        build = Path(os.environ.get("GPTOPT_CACHE", Path.home() / ".cache" / "gptopt")) / "paged_attention"
        name = f"gptopt_paged_{_cpu_kind()}"
        build = build / name
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load_inline(name, cpp_sources=_SOURCE, functions=["paged_decode"],
                                         extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                                         build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only home: the generic path still serves
        log.warning("the CPU paged-attention kernel could not be built (%s: %s); decode steps gather their KV "
                    "blocks first, slower at long contexts. Install a C++ compiler and ninja (pip install ninja) "
                    "to build it", type(e).__name__, (str(e).splitlines() or [""])[0])
        return None


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(hs)) v of a decode step, q (B, nh, 1, hs), each row over its first lengths[b] positions
    of the blocks tables[b] lists: (B, nh, 1, hs) in q's dtype. None where the kernel does not apply (not a CPU,
    not float32 or bfloat16, not built): the caller gathers instead."""
    if q.device.type != "cpu" or k_pool.dtype not in (torch.float32, torch.bfloat16):
        return None
    k = kernel()
    if k is None:
        return None
    B, nh, _, hs = q.shape
    out = k.paged_decode(q.reshape(B, nh, hs).float().contiguous(), k_pool, v_pool, tables, lengths, hs**-0.5)
    return out.view(B, nh, 1, hs).to(q.dtype)
