"""The rollout engine's log-probs against the trainer's: the per-step mismatch metrics and
truncated importance sampling (TIS), by hand and in tiny-model GRPO steps."""

import math
from dataclasses import replace

import pytest
import torch

from rlvr.fastpaths import eligibility
from rlvr.generation import SamplingConfig, generate_rollouts
from rlvr.grpo import GRPOConfig, GRPOTrainer
from rlvr.grpo.loss import group_advantages, rollout_mismatch, truncated_importance_weights
from rlvr.grpo.scoring import completion_logprobs, pack_rows
from support.tiny_models import COPY_DIGIT_CHARS, COPY_DIGIT_PROBLEMS, char_tokenizer, tiny_llama

GROUP = 4
PROBLEMS = COPY_DIGIT_PROBLEMS[:4]


def test_tis_weight_by_hand_is_capped_and_detached():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -0.2]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -0.2, -0.2]])
    weights = truncated_importance_weights(old, rollout, cap=1.5)
    # exp(0.5) = 1.649 capped at 1.5; exp(-1); exp(0); exp(-2); exp(0.1) = 1.105 under the cap
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0], [math.exp(-2.0), math.exp(0.1), 1.0]])
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad
    assert truncated_importance_weights(torch.tensor([100.0]), torch.tensor([-100.0]), cap=2.0).item() == pytest.approx(2.0)  # no overflow


def test_mismatch_metrics_by_hand_respect_the_mask():
    old = torch.tensor([[-1.0, -2.0, 7.0], [-0.5, 9.0, 9.0]])
    rollout = torch.tensor([[-1.5, -1.0, -40.0], [-0.5, 0.0, -30.0]])  # masked positions far apart
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    metrics = rollout_mismatch(old, rollout, mask)
    assert metrics["rollout_logprob_abs_diff"].item() == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    # k3 of KL(π_rollout || π_old) with d = log π_old - log π_rollout: exp(d) - d - 1
    k3 = [math.exp(d) - d - 1 for d in (0.5, -1.0, 0.0)]
    assert metrics["rollout_kl"].item() == pytest.approx(sum(k3) / 3)
    zero = rollout_mismatch(old, old, mask)
    assert zero["rollout_logprob_abs_diff"] == 0 and zero["rollout_kl"] == 0


@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0, float("nan"), "2", True])
def test_tis_cap_must_be_a_number_above_one(bad):
    with pytest.raises(ValueError, match="tis_cap must be a number > 1"):
        GRPOConfig(tis_cap=bad)


def test_tis_mode_is_validated_and_resolved():
    with pytest.raises(ValueError, match="tis must be one of"):
        GRPOConfig(tis="yes")
    assert GRPOConfig().tis_weight_cap(other_rollouts=True) == 2.0
    assert GRPOConfig().tis_weight_cap(other_rollouts=False) is None
    assert GRPOConfig(tis="on", tis_cap=3).tis_weight_cap(other_rollouts=False) == 3.0
    assert GRPOConfig(tis="off").tis_weight_cap(other_rollouts=True) is None


def make_trainer(**overrides) -> tuple[GRPOTrainer, object]:
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    settings = dict(
        group_size=GROUP,
        prompts_per_step=len(PROBLEMS),
        sampling=SamplingConfig(max_new_tokens=6, temperatures=[0.7, 1.0]),
        aggregation="token-mean",
        lr=1e-2,  # large: an update moves the log-probs visibly
        lr_decay="constant",
        micro_batch_size=64,
        total_steps=1,
        compute_dtype="float32",  # the mechanics by exact numbers; bf16 only where a test asks for it
    )
    config = GRPOConfig(**(settings | overrides))
    return GRPOTrainer(tiny_llama(len(tokenizer), seed=4), tokenizer, config, lambda texts, problems: ([0.0] * len(texts), {})), tokenizer


def sampled_rollouts(trainer, tokenizer, shift=None):
    """The trainer's rollouts of PROBLEMS; with ``shift`` its policy tokens' sampled log-probs are
    moved by +shift / -shift on alternate rows (the trainer's stay where they are)."""
    rollouts = generate_rollouts(trainer.rollout_policy, tokenizer, [p["prompt"] for p in PROBLEMS], GROUP, replace(trainer.config.sampling, seed=3))
    if shift is None:
        return rollouts
    signs = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(rollouts))]).unsqueeze(1)
    return replace(rollouts, logprobs=rollouts.logprobs + shift * signs * rollouts.policy_mask)


def run_step(trainer, rollouts, monkeypatch):
    """One GRPO step on ``rollouts``, every group with signal (all rows trained)."""
    rewards = [float(i % 2) for i in range(len(rollouts))]
    trainer.reward_fn = lambda texts, problems: (rewards, {})
    monkeypatch.setattr(trainer, "_generate", lambda problems: rollouts)
    metrics, _ = trainer.step(PROBLEMS)
    assert metrics["trained_rows"] == len(rollouts)
    return metrics, group_advantages(torch.tensor(rewards), GROUP)


