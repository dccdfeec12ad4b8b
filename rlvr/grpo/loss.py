"""The GRPO objective, piece by piece: advantages, policy-loss variants, KL, aggregation.

Notation: a group is G completions o_1..o_G of one prompt q with rewards r_1..r_G; tensors are
[rows, T] over completion tokens with a 0/1 ``mask`` (1 = a token that is trained on: the policy's
own, neither padding nor a token an environment wrote).

Policy-loss variants live in a registry (as verl's ``core_algos``): each takes
``(logprobs, old_logprobs, advantages, mask, config)`` and returns a per-token loss matrix and a
dict of scalar metrics. Aggregating that matrix into one number is a separate choice, made by
:func:`aggregate_loss`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from rlvr.generation import logprob_temperatures

PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, dict]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
_MAX_LOG_RATIO = 20.0


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy-loss variant under ``name`` (the value of ``GRPOConfig.loss_type``)."""

    def register(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return register


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages, one per completion (rows ordered group by group).

    A_i = (r_i - mean(r)) / (std(r) + eps) over the G rewards of the group (GRPO, Shao et al. 2024,
    DeepSeekMath, outcome supervision); with ``scale_by_std=False``, A_i = r_i - mean(r)
    (Dr. GRPO, Liu et al. 2025). std is the sample standard deviation, as in TRL and verl.
    """
    grouped = rewards.float().view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.flatten()


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose G rewards are all equal (every advantage is 0: no signal)."""
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


@register_policy_loss("grpo")
def grpo_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: Any
) -> tuple[torch.Tensor, dict]:
    """Token-level clipped surrogate (PPO, Schulman et al. 2017, as used by GRPO):

    r_t = π(o_t | q, o_<t) / π_old(o_t | q, o_<t),
    L_t = -min(r_t A, clip(r_t, 1 - ε_low, 1 + ε_high) A),

    with separate ε_low / ε_high ("clip-higher", DAPO, Yu et al. 2025). A clip is active when
    r_t < 1 - ε_low with A < 0 (``clip_frac_low``) or r_t > 1 + ε_high with A > 0 (``clip_frac_high``).
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return _clipped_surrogate(ratio, advantages, mask, config.eps_low, config.eps_high)


@register_policy_loss("gspo")
def gspo_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: Any
) -> tuple[torch.Tensor, dict]:
    """Sequence-level clipped surrogate (GSPO, Zheng et al. 2025):

    s_i = exp( (1/|o_i|) Σ_t log π(o_i,t) / π_old(o_i,t) ),
    L_i = -min(s_i A_i, clip(s_i, 1 - ε_low, 1 + ε_high) A_i),

    written per token as GSPO-token, s_i,t = sg[s_i] · π(o_i,t) / sg[π(o_i,t)], which has the value
    s_i and the gradient of s_i at every token. GSPO uses small ε (e.g. 3e-4 / 4e-4) and
    ``seq-mean-token-mean`` aggregation.
    """
    seq_log_ratio = _masked_sum(logprobs - old_logprobs, mask, dim=1) / mask.sum(dim=1).clamp(min=1)
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(1)
    ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))
    return _clipped_surrogate(ratio, advantages, mask, config.eps_low, config.eps_high)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, dict]:
    advantages = advantages.unsqueeze(1)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    with torch.no_grad():
        metrics = {
            "clip_frac_low": masked_mean(((ratio < 1.0 - eps_low) & (advantages < 0)).float(), mask),
            "clip_frac_high": masked_mean(((ratio > 1.0 + eps_high) & (advantages > 0)).float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return torch.maximum(unclipped, clipped), metrics


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π || π_ref) (Schulman 2020, "Approximating KL divergence"; GRPO eq. 4):

    KL_t = π_ref(o_t)/π(o_t) - log(π_ref(o_t)/π(o_t)) - 1  >= 0, unbiased, low variance.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


def truncated_importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token truncated importance sampling weight (TIS, Yao et al. 2025; TRL's
    ``vllm_importance_sampling_correction``, verl's TIS), detached:

    w_t = min(π_old(o_t) / π_rollout(o_t), C),

    which corrects each token's policy-gradient loss for having been sampled by the rollout
    engine's π_rollout (another precision, other kernels) rather than the trainer's π_old.
    """
    log_ratio = (old_logprobs - rollout_logprobs).detach().clamp(max=math.log(cap))
    return torch.exp(log_ratio)


