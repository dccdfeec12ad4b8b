"""The GRPO objective against hand computations on tiny tensors."""

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from rlvr.grpo.config import GRPOConfig
from rlvr.grpo.loss import (
    POLICY_LOSSES,
    aggregate_loss,
    entropy_from_logits,
    group_advantages,
    kl_k3,
    register_policy_loss,
    token_logprobs,
    zero_variance_groups,
)

CLIP = SimpleNamespace(eps_low=0.2, eps_high=0.2)


def test_group_advantages_mean_baseline_and_std_scaling():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    std = math.sqrt(4 * 0.25 / 3)  # sample std of (1, 0, 0, 1)
    a = 0.5 / (std + 1e-6)
    expected = [a, -a, -a, a, 0, 0, 0, 0]
    torch.testing.assert_close(group_advantages(rewards, 4)[:8], torch.tensor(expected))
    # (0, 0, 0, 3): mean 0.75, sample std 1.5
    expected = torch.tensor([-0.5, -0.5, -0.5, 1.5])
    torch.testing.assert_close(group_advantages(rewards, 4)[8:], expected, atol=1e-5, rtol=0)
    unscaled = group_advantages(rewards, 4, scale_by_std=False)
    torch.testing.assert_close(unscaled, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.75, -0.75, -0.75, 2.25]))
    assert zero_variance_groups(rewards, 4).tolist() == [False, True, False]


def test_grpo_clipped_surrogate_by_hand():
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    old = torch.full((2, 3), -1.0)
    logprobs = (old + ratios.log()).requires_grad_()
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3)
    loss, metrics = POLICY_LOSSES["grpo"](logprobs, old, advantages, mask, CLIP)
    # A > 0: -min(r, clip(r)) ; A < 0: max(r, clip(r))
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, -1.0], [1.5, 0.8, 1.0]]))
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6) and metrics["clip_frac_low"] == pytest.approx(1 / 6)
    loss.sum().backward()
    # d(-A r)/d log π = -A r where the unclipped term is active, 0 where the clip is
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, -1.0], [1.5, 0.0, 1.0]]))

    clip_higher = SimpleNamespace(eps_low=0.2, eps_high=0.28)
    loss, _ = POLICY_LOSSES["grpo"](logprobs.detach(), old, advantages, mask, clip_higher)
    assert loss[0, 0] == pytest.approx(-1.28)


def test_on_policy_gradient_is_minus_advantage_times_score():
    old = torch.log(torch.tensor([[0.2, 0.7], [0.4, 0.1]]))
    logprobs = old.clone().requires_grad_()
    advantages = torch.tensor([2.0, -0.5])
    loss, metrics = POLICY_LOSSES["grpo"](logprobs, old, advantages, torch.ones(2, 2), CLIP)
    torch.testing.assert_close(loss, -advantages[:, None].expand(2, 2))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, -advantages[:, None].expand(2, 2))
    assert metrics["ratio_mean"] == pytest.approx(1.0)


def test_gspo_uses_one_clipped_ratio_per_sequence():
    old = torch.zeros(2, 2)
    logprobs = torch.tensor([[0.1, 0.3], [-0.1, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # row 1's second token is padding
    loss, metrics = POLICY_LOSSES["gspo"](logprobs, old, torch.tensor([1.0, -1.0]), mask, CLIP)
    s1 = math.exp(-0.1)  # exp(mean log-ratio over the real tokens)
    torch.testing.assert_close(loss[0], torch.tensor([-1.2, -1.2]))  # exp(0.2) = 1.221 clipped to 1.2
    assert loss[1, 0].item() == pytest.approx(s1)
    assert metrics["clip_frac_high"] == pytest.approx(2 / 3)
    (loss * mask).sum().backward()
    # clipped row: no gradient; row 1: d(s A)/d log π_t = s for each token of the sequence
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0], [s1, 0.0]]))


