"""The update's forward over completion tokens without padding, for Llama-family models.

A micro-batch's completions are right-padded to the longest; with the model's own forward every
padding position goes through every layer's matrix products, and with answer stops many rows end
early. Here the per-token work (norms, projections, MLP) runs on the real tokens only, packed
[tokens, hidden]; only attention,
which must see each row's positions in order, scatters queries, keys and values into the padded
layout and gathers its output back (as verl's remove-padding does with variable-length flash
attention, which CPUs lack). Each distinct prompt still goes through the model once (the caller's
prompt pass), its keys and values (gradient attached) shared by its completions. The modules and
formulas are the model's own (its norms, projections, rotary embedding, ``rlvr.fastpaths.attention``'s
SDPA), so values and gradients equal the padded forward's up to rounding; a test checks both.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rlvr.fastpaths.attention import upcast_sdpa_forward


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
    hidden = decoder.embed_tokens(batch.targets[:, :-1].flatten()[index])
    cos, sin = decoder.rotary_emb(hidden, positions.unsqueeze(0))
    cos, sin = cos[0], sin[0]  # [tokens, head_dim]
    prompt_width = batch.prompt_ids.shape[1]
    keys_visible = torch.cat([batch.prompt_mask[batch.prompt_index].bool(), is_input], dim=1)
    causal = torch.ones(span, prompt_width + span, dtype=torch.bool, device=index.device).tril(prompt_width)
    attention_mask = keys_visible[:, None, None, :] & causal  # [rows, 1, span, prompt + span]

    def padded(states: torch.Tensor) -> torch.Tensor:  # [tokens, heads, d] -> [rows, heads, span, d]
        out = states.new_zeros(rows * span, *states.shape[1:]).index_copy(0, index, states)
        return out.view(rows, span, *states.shape[1:]).transpose(1, 2)

    for layer_index, layer in enumerate(decoder.layers):
        attention = layer.self_attn
        head_dim = attention.head_dim
        normed = layer.input_layernorm(hidden)
        queries = attention.q_proj(normed).view(len(index), -1, head_dim)
        keys = attention.k_proj(normed).view(len(index), -1, head_dim)
        values = attention.v_proj(normed).view(len(index), -1, head_dim)
        queries, keys = apply_rotary_pos_emb(queries, keys, cos, sin, unsqueeze_dim=1)
        prompt_keys, prompt_values = prompt_cache.layers[layer_index].keys, prompt_cache.layers[layer_index].values
        keys = torch.cat([prompt_keys[batch.prompt_index], padded(keys).to(prompt_keys.dtype)], dim=2)
        values = torch.cat([prompt_values[batch.prompt_index], padded(values).to(prompt_values.dtype)], dim=2)
        attended, _ = upcast_sdpa_forward(
            attention,
            padded(queries),
            keys,
            values,
            attention_mask,
            dropout=attention.attention_dropout if attention.training else 0.0,
            scaling=attention.scaling,
        )  # [rows, span, heads, head_dim]
        attended = attended.reshape(rows * span, -1)[index]
        hidden = hidden + attention.o_proj(attended)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = decoder.norm(hidden)
    states = hidden.new_zeros(rows * span, hidden.shape[-1]).index_copy(0, index, hidden).view(rows, span, -1)
    states = torch.cat([first.unsqueeze(1).to(states.dtype), states], dim=1)  # [rows, width, hidden]
    return states[batch.mask.bool()]
