"""One-token decode steps for Llama-family models, written out with fused weights.

:class:`FusedDecoder` computes what the model's forward computes for a decode step (RMSNorm, rotary
embedding, grouped-query attention over the cache, SiLU-gated MLP) in fewer, larger operations: fused
projections on weights packed once per rollout (through ``rlvr.fastpaths.linear_kernels`` where the
plan says, others through oneDNN), attention in float32 for bf16 / fp16 where the plan says.
``llama``, ``qwen2``, ``qwen3`` and ``mistral`` models with plain linear layers qualify (the plan's
``runner``, ``rlvr.fastpaths.plan``); for any other :func:`fused_decoder` returns None and the engine runs
the model's own forward. ``bench/cpu_kernels.py`` times it against that forward (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from rlvr.fastpaths import FastPaths, layer_kernels, linear_kernels
from rlvr.fastpaths.attention import LOW_PRECISION
from rlvr.fastpaths.eligibility import head_dim
from rlvr.fastpaths.packed_linear import WeightVersions, fused_bias, fused_linear
from rlvr.fastpaths.plan import BackendPlan, plan_backend


def fused_decoder(model: Any, rows: int, plan: BackendPlan | FastPaths = FastPaths()) -> FusedDecoder | None:
    """A :class:`FusedDecoder` for ``model`` (weights packed for ``rows`` rows), or None where ``plan`` (a
    :class:`~rlvr.fastpaths.plan.BackendPlan`, or switches to plan with) runs the model's own forward; call
    without gradients. A frozen model keeps its decoder while none of its weights changes (tensor version
    counters), so repeated rollouts skip the packing; a trainable one gets a fresh decoder each time, so no
    kept copy doubles its weights' memory through the update."""
    if not isinstance(plan, BackendPlan):
        plan = plan_backend(model, plan)
    if not plan.fused:
        return None
    kernels, panels = plan.layer_kernels, plan.linear_kernels
    parameters = list(model.parameters())
    if any(p.requires_grad for p in parameters):
        return FusedDecoder(model, rows, kernels, panels)
    kept = _FROZEN.get(model)
    if kept is None or not kept[0].current(model) or kept[1].linear_kernels != panels:
        # packed for at least 8 rows: it serves later rollouts of any size, and a float32 weight
        # packed by oneDNN for 1 row (a service's warm-up) runs markedly slower on 4 or more
        kept = _FROZEN[model] = (WeightVersions(model), FusedDecoder(model, max(rows, 8), kernels, panels))
    decoder = kept[1]
    if decoder.kernels != kernels:  # the same packed weights, another switch
        decoder = copy.copy(decoder)
        decoder.kernels = kernels
    return decoder


_FROZEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # frozen model -> (WeightVersions, decoder)


class FusedDecoder:
    """``decoder(tokens, positions, attention_mask, cache)`` -> the next-token logits [rows, vocab],
    for one new token per row; the cache gets that token's keys and values, as the model's own
    forward would add them. ``kernels``: its RMSNorms and rotary embeddings through
    ``rlvr.fastpaths.layer_kernels``; ``panels``: its linear layers through ``rlvr.fastpaths.linear_kernels``
    (float32 and bf16 CPU models), else through oneDNN's weights packed for ``rows`` rows."""

    def __init__(self, model: Any, rows: int, kernels: bool = False, panels: bool = False):
        self.kernels, self.linear_kernels = kernels, panels
        config, decoder = model.config, model.model
        self.embed, self.rotary, self.final_norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.layers = []
        for layer in decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    getattr(attention, "q_norm", None),  # Qwen3: each head's query and key RMS-normed before rotary
                    getattr(attention, "k_norm", None),
                    layer.input_layernorm,
                    Projection([attention.q_proj, attention.k_proj, attention.v_proj], rows, panels),
                    Projection([attention.o_proj], rows, panels),
                    attention.scaling,
                    layer.post_attention_layernorm,
                    Projection([mlp.gate_proj, mlp.up_proj], rows, panels),
                    Projection([mlp.down_proj], rows, panels),
                )
            )
        self.head = Projection([model.lm_head], rows, panels)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """``tokens`` and ``positions`` [rows]; ``attention_mask`` [rows, cached + 1] (0 on padding)."""
        key_mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        return self.forward(tokens, positions, cached_attention(cache, key_mask))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """The next-token logits [len(logits_at) or tokens, vocab] of a flat batch of ``tokens`` at
        ``positions`` [tokens], which may belong to different sequences (one decode token per row, a
        chunk of a prompt): every linear layer runs once over all of them, and ``attend(layer,
        queries, keys, values, scaling)`` ([tokens, heads or KV heads, head dim], rotary applied) stores
        each sequence's keys and values where it keeps them and returns its attention outputs
        [tokens, heads x head dim]. Only the rows ``logits_at`` go through the output head."""
        rows, heads, kv_heads, head_dim = len(tokens), self.num_heads, self.num_kv_heads, self.head_dim
        hidden = self.embed(tokens)  # [rows, hidden]
        cos, sin = self.rotary(hidden, positions.unsqueeze(1))  # [rows, 1, head_dim], broadcast over heads
        half, qk_width = head_dim // 2, (heads + kv_heads) * head_dim
        norm = _compiled_rms_norm if self.kernels else _rms_norm
        for index, (q_norm, k_norm, norm1, qkv_proj, o_proj, scaling, norm2, gate_up_proj, down_proj) in enumerate(self.layers):
            qkv = qkv_proj(norm(hidden, norm1))
            if q_norm is not None:
                qk = qkv[:, :qk_width].reshape(rows, heads + kv_heads, head_dim)
                qk = torch.cat([_rms_norm(qk[:, :heads], q_norm), _rms_norm(qk[:, heads:], k_norm)], dim=1)
                qkv = torch.cat([qk.view(rows, qk_width), qkv[:, qk_width:]], dim=1)
            if self.kernels:
                qk = layer_kernels.rotary(qkv, cos.view(rows, head_dim), sin.view(rows, head_dim), heads + kv_heads)
            else:
                qk = qkv[:, :qk_width].view(rows, heads + kv_heads, head_dim)
                qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin  # rotate_half
            values = qkv[:, qk_width:].view(rows, kv_heads, head_dim)
            attended = attend(index, qk[:, :heads], qk[:, heads:], values, scaling)
            hidden = o_proj(attended.to(hidden.dtype), residual=hidden)
            gate_up = gate_up_proj(norm(hidden, norm2))
            hidden = down_proj(gate_up, residual=hidden, gated=True)
        if logits_at is not None:
            hidden = hidden[logits_at]
        return self.head(norm(hidden, self.final_norm))


