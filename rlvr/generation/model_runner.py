"""The model runner: one forward over a flat batch of tokens from many sequences, for any causal LM.

``runner.forward(tokens, positions, attend, logits_at)`` runs every linear layer once over the step's
tokens (decode rows and prompt chunks alike) and leaves attention to ``attend(layer, queries, keys,
values, scaling)``, which keeps each sequence's keys and values where the engine holds them. Two
backends, chosen by :func:`model_runner`: the fused decoder (``rlvr.fastpaths.fused_decode``: the
Llama-family math on packed weights, for Llama, Qwen2, Qwen3 and Mistral on any device) and
:class:`ModelForward`, the model's own forward with its attention calls routed to ``attend`` (any
transformers causal LM whose attention goes through transformers' attention interface).
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

import torch
from transformers import AttentionInterface

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.fused_decode import Attend, fused_decoder

ENGINE_ATTENTION = "rlvr_engine"  # the attention implementation ModelForward switches the model to
_ATTEND: contextvars.ContextVar[Attend | None] = contextvars.ContextVar("rlvr_engine_attend", default=None)


class ModelRunner(Protocol):
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_at: torch.Tensor | None = None) -> torch.Tensor: ...


def model_runner(model: Any, rows: int, fast: FastPaths = FastPaths()) -> ModelRunner:
    """The fused decoder where the model qualifies (``eligibility.use_fused_decode``), else the model's own forward."""
    return fused_decoder(model, rows, fast) or ModelForward(model)


def attention_window(config: Any) -> int | None:
    """The model's sliding attention window, or None when every layer attends over the whole sequence."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return getattr(config, "sliding_window", None) if any(kind != "full_attention" for kind in layer_types) else None
    return getattr(config, "sliding_window", None)


class ModelForward:
    """Any transformers causal LM through its own modules: the flat batch goes in as one sequence of
    ``len(tokens)`` positions (``position_ids`` per token, no cache, no mask), and each attention layer's
    call (queries, keys and values with the model's own rotary or none) goes to ``attend``."""

    def __init__(self, model: Any):
        self.model = model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        config = self.model.config
        previous, token = config._attn_implementation, _ATTEND.set(attend)
        config._attn_implementation = ENGINE_ATTENTION
        try:
            keep = logits_at if logits_at is not None else 0
            out = self.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep)
        finally:
            config._attn_implementation = previous
            _ATTEND.reset(token)
        return out.logits[0]


def _engine_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any):
    """transformers' attention interface, routed to the engine's ``attend`` ([1, heads, tokens, head dim] in,
    [1, tokens, heads, head dim] out)."""
    attend = _ATTEND.get()
    if attend is None:
        raise RuntimeError(f"{ENGINE_ATTENTION} attention runs only inside ModelForward.forward")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the engine's attention does not apply {name} ({type(module).__name__})")
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scaling)
    return out.view(1, out.shape[0], query.shape[1], query.shape[3]), None


AttentionInterface.register(ENGINE_ATTENTION, _engine_attention)
