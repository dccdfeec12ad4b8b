"""Decode attention over the continuous engine's row slots on CPU, each row read to its own length.

:func:`slot_attention` writes each row's new key and value into its slot and streams its keys and values
once each (its query heads together), to the row's own length, where SDPA reads every row of a lane to
its longest row under a mask: in float32 over float32 or bf16 slots, a C++ kernel whose (row, KV head)
tasks run on PyTorch's threads where it builds here (``rlvr.fastpaths.jit.cpp_module``), else (float32
only) numba's on one thread, the GIL released.
``bench/cpu_kernels.py`` times it against SDPA (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlvr.fastpaths.jit import available, compiled, cpp_module

__all__ = ["available", "cpp_built", "slot_attention"]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

// One head vector as float32: float32 ones in place, others converted into buffer.
template <typename T>
inline const float* as_float(const T* vector, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return vector;
  } else {
    for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(vector[d]);
    return buffer;
  }
}

// Row r's new key and value go into slot r of k and v [slots, KV heads, positions, dim] (T: float or bf16) at
// positions[r]; its query heads q[r] [heads, dim] (float32) attend over the slot's positions 0 .. positions[r]
// (query head h reads KV head h / (heads / KV heads)) into out[r] (float32), in float32. One (row, KV head) a
// task: its keys and values read once.
template <typename T>
void attend_slots(const torch::Tensor& q, const torch::Tensor& new_k, const torch::Tensor& new_v, torch::Tensor& k, torch::Tensor& v,
                  const torch::Tensor& positions, double scale, torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, pos[r] + 1);
  TORCH_CHECK(rows <= k.size(0) && longest <= k.size(2), "rows and positions within the slots");
  const int64_t s0 = k.stride(0), s1 = k.stride(1), s2 = k.stride(2);
  const float* qp = q.data_ptr<float>();
  const T *nk = new_k.data_ptr<T>(), *nv = new_v.data_ptr<T>();
  T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * longest), acc(group * dim), inverse(group), row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads, n = pos[r] + 1;
      T* keys = kp + r * s0 + h * s1;
      T* values = vp + r * s0 + h * s1;
      std::copy(nk + task * dim, nk + (task + 1) * dim, keys + (n - 1) * s2);
      std::copy(nv + task * dim, nv + (task + 1) * dim, values + (n - 1) * s2);
      const float* query = qp + (r * heads + h * group) * dim;
      for (int64_t j = 0; j < n; ++j) {
        const float* key = as_float(keys + j * s2, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query + g * dim;
          float s = 0.f;
          #pragma omp simd reduction(+:s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * key[d];
          scores[g * n + j] = s * fscale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        const float top = *std::max_element(sg, sg + n);
        float sum = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - top);
          sum += sg[j];
        }
        inverse[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float* value = as_float(values + j * s2, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * n + j];
          float* a = acc.data() + g * dim;
          #pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += w * value[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (r * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] * inverse[g];
      }
    }
  });
}

void slot_attention(const torch::Tensor& q, const torch::Tensor& new_k, const torch::Tensor& new_v, torch::Tensor& k, torch::Tensor& v,
                    const torch::Tensor& positions, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && new_k.is_contiguous() && new_v.is_contiguous() && out.is_contiguous(), "contiguous q, new_k, new_v, out");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32, "float32 q and out");
  TORCH_CHECK(k.stride(3) == 1 && k.strides() == v.strides() && k.sizes() == v.sizes(), "k and v alike, each head vector contiguous");
  const auto dtype = k.scalar_type();
  TORCH_CHECK(new_k.scalar_type() == dtype && new_v.scalar_type() == dtype && v.scalar_type() == dtype, "keys and values of one dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == q.size(0), "int64 positions, one a row");
  if (dtype == torch::kFloat32) {
    attend_slots<float>(q, new_k, new_v, k, v, positions, scale, out);
  } else {
    TORCH_CHECK(dtype == torch::kBFloat16, "float32 or bfloat16 keys and values");
    attend_slots<c10::BFloat16>(q, new_k, new_v, k, v, positions, scale, out);
  }
}
"""