class Projection:
    """The linear ``layers`` on one input, their outputs side by side: on weights packed once, in panels for
    ``rlvr.fastpaths.linear_kernels`` (``panels``) or by oneDNN for ``rows`` rows (``rlvr.fastpaths.packed_linear``).
    ``residual``: added to the output (in place on the panels' path: the caller's to overwrite); ``gated``: the
    input is a SiLU-gated MLP's gate and up side by side, taken as ``silu(gate) * up``."""

    def __init__(self, layers: list[nn.Linear], rows: int, panels: bool = False):
        self.panels = linear_kernels.pack(layers) if panels else None
        self.packed = None if panels else fused_linear(layers, rows)
        self.bias = fused_bias(layers) if panels else None  # the oneDNN path adds its own

    def __call__(self, inputs: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
        if self.panels is not None:
            out = linear_kernels.linear(self.panels, inputs, residual, gated)
            return out if self.bias is None else out.add_(self.bias)
        if gated:
            half = inputs.shape[-1] // 2
            inputs = F.silu(inputs[:, :half]) * inputs[:, half:]
        out = self.packed(inputs)
        return out if residual is None else residual + out


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def cached_attention(cache: Any, key_mask: torch.Tensor | None, upcast: bool = True) -> Attend:
    """Decode attention of one new token per row: its key and value go into ``cache`` (its layers'
    ``update``, which returns each row's keys and values so far), its query attends over them
    (``key_mask`` [rows, 1, 1, keys]: True where it may; None: everywhere; ``upcast``: as in
    :func:`gqa_attention`)."""

    def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        keys, values = cache.layers[index].update(keys.unsqueeze(2), values.unsqueeze(2))
        return gqa_attention(queries.unsqueeze(2), keys, values, key_mask, scaling, upcast).view(len(queries), -1)

    return attend


def gqa_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    upcast: bool = True,
    causal: bool = False,
) -> torch.Tensor:
    """Grouped-query attention [batch, heads, queries, head dim] over keys and values [batch, KV heads, keys,
    head dim] (``mask``: True where a query may attend; ``causal`` instead: query i attends keys 0 .. i,
    which lets SDPA skip the blocks above the diagonal), SDPA called directly; ``upcast``: in float32 for
    bf16 / fp16 (the engine passes its plan's ``float32_attention``: on CPU, under the switch).

    On CPU a decode step's one query per head is packed by KV head (a group's queries become one KV head's
    query positions): the same sums. ``bench/cpu_kernels.py`` times it against SDPA's ``enable_gqa`` (its
    "packed by KV head" rows in docs/benchmarks.md: faster at 1,500 keys, slower at 150).
    """
    dtype = queries.dtype
    if upcast and dtype in LOW_PRECISION:
        queries, keys, values = queries.float(), keys.float(), values.float()
    batch, heads, length, head_dim = queries.shape
    kv_heads = keys.shape[1]
    one_mask_per_row = mask is None or (mask.shape[-2] == 1 and (mask.dim() < 3 or mask.shape[-3] == 1))
    if length == 1 and heads != kv_heads and one_mask_per_row and queries.device.type == "cpu":
        packed = queries.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        attended = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return attended.reshape(batch, heads, 1, head_dim).to(dtype)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True).to(dtype)


def _compiled_rms_norm(hidden: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return layer_kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon)


def _rms_norm(hidden: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """The model's RMSNorm: normalized in float32, cast back, then scaled by the weight."""
    if hidden.dtype == torch.float32:
        return F.rms_norm(hidden, hidden.shape[-1:], norm.weight, norm.variance_epsilon)
    return F.rms_norm(hidden.float(), hidden.shape[-1:], None, norm.variance_epsilon).to(hidden.dtype) * norm.weight
