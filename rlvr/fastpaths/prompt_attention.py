"""Causal attention of a prompt chunk on CPU: each query to its own position, its KV head's query heads together.

:func:`prompt_attention` attends a chunk's queries (positions ``begin`` ..) over the prompt's keys so far,
query t to keys ``0 .. begin + t`` only: key blocks past a task's last position are never read, where SDPA's
CPU flash kernel computes whole blocks across the diagonal (and a later chunk's explicit mask everywhere).
A (KV head, 32 positions) task multiplies its group's query heads against each key block at once, an online
softmax between. A C++ kernel on PyTorch's threads (``rlvr.fastpaths.jit.cpp_module``), float32; where it
does not build, the engine keeps SDPA. ``bench/cpu_kernels.py`` times it against SDPA (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

import torch

from rlvr.fastpaths.jit import cpp_module

__all__ = ["cpp_built", "prompt_attention"]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// Sixteen floats as one vector (GCC/Clang vector extensions: AVX-512 registers where the CPU has them).
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4)));
constexpr int W = 16;   // floats a vector
constexpr int BQ = 32;  // query positions a task
constexpr int BK = 128; // keys a block
constexpr int TILE = 6; // query rows a micro-tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf_unaligned*>(p) = x; }
inline vf splat(float x) { return vf{} + x; }

// 2^x for x <= 0 to float32 precision (flushed at 2^-126); masked scores (-inf) come back 0.
inline vf exp2_nonpositive(vf x) {
  const vi masked = x == NEG_INF;
  x = x < -126.f ? splat(-126.f) : x;
  const vi n = __builtin_convertvector(x - 0.5f, vi);  // x rounded to nearest (x <= 0)
  const vf f = x - __builtin_convertvector(n, vf);     // in [-0.5, 0.5]
  vf p = splat(1.5403530e-4f);                          // e^(f ln 2), Taylor to degree 6
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const vi bits = (n + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return masked ? vf{} : p * two_n;
}

// S[R rows, BK] = Q[R rows, dim] . Kt[dim, BK columns at ldk].
template <int R>
inline void score_tile(const float* q, int64_t dim, const float* kt, int64_t ldk, float* s) {
  for (int c = 0; c < BK; c += 2 * W) {
    vf acc[R][2] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const vf b0 = load(kt + d * ldk + c), b1 = load(kt + d * ldk + c + W);
      for (int r = 0; r < R; ++r) {
        const vf a = splat(q[r * dim + d]);
        acc[r][0] += a * b0;
        acc[r][1] += a * b1;
      }
    }
    for (int r = 0; r < R; ++r) {
      store(s + r * BK + c, acc[r][0]);
      store(s + r * BK + c + W, acc[r][1]);
    }
  }
}

// O[R rows, NV vectors] = alpha[r] * O + P[R rows, keys] . V[keys, NV vectors at ldv].
template <int R, int NV>
inline void value_tile(const float* p, int64_t keys, const float* v, int64_t ldv, const float* alpha, float* o, int64_t ldo) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = load(o + r * ldo + c * W) * alpha[r];
  for (int64_t j = 0; j < keys; ++j) {
    vf b[NV];
    for (int c = 0; c < NV; ++c) b[c] = load(v + j * ldv + c * W);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(p[r * BK + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store(o + r * ldo + c * W, acc[r][c]);
}

template <int R>
inline void value_rows(const float* p, int64_t keys, const float* v, int64_t ldv, const float* alpha, float* o, int64_t dim) {
  for (int64_t c = 0; c < dim; c += 4 * W) {
    switch (std::min<int64_t>(4, (dim - c) / W)) {
      case 4: value_tile<R, 4>(p, keys, v + c, ldv, alpha, o + c, dim); break;
      case 3: value_tile<R, 3>(p, keys, v + c, ldv, alpha, o + c, dim); break;
      case 2: value_tile<R, 2>(p, keys, v + c, ldv, alpha, o + c, dim); break;
      default: value_tile<R, 1>(p, keys, v + c, ldv, alpha, o + c, dim); break;
    }
  }
}

// fn(std::integral_constant<int, R>, r) for the rows [0, rows) of a task in micro-tiles of R <= TILE rows.
template <typename F>
inline void for_tiles(int64_t rows, F fn) {
  int64_t r = 0;
  for (; r + TILE <= rows; r += TILE) fn(std::integral_constant<int, TILE>{}, r);
  switch (rows - r) {
    case 5: fn(std::integral_constant<int, 5>{}, r); break;
    case 4: fn(std::integral_constant<int, 4>{}, r); break;
    case 3: fn(std::integral_constant<int, 3>{}, r); break;
    case 2: fn(std::integral_constant<int, 2>{}, r); break;
    case 1: fn(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Causal attention of a prompt chunk: query t (q [T, heads, dim], float32) sits at position begin + t and
// attends keys 0 .. begin + t of k, v [KV heads, keys, dim]; query head h reads KV head h / (heads / KV heads).
// out [T, heads x dim]. Each task is (KV head, BQ query positions): the group's query heads together
// (GQA), key blocks up to the task's last position only, an online softmax in base 2.
void prompt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t begin, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 &&
                  out.scalar_type() == torch::kFloat32, "float32 q, k, v and out");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "q [tokens, heads, dim], k and v [KV heads, keys, dim], each head vector contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0), keys = k.size(1);
  TORCH_CHECK(dim % W == 0 && k.size(2) == dim && v.sizes() == k.sizes() && heads % kv_heads == 0, "head dim a multiple of 16, k and v alike");
  TORCH_CHECK(begin >= 0 && begin + tokens <= keys, "every query's position within the keys");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == tokens && out.size(1) == heads * dim, "out [tokens, heads x dim], contiguous");
  const int64_t group = heads / kv_heads, padded = (keys + BK - 1) / BK * BK;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // keys transposed, [KV heads, dim, padded], zeros past the last key
  std::vector<float> kt(kv_heads * dim * padded, 0.f);
  at::parallel_for(0, kv_heads * dim, 1, [&](int64_t a, int64_t b) {
    for (int64_t gd = a; gd < b; ++gd) {
      const int64_t g = gd / dim, d = gd % dim;
      float* row = kt.data() + gd * padded;
      for (int64_t j = 0; j < keys; ++j) row[j] = kp[g * k.stride(0) + j * k.stride(1) + d];
    }
  });
  const float qscale = static_cast<float>(scale * 1.4426950408889634);  // scores in base 2
  const int64_t blocks = (tokens + BQ - 1) / BQ, tasks = blocks * kv_heads;
  std::atomic<int64_t> next{0};
  const int threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t rows_max = group * BQ;
    std::vector<float> qb(rows_max * dim), ob(rows_max * dim), s(rows_max * BK), m(rows_max), l(rows_max), alpha(rows_max);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t block = blocks - 1 - task / kv_heads, g = task % kv_heads;  // the longest blocks first
      const int64_t t0 = block * BQ, span = std::min<int64_t>(BQ, tokens - t0), rows = group * span;
      for (int64_t r = 0; r < rows; ++r) {  // row r: query head g * group + r / span, token t0 + r % span
        const float* src = qp + (t0 + r % span) * q.stride(0) + (g * group + r / span) * q.stride(1);
        for (int64_t d = 0; d < dim; ++d) qb[r * dim + d] = src[d] * qscale;
      }
      std::fill(ob.begin(), ob.begin() + rows * dim, 0.f);
      std::fill(m.begin(), m.begin() + rows, NEG_INF);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t first = begin + t0, last = first + span - 1;  // the task's positions
      const float* ktg = kt.data() + g * dim * padded;
      const float* vg = vp + g * v.stride(0);
      for (int64_t j0 = 0; j0 <= last; j0 += BK) {
        const int64_t valid = std::min<int64_t>(BK, last + 1 - j0);  // keys past `last` are masked for every row
        for_tiles(rows, [&](auto tile, int64_t r) { score_tile<decltype(tile)::value>(qb.data() + r * dim, dim, ktg + j0, padded, s.data() + r * BK); });
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.data() + r * BK;
          const int64_t visible = std::min<int64_t>(valid, first + r % span - j0 + 1);  // keys j0 .. position
          for (int64_t c = std::max<int64_t>(visible, 0); c < BK; ++c) sr[c] = NEG_INF;
          vf top = splat(NEG_INF);
          for (int c = 0; c < BK; c += W) top = top > load(sr + c) ? top : load(sr + c);
          float block_max = NEG_INF;
          for (int i = 0; i < W; ++i) block_max = std::max(block_max, top[i]);
          const float m_new = std::max(m[r], block_max);
          vf sum{};  // m_new is finite: block 0 shows every row key 0
          for (int c = 0; c < BK; c += W) {
            const vf p = exp2_nonpositive(load(sr + c) - m_new);
            store(sr + c, p);
            sum += p;
          }
          float total = 0.f;
          for (int i = 0; i < W; ++i) total += sum[i];
          alpha[r] = std::exp2(m[r] - m_new);
          l[r] = l[r] * alpha[r] + total;
          m[r] = m_new;
        }
        const float* vj = vg + j0 * v.stride(1);
        for_tiles(rows, [&](auto tile, int64_t r) {
          value_rows<decltype(tile)::value>(s.data() + r * BK, valid, vj, v.stride(1), alpha.data() + r, ob.data() + r * dim, dim);
        });
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = op + (t0 + r % span) * heads * dim + (g * group + r / span) * dim;
        const float inverse = 1.f / l[r];
        for (int64_t d = 0; d < dim; ++d) dst[d] = ob[r * dim + d] * inverse;
      }
    }
  });
}
"""


