"""The continuous engine's CPU decode attention (rlvr.fastpaths.slot_attention): SDPA's result, each
row read to its own length only, used by the engine where eligible and equal to the rollout engine."""

import pytest
import torch
import torch.nn.functional as F

import rlvr.fastpaths.slot_attention as slot_attention_module
import rlvr.generation.executor as executor_module
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.slot_attention import prompt_slots, slot_attention
from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts
from support.tiny_models import char_tokenizer, tiny_llama


@pytest.mark.parametrize("kernel, dtype", [("c++", torch.float32), ("c++", torch.bfloat16), ("numba", torch.float32)])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (12, 2)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 24])
def test_each_row_stores_its_token_and_attends_over_its_own_length_as_sdpa_does(heads, kv_heads, head_dim, kernel, dtype, monkeypatch):
    """Rows at different positions in slot buffers with more slots and positions than used, NaN from
    each row's position on: each row's new key and value land at its position, every output equals
    SDPA over that row's keys and values alone in float32 (no NaN read), and nothing else in the slots
    changes; through the C++ kernel (on PyTorch's threads; float32 or bf16 slots and queries; head widths
    of 16-float vectors by vector, others key by key; groups of 1, 3 and 6 query heads) and through numba's
    (float32, where no compiler is)."""
    if kernel == "numba":
        monkeypatch.setattr(slot_attention_module, "_module", lambda: None)
    elif slot_attention_module._module() is None:
        pytest.skip("no C++ kernel here (no compiler, or its build failed: logged)")
    torch.manual_seed(0)
    rows, positions = 4, torch.tensor([36, 0, 19, 63])
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


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.float32, 24), (torch.bfloat16, 64)])
def test_rows_of_one_prompt_read_it_from_one_slot_and_get_what_each_gets_alone(dtype, head_dim):
    """Rows 0, 2, 3 hold 12 prompt positions alike, rows 1 and 4 another 5, row 5 its own: with the other
    slots' prompt positions overwritten by NaN, each row reads them from its request's first slot, and
    every output is bit for bit what it gives reading its own intact slot; each new token lands in its own slot."""
    if slot_attention_module._module() is None:
        pytest.skip("no C++ kernel here (no compiler, or its build failed: logged)")
    torch.manual_seed(1)
    heads, kv_heads, positions = 6, 2, torch.tensor([20, 9, 31, 12, 5, 17])
    key_slots, value_slots = (torch.randn(7, kv_heads, 40, head_dim, dtype=dtype) for _ in range(2))
    for slots in (key_slots, value_slots):
        slots[[2, 3], :, :12] = slots[0, :, :12]
        slots[4, :, :5] = slots[1, :, :5]
    queries, keys, values = torch.randn(6, heads, head_dim), *(torch.randn(6, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    lengths = [12, 5, 12, 12, 5, 8]
    alone_keys, alone_values = key_slots.clone(), value_slots.clone()
    alone = slot_attention(queries, keys, values, alone_keys, alone_values, positions, 0.25, prompt_slots([(r, n) for r, n in enumerate(lengths)]))
    for slots in (key_slots, value_slots):
        slots[[2, 3], :, :12] = slots[4, :, :5] = float("nan")
    shared = prompt_slots(list(zip([0, 1, 0, 0, 1, 5], lengths)))
    together = slot_attention(queries, keys, values, key_slots, value_slots, positions, 0.25, shared)
    assert torch.equal(together, alone) and not together.isnan().any()
    for r, p in enumerate(positions.tolist()):
        assert torch.equal(key_slots[r, :, p], alone_keys[r, :, p]) and torch.equal(value_slots[r, :, p], alone_values[r, :, p])


@pytest.mark.parametrize(
    "shared, message", [([(0, 4), (0, 4)], "shared positions before each row's new one"), ([(0, 2), (2, 2)], "prompt slots among the rows")]
)
def test_a_prompt_past_a_rows_new_position_or_outside_the_rows_is_refused_by_name(shared, message):
    if slot_attention_module._module() is None:
        pytest.skip("no C++ kernel here (no compiler, or its build failed: logged)")
    slots = torch.zeros(3, 1, 8, 16)
    args = (torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), slots, slots.clone(), torch.tensor([3, 5]), 1.0)
    with pytest.raises(RuntimeError, match=message):
        slot_attention(*args, prompt_slots(shared))  # row 0's new token is position 3


def test_queries_keys_and_values_as_views_of_one_projection_are_read_in_place():
    """The decoder hands each row's query, key and value heads as column views of one projection: the same
    result as contiguous copies, and a transposed view (heads not side by side) is copied, not misread."""
    if slot_attention_module._module() is None:
        pytest.skip("no C++ kernel here (no compiler, or its build failed: logged)")
    torch.manual_seed(2)
    rows, heads, kv_heads, head_dim, positions = 3, 6, 2, 16, torch.tensor([4, 9, 2])
    projected = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).view(rows, heads + 2 * kv_heads, head_dim)
    queries, keys, values = projected[:, :heads], projected[:, heads : heads + kv_heads], projected[:, heads + kv_heads :]
    key_slots, value_slots = torch.randn(rows, kv_heads, 12, head_dim), torch.randn(rows, kv_heads, 12, head_dim)
    expected = slot_attention(queries.contiguous(), keys.contiguous(), values.contiguous(), key_slots.clone(), value_slots.clone(), positions, 0.25)
    assert torch.equal(slot_attention(queries, keys, values, key_slots.clone(), value_slots.clone(), positions, 0.25), expected)
    transposed = queries.transpose(0, 1).contiguous().transpose(0, 1)  # [rows, heads, dim] with heads outermost in memory
    assert not transposed.is_contiguous()
    assert torch.equal(slot_attention(transposed, keys, values, key_slots.clone(), value_slots.clone(), positions, 0.25), expected)


def test_an_engines_sampled_rows_read_their_prompt_from_one_slot_as_they_would_alone(monkeypatch):
    """Prompts of 3 and 11 samples at temperature 1: the engine's steps name each request's first slot for
    its rows' prompt, and the tokens and log-probs are bit for bit those of the same engine with every row
    reading its own slot."""
    import rlvr.generation.scheduler as scheduler_module

    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0).requires_grad_(False)

    def sampled(together: bool) -> tuple[list, list, list]:
        seen = []
        alone = lambda rows: tuple((slot, len(row.request.prompt_ids)) for slot, row in enumerate(rows))  # noqa: E731
        shared = scheduler_module.shared_prompts if together else alone
        monkeypatch.setattr(scheduler_module, "shared_prompts", lambda rows: seen.append(shared(rows)) or seen[-1])
        engine = Engine(model, tokenizer, max_rows=32, step_tokens=64, kv_budget_bytes=2**24)
        engine.stops.stop_ids = set()
        requests = [EngineRequest(tokenizer(p).input_ids, n, (1.0,), 12, seed=3) for p, n in (("what is 12+30?", 3), ("x" * 40, 11))]
        with torch.inference_mode():
            list(engine.run_requests(requests))
        return [q.token_ids for q in requests], [q.logprobs for q in requests], seen

    tokens, logprobs, prompts = sampled(True)
    assert any(len({slot for slot, _ in p}) == 2 and len(p) == 14 for p in prompts)  # 14 rows reading 2 slots
    expected_tokens, expected_logprobs, alone = sampled(False)
    assert all(len({slot for slot, _ in p}) == len(p) for p in alone) and tokens == expected_tokens and logprobs == expected_logprobs


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
