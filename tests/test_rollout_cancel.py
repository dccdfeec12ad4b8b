"""Rollout engine: ``SamplingConfig.should_stop`` ends a prompt's rows at the next decode step."""

import pytest

from rlvr.rollout import SamplingConfig, generate_rollouts
from tiny_policy import char_tokenizer, tiny_llama

PROMPTS = ["what is 12+30?", "7", "count: a b c d e f"]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=0)


def greedy(**overrides) -> SamplingConfig:
    # No end token can stop a row early: only the budget or should_stop does.
    settings = {"max_new_tokens": 40, "temperatures": [0.0], "stop_at_final_answer": False, "stop_token_ids": [-1]}
    return SamplingConfig(**{**settings, **overrides})


def test_cancelled_prompt_stops_at_the_next_step_and_the_others_run_on(model, tokenizer):
    plain = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=greedy())
    steps: dict[int, int] = {}

    def should_stop(prompt: int) -> bool:
        steps[prompt] = steps.get(prompt, 0) + 1
        return prompt == 1 and steps[prompt] >= 5  # prompt 1 is cancelled during its 5th step

    r = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=greedy(should_stop=should_stop))
    assert r.finish_reasons == ["length", "length", "cancelled", "cancelled", "length", "length"]
    assert r.completion_lengths.tolist() == [40, 40, 5, 5, 40, 40]
    assert steps[1] == 5 and steps[0] == steps[2] == 40  # asked once per step, never again once stopped
    assert r.texts[:2] == plain.texts[:2] and r.texts[4:] == plain.texts[4:]  # the others are unchanged
    assert r.completion_ids[2, :5].tolist() == plain.completion_ids[2, :5].tolist()


def test_prompt_indices_count_across_chunks(model, tokenizer):
    """With chunks of 2 rows (one prompt each), ``should_stop`` still sees the call's prompt indices."""
    config = greedy(should_stop=lambda prompt: prompt == 2, max_batch_rows=2)
    r = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=config)
    assert r.finish_reasons == ["length"] * 4 + ["cancelled"] * 2
    assert r.completion_lengths.tolist() == [40, 40, 40, 40, 1, 1]


def test_every_prompt_cancelled_ends_the_call_at_once(model, tokenizer):
    r = generate_rollouts(model, tokenizer, PROMPTS, num_samples=3, config=greedy(max_new_tokens=10_000, should_stop=lambda prompt: True))
    assert set(r.finish_reasons) == {"cancelled"} and r.completion_lengths.max() == 1
