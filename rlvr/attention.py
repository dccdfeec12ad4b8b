"""An attention implementation for low-precision models on CPU, registered with transformers.

PyTorch's bfloat16 / float16 ``scaled_dot_product_attention`` on CPU is slow on the rollout
engine's preallocated cache (keys and values are strided views of a larger buffer);
``"rlvr_sdpa"`` runs the float32 kernel on upcast inputs there (also the more accurate softmax)
and is plain ``"sdpa"`` everywhere else. ``bench/cpu_kernels.py`` times a decode step both ways.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rlvr_sdpa"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def upcast_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, computed in float32 for low-precision inputs on CPU."""
    if query.device.type != "cpu" or query.dtype not in _LOW_PRECISION:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


AttentionInterface.register(NAME, upcast_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes (unregistered names get none)


def use_fast_attention(model: Any) -> Any:
    """Switch a transformers model that uses ``"sdpa"`` to ``"rlvr_sdpa"`` (others are left alone);
    the rollout engine does this to the model it decodes with."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    return model
