"""gptopt's C++ kernels for CPU inference, one extension built on first use with torch's cpp_extension and cached
by CPU kind: the paged decode attention (paged_attention.py: from the model's queries, or straight from c_attn's
output, the keys and values written to their blocks in the same call) and the fused elementwise steps of the Llama- and
Qwen3-shaped blocks (cpu_fused.py).

    python -c "from gptopt.infer.cpu_kernels import extension; print(extension())"

An eager decode step of a small model at a few rows is more launches than arithmetic: RMSNorm computed in fp32 and
cast back, the residual add before it, and rotary's half-rotation are a dozen aten calls per layer, each a pass over
a small tensor and a trip through the dispatcher. These kernels do each group in one pass, in fp32, storing in the
model's dtype what the aten calls would have stored:
- add_rms_norm(x, r, w, eps): x += r in place (r optional), returns rms_norm(x) * w;
- qk_rope_(qkv, cos, sin, qw, kw, nh, nkv, hs, eps): on c_attn's output in place, each query and key head
  RMS-normed (Qwen3's qk-norm; qw, kw optional) and then rotated (rotate-half convention; cos, sin (M, hs) fp32,
  row n of qkv taking row n % M), the values left alone.
One extension so that a machine pays one build. Where it cannot be built (no compiler, no ninja, a read-only
home), extension() is None after one log line saying why, and the callers run the aten ops instead.
GPTOPT_CPU_KERNELS=0 turns the extension off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["extension"]

log = logging.getLogger("gptopt")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstring>
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

template <typename T>
static void split_qkv(const T* qkv, T* kp, T* vp, const int64_t* write, float* q, int64_t B, int64_t W, int64_t nh,
                      int64_t nkv, int64_t hs) {
  const int64_t row = nkv * hs;
  for (int64_t b = 0; b < B; ++b) {
    const T* x = qkv + b * W;
    for (int64_t d = 0; d < nh * hs; ++d) q[b * nh * hs + d] = static_cast<float>(x[d]);
    std::memcpy(kp + write[b] * row, x + nh * hs, row * sizeof(T));
    std::memcpy(vp + write[b] * row, x + nh * hs + row, row * sizeof(T));
  }
}

// A decode step straight from c_attn's output. qkv: (B, W) contiguous, one token a row, its first (nh + 2 nkv) hs
// columns the (rotated) queries, keys and values; k_pool, v_pool: (blocks, bs, nkv, hs) of qkv's dtype; write: (B,)
// int64, each row's pool row (block x bs + offset); tables, lengths: as paged_decode's, lengths counting the new
// token. Writes each row's key and value, and returns the attention's output (B, nh x hs) in qkv's dtype.
torch::Tensor paged_decode_qkv(torch::Tensor qkv, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor write,
                               torch::Tensor tables, torch::Tensor lengths, int64_t nh, int64_t nkv, double scale) {
  TORCH_CHECK(qkv.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && write.is_contiguous()
              && tables.is_contiguous() && lengths.is_contiguous(), "paged_decode_qkv takes contiguous tensors");
  TORCH_CHECK(qkv.dim() == 2 && k_pool.scalar_type() == qkv.scalar_type() && v_pool.scalar_type() == qkv.scalar_type(),
              "paged_decode_qkv: qkv (B, W) and pools of one dtype");
  const int64_t B = qkv.size(0), W = qkv.size(1), bs = k_pool.size(1), hs = k_pool.size(3);
  TORCH_CHECK(k_pool.size(2) == nkv && nh % nkv == 0 && W >= (nh + 2 * nkv) * hs && write.numel() == B,
              "paged_decode_qkv: heads do not match");
  auto q = torch::empty({B, nh, hs}, qkv.options().dtype(at::kFloat));
  auto out = torch::empty({B, nh, hs}, q.options());
  const int64_t* w = write.data_ptr<int64_t>();
  if (qkv.scalar_type() == at::kFloat) {
    split_qkv<float>(qkv.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), w, q.data_ptr<float>(),
                     B, W, nh, nkv, hs);
    dispatch<float>(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tables.data_ptr<int64_t>(),
                    lengths.data_ptr<int64_t>(), out.data_ptr<float>(), B, nh, nkv, hs, bs, tables.size(1), scale);
    return out.view({B, nh * hs});
  }
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "paged_decode_qkv takes float32 or bfloat16");
  using B16 = c10::BFloat16;
  split_qkv<B16>(qkv.data_ptr<B16>(), k_pool.data_ptr<B16>(), v_pool.data_ptr<B16>(), w, q.data_ptr<float>(), B, W,
                 nh, nkv, hs);
  dispatch<B16>(q.data_ptr<float>(), k_pool.data_ptr<B16>(), v_pool.data_ptr<B16>(), tables.data_ptr<int64_t>(),
                lengths.data_ptr<int64_t>(), out.data_ptr<float>(), B, nh, nkv, hs, bs, tables.size(1), scale);
  return out.view({B, nh * hs}).to(at::kBFloat16);
}

// ---- the fused elementwise steps of a Llama/Qwen3 block -----------------------------------------------------------
// bf16 <-> fp32 by bits (round to nearest even, as c10::BFloat16 does), so that the compiler vectorises the loops.

static inline float ld(float x) { return x; }
static inline float ld(c10::BFloat16 h) {
  const uint32_t u = static_cast<uint32_t>(h.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline void st(float* p, float f) { *p = f; }
static inline void st(c10::BFloat16* p, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  p->x = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                          : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Elements a task takes before a parallel region pays for itself.
constexpr int64_t kGrainElements = 16384;

template <typename T>
static void add_rms_norm_impl(T* x, const T* r, const T* w, T* out, int64_t N, int64_t C, float eps) {
  at::parallel_for(0, N, std::max<int64_t>(1, kGrainElements / C), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(C);
    float* f = buf.data();
    for (int64_t n = begin; n < end; ++n) {
      T* xn = x + n * C;
      if (r != nullptr) {
        const T* rn = r + n * C;
        for (int64_t d = 0; d < C; ++d) st(xn + d, ld(xn[d]) + ld(rn[d]));  // the sum, stored in T
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < C; ++d) {
        f[d] = ld(xn[d]);
        ss += f[d] * f[d];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
      T* on = out + n * C;
      for (int64_t d = 0; d < C; ++d) st(on + d, f[d] * inv * ld(w[d]));
    }
  });
}

// x: (N, C) contiguous, float32 or bfloat16; r: like x or empty; w: (C,) of x's dtype. x += r in place.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && (r.numel() == 0 || r.is_contiguous()),
              "add_rms_norm takes contiguous tensors");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && (r.numel() == 0 || r.scalar_type() == x.scalar_type()),
              "add_rms_norm: one dtype");
  const int64_t C = x.size(-1), N = x.numel() / C;
  TORCH_CHECK(w.numel() == C && (r.numel() == 0 || r.numel() == x.numel()), "add_rms_norm: shapes do not match");
  auto out = torch::empty_like(x);
  const bool has_r = r.numel() > 0;
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x.data_ptr<float>(), has_r ? r.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                             out.data_ptr<float>(), N, C, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm takes float32 or bfloat16");
    using B16 = c10::BFloat16;
    add_rms_norm_impl<B16>(x.data_ptr<B16>(), has_r ? r.data_ptr<B16>() : nullptr, w.data_ptr<B16>(),
                           out.data_ptr<B16>(), N, C, static_cast<float>(eps));
  }
  return out;
}

template <typename T>
static void qk_rope_impl(T* qkv, const float* cos, const float* sin, const T* qw, const T* kw, int64_t N, int64_t W,
                         int64_t nh, int64_t nkv, int64_t hs, int64_t M, float eps) {
  const int64_t heads = nh + nkv, half = hs / 2;
  at::parallel_for(0, N * heads, std::max<int64_t>(1, kGrainElements / hs), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hs), nbuf(hs);
    float* f = buf.data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / heads, h = i % heads;
      T* x = qkv + n * W + h * hs;
      for (int64_t d = 0; d < hs; ++d) f[d] = ld(x[d]);
      const T* nw = h < nh ? qw : kw;
      if (nw != nullptr) {  // the head's RMSNorm, rounded to T as the model's q_norm / k_norm store it
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < hs; ++d) ss += f[d] * f[d];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(hs) + eps);
        for (int64_t d = 0; d < hs; ++d) {
          T t;
          st(&t, f[d] * inv * ld(nw[d]));
          f[d] = ld(t);
        }
      }
      const float* c = cos + (n % M) * hs;
      const float* s = sin + (n % M) * hs;
      for (int64_t d = 0; d < half; ++d) st(x + d, f[d] * c[d] - f[d + half] * s[d]);
      for (int64_t d = half; d < hs; ++d) st(x + d, f[d] * c[d] + f[d - half] * s[d]);
    }
  });
}

// qkv: (N, W) contiguous, its first (nh + nkv) * hs columns the query and key heads; cos, sin: (M, hs) float32;
// qw, kw: (hs,) of qkv's dtype, or empty for no qk-norm.
void qk_rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor qw, torch::Tensor kw,
              int64_t nh, int64_t nkv, int64_t hs, double eps) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "qk_rope_ takes contiguous tensors");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(-1) == hs
              && sin.sizes() == cos.sizes() && hs % 2 == 0, "qk_rope_: cos and sin are (M, hs) float32");
  const int64_t W = qkv.size(-1), N = qkv.numel() / W, M = cos.numel() / hs;
  TORCH_CHECK(W >= (nh + nkv) * hs && M > 0, "qk_rope_: heads do not fit the rows");
  const bool norm = qw.numel() > 0;
  TORCH_CHECK(!norm || (qw.numel() == hs && kw.numel() == hs && qw.scalar_type() == qkv.scalar_type()
                        && kw.scalar_type() == qkv.scalar_type()), "qk_rope_: norm weights are (hs,) of qkv's dtype");
  if (qkv.scalar_type() == at::kFloat) {
    qk_rope_impl<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                        norm ? qw.data_ptr<float>() : nullptr, norm ? kw.data_ptr<float>() : nullptr, N, W, nh, nkv,
                        hs, M, static_cast<float>(eps));
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "qk_rope_ takes float32 or bfloat16");
    using B16 = c10::BFloat16;
    qk_rope_impl<B16>(qkv.data_ptr<B16>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                      norm ? qw.data_ptr<B16>() : nullptr, norm ? kw.data_ptr<B16>() : nullptr, N, W, nh, nkv, hs, M,
                      static_cast<float>(eps));
  }
}
"""

_FUNCTIONS = ["paged_decode", "paged_decode_qkv", "add_rms_norm", "qk_rope_"]

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
def extension() -> Any:
    """The built extension (its functions: _FUNCTIONS), or None where it cannot be built (logged once, with the
    reason) or GPTOPT_CPU_KERNELS=0 turns it off."""
    if os.environ.get("GPTOPT_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        name = f"gptopt_cpu_{_cpu_kind()}"
        build = Path(os.environ.get("GPTOPT_CACHE", Path.home() / ".cache" / "gptopt")) / "cpu_kernels" / name
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load_inline(name, cpp_sources=_SOURCE, functions=_FUNCTIONS, extra_cflags=_FLAGS,
                                         extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only home: the aten paths still serve
        log.warning("gptopt's CPU kernels could not be built (%s: %s); decode steps gather their KV blocks first "
                    "(slower at long contexts) and the Llama/Qwen3 blocks run their norms and rotary as aten ops. "
                    "Install a C++ compiler and ninja (pip install ninja) to build them", type(e).__name__,
                    (str(e).splitlines() or [""])[0])
        return None
