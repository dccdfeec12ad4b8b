"""A CPU step's sampling of rows without top-p: softmax, draw and log-prob in one compiled pass a row.

The sampler's PyTorch path makes four passes over a [rows, vocab] float32 tensor (divide, softmax,
cumulative sum, search), each writing a copy: ~2 ms a step of 32 rows of a 49k vocabulary here. This
kernel reads each row twice, the rows split over PyTorch's threads: its maximum, then each token's
exp((logit - max) / T) and 512-token block sums; the draw is found among the blocks, then within one. The
sampler's draw by inverse CDF (float32 rounding apart: a uniform at a boundary may take the neighbour),
tokens of zero probability never drawn. Built with PyTorch's extension builder (``rlvr.fastpaths.jit``).
"""

from __future__ import annotations

from typing import Any

import torch

from rlvr.fastpaths.jit import cpp_module

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {
constexpr int64_t BLOCK = 512;  // tokens a block sum covers: the draw scans block sums, then one block

// exp(z) for z <= 0, 0 below -87 (where float32's underflows), in a form the compiler vectorizes:
// z = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' polynomial, 2^n written as exponent bits
inline float exp_nonpositive(float z) {
  const float c = std::fmax(z, -87.f);
  const float n = std::floor(c * 1.44269504088896341f + 0.5f);
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return z < -87.f ? 0.f : (p * r * r + r + 1.f) * scale;
}
}  // namespace

// tokens[r], logprobs[r]: row r of logits [rows, vocab] drawn at uniforms[r] from softmax(logits[r] / T[r])
// by inverse CDF, or its first argmax where T[r] < greedy_below (its log-prob then at T = 1)
void sample_rows(const torch::Tensor& logits, const torch::Tensor& temperatures, const torch::Tensor& uniforms,
                 double greedy_below, torch::Tensor& tokens, torch::Tensor& logprobs) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.is_contiguous() && logits.dim() == 2, "float32 contiguous logits [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), blocks = (vocab + BLOCK - 1) / BLOCK;
  TORCH_CHECK(vocab > 0, "a vocabulary of at least one token");
  for (const auto* t : {&temperatures, &uniforms})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == rows, "float32 temperatures and uniforms, one a row");
  TORCH_CHECK(tokens.numel() == rows && logprobs.numel() == rows, "one token and log-prob a row");
  const float* all = logits.data_ptr<float>();
  const float* temperature = temperatures.data_ptr<float>();
  const float* uniform = uniforms.data_ptr<float>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* logprob_out = logprobs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(vocab), sums(blocks);
    for (int64_t row = begin; row < end; ++row) {
      const float* x = all + row * vocab;
      const bool greedy = temperature[row] < greedy_below;
      const float t = greedy ? 1.f : temperature[row];
      float top = -INFINITY;
      #pragma omp simd reduction(max:top)
      for (int64_t i = 0; i < vocab; ++i) top = std::fmax(top, x[i]);
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t lo = b * BLOCK, hi = std::min(vocab, lo + BLOCK);
        float sum = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int64_t i = lo; i < hi; ++i) {
          weights[i] = exp_nonpositive((x[i] - top) / t);
          sum += weights[i];
        }
        sums[b] = sum;
        total += sum;
      }
      int64_t token = 0;
      if (greedy) {
        while (token < vocab - 1 && !(x[token] == top)) ++token;
      } else {
        const double target = static_cast<double>(uniform[row]) * total;
        double before = 0.0;
        int64_t b = 0;
        while (b < blocks - 1 && before + sums[b] <= target) before += sums[b++];
        const int64_t lo = b * BLOCK, hi = std::min(vocab, lo + BLOCK);
        token = -1;
        for (int64_t i = lo; i < hi && !(before > target && token >= 0); ++i) {
          if (weights[i] > 0.f) token = i;  // the last token with mass so far: a rounding short of the target ends here
          before += weights[i];
        }
        if (token < 0) token = lo;  // a block holding the target has mass: not reached
      }
      token_out[row] = token;
      logprob_out[row] = static_cast<float>((x[token] - top) / t - std::log(total));
    }
  });
}
"""


def available() -> bool:
    """Whether the kernel is built (or builds now) on this machine: a C++ compiler and ninja present."""
    return _module() is not None


def _module() -> Any:
    return cpp_module("the sampling kernel", "rlvr_sampling_kernel_", SOURCE, ("sample_rows",), ("-ffast-math",))


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor, greedy_below: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``logits`` [rows, vocab] (CPU) drawn at its ``uniforms`` [rows] (in [0, 1)) from
    softmax(logits / T) at its ``temperatures`` [rows], or its argmax below ``greedy_below``: the tokens
    (int64) and their log-probs (float32; at T = 1 for greedy rows). Needs the kernel (:func:`available`)."""
    module = _module()
    if module is None:
        raise RuntimeError("the sampling kernel is not built here (no C++ compiler, or the build failed)")
    rows = len(logits)
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
    module.sample_rows(logits.float().contiguous(), temperatures.float().contiguous(), uniforms.float().contiguous(), greedy_below, tokens, logprobs)
    return tokens, logprobs


if __name__ == "__main__":  # `make setup`: build the kernel once for this machine, or say why it stays off
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("sampling kernel:", "built" if available() else "off (the engine samples on PyTorch)")
