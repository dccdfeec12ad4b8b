"""Fixed-shape decode steps (CUDA graphs on a GPU): the model's function, row buckets, kept buffers.

On CPU the steps run eagerly (no graphs), which checks everything but the capture itself; the
CUDA test at the end runs where a GPU is present.
"""

from functools import partial

import pytest
import torch

import rlvr.rollout as rollout
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.eligibility import use_static_decode
from rlvr.fastpaths.static_decode import BUCKETS, StaticDecoder, row_bucket, static_decoder
from rlvr.rollout import SamplingConfig, generate_rollouts
from tiny_policy import char_tokenizer, tiny_llama, tiny_qwen2


def test_row_buckets():
    assert [row_bucket(n, 512) for n in (1, 2, 3, 5, 8, 9, 100, 129)] == [1, 2, 4, 8, 8, 16, 128, 256]
    assert row_bucket(24, 24) == 24  # past the last bucket that fits: the decoder's own size
    assert row_bucket(3, 3) == 3
    with pytest.raises(ValueError, match=r"rows must be in \[1, 8\]"):
        row_bucket(9, 8)
    assert list(BUCKETS) == sorted(BUCKETS)


def decode(model, tokenizer, prompts, samples, config, decode_step):
    generator = torch.Generator().manual_seed(config.seed)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    with torch.inference_mode():
        return rollout._decode_loop(model, tokenizer, ids, samples, config, generator, decode_step)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_rollouts_through_fixed_buffers_equal_the_models_forward(build, dtype):
    """Uneven prompts (left padding), rows finishing at different steps (compaction into smaller buckets)."""
    tokenizer = char_tokenizer()
    model = build(len(tokenizer), seed=5).to(dtype)
    prompts = ["12+3=", "7*8 = ?", "a"]
    config = SamplingConfig(
        max_new_tokens=14, temperatures=[0.0, 1.0], stop_at_final_answer=False, seed=3, stop_token_ids=[tokenizer.convert_tokens_to_ids("1")]
    )  # rows stop early
    static = StaticDecoder(model, max_rows=6, capacity=64, graphs=False)
    got = decode(model, tokenizer, prompts, 2, config, static)
    expected = decode(model, tokenizer, prompts, 2, config, partial(rollout._model_decode_step, model))
    assert len(set(got.completion_lengths.tolist())) > 1  # some rows were compacted away mid-rollout
    if dtype == torch.float32:
        assert torch.equal(got.completion_ids, expected.completion_ids)
        torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-4)
    else:  # bf16 rounding in another operation order: greedy rows agree, log-probs within bf16 noise
        greedy = torch.arange(6) % 2 == 0
        agree = (got.completion_ids[greedy] == expected.completion_ids[greedy]).float().mean()
        assert agree > 0.8
        torch.testing.assert_close(got.logprobs[:, :1], expected.logprobs[:, :1], rtol=0, atol=0.05)


def test_a_kept_decoder_serves_the_next_rollout_until_a_weight_is_replaced():
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=1)
    first = static_decoder(model, rows=4, capacity=40, graphs=False)
    assert first.capacity == 256 and static_decoder(model, rows=3, capacity=200, graphs=False) is first
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # in place (an optimizer step): the same decoder sees it
    assert static_decoder(model, rows=4, capacity=40, graphs=False) is first
    bigger = static_decoder(model, rows=16, capacity=40, graphs=False)
    assert bigger is not first and bigger.max_rows == 16
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # a new tensor
    assert static_decoder(model, rows=4, capacity=40, graphs=False) is not bigger


def test_it_is_used_on_cuda_only_and_switched_by_config():
    model = tiny_llama(20)
    assert not use_static_decode(model, FastPaths())  # CPU: the fused decoder is the fast path there
    if torch.cuda.is_available():
        model = model.cuda()
        assert use_static_decode(model, FastPaths()) and not use_static_decode(model, FastPaths(cuda_graphs=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graph capture and replay)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_cuda_graph_rollouts_equal_the_models_forward_and_see_weight_updates(dtype):
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=5).to("cuda", dtype)
    prompts = ["12+3=", "7*8 = ?", "a"]
    config = SamplingConfig(max_new_tokens=12, temperatures=[0.0], stop_at_final_answer=False)
    graphs = generate_rollouts(model, tokenizer, prompts, 2, config)
    plain = generate_rollouts(model, tokenizer, prompts, 2, SamplingConfig(**{**config.__dict__, "fast_paths": FastPaths(cuda_graphs=False)}))
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(graphs.logprobs, plain.logprobs, rtol=0, atol=tolerance)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # an in-place update: replayed graphs must see it
    flipped = generate_rollouts(model, tokenizer, prompts, 2, config)
    plain_flipped = generate_rollouts(model, tokenizer, prompts, 2, SamplingConfig(**{**config.__dict__, "fast_paths": FastPaths(cuda_graphs=False)}))
    torch.testing.assert_close(flipped.logprobs, plain_flipped.logprobs, rtol=0, atol=tolerance)
