"""The low-precision CPU attention ("rlvr_sdpa"): same results as transformers' "sdpa", masks included."""

import json

import pytest
import torch

from rlvr.fastpaths.attention import NAME, use_fast_attention
from support.tiny_models import char_tokenizer, tiny_llama


def padded_batch(vocab_size: int) -> dict:
    torch.manual_seed(0)
    input_ids = torch.randint(3, vocab_size, (3, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # left padding: these positions must not be attended to
    attention_mask[1, :1] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def test_float32_results_equal_sdpa_with_padding_masks():
    vocab = len(char_tokenizer())
    reference, fast = tiny_llama(vocab, seed=1), use_fast_attention(tiny_llama(vocab, seed=1))
    assert fast.config._attn_implementation == NAME
    batch = padded_batch(vocab)
    with torch.no_grad():
        expected, got = reference(**batch).logits, fast(**batch).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the padded row's real positions do not depend on what the padding holds
    batch["input_ids"][0, :4] = 5
    with torch.no_grad():
        torch.testing.assert_close(fast(**batch).logits[0, 4:], got[0, 4:], rtol=1e-5, atol=1e-5)


def test_bfloat16_attention_runs_in_float32_and_stays_close():
    vocab = len(char_tokenizer())
    reference = tiny_llama(vocab, seed=2)
    fast = use_fast_attention(tiny_llama(vocab, seed=2)).to(torch.bfloat16)
    batch = padded_batch(vocab)
    with torch.no_grad():
        expected, got = reference(**batch).logits, fast(**batch).logits
    assert got.dtype == torch.bfloat16
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got.float()[real], expected[real], rtol=0.05, atol=0.05)


def test_only_sdpa_models_are_switched_and_checkpoints_do_not_carry_it(tmp_path):
    vocab = len(char_tokenizer())
    eager = tiny_llama(vocab)
    eager.set_attn_implementation("eager")
    assert use_fast_attention(eager).config._attn_implementation == "eager"
    fast = use_fast_attention(tiny_llama(vocab))
    fast.save_pretrained(tmp_path)
    assert NAME not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_gradients_flow_through_it(dtype):
    vocab = len(char_tokenizer())
    model = use_fast_attention(tiny_llama(vocab, seed=3)).to(dtype)
    model(**padded_batch(vocab)).logits.float().sum().backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_under_bf16_autocast_the_kernel_runs_in_float32(monkeypatch):
    """Autocast would cast SDPA's inputs back to bf16 (a slow backward on CPU): rlvr_sdpa turns it off."""
    import rlvr.fastpaths.attention as attention

    vocab = len(char_tokenizer())
    reference, fast = tiny_llama(vocab, seed=4), use_fast_attention(tiny_llama(vocab, seed=4))
    seen = []
    kernel = attention.sdpa_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype, torch.is_autocast_enabled("cpu")))
        return kernel(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    batch = padded_batch(vocab)
    with torch.autocast("cpu", torch.bfloat16):
        got = fast(**batch).logits
        expected = reference(**batch).logits
    assert seen and set(seen) == {(torch.float32, torch.float32, torch.float32, False)}
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got.float()[real], expected.float()[real], rtol=0.05, atol=0.05)
    got.float().sum().backward()
    assert fast.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
