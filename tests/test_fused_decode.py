"""Fused decode steps: the same logits as the model's own forward for Llama, Qwen2, Qwen3 and Mistral, in
rollouts too; other models run through their own forward."""

from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

import rlvr.generation.model_runner as model_runner
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.fused_decode import FusedDecoder, fused_decoder
from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts
from support.tiny_models import char_tokenizer, tiny_causal_lm, tiny_llama, tiny_qwen2


def last_position_logits(model, **inputs) -> torch.Tensor:
    return model(**inputs, use_cache=True, logits_to_keep=1).logits[:, -1]


def decode_both_ways(model, steps: int = 6) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill three left-padded prompts, then decode the same tokens with the model's forward and
    with the fused decoder, each on its own cache; the middle row leaves after two steps."""
    vocab = model.config.vocab_size
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = torch.randint(3, vocab, (3, steps))
    results = []
    with torch.inference_mode():
        decoder = fused_decoder(model, rows=3)
        assert isinstance(decoder, FusedDecoder)
        for fused in (False, True):
            cache = DynamicCache(config=model.config)
            last_position_logits(model, input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
            attention_mask, position, rows, out = mask, positions[:, -1] + 1, torch.arange(3), []
            for t in range(steps):
                if t == 2:
                    keep = torch.tensor([0, 2])
                    cache.batch_select_indices(keep)
                    attention_mask, position, rows = attention_mask[keep], position[keep], rows[keep]
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
                step_tokens = tokens[rows, t]
                if fused:
                    logits = decoder(step_tokens, position, attention_mask, cache)
                else:
                    logits = last_position_logits(
                        model,
                        input_ids=step_tokens[:, None],
                        attention_mask=attention_mask,
                        position_ids=position[:, None],
                        past_key_values=cache,
                    )
                out.append(logits.float())
                position = position + 1
            results.append(out)
    return results[0], results[1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_float32_logits_equal_the_models_forward(family):
    model = tiny_causal_lm(family, 60, seed=3)
    expected, got = decode_both_ways(model)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_bfloat16_log_probs_stay_close_to_the_models_forward():
    model = tiny_llama(60, seed=5).to(torch.bfloat16)
    expected, got = decode_both_ways(model)
    for a, b in zip(expected, got):
        # bf16 rounding (different kernels, different operation order), not a different function
        torch.testing.assert_close(b.log_softmax(-1), a.log_softmax(-1), rtol=0, atol=0.05)


def test_rollouts_use_it_and_match_the_models_forward(monkeypatch):
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), seed=2)
    prompts = ["12+3=", "7*8 = ?", "a"]
    config = SamplingConfig(max_new_tokens=12, temperatures=[0.0, 1.0], seed=4)
    built = []
    monkeypatch.setattr(model_runner, "fused_decoder", lambda *args: built.append(fused_decoder(*args)) or built[-1])
    fused = generate_rollouts(model, tokenizer, prompts, 2, config)
    assert len(built) == 1 and isinstance(built[0], FusedDecoder)
    plain = generate_rollouts(model, tokenizer, prompts, 2, replace(config, fast_paths=FastPaths(fused_decode=False)))
    assert len(built) == 2 and built[1] is None  # switched off by config
    assert torch.equal(fused.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, rtol=1e-4, atol=1e-4)


def test_models_it_does_not_cover_decode_through_their_own_forward():
    with torch.inference_mode():
        assert fused_decoder(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)), 4) is None
        gelu = tiny_qwen2(50, hidden_act="gelu")
        assert fused_decoder(gelu, 4) is None

        class Adapter(nn.Linear):  # e.g. a LoRA or quantized layer with its own forward
            pass

        model = tiny_llama(50)
        old = model.model.layers[1].mlp.up_proj
        model.model.layers[1].mlp.up_proj = Adapter(old.in_features, old.out_features, bias=False)
        assert fused_decoder(model, 4) is None


def test_a_frozen_model_keeps_its_decoder_until_a_weight_changes():
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=6).requires_grad_(False)
    config = SamplingConfig(max_new_tokens=6, temperatures=[0.0])
    built = []
    original = FusedDecoder.__init__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedDecoder, "__init__", lambda self, *a: built.append(1) or original(self, *a))
        first = generate_rollouts(model, tokenizer, ["12+3="], 2, config)
        assert generate_rollouts(model, tokenizer, ["12+3="], 2, config).texts == first.texts
        assert len(built) == 1  # the second rollout reused the packed weights
        with torch.no_grad():
            model.lm_head.weight.mul_(-1)  # in place: its version counter moves
        flipped = generate_rollouts(model, tokenizer, ["12+3="], 2, config)
        assert len(built) == 2 and not torch.equal(flipped.completion_ids, first.completion_ids)
        model.model.layers[0].mlp.up_proj = nn.Linear(64, 128, bias=False).requires_grad_(False)  # a swapped module
        generate_rollouts(model, tokenizer, ["12+3="], 2, config)
        assert len(built) == 3
        model.requires_grad_(True)  # trainable: a fresh decoder every rollout
        generate_rollouts(model, tokenizer, ["12+3="], 2, config)
        generate_rollouts(model, tokenizer, ["12+3="], 2, config)
        assert len(built) == 5


def test_the_engine_refuses_a_request_longer_than_the_models_sliding_window():
    """Attention over whole sequences equals a sliding window's only within the window: longer is refused."""
    tokenizer = char_tokenizer()
    sliding = tiny_qwen2(len(tokenizer), use_sliding_window=True, sliding_window=16, max_window_layers=0)
    engine = Engine(sliding, tokenizer, max_rows=2, kv_budget_bytes=2**24)
    engine.submit(EngineRequest([5] * 8, 1, (0.0,), 8))
    with pytest.raises(ValueError, match="over the model.s sliding window of 16 tokens"):
        engine.submit(EngineRequest([5] * 8, 1, (0.0,), 9))
