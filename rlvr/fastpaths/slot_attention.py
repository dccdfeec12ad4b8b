"""Decode attention over the continuous engine's row slots on CPU, each row read to its own length.

:func:`slot_attention` writes each row's new key and value into its slot and streams its keys and values
to the row's own length, where SDPA reads every row of a lane to its longest row under a mask; the rows
of one request read its prompt from one slot, one after another, so it streams from memory once. In
float32 over float32 or bf16 slots: a C++ kernel on PyTorch's threads (heads 16 to 128 wide in 16s: 16 keys'
scores summed across lanes at once, weighted values summed in registers) where it builds (``rlvr.fastpaths.jit.cpp_module``),
else (float32 only) numba's on one thread, the GIL released, each row from its own slot.
``bench/cpu_kernels.py`` times it against SDPA (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from rlvr.fastpaths.jit import available, compiled, cpp_module

__all__ = ["PromptSlots", "available", "cpp_built", "prompt_slots", "slot_attention"]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <utility>
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

// A (row, KV head)'s keys or values: positions before `split` (its prompt's) read from the slot of the row that
// holds them for its request, the rest from its own slot.
template <typename T>
struct Positions {
  const T* shared;
  const T* own;
  int64_t stride, split;
  const T* at(int64_t j) const { return (j < split ? shared : own) + j * stride; }
};

typedef float vf __attribute__((vector_size(64)));  // 16 float32 lanes: one AVX-512 register, two or four narrower ones elsewhere
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4)));
typedef int vi __attribute__((vector_size(64)));
constexpr int W = 16;

typedef unsigned short vbf16 __attribute__((vector_size(32)));  // 16 bf16 values
typedef unsigned short vbf16_unaligned __attribute__((vector_size(32), aligned(2)));
typedef unsigned int vu __attribute__((vector_size(64)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline vf load(const c10::BFloat16* p) {  // a bf16 is a float32's top 16 bits
  return (vf)(__builtin_convertvector(*reinterpret_cast<const vbf16_unaligned*>(p), vu) << 16);
}
inline void store(float* p, vf x) { *reinterpret_cast<vf_unaligned*>(p) = x; }

#if defined(__GNUC__) && !defined(__clang__)
template <int B, int... t>
constexpr vi fold_x(std::integer_sequence<int, t...>) { return vi{((t / B) % 2 == 0 ? t : W + t - B)...}; }
template <int B, int... t>
constexpr vi fold_y(std::integer_sequence<int, t...>) { return vi{((t / B) % 2 == 0 ? t + B : W + t)...}; }

// a and b folded at block size B: block 2k of the result sums a's blocks 2k and 2k + 1, block 2k + 1 b's.
template <int B>
inline vf fold(vf a, vf b) {
  constexpr vi x = fold_x<B>(std::make_integer_sequence<int, W>{}), y = fold_y<B>(std::make_integer_sequence<int, W>{});
  return __builtin_shuffle(a, b, x) + __builtin_shuffle(a, b, y);
}

// The lane sums of v[0 .. 16) in one vector, v[i]'s in lane lane_of[i] (lane_order), by 15 folds, not 16 reductions.
inline vf lane_sums(const vf* v) {
  vf s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = fold<8>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) s4[i] = fold<4>(s8[2 * i], s8[2 * i + 1]);
  for (int i = 0; i < 2; ++i) s2[i] = fold<2>(s4[2 * i], s4[2 * i + 1]);
  return fold<1>(s2[0], s2[1]);
}

inline vf reordered(vf sums, const vi& lane_of) { return __builtin_shuffle(sums, lane_of); }
#else  // other compilers: one reduction a vector
inline vf lane_sums(const vf* v) {
  vf sums;
  for (int i = 0; i < W; ++i) {
    float s = 0.f;
    for (int l = 0; l < W; ++l) s += v[i][l];
    sums[i] = s;
  }
  return sums;
}

inline vf reordered(vf sums, const vi& lane_of) {
  vf out;
  for (int l = 0; l < W; ++l) out[l] = sums[lane_of[l]];
  return out;
}
#endif

// reordered(lane_sums(v), lane_of) holds v[i]'s sum in lane i.
static vi lane_order() {
  vf v[W] = {};
  for (int i = 0; i < W; ++i) v[i][0] = float(i);
  const vf sums = lane_sums(v);
  vi lane_of{};
  for (int l = 0; l < W; ++l) lane_of[int(sums[l])] = l;
  return lane_of;
}

template <int C, typename T>
inline vf products(const vf* q, const T* key) {
  vf a = q[0] * load(key);
  for (int c = 1; c < C; ++c) a += q[c] * load(key + c * W);
  return a;
}

// scores[g][j] (rows `padded` apart) = query g . key j x scale for g < group, j < n, queries and keys C x 16 floats:
// 16 keys' products summed across lanes at once, each block of keys read from memory once for the group.
template <int C, typename T>
void score(const float* queries, int64_t group, const Positions<T>& keys, int64_t n, float scale, float* scores, int64_t padded,
           const vi& lane_of) {
  vf lanes[W];
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    for (int64_t g = 0; g < group; ++g) {
      vf q[C];
      for (int c = 0; c < C; ++c) q[c] = load(queries + g * C * W + c * W) * scale;
      for (int i = 0; i < W; ++i) lanes[i] = products<C>(q, keys.at(j + i));
      store(scores + g * padded + j, reordered(lane_sums(lanes), lane_of));
    }
  }
  for (; j < n; ++j) {
    for (int64_t g = 0; g < group; ++g) {
      vf q[C];
      for (int c = 0; c < C; ++c) q[c] = load(queries + g * C * W + c * W) * scale;
      const vf a = products<C>(q, keys.at(j));
      float s = 0.f;
      for (int l = 0; l < W; ++l) s += a[l];
      scores[g * padded + j] = s;
    }
  }
}

// out[g] = sum over j < n of w[g][j] x value j for G query heads at once (w rows `w_stride` apart), the sums in registers.
template <int C, int G, typename T>
void weigh(const float* w, int64_t w_stride, const Positions<T>& values, int64_t n, float* out, int64_t dim) {
  vf acc[G][C] = {};
  for (int64_t j = 0; j < n; ++j) {
    const T* value = values.at(j);
    vf v[C];
    for (int c = 0; c < C; ++c) v[c] = load(value + c * W);
    for (int g = 0; g < G; ++g) {
      const float wg = w[g * w_stride + j];
      for (int c = 0; c < C; ++c) acc[g][c] += wg * v[c];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store(out + g * dim + c * W, acc[g][c]);
}

// Softmax of scores[0 .. n) in place.
inline void softmax(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  float sum = 0.f;
  #pragma omp simd reduction(+:sum)
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - top);
    sum += scores[j];
  }
  const float inverse = 1.f / sum;
  #pragma omp simd
  for (int64_t j = 0; j < n; ++j) scores[j] *= inverse;
}

// One (row, KV head): its group's query heads q [group, dim] over n positions into out [group, dim], slots of dim = C x 16
// (float32 or bf16, read as float32). Scores for 16 keys at a time, the weighted values summed in registers, three query
// heads a pass.
template <int C, typename T>
void attend_vectors(const float* q, const Positions<T>& keys, const Positions<T>& values, int64_t n, int64_t group,
                    double scale, float* scores, int64_t padded, float* out, const vi& lane_of) {
  const int64_t dim = C * W;
  score<C, T>(q, group, keys, n, static_cast<float>(scale), scores, padded, lane_of);
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * padded, n);
  int64_t g = 0;
  for (; g + 3 <= group; g += 3) weigh<C, 3, T>(scores + g * padded, padded, values, n, out + g * dim, dim);
  for (; g < group; ++g) weigh<C, 1, T>(scores + g * padded, padded, values, n, out + g * dim, dim);
}

// The same for other widths (not 16 to 128 floats in 16s): key by key, the sums in memory.
template <typename T>
void attend_any(const float* q, const Positions<T>& keys, const Positions<T>& values, int64_t n, int64_t group, int64_t dim,
                double scale, float* scores, int64_t padded, float* out, float* row) {
  const float fscale = static_cast<float>(scale);
  for (int64_t j = 0; j < n; ++j) {
    const float* key = as_float(keys.at(j), row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      float s = 0.f;
      #pragma omp simd reduction(+:s)
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * key[d];
      scores[g * padded + j] = s * fscale;
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * padded, n);
  std::fill(out, out + group * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* value = as_float(values.at(j), row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * padded + j];
      float* o = out + g * dim;
      #pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += w * value[d];
    }
  }
}

// Row r's new key and value go into slot r of k and v [slots, KV heads, positions, dim] (T: float or bf16) at
// positions[r]; its query heads q[r] [heads, dim] (float32) attend over positions 0 .. positions[r] (query head h reads
// KV head h / (heads / KV heads)) into out[r] (float32), in float32: positions before prompt_lengths[r] from slot
// prompt_slots[r] (a row of its request holding its prompt alike), the rest from its own. One (KV head, row) a task,
// taken in turn by the threads, the rows of a prompt one after another, so its positions are read from memory once and
// then from cache.
template <typename T>
void attend_slots(const torch::Tensor& q, const torch::Tensor& new_k, const torch::Tensor& new_v, torch::Tensor& k, torch::Tensor& v,
                  const torch::Tensor& positions, const torch::Tensor& prompt_slots, const torch::Tensor& prompt_lengths, double scale,
                  torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t *pos = positions.data_ptr<int64_t>(), *source = prompt_slots.data_ptr<int64_t>(), *shared = prompt_lengths.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    longest = std::max(longest, pos[r] + 1);
    TORCH_CHECK(source[r] >= 0 && source[r] < rows, "prompt slots among the rows");
    TORCH_CHECK(shared[r] >= 0 && shared[r] <= pos[r] && shared[r] <= pos[source[r]], "shared positions before each row's new one");
  }
  TORCH_CHECK(rows <= k.size(0) && longest <= k.size(2), "rows and positions within the slots");
  std::vector<int64_t> order(rows);  // rows by the slot holding their prompt
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return source[a] < source[b]; });
  const int64_t s0 = k.stride(0), s1 = k.stride(1), s2 = k.stride(2), padded = (longest + W - 1) / W * W;
  const float* qp = q.data_ptr<float>();
  const T *nk = new_k.data_ptr<T>(), *nv = new_v.data_ptr<T>();
  const int64_t q_row = q.stride(0), k_row = new_k.stride(0), v_row = new_v.stride(0);  // rows may lie apart (views of one projection)
  T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  static const vi lane_of = lane_order();
  const int64_t chunks = dim % W == 0 ? dim / W : 0;
  const int64_t tasks = kv_heads * rows;
  std::atomic<int64_t> next{0};  // each thread takes the next task when done with one: a long row holds up no other's share
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(group * padded), row(dim);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t h = task / rows, r = order[task % rows], n = pos[r] + 1, own = r * s0 + h * s1, prompt = source[r] * s0 + h * s1;
      std::copy(nk + r * k_row + h * dim, nk + r * k_row + (h + 1) * dim, kp + own + (n - 1) * s2);
      std::copy(nv + r * v_row + h * dim, nv + r * v_row + (h + 1) * dim, vp + own + (n - 1) * s2);
      const Positions<T> keys{kp + prompt, kp + own, s2, shared[r]}, values{vp + prompt, vp + own, s2, shared[r]};
      const float* query = qp + r * q_row + h * group * dim;
      float* o = op + (r * heads + h * group) * dim;
      switch (chunks) {
        case 1: attend_vectors<1, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        case 2: attend_vectors<2, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        case 3: attend_vectors<3, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        case 4: attend_vectors<4, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        case 5: attend_vectors<5, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        case 6: attend_vectors<6, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        case 7: attend_vectors<7, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        case 8: attend_vectors<8, T>(query, keys, values, n, group, scale, scores.data(), padded, o, lane_of); continue;
        default: break;
      }
      attend_any<T>(query, keys, values, n, group, dim, scale, scores.data(), padded, o, row.data());
    }
  });
}

void slot_attention(const torch::Tensor& q, const torch::Tensor& new_k, const torch::Tensor& new_v, torch::Tensor& k, torch::Tensor& v,
                    const torch::Tensor& positions, const torch::Tensor& prompt_slots, const torch::Tensor& prompt_lengths, double scale,
                    torch::Tensor& out) {
  for (const auto* t : {&q, &new_k, &new_v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q, new_k and new_v: each row's heads side by side");
  TORCH_CHECK(out.is_contiguous(), "contiguous out");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32, "float32 q and out");
  TORCH_CHECK(k.stride(3) == 1 && k.strides() == v.strides() && k.sizes() == v.sizes(), "k and v alike, each head vector contiguous");
  const auto dtype = k.scalar_type();
  TORCH_CHECK(new_k.scalar_type() == dtype && new_v.scalar_type() == dtype && v.scalar_type() == dtype, "keys and values of one dtype");
  for (const auto* t : {&positions, &prompt_slots, &prompt_lengths})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == q.size(0), "int64 positions, prompt slots and lengths, one a row");
  if (dtype == torch::kFloat32) {
    attend_slots<float>(q, new_k, new_v, k, v, positions, prompt_slots, prompt_lengths, scale, out);
  } else {
    TORCH_CHECK(dtype == torch::kBFloat16, "float32 or bfloat16 keys and values");
    attend_slots<c10::BFloat16>(q, new_k, new_v, k, v, positions, prompt_slots, prompt_lengths, scale, out);
  }
}
"""


