"""The fused decoder's float32 and bf16 CPU linear layers through one compiled GEMM, for any number of token rows.

oneDNN's packed GEMM computes, then waits for the next weights, then computes. This kernel packs each weight
once into 48-output panels, computes 8 rows x 48 outputs a tile with the sums in registers (bf16: input pairs,
one AVX-512 BF16 dot product a step, summed in float32, rounded where the model's bf16 layers round), and the
first tile of each panel prefetches the next, so weights stream while the cores multiply; panels are split
over PyTorch's threads. The residual is added in the same pass; a SiLU-gated input is taken as
``silu(gate) * up`` first. Built once per machine (PyTorch's extension builder, cached on disk);
``bench/linear_kernels.py [--dtype bfloat16]`` times it against oneDNN by row count (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from rlvr.fastpaths.heap import huge_pages
from rlvr.fastpaths.jit import cpp_module

PANEL = 48  # outputs a panel: three 16-float vectors

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(64)));  // 16 float32 lanes: one AVX-512 register, two or four narrower ones elsewhere
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4)));
constexpr int W = 16, V = 3, P = V * W, ROWS = 8;  // a tile: ROWS rows x P outputs, ROWS x V sums in registers

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf_unaligned*>(p) = x; }

// out[r, 0 .. width) (+)= x[r] . panel's columns for R rows of x over `inputs` inputs (out rows `outputs` apart); `next`: a
// panel to prefetch meanwhile (or null).
template <int R>
void tile(const float* x, int64_t inputs, const float* panel, float* out, int64_t outputs, int64_t width, bool accumulate, const float* next) {
  vf sums[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sums[r][v] = vf{};
  for (int64_t k = 0; k < inputs; ++k) {
    const float* w = panel + k * P;
    if (next)
      for (int v = 0; v < V; ++v) __builtin_prefetch(next + k * P + v * W, 0, 1);
    vf weights[V];
    for (int v = 0; v < V; ++v) weights[v] = load(w + v * W);
    for (int r = 0; r < R; ++r) {
      const vf xr = vf{} + x[r * inputs + k];
      for (int v = 0; v < V; ++v) sums[r][v] += xr * weights[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * outputs;
    if (width == P) {
      for (int v = 0; v < V; ++v) store(o + v * W, accumulate ? load(o + v * W) + sums[r][v] : sums[r][v]);
    } else {
      for (int j = 0; j < width; ++j) o[j] = accumulate ? o[j] + sums[r][j / W][j % W] : sums[r][j / W][j % W];
    }
  }
}

// Every panel (split over PyTorch's threads) against the rows of x (`row` elements apart), 8 rows a tile then the rest:
// run(std::integral_constant<int, R>, x's R rows, panel, out's R rows, panel width, next panel to prefetch or null).
template <typename X, typename Wt, typename O, typename Run>
void over_panels(int64_t rows, int64_t row, const X* x, const Wt* w, int64_t panel_size, int64_t panels, int64_t outputs, O* out, const Run& run) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const Wt* panel = w + p * panel_size;
      const Wt* next = p + 1 < end ? panel + panel_size : nullptr;  // the first tile streams the thread's next panel in
      const int64_t width = std::min<int64_t>(P, outputs - p * P);
      O* o = out + p * P;
      int64_t r = 0;
      for (; r + ROWS <= rows; r += ROWS, next = nullptr) run(std::integral_constant<int, ROWS>{}, x + r * row, panel, o + r * outputs, width, next);
      const X* xr = x + r * row;
      O* orow = o + r * outputs;
      switch (rows - r) {
        case 1: run(std::integral_constant<int, 1>{}, xr, panel, orow, width, next); break;
        case 2: run(std::integral_constant<int, 2>{}, xr, panel, orow, width, next); break;
        case 3: run(std::integral_constant<int, 3>{}, xr, panel, orow, width, next); break;
        case 4: run(std::integral_constant<int, 4>{}, xr, panel, orow, width, next); break;
        case 5: run(std::integral_constant<int, 5>{}, xr, panel, orow, width, next); break;
        case 6: run(std::integral_constant<int, 6>{}, xr, panel, orow, width, next); break;
        case 7: run(std::integral_constant<int, 7>{}, xr, panel, orow, width, next); break;
        default: break;
      }
    }
  });
}

// The weights [outputs_j, inputs] side by side, packed into `packed` [panels, inputs, P] (outputs past theirs zero), the
// panels split over PyTorch's threads: each thread writes (and so first touches) its own part.
void pack_panels(const std::vector<torch::Tensor>& weights, torch::Tensor& packed) {
  TORCH_CHECK(!weights.empty(), "weights to pack");
  const int64_t inputs = weights[0].size(1);
  std::vector<const float*> rows;  // each output's weights, in order
  for (const auto& w : weights) {
    TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.size(1) == inputs && w.stride(1) == 1, "float32 weights of ", inputs,
                " inputs, each output's contiguous");
    for (int64_t o = 0; o < w.size(0); ++o) rows.push_back(w.data_ptr<float>() + o * w.stride(0));
  }
  const int64_t outputs = rows.size(), panels = (outputs + P - 1) / P;
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 && packed.is_contiguous() && packed.sizes() == torch::IntArrayRef({panels, inputs, P}),
              "a float32 contiguous [", panels, ", ", inputs, ", ", P, "] to pack into");
  float* out = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* panel = out + p * inputs * P;
      for (int64_t k0 = 0; k0 < inputs; k0 += 64)  // 64 inputs of the panel's 48 outputs at a time: reads and writes stay in cache
        for (int64_t j = 0; j < P; ++j) {
          const int64_t o = p * P + j;
          for (int64_t k = k0; k < std::min<int64_t>(k0 + 64, inputs); ++k) panel[k * P + j] = o < outputs ? rows[o][k] : 0.f;
        }
    }
  });
}

// float32: out [rows, outputs] (+)= x [rows, inputs] . weight^T (checked by panel_linear).
void linear_f32(const torch::Tensor& packed, const torch::Tensor& input, torch::Tensor& out, bool accumulate, bool gated) {
  const int64_t rows = input.size(0), inputs = packed.size(1), outputs = out.size(1), panels = packed.size(0);
  torch::Tensor x = input;
  if (gated) {
    x = torch::empty({rows, inputs}, input.options());
    const float* in = input.data_ptr<float>();
    float* g = x.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float *gate = in + r * 2 * inputs, *up = gate + inputs;
        #pragma omp simd
        for (int64_t k = 0; k < inputs; ++k) g[r * inputs + k] = gate[k] / (1.f + std::exp(-gate[k])) * up[k];
      }
    });
  }
  const auto run = [&](auto R, const float* rows_x, const float* panel, float* o, int64_t width, const float* next) {
    tile<decltype(R)::value>(rows_x, inputs, panel, o, outputs, width, accumulate, next);
  };
  over_panels(rows, inputs, x.data_ptr<float>(), packed.data_ptr<float>(), inputs * P, panels, outputs, out.data_ptr<float>(), run);
}

// bf16: weights packed as input pairs, [panels, inputs / 2 (rounded up), P, 2] (a panel's P outputs' weights for inputs 2k and
// 2k + 1 side by side), each step of a tile one AVX-512 BF16 dot product of a row's input pair with 16 outputs' pairs,
// summed in float32; the sums rounded to bf16 where the model's bf16 operations round (the output, then with the residual).
bool bf16_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

inline uint16_t to_bf16(float value) {  // round to nearest, ties to even (PyTorch's); NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

void pack_panels_bf16(const std::vector<torch::Tensor>& weights, torch::Tensor& packed) {
  TORCH_CHECK(!weights.empty(), "weights to pack");
  const int64_t inputs = weights[0].size(1), pairs = (inputs + 1) / 2;
  std::vector<const uint16_t*> rows;
  for (const auto& w : weights) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.size(1) == inputs && w.stride(1) == 1, "bf16 weights of ", inputs,
                " inputs, each output's contiguous");
    for (int64_t o = 0; o < w.size(0); ++o) rows.push_back(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + o * w.stride(0));
  }
  const int64_t outputs = rows.size(), panels = (outputs + P - 1) / P;
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.sizes() == torch::IntArrayRef({panels, pairs, 2 * P}),
              "a bf16 contiguous [", panels, ", ", pairs, ", ", 2 * P, "] to pack into");
  uint32_t* out = reinterpret_cast<uint32_t*>(packed.data_ptr<at::BFloat16>());  // a pair a word: input 2k low, 2k + 1 high
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint32_t* panel = out + p * pairs * P;
      for (int64_t k0 = 0; k0 < pairs; k0 += 32)
        for (int64_t j = 0; j < P; ++j) {
          const int64_t o = p * P + j, last = std::min<int64_t>(k0 + 32, pairs);
          for (int64_t k = k0; k < last; ++k) {
            uint32_t pair = 0;
            if (o < outputs && 2 * k + 1 < inputs)
              std::memcpy(&pair, rows[o] + 2 * k, 4);
            else if (o < outputs)
              pair = rows[o][2 * k];  // an odd width's last input, beside a zero
            panel[k * P + j] = pair;
          }
        }
    }
  });
}

#ifdef __AVX512BF16__
// out[r, 0 .. width) = bf16(x[r] . panel), or bf16(out + bf16(x[r] . panel)) accumulating, for R rows of x (bf16 pairs,
// rows `pairs` apart) over `pairs` input pairs.
template <int R>
void tile_bf16(const uint32_t* x, int64_t pairs, const uint16_t* panel, uint16_t* out, int64_t outputs, int64_t width, bool accumulate,
               const uint16_t* next) {
  __m512 sums[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sums[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    const uint16_t* w = panel + k * 2 * P;
    if (next)
      for (int v = 0; v < V; ++v) __builtin_prefetch(next + k * 2 * P + v * 2 * W, 0, 1);  // the 3 lines of a pair step
    __m512bh weights[V];
    for (int v = 0; v < V; ++v) weights[v] = (__m512bh)_mm512_loadu_si512(w + v * 2 * W);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + k]));
      for (int v = 0; v < V; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], weights[v], xr);
    }
  }
  for (int r = 0; r < R; ++r) {
    uint16_t* o = out + r * outputs;
    if (width == P) {
      for (int v = 0; v < V; ++v) {
        __m256bh rounded = _mm512_cvtneps_pbh(sums[r][v]);
        if (accumulate) {
          const __m512 kept = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + v * W)));
          rounded = _mm512_cvtneps_pbh(_mm512_add_ps(kept, _mm512_cvtpbh_ps(rounded)));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + v * W), (__m256i)rounded);
      }
      continue;
    }
    alignas(64) float lane[P];
    for (int v = 0; v < V; ++v) _mm512_store_ps(lane + v * W, sums[r][v]);
    for (int64_t j = 0; j < width; ++j) {
      const uint16_t rounded = to_bf16(lane[j]);
      o[j] = accumulate ? to_bf16(from_bf16(o[j]) + from_bf16(rounded)) : rounded;
    }
  }
}

void linear_bf16(const torch::Tensor& packed, const torch::Tensor& input, torch::Tensor& out, bool accumulate, bool gated) {
  const int64_t rows = input.size(0), pairs = packed.size(1), outputs = out.size(1), panels = packed.size(0);
  const int64_t inputs = input.size(1) / (gated ? 2 : 1), padded = 2 * pairs;
  torch::Tensor x = input;
  if (gated || padded != inputs) {  // silu(gate) * up as the model rounds it (each bf16), or an odd width padded with a zero
    x = torch::zeros({rows, padded}, input.options());
    const uint16_t* in = reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>());
    uint16_t* g = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t k = 0; k < inputs; ++k) {
          if (!gated) {
            g[r * padded + k] = in[r * inputs + k];
            continue;
          }
          const float gate = from_bf16(in[r * 2 * inputs + k]), up = from_bf16(in[r * 2 * inputs + inputs + k]);
          g[r * padded + k] = to_bf16(from_bf16(to_bf16(gate / (1.f + std::exp(-gate)))) * up);
        }
    });
  }
  const auto run = [&](auto R, const uint32_t* rows_x, const uint16_t* panel, uint16_t* o, int64_t width, const uint16_t* next) {
    tile_bf16<decltype(R)::value>(rows_x, pairs, panel, o, outputs, width, accumulate, next);
  };
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  over_panels(rows, pairs, xp, w, pairs * 2 * P, panels, outputs, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), run);
}
#endif

// out [rows, outputs] (+)= x [rows, inputs] . weight^T, the weight packed by pack_panels (float32) or pack_panels_bf16, the
// input, out and weight of one dtype; gated: input is [rows, 2 inputs], a gate and an up side by side, and x = silu(gate) * up.
void panel_linear(const torch::Tensor& packed, const torch::Tensor& input, torch::Tensor& out, bool accumulate, bool gated) {
  const auto dtype = packed.scalar_type();
  const bool bf16 = dtype == torch::kBFloat16;
  TORCH_CHECK((dtype == torch::kFloat32 || bf16) && packed.is_contiguous() && packed.dim() == 3 && packed.size(2) == (bf16 ? 2 : 1) * P,
              "a float32 or bf16 weight packed in panels of ", P);
  TORCH_CHECK(input.scalar_type() == dtype && input.is_contiguous() && input.dim() == 2, "contiguous input rows of the weight's dtype (",
              dtype, "), not ", input.scalar_type());
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.dim() == 2 && out.size(0) == input.size(0),
              "a contiguous out of the weight's dtype (", dtype, "), a row an input row");
  const int64_t width = input.size(1), inputs = gated ? width / 2 : width, panels = packed.size(0), outputs = out.size(1);
  const bool fits = bf16 ? (inputs + 1) / 2 == packed.size(1) : inputs == packed.size(1);
  TORCH_CHECK(fits && (!gated || width % 2 == 0), "input width ", width, " for a weight of ",
              bf16 ? std::to_string(2 * packed.size(1) - 1) + " or " + std::to_string(2 * packed.size(1)) : std::to_string(packed.size(1)),
              " inputs", gated ? " (gated)" : "");
  TORCH_CHECK(outputs <= panels * P && outputs > (panels - 1) * P, "out width ", outputs, " for ", panels, " panels");
  if (!bf16) return linear_f32(packed, input, out, accumulate, gated);
#ifdef __AVX512BF16__
  linear_bf16(packed, input, out, accumulate, gated);
#else
  TORCH_CHECK(false, "bf16 panels need AVX-512 BF16, which this CPU lacks");
#endif
}
"""


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel is built (or builds now) on this machine for ``dtype``: a C++ compiler and ninja
    present; for bf16, a CPU with AVX-512 BF16 too."""
    module = _module()
    return module is not None and (dtype == torch.float32 or (dtype == torch.bfloat16 and module.bf16_built()))


def _module() -> Any:
    functions = ("pack_panels", "pack_panels_bf16", "panel_linear", "bf16_built")
    return cpp_module("linear kernels", "rlvr_linear_kernels_", SOURCE, functions, ("-ffast-math",))


class Panels(NamedTuple):
    """Linear layers' weights side by side, packed in panels of :data:`PANEL` outputs ([panels, in, PANEL],
    the last panel's missing outputs zero: a copy, made once), and their outputs in all."""

    packed: torch.Tensor
    outputs: int


