"""The engine's KV cache: one slot per running row, each row's keys and values at its own positions.

A :class:`SlotCache` holds buffers of [slots, KV heads, length, head dim] per layer; slot r holds row
r's tokens at positions 0 .. lengths[r] - 1. A finished row's slot is refilled by the last row's (one
row copied, no compaction). A running row's positions past its tokens hold zeros or finite stale keys
(a step may read them, masked, up to the longest row); free slots hold whatever the allocator left until
a row takes them or :meth:`SlotCache.zero_free_slots`.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from transformers import DynamicCache

from rlvr.fastpaths.eligibility import head_dim
from rlvr.fastpaths.heap import huge_pages

SLOT_LENGTH_QUANTUM = 128  # slot lengths grow and shrink in these steps (fewer buffer reallocations)
_ALLOCATIONS = itertools.count(1)


def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Keys and values one token of one row holds in the cache: layers x 2 x KV heads x head dim x dtype size."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim(config) * dtype.itemsize


def quantized(length: int) -> int:
    """``length`` rounded up to a multiple of ``SLOT_LENGTH_QUANTUM``."""
    return -(-length // SLOT_LENGTH_QUANTUM) * SLOT_LENGTH_QUANTUM


class SlotLayer:
    """One layer's keys and values by row slot; :meth:`update` writes each row's new token at its own
    position and returns the keys and values up to the longest row."""

    def __init__(self, cache: SlotCache):
        # weak: a cycle with the cache would keep its buffers (up to the KV budget) until the cyclic GC ran
        self.cache, self.keys, self.values = weakref.proxy(cache), None, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        rows, positions, used = self.cache.rows, self.cache.lengths[: self.cache.rows], self.cache.step_length
        index = torch.arange(rows)
        self.keys[index, :, positions] = key_states[:, :, 0]
        self.values[index, :, positions] = value_states[:, :, 0]
        return self.keys[:rows, :, :used], self.values[:rows, :, :used]


class SlotCache:
    """Running rows' KV cache: slot r holds row r's tokens at positions 0 .. lengths[r] - 1."""

    def __init__(self, num_layers: int):
        self.layers = [SlotLayer(self) for _ in range(num_layers)]
        self.rows = 0
        self.capacity_rows = self.capacity_length = 0
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.step_length = 0
        self.allocation = 0  # which buffers: a new number at each resize (0: none)

    def bytes(self, bytes_per_token: int, rows: int | None = None, length: int | None = None) -> int:
        rows = self.capacity_rows if rows is None else rows
        return rows * (self.capacity_length if length is None else length) * bytes_per_token

    def resize(self, rows: int, length: int, like: torch.Tensor) -> None:
        """Buffers for ``rows`` slots of ``length`` positions, the running rows' contents kept."""
        kept = min(self.capacity_length, length) if self.rows else 0
        for layer in self.layers:
            shape = (rows, like.shape[1], length, like.shape[3])
            for name in ("keys", "values"):
                new = huge_pages(like.new_empty(shape))  # read through at every step: fewer TLB misses
                old = getattr(layer, name)
                if kept:
                    new[: self.rows, :, :kept] = old[: self.rows, :, :kept]
                new[: self.rows, :, kept:].zero_()
                setattr(layer, name, new)
        lengths = torch.zeros(rows, dtype=torch.long)
        lengths[: self.rows] = self.lengths[: self.rows]
        self.lengths, self.capacity_rows, self.capacity_length = lengths, rows, length
        self.allocation = next(_ALLOCATIONS)

    def zero_free_slots(self) -> None:
        """Zeros in the slots no row holds (for a step that reads them, masked: no NaN from stale bytes)."""
        for layer in self.layers:
            layer.keys[self.rows :].zero_()
            layer.values[self.rows :].zero_()

    def add_rows(self, prompt_cache: DynamicCache, count: int) -> range:
        """``count`` new rows holding the prompt's keys and values (capacity already there)."""
        start = self.rows
        for layer, source in zip(self.layers, prompt_cache.layers):
            length = source.keys.shape[-2]
            layer.keys[start : start + count, :, :length] = source.keys[0]
            layer.values[start : start + count, :, :length] = source.values[0]
            layer.keys[start : start + count, :, length:].zero_()
            layer.values[start : start + count, :, length:].zero_()
        self.lengths[start : start + count] = prompt_cache.layers[0].keys.shape[-2]
        self.rows += count
        return range(start, start + count)

    def remove_row(self, row: int) -> int | None:
        """Free ``row``: the last row moves into it; returns the row that moved (None if it was the last)."""
        last = self.rows - 1
        self.rows = last
        if row == last:
            return None
        used = int(self.lengths[last])
        for layer in self.layers:
            layer.keys[row, :, :used] = layer.keys[last, :, :used]
            layer.values[row, :, :used] = layer.values[last, :, :used]
        self.lengths[row] = self.lengths[last]
        return last
