"""A float32 CPU decode step of a few rows: its linear layers as one compiled matrix-vector loop each.

With one token per row a step reads every weight once, so its time is the weights' read from memory;
oneDNN's GEMM, made for more rows, streams them well below that rate. Where the plan's ``row_kernels``
says (float32 on CPU, a C++ compiler here) the fused decoder runs steps of at most :data:`MAX_ROWS` rows
through :func:`linear`: each output a dot product over the model's own weights (no packed copy), the
outputs split over PyTorch's own threads (numba's would spin beside them), the residual added in the
same pass. The kernel is built once per machine with PyTorch's extension builder (cached on disk).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from rlvr.fastpaths.jit import cpp_module

MAX_ROWS = 4  # steps of up to this many token rows; from 5, oneDNN's packed GEMM is as fast or faster (bench/row_kernels.py)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

// out[m, starts[j] + r] (+)= weights[j][r] . x[m], each weight [out_j, width], x [rows, width], out [rows, sum out_j];
// gated: x is [rows, 2 width], its halves a and b, and the product is taken with silu(a) * b
void rows_linear(const std::vector<torch::Tensor>& weights, const torch::Tensor& input, torch::Tensor& out, bool accumulate, bool gated) {
  torch::Tensor x = input;
  if (gated) {
    const int64_t half = input.size(1) / 2;
    x = torch::empty({input.size(0), half}, input.options());
    const float* ip = input.data_ptr<float>();
    float* gp = x.data_ptr<float>();
    for (int64_t m = 0; m < input.size(0); ++m)
      for (int64_t k = 0; k < half; ++k) {
        const float a = ip[m * 2 * half + k];
        gp[m * half + k] = a / (1.f + std::exp(-a)) * ip[m * 2 * half + half + k];
      }
  }
  const int64_t rows = x.size(0), width = x.size(1), total = out.size(1);
  std::vector<const float*> pointers;
  std::vector<int64_t> starts{0};
  for (const auto& w : weights) {
    TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.size(1) == width, "a float32 contiguous weight of width ", width);
    pointers.push_back(w.data_ptr<float>());
    starts.push_back(starts.back() + w.size(0));
  }
  TORCH_CHECK(starts.back() == total && x.is_contiguous() && out.is_contiguous() && out.size(0) == rows, "shapes");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    size_t j = 0;
    for (int64_t r = begin; r < end; ++r) {
      while (r >= starts[j + 1]) ++j;
      const float* wr = pointers[j] + (r - starts[j]) * width;
      for (int64_t m = 0; m < rows; ++m) {
        const float* xr = xp + m * width;
        float acc = 0.f;
        #pragma omp simd reduction(+:acc)
        for (int64_t k = 0; k < width; ++k) acc += wr[k] * xr[k];
        op[m * total + r] = accumulate ? op[m * total + r] + acc : acc;
      }
    }
  });
}
"""


def available() -> bool:
    """Whether the kernel is built (or builds now) on this machine: a C++ compiler and ninja present."""
    return _module() is not None


def _module() -> Any:
    return cpp_module("row kernels", "rlvr_row_kernels_", SOURCE, ("rows_linear",))


class Weights(NamedTuple):
    """Linear layers' weights side by side: the tensors (sharing the layers' memory: an update in place is
    seen) and their outputs in all."""

    tensors: list[torch.Tensor]
    outputs: int


def weights(layers: list[torch.nn.Linear]) -> Weights:
    return Weights([layer.weight.detach() for layer in layers], sum(layer.out_features for layer in layers))


def linear(weights: Weights, inputs: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """``inputs`` [rows, in] times every weight of ``weights`` (each [out_j, in]), the outputs side by side
    [rows, sum out_j], plus ``residual`` [rows, sum out_j] where given (written in place and returned).
    ``gated``: ``inputs`` are [rows, 2 in], a SiLU-gated MLP's gate and up side by side, taken as ``silu(gate) * up``."""
    out = residual if residual is not None else inputs.new_empty(len(inputs), weights.outputs)
    _module().rows_linear(weights.tensors, inputs.contiguous(), out, residual is not None, gated)
    return out


if __name__ == "__main__":  # `make setup`: build the kernel once for this machine, or say why it stays off
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("row kernels:", "built" if available() else "off (the fused decoder's steps of a few rows run on oneDNN)")
