"""The update's forward over completion tokens without padding, through the model's own modules.

The real completion tokens go through the decoder as one flat sequence (``position_ids`` per token), as
the engine runs a model (``rlvr.generation.model_runner.ModelForward``): norms, projections, rotary
embedding and MLP, adapters included, see real tokens only. Attention alone scatters into the padded
layout, after the row's prompt keys and values (gradient attached), and gathers back, as verl's
remove-padding does. Values and gradients equal the padded forward's up to rounding; a test checks both.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from rlvr.fastpaths.attention import upcast_sdpa_forward
from rlvr.generation.model_runner import routed_attention


def unpadded_completion_features(model: Any, batch: Any, prompt_states: torch.Tensor, prompt_cache: DynamicCache) -> torch.Tensor:
    """The decoder's final hidden states at the real completion positions of ``batch`` (a
    :class:`~rlvr.grpo.trainer.PackedRows`), [real tokens, hidden] in row-major order: position t of
    a row is the state that predicts its completion token t. ``prompt_states`` [prompts, hidden]
    are the final states at each prompt's last position and ``prompt_cache`` its keys and values,
    from the prompt pass (gradient attached). Tokens an environment wrote are real positions here:
    the policy conditions on them; the caller leaves them out of the output layer."""
    decoder = model.get_decoder()
    rows, width = batch.targets.shape
    first = prompt_states[batch.prompt_index]  # predicts each row's first completion token
    if width == 1:
        return first
    span = width - 1  # completion inputs: token t feeds the prediction of token t + 1
    is_input = batch.mask[:, 1:].bool()
    index = is_input.flatten().nonzero().squeeze(1)  # real inputs in the padded [rows * span] layout
    prompt_lengths = batch.prompt_mask.sum(dim=1)[batch.prompt_index]
    positions = (prompt_lengths.unsqueeze(1) + torch.arange(span, device=index.device)).flatten()[index]
    prompt_width = batch.prompt_ids.shape[1]
    keys_visible = torch.cat([batch.prompt_mask[batch.prompt_index].bool(), is_input], dim=1)
    causal = torch.ones(span, prompt_width + span, dtype=torch.bool, device=index.device).tril(prompt_width)
    attention_mask = keys_visible[:, None, None, :] & causal  # [rows, 1, span, prompt + span]

    def padded(states: torch.Tensor) -> torch.Tensor:  # [tokens, heads, d] -> [rows, heads, span, d]
        out = states.new_zeros(rows * span, *states.shape[1:]).index_copy(0, index, states)
        return out.view(rows, span, *states.shape[1:]).transpose(1, 2)

    def attend(module: Any, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        layer = prompt_cache.layers[module.layer_idx]
        keys = torch.cat([layer.keys[batch.prompt_index], padded(keys).to(layer.keys.dtype)], dim=2)
        values = torch.cat([layer.values[batch.prompt_index], padded(values).to(layer.values.dtype)], dim=2)
        attended, _ = upcast_sdpa_forward(module, padded(queries), keys, values, attention_mask, **kwargs)  # [rows, span, heads, d]
        return attended.reshape(rows * span, *attended.shape[2:])[index]

    with routed_attention(decoder.config, attend):
        hidden = decoder(input_ids=batch.targets[:, :-1].flatten()[index][None], position_ids=positions[None], use_cache=False).last_hidden_state[0]
    states = hidden.new_zeros(rows * span, hidden.shape[-1]).index_copy(0, index, hidden).view(rows, span, -1)
    states = torch.cat([first.unsqueeze(1).to(states.dtype), states], dim=1)  # [rows, width, hidden]
    return states[batch.mask.bool()]
