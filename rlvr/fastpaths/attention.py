"""An attention implementation for low-precision models on CPU, registered with transformers.

PyTorch's bfloat16 / float16 ``scaled_dot_product_attention`` on CPU is slow: on the rollout
engine's preallocated cache (keys and values are strided views of a larger buffer) and in the
backward of a bf16-autocast update. ``"rlvr_sdpa"`` runs the float32 kernel on upcast inputs on
CPU in low precision or under low-precision autocast (also the more accurate softmax) and is plain
``"sdpa"`` everywhere else. ``bench/cpu_kernels.py`` times a decode step and an update both ways.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rlvr_sdpa"
LOW_PRECISION = (torch.bfloat16, torch.float16)  # dtypes whose attention runs in float32 on CPU


def upcast_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, computed in float32 on CPU for low-precision inputs or under
    low-precision autocast (which would otherwise cast the float32 kernel's inputs back down)."""
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in LOW_PRECISION
    if query.device.type != "cpu" or not (autocast or query.dtype in LOW_PRECISION):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):  # under autocast SDPA would run in bf16 again
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(torch.get_autocast_dtype("cpu") if autocast else query.dtype), weights


AttentionInterface.register(NAME, upcast_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes (unregistered names get none)


def use_fast_attention(model: Any, enabled: bool = True) -> Any:
    """Switch a transformers model that uses ``"sdpa"`` to ``"rlvr_sdpa"`` (back to ``"sdpa"`` when not
    ``enabled``; models on other implementations are left alone). The GRPO and SFT trainers do this to the
    policy as their plan's ``fast_attention`` says (``rlvr.fastpaths.plan``)."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    wanted = NAME if enabled else "sdpa"
    if current in ("sdpa", NAME) and current != wanted and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(wanted)
    return model