def test_kl_k3_by_hand_and_unbiased():
    assert kl_k3(torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.25))).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_k3(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0
    # E_{x ~ π}[k3(x)] = KL(π || π_ref), exactly, over a whole vocabulary
    pi = torch.softmax(torch.tensor([1.0, 0.2, -0.5, 2.0]), 0)
    ref = torch.softmax(torch.tensor([0.1, 0.4, 0.3, -1.0]), 0)
    expected = (pi * (pi.log() - ref.log())).sum()
    torch.testing.assert_close((pi * kl_k3(pi.log(), ref.log())).sum(), expected)


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10.0 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_new_tokens=5).item() == pytest.approx(10.0 / 10)
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "sum")


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_normalizers_add_up(mode):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [0.5, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    whole = aggregate_loss(loss, mask, mode, max_new_tokens=3)
    totals = dict(max_new_tokens=3, num_seqs=3, num_tokens=int(mask.sum()))
    parts = aggregate_loss(loss[:1], mask[:1], mode, **totals) + aggregate_loss(loss[1:], mask[1:], mode, **totals)
    torch.testing.assert_close(parts, whole)


def test_token_logprobs_and_entropy():
    logits = torch.randn(3, 4, 7)
    tokens = torch.randint(0, 7, (3, 4))
    temperatures = torch.tensor([0.5, 0.0, 2.0])
    expected = torch.stack(
        [torch.log_softmax(logits[i] / (t if t > 0 else 1.0), -1).gather(1, tokens[i, :, None]).squeeze(1) for i, t in enumerate(temperatures.tolist())]
    )
    torch.testing.assert_close(token_logprobs(logits, tokens, temperatures), expected)
    assert entropy_from_logits(torch.zeros(2, 7)).tolist() == pytest.approx([math.log(7)] * 2)
    assert entropy_from_logits(torch.tensor([[50.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)
    p = torch.softmax(logits[0, 0] / 0.5, 0)
    assert entropy_from_logits(logits[0, 0], 0.5).item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)


def test_registry_and_config_validation():
    assert {"grpo", "gspo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError):
        register_policy_loss("grpo")(lambda *a: None)
    with pytest.raises(ValueError, match="loss_type"):
        GRPOConfig(loss_type="nope")
    with pytest.raises(ValueError, match="aggregation"):
        GRPOConfig(aggregation="sum")
    with pytest.raises(ValueError):
        GRPOConfig(group_size=1)


def test_training_logprobs_match_sampling_logprobs_with_and_without_prompt_sharing():
    """The update's log-probs equal the engine's (ratio 1 on-policy), whether each prompt is run
    once for its group (KV cache reused, gradient attached) or once per row; gradients agree too."""
    from rlvr.generation import SamplingConfig, generate_rollouts
    from rlvr.grpo.scoring import completion_logprobs, pack_rows
    from support.tiny_models import char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=1)
    prompts = ["a much longer prompt: 12+30=", "7=", "x"]
    sampling = SamplingConfig(max_new_tokens=9, temperatures=[0.7, 1.0, 0.0])
    rollouts = generate_rollouts(model, tokenizer, prompts, 3, sampling)
    rows = torch.tensor([0, 1, 2, 4, 5, 7])  # uneven groups, as after masking
    batch = pack_rows(rollouts, rows)
    assert batch.prompt_ids.shape[0] == 3 and batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 2]

    grads = []
    for share in (True, False):
        model.zero_grad()
        logprobs, entropy = completion_logprobs(model, batch, share_prompts=share, with_entropy=True)
        torch.testing.assert_close(logprobs * batch.mask, rollouts.logprobs[rows, : batch.width], atol=1e-5, rtol=1e-5)
        assert (entropy[batch.mask.bool()] > 0).all()
        (logprobs * batch.mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for shared, joint in zip(*grads):
        torch.testing.assert_close(shared, joint, atol=1e-5, rtol=1e-4)


def test_fused_entropy_matches_entropy_from_logits():
    from rlvr.grpo.loss import token_logprobs_and_entropy

    logits, tokens, temperatures = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3)), torch.tensor([0.6, 0.0])
    logprobs, entropy = token_logprobs_and_entropy(logits, tokens, temperatures)
    torch.testing.assert_close(logprobs, token_logprobs(logits, tokens, temperatures))
    torch.testing.assert_close(entropy, entropy_from_logits(logits, temperatures.unsqueeze(1)))


def autograd_head_logprobs(hidden, weight, targets, temperatures):
    """The reference chain: full logits through lm_head, then token_logprobs_and_entropy."""
    from rlvr.grpo.loss import token_logprobs_and_entropy

    logits = torch.nn.functional.linear(hidden, weight).unsqueeze(1)
    logprobs, entropy = token_logprobs_and_entropy(logits, targets.unsqueeze(1), temperatures)
    return logprobs.squeeze(1), entropy.squeeze(1)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_head_logprobs_match_autograd_through_full_logits(monkeypatch, autocast):
    """Values, entropies and both gradients, over several chunks, with per-row temperatures (0 = 1)."""
    import rlvr.grpo.head as head

    monkeypatch.setattr(head, "_CHUNK_ELEMENTS", 16 * 50)  # 16-row chunks: 70 rows take 5
    torch.manual_seed(0)
    hidden = torch.randn(70, 24, requires_grad=True)
    weight = (0.3 * torch.randn(50, 24)).requires_grad_()
    targets = torch.randint(0, 50, (70,))
    temperatures = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9]).repeat(14)
    upstream = torch.randn(70)
    results = []
    for fn in (autograd_head_logprobs, partial(head.head_logprobs, with_entropy=True)):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logprobs, entropy = fn(hidden, weight, targets, temperatures)
        (logprobs * upstream).sum().backward()
        results.append((logprobs.detach(), entropy, hidden.grad, weight.grad))
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, **tolerance)
    assert results[1][2].dtype == hidden.dtype and results[1][3].dtype == weight.dtype


def test_completion_logprobs_through_the_head_equal_the_models_logits():
    """The hidden-state path (plain lm_head) and the logits path give the same values and gradients."""
    import rlvr.grpo.scoring as scoring
    from rlvr.fastpaths import FastPaths
    from rlvr.fastpaths.eligibility import output_head
    from rlvr.generation import SamplingConfig, generate_rollouts
    from support.tiny_models import char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=4)
    assert output_head(model, FastPaths()) is model.lm_head
    rollouts = generate_rollouts(model, tokenizer, ["12+30=", "a longer prompt: 7="], 3, SamplingConfig(max_new_tokens=8, temperatures=[0.8, 1.0]))
    batch = scoring.pack_rows(rollouts, torch.arange(6))
    results = []
    for chunked_head in (True, False):  # the unpadded update needs the head: off for both, to compare heads alone
        model.zero_grad()
        fast = FastPaths(chunked_head=chunked_head, unpadded_update=False)
        logprobs, entropy = scoring.completion_logprobs(model, batch, with_entropy=True, fast=fast)
        (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
        results.append((logprobs.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
    assert output_head(model, FastPaths(chunked_head=False)) is None  # the logits path ran second
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][2], results[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert (results[0][0][batch.mask == 0] == 0).all()  # padding gets no log-prob
