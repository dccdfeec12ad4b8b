"""Tiny policies for mechanics tests: a character-level tokenizer and 2-layer causal LMs of each family built from a config."""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SPECIALS = ["<pad>", "<eos>", "<unk>"]  # ids 0, 1, 2
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz #=+-*/:?.,\n"


def char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """One token per character; pad 0, eos 1; left padding as in rlvr.policy.load_policy."""
    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(chars)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")


def tiny_llama(vocab_size: int, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (sdpa attention), deterministic given ``seed``."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model.eval()


def tiny_qwen2(vocab_size: int, seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (biases on the query, key and value projections), tied embeddings."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        **overrides,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # nonzero biases, so that a dropped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model.eval()


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


def tiny_causal_lm(family: str, vocab_size: int, seed: int = 0):
    """A randomly initialised 2-layer causal LM of ``family`` (one of ``FAMILIES``), deterministic given ``seed``."""
    if family == "llama":
        return tiny_llama(vocab_size, seed)
    if family == "qwen2":
        return tiny_qwen2(vocab_size, seed)
    common = dict(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=None, attn_implementation="sdpa")
    if family == "gpt2":
        config, model_class = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common), GPT2LMHeadModel
    else:
        sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512)
        if family == "qwen3":
            config, model_class = Qwen3Config(head_dim=16, tie_word_embeddings=True, **sizes, **common), Qwen3ForCausalLM
        elif family == "mistral":
            config, model_class = MistralConfig(sliding_window=None, tie_word_embeddings=False, **sizes, **common), MistralForCausalLM
        else:
            raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # Qwen3's per-head norms start at 1: make them matter
        for module in model.modules():
            if type(module).__name__ == "Qwen3RMSNorm" and module.weight.shape[0] == 16:
                module.weight.uniform_(0.5, 1.5)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model.eval()


# A verifiable toy task: the prompt is "dd:" for a digit d; reward 1 when the completion starts with d.
COPY_DIGIT_CHARS = "0123456789:"
COPY_DIGIT_PROBLEMS = [{"prompt": f"{d}{d}:", "digit": str(d), "problem_id": f"copy-{d}"} for d in range(10)]


def copy_digit_reward(completions: list[str], problems: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """The GRPO reward callback for the toy task: (totals, {reward name: values})."""
    correct = [1.0 if text.startswith(p["digit"]) else 0.0 for text, p in zip(completions, problems)]
    return correct, {"copy_digit": correct}
