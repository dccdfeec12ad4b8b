"""Scripted tiny Llamas over the embedded model's tokenizer: bigram models (attention and MLP outputs
zeroed) whose one-hot embeddings and output rows chain a fixed script, so a test knows what they write.

``save_scripted_tiny_llama``: the greedy completion of any chat prompt is ``GREEDY_COMPLETION``.
``save_calculator_llama``: writes a GSM8k calculator annotation (``<<6*7=`` greedy, ``<<9/0=`` sampled
about a third of the time, ``' <<9/0='`` after a ``:``), then `` #### 42`` after ``>>``: with the
calculator the environment writes ``42>>`` (or ``error>>``), without it the policy writes ``>>``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from support.tiny_models import tiny_llama_with_embedded_tokenizer

GREEDY_COMPLETION = "#### 2^{3}"  # a symbolic final answer
GREEDY_WITHOUT_TOOL = "<<6*7=>> #### 42"
GREEDY_WITH_CALCULATOR = "<<6*7=42>> #### 42"


def save_scripted_tiny_llama(out_dir: Path, completion: str = GREEDY_COMPLETION) -> Path:
    """The tiny Llama whose greedy completion of any chat prompt is ``completion`` (its tokens all distinct),
    saved to ``out_dir``: the tokens from the prompt's last one (the newline opening the assistant turn)
    through the completion to the end token are chained. Sampled completions stay gibberish."""
    from rlvr import policy

    model, tokenizer = tiny_llama_with_embedded_tokenizer(seed=0, tie_word_embeddings=False)
    config = model.config
    chain = [tokenizer.convert_tokens_to_ids("Ċ"), *tokenizer(completion, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain) <= config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for k, (token, following) in enumerate(zip(chain, chain[1:])):
            direction = torch.nn.functional.one_hot(torch.tensor(k), config.hidden_size).float()
            model.model.embed_tokens.weight[token] = direction
            model.lm_head.weight[following] = 1.4 * direction  # logit 8 after the final norm; the rest ~N(0, 0.1)
    policy.export_checkpoint(model, tokenizer, out_dir)
    return out_dir


def save_calculator_llama(out_dir: Path, scale: float = 4.0) -> Path:
    """The scripted calculator policy (module docstring), saved to ``out_dir``. A token's output row points
    at the tokens that may follow it (logit ~23: sampling follows the script too, but at the one branch
    after ``<<``: ``6`` or, a bit less likely, ``9``)."""
    from rlvr import policy

    model, tokenizer = tiny_llama_with_embedded_tokenizer(seed=0, tie_word_embeddings=False)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    newline, colon, equals, close = tokenizer.convert_tokens_to_ids("Ċ"), ids(":")[0], ids("=")[0], ids(">>")[0]
    edges: list[tuple[int, int, float]] = []  # (token, a token that may follow it, weight)

    def path(tokens: list[int], weight: float = 1.0) -> None:
        edges.extend((a, b, weight) for a, b in zip(tokens, tokens[1:]))

    path([newline, *ids("<<6*7=")])
    path([ids("<<")[0], *ids("9")], weight=0.97)
    path(ids("9/0="))
    path([colon, *ids(" <<9/0=")])
    path([equals, close])  # what the policy writes itself where no calculator answers
    path([close, *ids(" #### 42"), tokenizer.eos_token_id])
    tokens = list(dict.fromkeys(t for a, b, _ in edges for t in (a, b) if t != tokenizer.eos_token_id))
    assert len(tokens) <= model.config.hidden_size
    direction = {t: torch.nn.functional.one_hot(torch.tensor(k), model.config.hidden_size).float() for k, t in enumerate(tokens)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for token, vector in direction.items():
            model.model.embed_tokens.weight[token] = vector
        for token, following, weight in edges:
            model.lm_head.weight[following] += scale * weight * direction[token]
    policy.export_checkpoint(model, tokenizer, out_dir)
    return out_dir
