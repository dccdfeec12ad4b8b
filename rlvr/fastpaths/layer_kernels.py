"""A float32 or bf16 CPU decode step's RMSNorm and rotary embedding, each one compiled loop.

In a step that streams every weight from memory, a layer's few small PyTorch operations for these cost
far more than their arithmetic. The fused decoder calls these instead where its plan's ``layer_kernels``
says (``rlvr.fastpaths.plan``: float32 or bf16 on CPU, numba importable): the formulas of the model's
``LlamaRMSNorm`` and ``rotate_half``, summed in another order (float32 rounding apart, the same values;
bf16 rounded where the model's bf16 operations round), compiled by numba (``rlvr.fastpaths.jit``), one
thread, the GIL released (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import numpy as np
import torch

from rlvr.fastpaths.jit import compiled


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * hidden / sqrt(mean(hidden ** 2) + eps)`` per row of ``hidden`` [rows, width] (float32; or
    bf16 with a bf16 ``weight``, normalized in float32 and rounded before the weight, as the model does)."""
    hidden, weight = hidden.contiguous(), _like(weight.detach(), hidden)
    out = torch.empty_like(hidden)
    if hidden.dtype == torch.bfloat16:
        _rms_norm_bf16(_bits(hidden), _bits(weight), np.float32(eps), _bits(out))
    else:
        _rms_norm(hidden.numpy(), weight.numpy(), np.float32(eps), out.numpy())
    return out


def rotary(projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The first ``heads`` heads of ``projected`` [rows, width >= heads x head dim] (the query and key
    projections side by side), each rotated as ``x * cos + rotate_half(x) * sin`` with its row's
    ``cos``/``sin`` [rows, head dim]: [rows, heads, head dim] (float32; or bf16, each product and the sum
    rounded to bf16 as PyTorch's bf16 operations round them)."""
    rows, head_dim = cos.shape
    out = torch.empty(rows, heads, head_dim, dtype=projected.dtype)
    inputs = (projected.contiguous(), _like(cos, projected).contiguous(), _like(sin, projected).contiguous())
    if projected.dtype == torch.bfloat16:
        _rotary_bf16(*(_bits(t) for t in inputs), _bits(out))
    else:
        _rotary(*(t.numpy() for t in inputs), out.numpy())
    return out


def _like(tensor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != other.dtype:
        raise ValueError(f"layer kernels take one dtype: {tensor.dtype} beside {other.dtype}")
    return tensor


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's bits, as numpy's uint16 (a view: writes reach the tensor)."""
    return tensor.view(torch.uint16).numpy()


@compiled
def _inverse_rms(squares, width, eps):  # pragma: no cover - compiled
    """1 / sqrt(mean square + eps), from a row's sum of squares (float32)."""
    return np.float32(1.0) / np.sqrt(squares / np.float32(width) + eps)


@compiled
def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    rows, width = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(width):
            total += x[r, i] * x[r, i]
        inverse = _inverse_rms(total, width, eps)
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


@compiled
def _to_bf16(value):  # pragma: no cover - compiled
    """A float32 rounded to the nearest bf16, ties to even (PyTorch's rounding; NaN stays NaN): its bits."""
    bits = np.float32(value).view(np.uint32)
    rounded = np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return np.uint16(0x7FC0) if bits & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000) else rounded


@compiled
def _from_bf16(bits):  # pragma: no cover - compiled
    """A bf16's value (its bits as a float32's top 16)."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@compiled
def _rounded(value):  # pragma: no cover - compiled
    """A float32 rounded to bf16's nearest value, as a float32."""
    return _from_bf16(_to_bf16(value))


@compiled
def _product(a, b):  # pragma: no cover - compiled
    """Two bf16s' product (given their bits) rounded to bf16, as a float32."""
    return _rounded(_from_bf16(a) * _from_bf16(b))


@compiled
def _rms_norm_bf16(x, weight, eps, out):  # pragma: no cover - compiled
    rows, width = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(width):
            value = _from_bf16(x[r, i])
            total += value * value
        inverse = _inverse_rms(total, width, eps)
        for i in range(width):  # normalized and rounded to bf16, then times the weight
            out[r, i] = _to_bf16(_from_bf16(weight[i]) * _rounded(_from_bf16(x[r, i]) * inverse))


@compiled
def _rotary_bf16(x, cos, sin, out):  # pragma: no cover - compiled
    rows, heads, head_dim = out.shape
    half = head_dim // 2
    for r in range(rows):
        c, s = cos[r], sin[r]
        for h in range(heads):  # x * cos + rotate_half(x) * sin, each product rounded, then the sum
            first, second, rotated = x[r, h * head_dim : h * head_dim + half], x[r, h * head_dim + half : (h + 1) * head_dim], out[r, h]
            for d in range(half):
                rotated[d] = _to_bf16(_product(first[d], c[d]) - _product(second[d], s[d]))
            for d in range(half):
                rotated[half + d] = _to_bf16(_product(second[d], c[half + d]) + _product(first[d], s[half + d]))