def pack(layers: list[nn.Linear]) -> Panels:
    """``layers``' float32 or bf16 weights (each [out_j, in]) packed side by side for :func:`linear` (a copy, in
    parallel; bf16 as input pairs, [panels, in / 2, 2 x PANEL])."""
    outputs, inputs, dtype = sum(layer.out_features for layer in layers), layers[0].in_features, layers[0].weight.dtype
    weights, panels = [layer.weight.detach() for layer in layers], -(-outputs // PANEL)
    if dtype == torch.bfloat16:
        packed = huge_pages(torch.empty(panels, -(-inputs // 2), 2 * PANEL, dtype=dtype))  # streamed every step: fewer TLB misses
        _module().pack_panels_bf16(weights, packed)
    else:
        packed = huge_pages(torch.empty(panels, inputs, PANEL))
        _module().pack_panels(weights, packed)
    return Panels(packed, outputs)


def linear(panels: Panels, inputs: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """``inputs`` [rows, in] times the packed weights, the outputs side by side [rows, sum out_j], plus
    ``residual`` [rows, sum out_j] where given (written in place and returned). ``gated``: ``inputs`` are
    [rows, 2 in], a SiLU-gated MLP's gate and up side by side, taken as ``silu(gate) * up``."""
    out = residual if residual is not None else inputs.new_empty(len(inputs), panels.outputs)
    _module().panel_linear(panels.packed, inputs.contiguous(), out, residual is not None, gated)
    return out


if __name__ == "__main__":  # `make setup`: build the kernel once for this machine, or say why it stays off
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bf16 = "; bf16 too" if available(torch.bfloat16) else "; bf16 on oneDNN (no AVX-512 BF16 here)"
    print("linear kernels:", "built" + bf16 if available() else "off (the fused decoder's float32 and bf16 linear layers run on oneDNN)")
