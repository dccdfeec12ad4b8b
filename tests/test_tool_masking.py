"""Tokens an environment wrote are context, not training signal: GRPO's loss, KL, ratio and token
counts over a rollout with injected tokens equal those of the policy's own tokens alone."""

from dataclasses import replace

import pytest
import torch

import rlvr.grpo.trainer as trainer_module
from rlvr.environments.base import ToolCall
from rlvr.fastpaths import FastPaths
from rlvr.generation import SamplingConfig, generate_rollouts
from rlvr.grpo import GRPOConfig, GRPOTrainer
from rlvr.grpo.loss import POLICY_LOSSES, aggregate_loss, group_advantages, kl_k3
from rlvr.grpo.scoring import completion_logprobs, pack_rows
from support.tiny_models import char_tokenizer, tiny_llama

PROMPTS = ["a longer prompt: 12+30=", "7*3=", "x"]
GROUP = 4
BETA = 0.1
# the update's three forwards: packed without padding, padded with one prompt pass per group, one pass per row
PATHS = {
    "unpadded": dict(fast_paths=FastPaths(unpadded_update=True)),
    "padded": dict(fast_paths=FastPaths(unpadded_update=False)),
    "per-row": dict(fast_paths=FastPaths(unpadded_update=False), share_prompt_forward=False),
}


def make_trainer(aggregation="token-mean", path="unpadded", loss_type="grpo"):
    tokenizer = char_tokenizer()
    cfg = GRPOConfig(
        group_size=GROUP,
        prompts_per_step=len(PROMPTS),
        sampling=SamplingConfig(max_new_tokens=12, temperatures=[0.7, 1.0]),
        aggregation=aggregation,
        loss_type=loss_type,
        beta=BETA,
        micro_batch_size=64,
        total_steps=1,
        compute_dtype="float32",  # compared with a float32 reference to 1e-5
        **PATHS[path],
    )
    reference = tiny_llama(len(tokenizer), seed=9)  # another model, so that the KL and its gradient are not 0
    trainer = GRPOTrainer(tiny_llama(len(tokenizer), seed=1), tokenizer, cfg, lambda texts, problems: ([0.0] * len(texts), {}), ref_model=reference)
    return trainer, tokenizer


def tool_rollouts(trainer, tokenizer, environment_logprob=0.0, with_environment=True):
    """Sampled rollouts where some tokens are declared the environment's (log-prob ``environment_logprob``,
    not sampled): a middle span, a tail, or none, by row; the policy tokens' old log-probs are
    perturbed so that ratios differ from 1 and some clip."""
    rollouts = generate_rollouts(trainer.policy, tokenizer, PROMPTS, GROUP, replace(trainer.config.sampling, seed=3))
    lengths = rollouts.completion_lengths.tolist()
    environment = torch.zeros_like(rollouts.completion_mask)
    calls = [[] for _ in lengths]
    if with_environment:
        for i, length in enumerate(lengths):
            if i % 3 == 1 and length >= 5:
                environment[i, 2:4] = 1
                calls[i] = [ToolCall(0, "calculator", "12+30", "42>>", None, 0.001)]
            elif i % 3 == 2 and length >= 3:
                environment[i, length - 2 : length] = 1
                calls[i] = [ToolCall(0, "calculator", "1/0", "", "ZeroDivisionError", 0.001), ToolCall(1, "calculator", "2*3", "6>>", None, 0.002)]
    assert environment.sum() > 0 or not with_environment
    policy = rollouts.completion_mask * (1 - environment)
    noise = 0.3 * torch.randn(rollouts.logprobs.shape, generator=torch.Generator().manual_seed(5))
    logprobs = (rollouts.logprobs + noise) * policy + environment_logprob * environment
    return replace(rollouts, logprobs=logprobs, environment_mask=environment, tool_calls=calls)


def trainer_loss(trainer, rollouts, advantages, on_policy=False):
    """The update's loss for all rows in one micro-batch, its parameter gradients and token stats;
    π_old is the rollouts' log-probs, or with ``on_policy`` the update's own (a one-update step's)."""
    rows = torch.arange(len(rollouts))
    ref_logprobs = trainer._reference_logprobs(rollouts, rows)
    trainer.policy.zero_grad()
    stats = dict.fromkeys(trainer_module._TOKEN_STATS, 0.0)
    num_tokens = int(rollouts.policy_mask.sum())
    old_logprobs = None if on_policy else rollouts.logprobs
    loss = trainer._micro_batch_loss(rollouts, advantages, ref_logprobs, rows, len(rows), num_tokens, stats, first_pass=True, old_logprobs=old_logprobs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.policy.parameters()], stats, ref_logprobs


def row_logprobs(model, rollouts, i):
    """log π of row i's completion tokens from one plain forward over prompt + completion (every token as input)."""
    prompt, length = rollouts.prompt_ids[i], int(rollouts.completion_lengths[i])
    ids = torch.tensor([prompt + rollouts.completion_ids[i, :length].tolist()])
    logits = model(ids).logits[0, len(prompt) - 1 : -1] / float(rollouts.temperatures[i])
    return logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)