def cpp_built() -> bool:
    """Whether the C++ kernel is built here (built at the first ask): bf16 slots need it."""
    return _module() is not None


def _module() -> Any:
    return cpp_module("slot attention's C++ kernel", "rlvr_slot_attention_", SOURCE, ("slot_attention",), ("-ffast-math",))


class PromptSlots(NamedTuple):
    """For each row of a step, by slot: the slot holding its prompt's keys and values (its request's first row
    in the lane: every row of a request took the same prompt) and the prompt's length."""

    slots: torch.Tensor  # int64 [rows]
    lengths: torch.Tensor  # int64 [rows]


def prompt_slots(shared: Sequence[tuple[int, int]]) -> PromptSlots:
    """:class:`PromptSlots` from each row's (slot holding its prompt, prompt length)."""
    slots, lengths = zip(*shared) if shared else ((), ())
    return PromptSlots(torch.tensor(slots, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))


def slot_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_slots: torch.Tensor,
    value_slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    prompts: PromptSlots | None = None,
) -> torch.Tensor:
    """Row r's new ``keys``/``values`` [rows, KV heads, head dim] go into slot r of ``key_slots``/
    ``value_slots`` [slots >= rows, KV heads, positions, head dim] (float32, or bf16 through the C++
    kernel; each head vector contiguous) at ``positions[r]``, then its ``queries`` [rows, heads, head dim]
    attend over the slot's positions ``0 .. positions[r]`` in float32; query head h reads KV head
    h // (heads / KV heads). ``prompts``: rows whose slots hold their prompt alike read it from one slot,
    one after another, so it streams from memory once for them all (the C++ kernel; the same sums as each
    row alone). Returns float32 [rows, heads x head dim]."""
    rows, heads, head_dim = queries.shape
    out = torch.empty(rows, heads, head_dim)
    if (module := _module()) is not None:
        slots, lengths = prompts or (torch.arange(rows), torch.zeros(rows, dtype=torch.int64))  # none named: each row its own slot
        q, k, v = (_rows_of_heads(t) for t in (queries.float(), keys, values))
        module.slot_attention(q, k, v, key_slots, value_slots, positions.contiguous(), slots, lengths, scale, out)
        return out.view(rows, heads * head_dim)
    if key_slots.dtype != torch.float32:
        raise ValueError(f"slot attention over {key_slots.dtype} slots needs the C++ kernel (numba's is float32 only); it is not built here")
    positions_np = positions.numpy()
    scores = torch.empty(rows, heads, int(positions.max()) + 1)
    _store_and_score(queries.contiguous().numpy(), keys.contiguous().numpy(), key_slots.numpy(), positions_np, np.float32(scale), scores.numpy())
    weights = torch.softmax(scores, dim=-1)
    _store_and_weigh(weights.numpy(), values.contiguous().numpy(), value_slots.numpy(), positions_np, out.numpy())
    return out.view(rows, heads * head_dim)


def _rows_of_heads(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` [rows, heads, head dim] as it is where each row's heads lie side by side (a view of a
    wider projection's columns), else a contiguous copy."""
    return tensor if tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2] else tensor.contiguous()


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
