"""The fused decoder's float32 CPU linear layers through one compiled GEMM, for any number of token rows.

oneDNN's packed GEMM computes, then waits for the next weights, then computes (a step's projections of
32 rows of the embedded model: 55.5 ms against this kernel's 46.7, ``bench/linear_kernels.py``). This kernel packs each weight
once into 48-column panels (a panel's 48 outputs' weights for one input side by side), computes 8 rows x
48 outputs a tile with the sums in registers, and the first tile of each panel prefetches the next, so
weights stream while the cores multiply; panels are split over PyTorch's threads. The residual is added in
the same pass; a SiLU-gated input is taken as ``silu(gate) * up`` first. Built once per machine (PyTorch's
extension builder, cached on disk); ``bench/linear_kernels.py`` times it against oneDNN by row count.
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

// out [rows, outputs] (+)= x [rows, inputs] . weight^T, the weight packed by pack_panels as [panels, inputs, P];
// gated: input is [rows, 2 inputs], a gate and an up side by side, and x = silu(gate) * up.
void panel_linear(const torch::Tensor& packed, const torch::Tensor& input, torch::Tensor& out, bool accumulate, bool gated) {
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 && packed.is_contiguous() && packed.dim() == 3 && packed.size(2) == P,
              "a float32 weight packed in panels of ", P);
  TORCH_CHECK(input.scalar_type() == torch::kFloat32 && input.is_contiguous() && input.dim() == 2, "float32 contiguous input rows");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 && out.size(0) == input.size(0),
              "float32 contiguous out, a row an input row");
  const int64_t rows = input.size(0), inputs = packed.size(1), outputs = out.size(1), panels = packed.size(0);
  TORCH_CHECK(input.size(1) == (gated ? 2 : 1) * inputs, "input width ", input.size(1), " for a weight of ", inputs, " inputs", gated ? " (gated)" : "");
  TORCH_CHECK(outputs <= panels * P && outputs > (panels - 1) * P, "out width ", outputs, " for ", panels, " panels");
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
  const float* w = packed.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = w + p * inputs * P;
      const float* next = p + 1 < end ? panel + inputs * P : nullptr;  // the first tile streams the thread's next panel in
      const int64_t width = std::min<int64_t>(P, outputs - p * P);
      float* o = op + p * P;
      int64_t r = 0;
      for (; r + ROWS <= rows; r += ROWS, next = nullptr) tile<ROWS>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next);
      switch (rows - r) {
        case 1: tile<1>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next); break;
        case 2: tile<2>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next); break;
        case 3: tile<3>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next); break;
        case 4: tile<4>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next); break;
        case 5: tile<5>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next); break;
        case 6: tile<6>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next); break;
        case 7: tile<7>(xp + r * inputs, inputs, panel, o + r * outputs, outputs, width, accumulate, next); break;
        default: break;
      }
    }
  });
}
"""


def available() -> bool:
    """Whether the kernel is built (or builds now) on this machine: a C++ compiler and ninja present."""
    return _module() is not None


def _module() -> Any:
    return cpp_module("linear kernels", "rlvr_linear_kernels_", SOURCE, ("pack_panels", "panel_linear"), ("-ffast-math",))


class Panels(NamedTuple):
    """Linear layers' weights side by side, packed in panels of :data:`PANEL` outputs ([panels, in, PANEL],
    the last panel's missing outputs zero: a copy, made once), and their outputs in all."""

    packed: torch.Tensor
    outputs: int


def pack(layers: list[nn.Linear]) -> Panels:
    """``layers``' float32 weights (each [out_j, in]) packed side by side for :func:`linear` (a copy, in parallel)."""
    outputs, inputs = sum(layer.out_features for layer in layers), layers[0].in_features
    packed = huge_pages(torch.empty(-(-outputs // PANEL), inputs, PANEL))  # streamed every step: fewer TLB misses
    _module().pack_panels([layer.weight.detach() for layer in layers], packed)
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
    print("linear kernels:", "built" if available() else "off (the fused decoder's float32 linear layers run on oneDNN)")