def rollout_mismatch(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's log-probs are from the trainer's π_old over ``mask``'s tokens:
    ``rollout_logprob_abs_diff`` = mean |log π_old - log π_rollout| and ``rollout_kl``, the k3
    estimate of KL(π_rollout || π_old) under the rollout's samples (:func:`kl_k3`), >= 0."""
    with torch.no_grad():
        old_logprobs, rollout_logprobs = old_logprobs.float(), rollout_logprobs.float()
        return {
            "rollout_logprob_abs_diff": masked_mean((old_logprobs - rollout_logprobs).abs(), mask),
            "rollout_kl": masked_mean(kl_k3(rollout_logprobs, old_logprobs), mask),
        }


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    max_new_tokens: int | None = None,
    num_seqs: float | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """One scalar from a [rows, T] per-token loss matrix, by ``mode``:

    * ``seq-mean-token-mean``: (1/N) Σ_i (1/|o_i|) Σ_t L_i,t, the GRPO paper (Shao et al. 2024);
    * ``token-mean``: Σ_i,t L_i,t / Σ_i |o_i|, DAPO (Yu et al. 2025): long completions weigh more;
    * ``seq-mean-token-sum-norm``: (1/N) Σ_i Σ_t L_i,t / max_new_tokens, Dr. GRPO (Liu et al. 2025): no length bias.

    ``num_seqs`` (N) and ``num_tokens`` default to this batch's; pass the whole optimizer batch's totals
    (all micro-batches and ranks) so that per-micro-batch losses add up to it.
    """
    mask = mask.to(loss_mat.dtype)
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        per_seq = _masked_sum(loss_mat, mask, dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / num_seqs
    if mode == "token-mean":
        num_tokens = mask.sum() if num_tokens is None else num_tokens
        return _masked_sum(loss_mat, mask) / num_tokens
    if mode == "seq-mean-token-sum-norm":
        if not max_new_tokens:
            raise ValueError("seq-mean-token-sum-norm needs max_new_tokens")
        return _masked_sum(loss_mat, mask) / (num_seqs * max_new_tokens)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log π(o_t) = z[o_t] - logsumexp(z) with z = logits / T per row (a greedy T, below ``GREEDY_BELOW_TEMPERATURE``, counts as 1).

    [rows, T, V] logits and [rows, T] tokens -> [rows, T]; a gather and a logsumexp, so the
    [rows, T, V] log-softmax is never materialized (the vocabulary is 49k wide).
    """
    return token_logprobs_and_entropy(logits, tokens, temperatures, with_entropy=False)[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` and, sharing its logsumexp, the entropy at each position (no
    gradient): H = logsumexp(z) - Σ_v softmax(z)_v z_v."""
    scale = logprob_temperatures(temperatures).to(device=logits.device, dtype=torch.float32)
    z = logits.float() / scale.view(-1, 1, 1)
    log_norm = z.logsumexp(dim=-1)
    logprobs = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        entropy = log_norm - torch.linalg.vecdot(torch.softmax(z, dim=-1), z)
    return logprobs, entropy


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, temperatures: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Entropy of the sampling distribution at each position: H = logsumexp(z) - Σ_v softmax(z)_v z_v,
    z = logits / T (a greedy T counts as 1). ``logits`` is [..., V] and ``temperatures`` broadcasts to [...]."""
    temperatures = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device)
    scale = logprob_temperatures(temperatures)
    z = logits.float() / scale.unsqueeze(-1)
    return z.logsumexp(dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return _masked_sum(values, mask) / mask.sum().clamp(min=1)


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)
