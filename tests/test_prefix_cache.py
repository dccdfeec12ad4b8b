"""Prompt-prefix caching (rlvr.generation.prefix_cache in the engine): a prompt that shares its start with an
earlier one prefills only what is new and completes exactly as alone; the blocks stay within their
limit and the KV budget, give way to requests, and a cached chain never loses its start first."""

import pytest
import torch
from transformers import DynamicCache

from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts, kv_cache_bytes_per_token
from rlvr.generation.prefix_cache import PrefixCache
from support.engine_runs import run_engine, watch_forwards
from support.tiny_models import char_tokenizer, tiny_llama

SHARED = "solve step by step and end with the answer line: "  # 49 characters, three whole blocks of 16


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=0).requires_grad_(False)


def _prefilled_tokens(engine: Engine) -> list[int]:
    """Patch the engine's decoder to count, per forward, the tokens that are not decode rows."""
    counts = []
    watch_forwards(engine, lambda tokens: counts.append(len(tokens) - len(engine.rows)))
    return counts


def _greedy(tokenizer, prompt: str, new_tokens: int = 10) -> EngineRequest:
    ids = tokenizer(prompt).input_ids
    return EngineRequest(prompt_ids=ids, num_samples=1, max_new_tokens=new_tokens, temperatures=(0.0,))


def test_a_prompt_sharing_a_start_prefills_only_what_is_new_and_completes_as_alone(model, tokenizer):
    prompts = [SHARED + "what is 12+30?", SHARED + "7*6", SHARED[:20] + "count a b c"]
    expected = generate_rollouts(model, tokenizer, prompts, 1, SamplingConfig(max_new_tokens=10, temperatures=[0.0]))
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=256, kv_budget_bytes=2**24)
    prefilled = _prefilled_tokens(engine)
    requests = [_greedy(tokenizer, p) for p in prompts]
    run_engine(engine, {0: requests[:1], 20: requests[1:2], 40: requests[2:]})
    assert [q.token_ids[0] for q in requests] == expected.completion_token_lists()
    torch.testing.assert_close(
        torch.tensor([lp for q in requests for lp in q.logprobs[0]]), expected.logprobs[expected.completion_mask.bool()], atol=1e-4, rtol=0
    )
    assert [n for n in prefilled if n] == [len(prompts[0]), len(prompts[1]) - 48, len(prompts[2]) - 16]
    assert engine.prefixes.hit_tokens == 48 + 16


def _prompt_cache(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache)
    return cache


def test_the_prefix_cache_keeps_its_limit_and_evicts_a_chain_from_its_end(model, tokenizer):
    per_token = kv_cache_bytes_per_token(model.config, model.dtype)
    cache = PrefixCache(per_token, limit_bytes=3 * 16 * per_token)
    first, second = tokenizer(SHARED + "x" * 20).input_ids, tokenizer("0123456789" * 5).input_ids  # 4 and 3 whole blocks before the last token
    for ids in (first, second):
        cache.store(ids, _prompt_cache(model, ids), room_bytes=2**30)
        assert cache.bytes <= cache.limit_bytes
    assert cache.lookup(first, model.config) == (0, None)  # the second prompt's blocks took the room: the first's went from its end
    found, kv = cache.lookup(second, model.config)
    assert found == 48 and kv.layers[0].keys.shape[-2] == 48
    torch.testing.assert_close(kv.layers[1].values[0], _prompt_cache(model, second).layers[1].values[0, :, :48])
    cache.shrink_to(16 * per_token)
    assert cache.lookup(second, model.config)[0] == 16  # the start survives its continuations
    cache.store(second, _prompt_cache(model, second), room_bytes=32 * per_token)  # what the KV budget leaves: two blocks
    assert cache.lookup(second, model.config)[0] == 32
    cache.shrink_to(0)
    assert cache.bytes == 0 and cache.lookup(second, model.config) == (0, None)


def test_cached_prefixes_give_way_to_a_request_and_the_kv_budget_holds(model, tokenizer):
    per_token = kv_cache_bytes_per_token(model.config, model.dtype)
    budget = 512 * per_token
    engine = Engine(model, tokenizer, max_rows=2, step_tokens=256, kv_budget_bytes=budget, prefix_cache_bytes=budget)
    warm = [_greedy(tokenizer, f"{i} " * 40, new_tokens=2) for i in range(4)]  # 80 tokens: 4 whole blocks each
    run_engine(engine, {5 * i: [q] for i, q in enumerate(warm)})
    assert engine.prefixes.bytes >= 8 * 16 * per_token
    big = _greedy(tokenizer, "z" * 200, new_tokens=20)  # its prompt (200) and its slot (256) leave 56 positions of the budget
    held = []
    big.on_tokens = lambda pairs: held.append(engine.prefixes.bytes)
    run_engine(engine, {0: [big]})  # _run checks kv_bytes() <= the budget after every step
    assert len(big.token_ids[0]) == 20 and held and max(held) <= 56 * per_token
