"""The continuous engine's CPU decode attention (rlvr.fastpaths.slot_attention): SDPA's result, each
row read to its own length only, used by the engine where eligible and equal to the rollout engine."""

import pytest
import torch
import torch.nn.functional as F

import rlvr.fastpaths.slot_attention as slot_attention_module
import rlvr.generation.executor as executor_module
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.slot_attention import slot_attention
from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts
from support.tiny_models import char_tokenizer, tiny_llama


@pytest.mark.parametrize("kernel, dtype", [("c++", torch.float32), ("c++", torch.bfloat16), ("numba", torch.float32)])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
def test_each_row_stores_its_token_and_attends_over_its_own_length_as_sdpa_does(heads, kv_heads, kernel, dtype, monkeypatch):
    """Rows at different positions in slot buffers with more slots and positions than used, NaN from
    each row's position on: each row's new key and value land at its position, every output equals
    SDPA over that row's keys and values alone in float32 (no NaN read), and nothing else in the slots
    changes; through the C++ kernel (on PyTorch's threads; float32 or bf16 slots and queries) and
    through numba's (float32, where no compiler is)."""
    if kernel == "numba":
        monkeypatch.setattr(slot_attention_module, "_module", lambda: None)
    elif slot_attention_module._module() is None:
        pytest.skip("no C++ kernel here (no compiler, or its build failed: logged)")
    torch.manual_seed(0)
    rows, head_dim, positions = 4, 16, torch.tensor([36, 0, 19, 63])
    key_slots, value_slots = torch.randn(6, kv_heads, 70, head_dim, dtype=dtype), torch.randn(6, kv_heads, 70, head_dim, dtype=dtype)
    for r, p in enumerate(positions.tolist()):
        key_slots[r, :, p:] = value_slots[r, :, p:] = float("nan")
    before_keys, before_values = key_slots.clone(), value_slots.clone()
    queries = torch.randn(rows, heads, head_dim, dtype=dtype)
    keys, values = torch.randn(rows, kv_heads, head_dim, dtype=dtype), torch.randn(rows, kv_heads, head_dim, dtype=dtype)
    got = slot_attention(queries, keys, values, key_slots, value_slots, positions, 0.25)
    assert got.dtype == torch.float32
    for r, p in enumerate(positions.tolist()):
        torch.testing.assert_close(key_slots[r, :, p], keys[r], rtol=0, atol=0)
        torch.testing.assert_close(value_slots[r, :, p], values[r], rtol=0, atol=0)
        before_keys[r, :, p], before_values[r, :, p] = keys[r], values[r]
        slot_keys, slot_values = key_slots[r, :, : p + 1].float(), value_slots[r, :, : p + 1].float()
        expected = F.scaled_dot_product_attention(queries[r, :, None].float(), slot_keys, slot_values, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(got[r], expected.reshape(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(key_slots, before_keys, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_slots, before_values, rtol=0, atol=0, equal_nan=True)


def test_the_engine_decodes_through_it_and_matches_the_rollout_engine(monkeypatch):
    """A float32 CPU model's engine attends through the kernel in its decode steps, and its greedy
    completions and log-probs are what ``generate_rollouts`` (SDPA) gives each prompt alone."""
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0).requires_grad_(False)
    prompts = ["what is 12+30?", "7", "x" * 40]
    config = SamplingConfig(max_new_tokens=10, temperatures=[0.0])
    expected = generate_rollouts(model, tokenizer, prompts, 1, config)
    calls = []
    monkeypatch.setattr(executor_module, "slot_attention", lambda *args: calls.append(len(args[0])) or slot_attention(*args))
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=8, kv_budget_bytes=2**24)
    assert engine.executor.slot_kernel
    requests = [EngineRequest(prompt_ids=tokenizer(p).input_ids, num_samples=1, max_new_tokens=10, temperatures=(0.0,)) for p in prompts]
    for request in requests:
        engine.submit(request)
    engine.take_submissions()
    while not all(q.done_s for q in requests):
        engine.step()
    assert calls and max(calls) == len(prompts)
    assert [q.token_ids[0] for q in requests] == expected.completion_token_lists()
    torch.testing.assert_close(
        torch.tensor([lp for q in requests for lp in q.logprobs[0]]), expected.logprobs[expected.completion_mask.bool()], atol=1e-4, rtol=0
    )


def test_numba_refuses_bf16_slots_by_name(monkeypatch):
    monkeypatch.setattr(slot_attention_module, "_module", lambda: None)
    slots = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 slots needs the C.. kernel"):
        slot_attention(
            torch.zeros(1, 1, 8),
            torch.zeros(1, 1, 8, dtype=torch.bfloat16),
            torch.zeros(1, 1, 8, dtype=torch.bfloat16),
            slots,
            slots.clone(),
            torch.tensor([0]),
            1.0,
        )


def test_a_bf16_engine_decodes_through_it_as_through_sdpa_in_float32(monkeypatch):
    """A bf16 CPU model's engine attends through the C++ kernel (attention in float32) and decodes the
    tokens, and nearly the log-probs, of the same engine with slot attention off (SDPA on its keys and
    values upcast to float32)."""
    if not slot_attention_module.cpp_built():
        pytest.skip("no C++ kernel here (no compiler, or its build failed: logged)")
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0).to(torch.bfloat16).requires_grad_(False)
    calls = []
    monkeypatch.setattr(executor_module, "slot_attention", lambda *args: calls.append(args[3].dtype) or slot_attention(*args))

    def greedy(fast_paths: FastPaths) -> tuple[list[list[int]], list[float]]:
        engine = Engine(model, tokenizer, max_rows=4, step_tokens=8, kv_budget_bytes=2**24, fast_paths=fast_paths)
        requests = [EngineRequest(tokenizer(p).input_ids, 1, (0.0,), 10) for p in ("what is 12+30?", "7", "x" * 40)]
        with torch.inference_mode():
            list(engine.run_requests(requests))
        return [q.token_ids[0] for q in requests], [lp for q in requests for lp in q.logprobs[0]]

    tokens, logprobs = greedy(FastPaths())
    assert calls and set(calls) == {torch.bfloat16}
    calls.clear()
    expected_tokens, expected_logprobs = greedy(FastPaths(slot_attention=False))
    assert not calls and tokens == expected_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=2e-2, rtol=0)
