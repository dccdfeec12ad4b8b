"""Decode attention over the continuous engine's row slots on CPU, each row read to its own length.

:func:`slot_attention` writes each row's new key and value into its slot and streams its keys and values
once each (its query heads together), to the row's own length, where SDPA reads every row of a lane to
its longest row under a mask: float32, compiled by numba (``rlvr.fastpaths.jit``), one thread, the GIL
released. ``bench/cpu_kernels.py`` times it against SDPA (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import numpy as np
import torch

from rlvr.fastpaths.jit import available, compiled

__all__ = ["available", "slot_attention"]


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
    ``value_slots`` [slots >= rows, KV heads, positions, head dim] (contiguous float32) at
    ``positions[r]``, then its ``queries`` [rows, heads, head dim] attend over the slot's positions
    ``0 .. positions[r]``; query head h reads KV head h // (heads / KV heads). Returns
    [rows, heads x head dim]."""
    rows, heads, head_dim = queries.shape
    positions_np = positions.numpy()
    scores = torch.empty(rows, heads, int(positions.max()) + 1)
    _store_and_score(queries.contiguous().numpy(), keys.contiguous().numpy(), key_slots.numpy(), positions_np, np.float32(scale), scores.numpy())
    weights = torch.softmax(scores, dim=-1)
    out = torch.empty(rows, heads, head_dim)
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