@pytest.mark.parametrize("updates", [{}, {"num_minibatches": 2}, {"num_iterations": 2}])
def test_a_float32_rollout_of_the_same_weights_matches_the_trainer(updates, monkeypatch):
    """Near 0, also when the step makes several optimizer steps: π_old is scored before the first
    (at lr 1e-2 the second minibatch would otherwise see moved log-probs)."""
    trainer, tokenizer = make_trainer(**updates)
    assert trainer.tis_cap is None  # float32 rollouts: auto leaves TIS off
    rollouts = sampled_rollouts(trainer, tokenizer)
    metrics, _ = run_step(trainer, rollouts, monkeypatch)
    assert metrics["optimizer_steps"] == max(updates.values(), default=1)
    assert metrics["rollout_logprob_abs_diff"] < 1e-5 and 0 <= metrics["rollout_kl"] < 1e-9
    if updates:  # the later optimizer steps did see moved log-probs
        assert abs(metrics["ratio_mean"] - 1) > 1e-3


@pytest.mark.parametrize("updates", [{}, {"num_iterations": 2}])
def test_perturbed_rollout_logprobs_show_in_the_metrics(updates, monkeypatch):
    trainer, tokenizer = make_trainer(**updates)
    rollouts = sampled_rollouts(trainer, tokenizer, shift=0.3)
    metrics, _ = run_step(trainer, rollouts, monkeypatch)
    odd = torch.tensor([i % 2 for i in range(len(rollouts))], dtype=torch.float32)
    tokens = rollouts.policy_mask.sum(dim=1)
    share_odd = float((tokens * odd).sum() / tokens.sum())  # rollout log-probs 0.3 above π_old there: d = -0.3
    k3 = share_odd * (math.exp(-0.3) + 0.3 - 1) + (1 - share_odd) * (math.exp(0.3) - 0.3 - 1)
    assert metrics["rollout_logprob_abs_diff"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["rollout_kl"] == pytest.approx(k3, rel=1e-3)


@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_tis_weights_each_tokens_policy_loss(loss_type, monkeypatch):
    """One on-policy update (ratio 1): the loss is token-mean of -A_i min(π_old / π_rollout, C)."""
    cap = 1.2
    trainer, tokenizer = make_trainer(tis="on", tis_cap=cap, loss_type=loss_type, eps_low=3e-4, eps_high=4e-4)
    rollouts = sampled_rollouts(trainer, tokenizer, shift=0.3)
    batch = pack_rows(rollouts, torch.arange(len(rollouts)))
    with torch.no_grad():
        old, _ = completion_logprobs(trainer.policy, batch, trainer.config.share_prompt_forward, fast=trainer.config.fast_paths)
    metrics, advantages = run_step(trainer, rollouts, monkeypatch)
    mask = batch.policy_mask
    weights = torch.exp(old - rollouts.logprobs[:, : batch.width]).clamp(max=cap)
    assert ((weights == cap) & mask.bool()).any() and ((weights < 1) & mask.bool()).any()  # rows of both signs
    expected = (-advantages.unsqueeze(1) * weights * mask).sum() / mask.sum()
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_frac"] == 0  # the trainer's own π_old
    unweighted = float((-advantages.unsqueeze(1) * mask).sum() / mask.sum())
    assert abs(metrics["loss"] - unweighted) > 1e-3


@pytest.mark.parametrize("compute_dtype, tis, cap", [("bfloat16", "auto", 2.0), ("float32", "auto", None), ("bfloat16", "off", None), ("float32", "on", 2.0)])
def test_auto_tis_is_on_exactly_with_a_low_precision_rollout_copy(compute_dtype, tis, cap):
    trainer, _ = make_trainer(compute_dtype=compute_dtype, tis=tis)
    assert (trainer.rollout_policy is not trainer.policy) == (compute_dtype == "bfloat16")
    assert trainer.tis_cap == cap


@pytest.mark.parametrize("native", [True, False])
def test_auto_compute_dtype_turns_auto_tis_on_exactly_when_it_resolves_to_bf16(monkeypatch, native):
    """The default (compute_dtype and tis "auto"): bf16 compute, a bf16 rollout copy and TIS on a device
    with native bf16; float32, no copy and no TIS on one without."""
    monkeypatch.setattr(eligibility, "native_bf16", lambda device: native)
    trainer, _ = make_trainer(compute_dtype="auto")
    assert trainer.config.tis == "auto" and trainer.plan.compute_dtype == ("bfloat16" if native else "float32")
    assert (trainer.rollout_policy is not trainer.policy) is native
    assert {p.dtype for p in trainer.rollout_policy.parameters()} == {torch.bfloat16 if native else torch.float32}
    assert trainer.tis_cap == (2.0 if native else None)


def test_bf16_rollouts_differ_from_the_float32_update_a_little(monkeypatch):
    """The real mismatch: rollouts from the bf16 copy, π_old from the float32 weights under bf16 autocast."""
    trainer, tokenizer = make_trainer(compute_dtype="bfloat16")
    metrics, _ = run_step(trainer, sampled_rollouts(trainer, tokenizer), monkeypatch)
    assert 1e-5 < metrics["rollout_logprob_abs_diff"] < 0.05
    assert 0 < metrics["rollout_kl"] < 1e-2
