"""A float32 CPU decode step's RMSNorm and rotary embedding, each one compiled loop.

In a step that streams every weight from memory, a layer's few small PyTorch operations for these cost
far more than their arithmetic. The fused decoder calls these instead where
its plan's ``layer_kernels`` says (``rlvr.fastpaths.plan``: float32 on CPU, numba importable): the formulas of the model's
``LlamaRMSNorm`` and ``rotate_half``, summed in another order (float32 rounding apart, the same values),
compiled by numba (``rlvr.fastpaths.jit``), one thread, the GIL released (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import numpy as np
import torch

from rlvr.fastpaths.jit import compiled


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * hidden / sqrt(mean(hidden ** 2) + eps)`` per row of ``hidden`` [rows, width] (float32)."""
    hidden = hidden.contiguous()
    out = torch.empty_like(hidden)
    _rms_norm(hidden.numpy(), weight.detach().numpy(), np.float32(eps), out.numpy())
    return out


def rotary(projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The first ``heads`` heads of ``projected`` [rows, width >= heads x head dim] (the query and key
    projections side by side), each rotated as ``x * cos + rotate_half(x) * sin`` with its row's
    ``cos``/``sin`` [rows, head dim]: [rows, heads, head dim] (float32)."""
    rows, head_dim = cos.shape
    out = torch.empty(rows, heads, head_dim)
    _rotary(projected.contiguous().numpy(), cos.contiguous().numpy(), sin.contiguous().numpy(), out.numpy())
    return out


@compiled
def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    rows, width = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(width):
            total += x[r, i] * x[r, i]
        inverse = np.float32(1.0) / np.sqrt(total / np.float32(width) + eps)
        for i in range(width):
            out[r, i] = weight[i] * (x[r, i] * inverse)


@compiled
def _rotary(x, cos, sin, out):  # pragma: no cover - compiled
    rows, heads, head_dim = out.shape
    half = head_dim // 2
    for r in range(rows):
        for h in range(heads):
            base = h * head_dim
            for d in range(half):
                first, second = x[r, base + d], x[r, base + half + d]
                out[r, h, d] = first * cos[r, d] - second * sin[r, d]
                out[r, h, half + d] = second * cos[r, half + d] + first * sin[r, half + d]