def cpp_built() -> bool:
    """Whether the C++ kernel is built here (built at the first ask)."""
    return _module() is not None


def _module() -> Any:
    return cpp_module("prompt attention's C++ kernel", "rlvr_prompt_attention_", SOURCE, ("prompt_attention",))


def prompt_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, begin: int, scale: float) -> torch.Tensor:
    """Query t of ``queries`` [tokens, heads, head dim] (at position ``begin`` + t) attends over ``keys`` and
    ``values`` [KV heads, keys >= begin + tokens, head dim] at positions ``0 .. begin + t``, query head h over
    KV head h // (heads / KV heads), all float32 (head dim a multiple of 16).
    Returns [tokens, heads x head dim]. Needs the C++ kernel (:func:`cpp_built`)."""
    module = _module()
    if module is None:
        raise RuntimeError("prompt attention needs its C++ kernel, which is not built here (no C++ compiler, or the build failed)")
    tokens, heads, head_dim = queries.shape
    out = torch.empty(tokens, heads * head_dim)
    queries, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (queries, keys, values))
    module.prompt_attention(queries, keys, values, begin, scale, out)
    return out


if __name__ == "__main__":  # `make setup`: build the C++ kernel once for this machine, or say why SDPA runs
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("prompt attention:", "C++ kernel built" if cpp_built() else "SDPA (no C++ kernel)")
