"""Decode attention over the continuous engine's row slots on CPU, each row read to its own length.

In a decode step each row's one query attends over its own keys and values; the work is reading
them, a few multiply-adds per byte. PyTorch's SDPA on CPU streams them well below one core's memory
bandwidth for such shapes (three query heads per KV head, hundreds to thousands of keys, a small
matrix product per block) and, given the lane's keys up to its longest row, reads every row to that
length under a mask. :func:`slot_attention` streams each row's keys once (its query heads'
dot products together), takes the softmax in PyTorch, then streams its values once, to the row's
own length: float32, compiled by numba (no C compiler needed), one thread, the GIL released.
``bench/cpu_kernels.py`` times it against SDPA.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
except ImportError:  # the plain SDPA path stays
    numba = None


def available() -> bool:
    """Whether the kernel can run here (numba importable)."""
    return numba is not None


def slot_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """``queries`` [rows, heads, head dim] attend over slot buffers ``keys``/``values`` [slots >= rows,
    KV heads, positions, head dim] (contiguous float32), row r over positions ``0 .. lengths[r] - 1``;
    query head h reads KV head h // (heads / KV heads). Returns [rows, heads x head dim]."""
    rows, heads, head_dim = queries.shape
    queries = queries.contiguous()
    lengths_np = lengths.numpy()
    scores = torch.empty(rows, heads, int(lengths.max()))
    _scores(queries.numpy(), keys.numpy(), lengths_np, np.float32(scale), scores.numpy())
    weights = torch.softmax(scores, dim=-1)
    out = torch.empty(rows, heads, head_dim)
    _weighted_values(weights.numpy(), values.numpy(), lengths_np, out.numpy())
    return out.view(rows, heads * head_dim)


# Scores past a row's length get the lowest float32, which the softmax turns into a zero weight: no
# infinity or NaN is made here, so every fast-math assumption holds (and sums vectorize).
PADDING_SCORE = np.float32(np.finfo(np.float32).min)


def _compiled(fn):
    """``fn`` compiled on its first call, the machine code cached on disk where numba finds a writable
    place (beside this file, or its user cache folder), else compiled again in each process."""
    if numba is None:
        return fn
    try:
        return numba.njit(fastmath=True, cache=True, nogil=True)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return numba.njit(fastmath=True, nogil=True)(fn)


@_compiled
def _scores(q, k, lengths, scale, scores):  # pragma: no cover - compiled
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    for r in range(rows):
        n = lengths[r]
        for h in range(kv_heads):
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


@_compiled
def _weighted_values(p, v, lengths, out):  # pragma: no cover - compiled
    rows, heads, head_dim = out.shape
    kv_heads = v.shape[1]
    group = heads // kv_heads
    for r in range(rows):
        n = lengths[r]
        for h in range(kv_heads):
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