def reference_loss(trainer, reference, rollouts, advantages, aggregation):
    """The GRPO objective summed over the policy's tokens only: each row's policy positions picked
    out by index, the clipped surrogate and k3 KL on those alone, token-mean over policy tokens."""
    cfg, per_row = trainer.config, []
    for i in range(len(rollouts)):
        policy = (rollouts.policy_mask[i, : int(rollouts.completion_lengths[i])] == 1).nonzero().squeeze(1)
        logprobs = row_logprobs(trainer.policy, rollouts, i)[policy]
        with torch.no_grad():
            ref = row_logprobs(reference, rollouts, i)[policy]
        ratio = torch.exp(logprobs - rollouts.logprobs[i, policy])
        a = advantages[i]
        surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
        kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
        per_row.append(surrogate + BETA * kl)
    if aggregation == "token-mean":
        return torch.cat(per_row).sum() / sum(len(r) for r in per_row)
    return torch.stack([r.mean() for r in per_row]).mean()


def advantages_for(rollouts):
    rewards = torch.tensor([float(i % 3 == 0) + 0.5 * (i % 2) for i in range(len(rollouts))])
    return group_advantages(rewards, GROUP)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_masked_loss_and_gradients_equal_those_of_the_policy_tokens_alone(path, aggregation):
    trainer, tokenizer = make_trainer(aggregation, path)
    assert trainer.plan.unpadded_update == (path == "unpadded")
    rollouts = tool_rollouts(trainer, tokenizer)
    advantages = advantages_for(rollouts)
    loss, grads, stats, ref_logprobs = trainer_loss(trainer, rollouts, advantages)

    trainer.policy.zero_grad()
    expected = reference_loss(trainer, trainer.ref_model, rollouts, advantages, aggregation)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, (p.grad for p in trainer.policy.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert stats["tokens"] == rollouts.policy_mask.sum() < rollouts.completion_mask.sum()
    assert (ref_logprobs[rollouts.environment_mask == 1] == 0).all()
    assert 0 < stats["clip_frac_low"] + stats["clip_frac_high"] < stats["tokens"]  # the clip is exercised


@pytest.mark.parametrize("path", ["unpadded", "per-row"])
@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_the_environment_tokens_old_logprobs_change_nothing(path, loss_type):
    trainer, tokenizer = make_trainer("seq-mean-token-mean", path, loss_type)
    results = []
    for environment_logprob in (0.0, -50.0):
        rollouts = tool_rollouts(trainer, tokenizer, environment_logprob)
        results.append(trainer_loss(trainer, rollouts, advantages_for(rollouts)))
    (loss_a, grads_a, stats_a, _), (loss_b, grads_b, stats_b, _) = results
    assert loss_a == loss_b and stats_a == stats_b
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", list(PATHS))
def test_without_environment_tokens_the_loss_is_the_completion_loss(path):
    """Regression: an all-zero environment mask gives the loss over all completion tokens, as before."""
    trainer, tokenizer = make_trainer("token-mean", path)
    rollouts = tool_rollouts(trainer, tokenizer, with_environment=False)
    advantages = advantages_for(rollouts)
    loss, grads, stats, ref_logprobs = trainer_loss(trainer, rollouts, advantages)

    trainer.policy.zero_grad()
    cfg, rows = trainer.config, torch.arange(len(rollouts))
    batch = pack_rows(rollouts, rows)
    logprobs, _ = completion_logprobs(trainer.policy, batch, cfg.share_prompt_forward, fast=cfg.fast_paths)
    old = rollouts.logprobs[:, : batch.width]
    loss_mat, _ = POLICY_LOSSES["grpo"](logprobs, old, advantages, batch.mask, cfg)
    loss_mat = loss_mat + BETA * kl_k3(logprobs, ref_logprobs[:, : batch.width])
    expected = aggregate_loss(loss_mat, batch.mask, "token-mean")
    expected.backward()
    assert stats["tokens"] == rollouts.completion_mask.sum()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, (p.grad for p in trainer.policy.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_step_records_tool_calls_and_token_counts(monkeypatch):
    trainer, tokenizer = make_trainer()
    rollouts = tool_rollouts(trainer, tokenizer)
    rewards = [float(i % 2) for i in range(len(rollouts))]  # every group has signal: all rows train
    expected_loss, *_ = trainer_loss(trainer, rollouts, group_advantages(torch.tensor(rewards), GROUP), on_policy=True)
    trainer.policy.zero_grad()
    trainer.reward_fn = lambda texts, problems: (rewards, {})
    monkeypatch.setattr(trainer, "_generate", lambda problems: rollouts)
    metrics, records = trainer.step([{"prompt": p, "problem_id": str(i)} for i, p in enumerate(PROMPTS)])
    assert metrics["loss"] == pytest.approx(float(expected_loss), rel=1e-5)  # token-mean over the step's policy tokens

    environment = rollouts.environment_mask.sum(dim=1).tolist()
    assert [r["environment_tokens"] for r in records] == environment
    assert [r["policy_tokens"] + r["environment_tokens"] for r in records] == rollouts.completion_lengths.tolist()
    assert [r["tool_calls"] for r in records] == [[c.as_dict() for c in calls] for calls in rollouts.tool_calls]
    calls = [len(c) for c in rollouts.tool_calls]
    errors = sum(call.error is not None for row in rollouts.tool_calls for call in row)
    assert metrics["tool_calls_mean"] == pytest.approx(sum(calls) / len(calls))
    assert metrics["tool_error_rate"] == pytest.approx(errors / sum(calls))
    assert 0 < errors < sum(calls)
