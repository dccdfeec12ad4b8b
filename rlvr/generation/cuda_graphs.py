"""Decode-only engine steps replayed from CUDA graphs, one per row bucket (vLLM's and gpt-fast's recipe).

On a GPU a small model's decode step is bound by launching its few hundred kernels from Python. A step
whose tokens are all decode rows of one lane runs the smallest bucket (1, 2, 4, 8, ...) that holds its
rows over the lane's :class:`~rlvr.generation.kv_cache.SlotCache` buffers: fixed shapes (each row's key
and value written at its position, attention over the whole slot, masked past it), captured once per
bucket and buffer set and replayed. Padding rows write only into slots no row holds. Where CUDA is
absent the same step runs eagerly (``graphs=False``), which is how tests hold it to the engine's step.
"""

from __future__ import annotations

from typing import Any

import torch

from rlvr.fastpaths.fused_decode import gqa_attention
from rlvr.generation.kv_cache import SlotCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def row_bucket(rows: int) -> int | None:
    """The smallest bucket holding ``rows`` rows (None past the last)."""
    return next((bucket for bucket in BUCKETS if bucket >= rows), None)


class GraphedDecode:
    """Decode steps of ``runner`` (a ``forward(tokens, positions, attend, logits_at)``) over a lane's slot
    cache; ``graphs``: captured as CUDA graphs and replayed (else run eagerly, for CPU tests);
    ``float32_attention``: attention of bf16 / fp16 in float32 (the engine's plan)."""

    def __init__(self, runner: Any, device: torch.device, graphs: bool, float32_attention: bool = True):
        self.runner, self.device, self.graphs, self.float32_attention = runner, device, graphs, float32_attention
        self.tokens = torch.zeros(BUCKETS[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(BUCKETS[-1], dtype=torch.long, device=device)
        self.rows = torch.arange(BUCKETS[-1], device=device)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._buffers = 0  # the cache buffers (SlotCache.allocation) the graphs were captured on
        self._pool = None

    def fits(self, cache: SlotCache, rows: int) -> bool:
        """Whether a step of ``rows`` rows has a bucket within the cache's slots."""
        bucket = row_bucket(rows)
        return bucket is not None and bucket <= cache.capacity_rows

    def step(self, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The next-token logits [rows, vocab] of the lane's rows (``tokens``, ``positions`` [rows]); each
        row's key and value are written into its slot at its position."""
        rows = len(tokens)
        bucket = row_bucket(rows)
        self.tokens[:rows].copy_(tokens)
        self.positions[:rows].copy_(positions)
        self.tokens[rows:bucket].zero_()
        self.positions[rows:bucket].zero_()  # padding rows attend to position 0 of a free slot
        if cache.allocation != self._buffers:  # new buffers: the graphs read the old ones, free slots hold stale bytes
            cache.zero_free_slots()
            self._graphs, self._buffers = {}, cache.allocation
        if not self.graphs:
            return self._step(cache, bucket)[:rows]
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(cache, bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:rows]

    def _capture(self, cache: SlotCache, bucket: int) -> tuple[Any, torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (kernel selection, workspaces)
            for _ in range(2):
                self._step(cache, bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(cache, bucket)
        return graph, logits

    def _step(self, cache: SlotCache, bucket: int) -> torch.Tensor:
        """One step of ``bucket`` rows on fixed buffers: fixed shapes, no host sync."""
        tokens, positions, rows = self.tokens[:bucket], self.positions[:bucket], self.rows[:bucket]
        key_positions = torch.arange(cache.capacity_length, device=self.device)
        mask = (key_positions[None, :] <= positions[:, None])[:, None, None, :]  # [bucket, 1, 1, slot length]

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
            layer = cache.layers[index]
            layer.keys[rows, :, positions] = keys.to(layer.keys.dtype)
            layer.values[rows, :, positions] = values.to(layer.values.dtype)
            attended = gqa_attention(queries.unsqueeze(2), layer.keys[:bucket], layer.values[:bucket], mask, scaling, self.float32_attention)
            return attended.reshape(bucket, -1)

        return self.runner.forward(tokens, positions, attend, None)
