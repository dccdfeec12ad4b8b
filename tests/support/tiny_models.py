"""Tiny policies built from a config, for mechanics tests: a character-level tokenizer, 2-layer causal
LMs of each family (deterministic given a seed), the same over the embedded model's tokenizer, and the
copy-digit toy task they learn."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

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
CHAR_TOKEN_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}  # char_tokenizer's
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


def char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """One token per character; pad 0, eos 1; left padding as in rlvr.policy.load_policy."""
    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(chars)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")


@functools.cache
def _embedded_tokenizer():
    from transformers import AutoTokenizer

    from rlvr import policy

    gguf = policy.embedded_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def embedded_tokenizer():
    """The embedded model's tokenizer and chat template: a copy of the one read from its GGUF file once
    per process (reading it takes seconds)."""
    return copy.deepcopy(_embedded_tokenizer())


def token_ids_of(tokenizer) -> dict:
    """The special-token ids of a model over ``tokenizer``: its begin and end tokens, the end token as pad."""
    return {"pad_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}


def _seeded(model_class, config, seed: int):
    """``model_class(config)`` initialised under ``seed``, generating with the config's pad and end tokens."""
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def tiny_llama(vocab_size: int, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, *, token_ids: dict = CHAR_TOKEN_IDS, **config) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (sdpa attention), deterministic given ``seed``; ``config`` overrides."""
    defaults = dict(intermediate_size=2 * hidden_size, max_position_embeddings=512, tie_word_embeddings=False, attn_implementation="sdpa")
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2)
    return _seeded(LlamaForCausalLM, LlamaConfig(**sizes, **token_ids, **(defaults | config)), seed).eval()


def tiny_qwen2(vocab_size: int, seed: int = 0, *, token_ids: dict = CHAR_TOKEN_IDS, **overrides) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (biases on the query, key and value projections), tied embeddings."""
    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512)
    config |= dict(tie_word_embeddings=True, attn_implementation="sdpa") | overrides
    model = _seeded(Qwen2ForCausalLM, Qwen2Config(vocab_size=vocab_size, **token_ids, **config), seed)
    with torch.no_grad():  # nonzero biases, so that a dropped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model.eval()


def tiny_causal_lm(family: str, vocab_size: int, seed: int = 0, *, token_ids: dict = CHAR_TOKEN_IDS, max_position_embeddings: int = 512):
    """A randomly initialised 2-layer causal LM of ``family`` (one of ``FAMILIES``), deterministic given ``seed``."""
    if family == "llama":
        return tiny_llama(vocab_size, seed, token_ids=token_ids, max_position_embeddings=max_position_embeddings)
    if family == "qwen2":
        return tiny_qwen2(vocab_size, seed, token_ids=token_ids, max_position_embeddings=max_position_embeddings)
    common = dict(vocab_size=vocab_size, **token_ids, attn_implementation="sdpa")
    if family == "gpt2":
        config, model_class = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=max_position_embeddings, **common), GPT2LMHeadModel
    else:
        sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
        sizes["max_position_embeddings"] = max_position_embeddings
        if family == "qwen3":
            config, model_class = Qwen3Config(head_dim=16, tie_word_embeddings=True, **sizes, **common), Qwen3ForCausalLM
        elif family == "mistral":
            config, model_class = MistralConfig(sliding_window=None, tie_word_embeddings=False, **sizes, **common), MistralForCausalLM
        else:
            raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    model = _seeded(model_class, config, seed)
    with torch.no_grad():  # Qwen3's per-head norms start at 1: make them matter
        for module in model.modules():
            if type(module).__name__ == "Qwen3RMSNorm" and module.weight.shape[0] == 16:
                module.weight.uniform_(0.5, 1.5)
    return model.eval()


def tiny_llama_with_embedded_tokenizer(seed: int = 0, tie_word_embeddings: bool = True):
    """(a randomly initialised 2-layer Llama of width 32, the embedded model's tokenizer and chat template)."""
    tokenizer = embedded_tokenizer()
    config = dict(intermediate_size=64, max_position_embeddings=2048, tie_word_embeddings=tie_word_embeddings, attn_implementation=None)
    return tiny_llama(len(tokenizer), seed, hidden_size=32, token_ids=token_ids_of(tokenizer), **config), tokenizer


def save_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """``tiny_llama_with_embedded_tokenizer(seed)`` exported as a checkpoint folder (``out_dir``, returned)."""
    from rlvr import policy

    model, tokenizer = tiny_llama_with_embedded_tokenizer(seed)
    policy.export_checkpoint(model, tokenizer, out_dir)
    return out_dir


# A verifiable toy task: the prompt is "dd:" for a digit d; reward 1 when the completion starts with d.
COPY_DIGIT_CHARS = "0123456789:"
COPY_DIGIT_PROBLEMS = [{"prompt": f"{d}{d}:", "digit": str(d), "problem_id": f"copy-{d}"} for d in range(10)]


def copy_digit_reward(completions: list[str], problems: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """The GRPO reward callback for the toy task: (totals, {reward name: values})."""
    correct = [1.0 if text.startswith(p["digit"]) else 0.0 for text, p in zip(completions, problems)]
    return correct, {"copy_digit": correct}