def cpp_built() -> bool:
    """Whether the C++ kernel is built here (built at the first ask): bf16 slots need it."""
    return _module() is not None


def _module() -> Any:
    return cpp_module("slot attention's C++ kernel", "rlvr_slot_attention_", SOURCE, ("slot_attention",), ("-ffast-math",))


def slot_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_slots: torch.Tensor,
    value_slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Row r's new ``keys``/``values`` [rows, KV heads, head dim] go into slot r of ``key_slots``/
    ``value_slots`` [slots >= rows, KV heads, positions, head dim] (float32, or bf16 through the C++
    kernel; each head vector contiguous) at ``positions[r]``, then its ``queries`` [rows, heads, head dim]
    attend over the slot's positions ``0 .. positions[r]`` in float32; query head h reads KV head
    h // (heads / KV heads). Returns float32 [rows, heads x head dim]."""
    rows, heads, head_dim = queries.shape
    out = torch.empty(rows, heads, head_dim)
    if (module := _module()) is not None:
        module.slot_attention(queries.float().contiguous(), keys.contiguous(), values.contiguous(), key_slots, value_slots, positions.contiguous(), scale, out)
        return out.view(rows, heads * head_dim)
    if key_slots.dtype != torch.float32:
        raise ValueError(f"slot attention over {key_slots.dtype} slots needs the C++ kernel (numba's is float32 only); it is not built here")
    positions_np = positions.numpy()
    scores = torch.empty(rows, heads, int(positions.max()) + 1)
    _store_and_score(queries.contiguous().numpy(), keys.contiguous().numpy(), key_slots.numpy(), positions_np, np.float32(scale), scores.numpy())
    weights = torch.softmax(scores, dim=-1)
    _store_and_weigh(weights.numpy(), values.contiguous().numpy(), value_slots.numpy(), positions_np, out.numpy())
    return out.view(rows, heads * head_dim)


# Scores past a row's length get the lowest float32, which the softmax turns into a zero weight: no
# infinity or NaN is made here, so every fast-math assumption holds (and sums vectorize).
PADDING_SCORE = np.float32(np.finfo(np.float32).min)


@compiled
def _store_and_score(q, new_k, k, positions, scale, scores):  # pragma: no cover - compiled
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    for r in range(rows):
        n = positions[r] + 1
        for h in range(kv_heads):
            k[r, h, n - 1] = new_k[r, h]
            for j in range(n):
                key = k[r, h, j]
                for g in range(group):
                    query = q[r, h * group + g]
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += query[d] * key[d]
                    scores[r, h * group + g, j] = s * scale
            for g in range(group):
                for j in range(n, scores.shape[2]):
                    scores[r, h * group + g, j] = PADDING_SCORE


@compiled
def _store_and_weigh(p, new_v, v, positions, out):  # pragma: no cover - compiled
    rows, heads, head_dim = out.shape
    kv_heads = v.shape[1]
    group = heads // kv_heads
    for r in range(rows):
        n = positions[r] + 1
        for h in range(kv_heads):
            v[r, h, n - 1] = new_v[r, h]
            acc = np.zeros((group, head_dim), np.float32)
            for j in range(n):
                value = v[r, h, j]
                for g in range(group):
                    weight = p[r, h * group + g, j]
                    for d in range(head_dim):
                        acc[g, d] += weight * value[d]
            for g in range(group):
                for d in range(head_dim):
                    out[r, h * group + g, d] = acc[g, d]


if __name__ == "__main__":  # `make setup`: build the C++ kernel once for this machine, or say why numba's runs
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("slot attention:", "C++ kernel built" if _module() is not None else "numba's kernel (one thread)")
