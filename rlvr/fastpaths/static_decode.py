"""Decode steps of fixed shapes for Llama-family models, replayed as CUDA graphs (gpt-fast's recipe).

On a GPU a decode step of a small model is bound by launching its few hundred kernels from Python,
not by the GPU. :class:`StaticDecoder` keeps every tensor a step touches at a fixed address: key
and value buffers of ``capacity`` positions for ``max_rows`` rows per layer, and the step's inputs
(tokens, positions, a key mask, the write slot). A step for ``n`` live rows runs the smallest row
bucket (1, 2, 4, 8, 16, 32, ...) that holds them; on CUDA each bucket's step is captured once as a
CUDA graph (sharing one memory pool) and replayed, so a step costs one launch. Finished rows are
compacted to the front of the buffers (vLLM pads batches to captured sizes the same way).

The graphs read the model's own parameter tensors: an optimizer step (in place) is seen by the next
replay without re-capture; a parameter replaced by another tensor rebuilds the decoder
(:func:`static_decoder` compares the tensors' addresses). Computed: the same function as the
model's forward (RMSNorm, rotary embedding, grouped-query attention over the cache, SiLU MLP); the
rollout engine uses it where ``eligibility.use_static_decode`` says (CUDA), and tests hold it to
the model's forward on CPU, where it runs eagerly.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlvr.fastpaths.attention import LOW_PRECISION

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CAPACITY_STEP = 256  # buffers grow in multiples of this many positions (fewer rebuilds)


def row_bucket(rows: int, max_rows: int) -> int:
    """The smallest bucket holding ``rows`` live rows (``max_rows`` past the last bucket)."""
    if not 1 <= rows <= max_rows:
        raise ValueError(f"rows must be in [1, {max_rows}], got {rows}")
    return next((b for b in BUCKETS if b >= rows and b <= max_rows), max_rows)


def static_decoder(model: Any, rows: int, capacity: int, graphs: bool) -> "StaticDecoder":
    """The model's kept decoder when it fits (``rows``, ``capacity``, same parameter tensors and
    dtype), else a new one, kept for the next rollout."""
    kept = _KEPT.get(model)
    if kept is None or not kept.fits(model, rows, capacity, graphs):
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        kept = _KEPT[model] = StaticDecoder(model, max(rows, kept.max_rows if kept else 0), capacity, graphs)
    return kept


_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StaticDecoder:
    """``decoder(tokens, positions, attention_mask, cache)`` -> next-token logits [rows, vocab] for
    one new token per row, on its own fixed buffers; ``adopt(prefill_cache)`` starts a rollout and
    returns the cache object the engine compacts rows of (``batch_select_indices``)."""

    def __init__(self, model: Any, max_rows: int, capacity: int, graphs: bool):
        config = model.config
        self.model, self.max_rows, self.capacity, self.graphs = model, max_rows, capacity, graphs
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.parameters = [p.data_ptr() for p in model.parameters()]
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        shape = (max_rows, self.kv_heads, capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in model.model.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in model.model.layers]
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.key_mask = torch.zeros(max_rows, capacity, dtype=torch.bool, device=self.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self.live = 0
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def fits(self, model: Any, rows: int, capacity: int, graphs: bool) -> bool:
        return (
            rows <= self.max_rows
            and capacity <= self.capacity
            and graphs == self.graphs
            and model.lm_head.weight.dtype == self.dtype
            and [p.data_ptr() for p in model.parameters()] == self.parameters
        )

    # --- the engine's interface ----------------------------------------------------------------

    def adopt(self, cache: DynamicCache) -> "StaticDecoder":
        """Copy a prefilled cache (rows x prompt positions) into the buffers; the decoder is the
        rollout's cache from now on."""
        rows, width = cache.layers[0].keys.shape[0], cache.layers[0].keys.shape[2]
        if rows > self.max_rows or width >= self.capacity:
            raise ValueError(f"{rows} rows x {width} positions do not fit {self.max_rows} x {self.capacity}")
        for keys, values, layer in zip(self.keys, self.values, cache.layers):
            keys[:rows, :, :width].copy_(layer.keys)
            values[:rows, :, :width].copy_(layer.values)
        self.live = rows
        return self

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the live rows ``indices`` (in that order) at the front of the buffers."""
        for buffer in (*self.keys, *self.values):
            buffer[: len(indices)] = buffer[indices]
        self.live = len(indices)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """``tokens``, ``positions`` [rows]; ``attention_mask`` [rows, cached + 1] (0 on padding)."""
        rows, slot = len(tokens), attention_mask.shape[1] - 1  # every row writes the same slot (left padding)
        if rows != self.live or slot >= self.capacity:
            raise ValueError(f"step for {rows} rows at slot {slot}; the decoder holds {self.live} x {self.capacity}")
        bucket = row_bucket(rows, self.max_rows)
        self.tokens[:rows].copy_(tokens)
        self.positions[:rows].copy_(positions)
        self.key_mask.zero_()
        self.key_mask[:rows, : slot + 1].copy_(attention_mask.bool())
        self.key_mask[rows:bucket, 0] = True  # padding rows attend somewhere: no NaN anywhere
        self.slot.fill_(slot)
        if not self.graphs:
            return self._step(bucket)[:rows]
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:rows]

    # --- the step --------------------------------------------------------------------------------

    def _capture(self, bucket: int) -> tuple[Any, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (kernel selection, workspaces)
            for _ in range(2):
                self._step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(bucket)
        return graph, logits

    def _step(self, bucket: int) -> torch.Tensor:
        """One decode step of ``bucket`` rows on the fixed buffers: fixed shapes, no host sync."""
        model, heads, kv_heads, head_dim = self.model.model, self.heads, self.kv_heads, self.head_dim
        hidden = F.embedding(self.tokens[:bucket], model.embed_tokens.weight)
        cos, sin = _rotary(model.rotary_emb, self.positions[:bucket], hidden.dtype)  # [bucket, 1, head_dim]
        key_mask = self.key_mask[:bucket, None, None, :]
        for index, layer in enumerate(model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            normed = _rms_norm(hidden, layer.input_layernorm)
            queries = _rotate(F.linear(normed, attention.q_proj.weight, attention.q_proj.bias).view(bucket, heads, head_dim), cos, sin)
            keys = _rotate(F.linear(normed, attention.k_proj.weight, attention.k_proj.bias).view(bucket, kv_heads, head_dim), cos, sin)
            values = F.linear(normed, attention.v_proj.weight, attention.v_proj.bias).view(bucket, kv_heads, head_dim)
            key_cache, value_cache = self.keys[index][:bucket], self.values[index][:bucket]
            key_cache.index_copy_(2, self.slot, keys.unsqueeze(2))
            value_cache.index_copy_(2, self.slot, values.unsqueeze(2))
            queries, key_cache, value_cache = queries.unsqueeze(2), key_cache, value_cache
            if hidden.dtype in LOW_PRECISION and hidden.device.type == "cpu":  # as rlvr.fastpaths.attention
                queries, key_cache, value_cache = queries.float(), key_cache.float(), value_cache.float()
            attended = F.scaled_dot_product_attention(queries, key_cache, value_cache, attn_mask=key_mask, scale=attention.scaling, enable_gqa=True)
            hidden = hidden + F.linear(attended.to(hidden.dtype).view(bucket, heads * head_dim), attention.o_proj.weight)
            normed = _rms_norm(hidden, layer.post_attention_layernorm)
            gate, up = F.linear(normed, mlp.gate_proj.weight), F.linear(normed, mlp.up_proj.weight)
            hidden = hidden + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        return F.linear(_rms_norm(hidden, model.norm), self.model.lm_head.weight)


def _rotary(rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the model's rotary embedding at ``positions``, computed in float32 as transformers does."""
    freqs = positions[:, None].float() * rotary.inv_freq[None, :].float()
    angles = torch.cat((freqs, freqs), dim=-1)
    scaling = getattr(rotary, "attention_scaling", 1.0)
    return (angles.cos() * scaling).to(dtype)[:, None], (angles.sin() * scaling).to(dtype)[:, None]


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = states.shape[-1] // 2
    return states * cos + torch.cat((-states[..., half:], states[..., :half]), dim=-1) * sin


def _rms_norm(hidden: torch.Tensor, norm: Any) -> torch.Tensor:
    """The model's RMSNorm: normalized in float32, cast back, then scaled by the weight."""
    normed = F.rms_norm(hidden.float(), hidden.shape[-1:], None, norm.variance_epsilon).to(hidden.dtype)
    return normed * norm.weight
