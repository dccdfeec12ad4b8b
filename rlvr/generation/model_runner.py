"""The model runner: one forward over a flat batch of tokens from many sequences, for any causal LM.

``runner.forward(tokens, positions, attend, logits_at)`` runs every linear layer once over the step's
tokens (decode rows and prompt chunks alike) and leaves attention to ``attend(layer, queries, keys,
values, scaling)``, which keeps each sequence's keys and values where the engine holds them. Two
backends, chosen by :func:`model_runner`: the fused decoder (``rlvr.fastpaths.fused_decode``: the
Llama-family math on packed weights, for Llama, Qwen2, Qwen3 and Mistral on any device) and
:class:`ModelForward`, the model's own forward with its attention calls routed to ``attend``
(:func:`routed_attention`: any transformers causal LM whose attention goes through transformers'
attention interface; the trainer's unpadded update runs the same way).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Protocol

import torch
from transformers import AttentionInterface

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.fused_decode import Attend, fused_decoder
from rlvr.fastpaths.packed_linear import PackedLinears
from rlvr.fastpaths.plan import BackendPlan, plan_backend

ENGINE_ATTENTION = "rlvr_engine"  # the attention implementation routed_attention switches a model to
Routed = Callable[..., torch.Tensor]  # (module, queries [T, heads, d], keys, values [T, KV heads, d], **kwargs) -> [T, heads, d]
_ROUTED: contextvars.ContextVar[Routed | None] = contextvars.ContextVar("rlvr_routed_attention", default=None)


@contextlib.contextmanager
def routed_attention(config: Any, attention: Routed) -> Iterator[None]:
    """Within the block, every attention layer of the model of ``config`` computes ``attention`` over the flat
    sequence it is given (one batch row of tokens from many sequences), the model's own modules around it."""
    previous, token = config._attn_implementation, _ROUTED.set(attention)
    config._attn_implementation = ENGINE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
        _ROUTED.reset(token)


class ModelRunner(Protocol):
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_at: torch.Tensor | None = None) -> torch.Tensor: ...


def model_runner(model: Any, rows: int, plan: BackendPlan | FastPaths = FastPaths()) -> ModelRunner:
    """The runner ``plan`` names (a :class:`~rlvr.fastpaths.plan.BackendPlan`, or switches to plan with): the
    fused decoder, else the model's own forward (on packed linear weights where the plan packs them)."""
    if not isinstance(plan, BackendPlan):
        plan = plan_backend(model, plan)
    return fused_decoder(model, rows, plan) or ModelForward(model, PackedLinears(model, rows) if plan.packed_linears else None)


class ModelForward:
    """Any transformers causal LM through its own modules: the flat batch goes in as one sequence of
    ``len(tokens)`` positions (``position_ids`` per token, no cache, no mask), and each attention layer's
    call (queries, keys and values with the model's own rotary or none) goes to ``attend``. ``packed``:
    its linear layers run on those packed weights (forwards without gradients only)."""

    def __init__(self, model: Any, packed: PackedLinears | None = None):
        self.model, self.packed = model, packed

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        def attention(module: Any, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return attend(module.layer_idx, queries, keys, values, kwargs.get("scaling") or queries.shape[-1] ** -0.5)

        packing = self.packed.applied() if self.packed is not None else contextlib.nullcontext()
        with routed_attention(self.model.config, attention), packing:
            keep = logits_at if logits_at is not None else 0
            return self.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep).logits[0]


def _routed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any):
    """transformers' attention interface, routed to :func:`routed_attention`'s function ([1, heads, tokens,
    head dim] in, [1, tokens, heads, head dim] out; no mask: the routed function knows the sequences)."""
    attention = _ROUTED.get()
    if attention is None:
        raise RuntimeError(f"{ENGINE_ATTENTION} attention runs only inside routed_attention")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the engine's attention does not apply {name} ({type(module).__name__})")
    out = attention(module, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), **kwargs)
    return out.reshape(1, out.shape[0], query.shape[1], query.shape[3]), None


AttentionInterface.register(ENGINE_ATTENTION, _routed_attention)
