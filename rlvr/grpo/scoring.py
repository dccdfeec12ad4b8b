"""Teacher-forced scoring of rollouts: the log-probs (and entropies) the GRPO update trains on.

:func:`pack_rows` lays rollout rows out for one forward; :func:`completion_logprobs` computes
log π(o_t | q, o_<t) over the policy's own completion tokens (an environment's tokens are context
only), through the speed-ups its :class:`~rlvr.fastpaths.plan.BackendPlan` names (one prompt pass per group,
the unpadded update, the chunked output layer); :class:`CompletionScorer` is that forward as the
module DDP / FSDP wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.eligibility import plain_output_head
from rlvr.fastpaths.plan import BackendPlan, plan_backend
from rlvr.generation import Rollouts

from .head import head_logprobs
from .loss import token_logprobs_and_entropy
from .unpadded import unpadded_completion_features


@dataclass
class PackedRows:
    """Rollout rows ready for a teacher-forced forward: their distinct prompts (left-padded) and
    their completions (right-padded to the longest, ``width``). Tokens an environment wrote
    (``environment_mask``) are context the policy conditions on, never scored: only
    ``policy_mask``'s tokens get log-probs."""

    prompt_ids: torch.Tensor  # [prompts, P]
    prompt_mask: torch.Tensor  # [prompts, P]
    prompt_index: torch.Tensor  # [rows] which prompt each row continues
    targets: torch.Tensor  # [rows, width] completion tokens
    mask: torch.Tensor  # [rows, width] float, 1 on real completion tokens
    temperatures: torch.Tensor  # [rows]
    environment_mask: torch.Tensor | None = None  # [rows, width] float, 1 on tokens the environment wrote; None: none did

    @property
    def width(self) -> int:
        return self.targets.shape[1]

    @property
    def policy_mask(self) -> torch.Tensor:
        """[rows, width] float, 1 on the policy's own tokens: the ones the loss, KL and ratio count."""
        return self.mask if self.environment_mask is None else self.mask * (1 - self.environment_mask)


def pack_rows(rollouts: Rollouts, rows: torch.Tensor, device: torch.device | str = "cpu") -> PackedRows:
    """Pack ``rows`` of ``rollouts``, padded only as much as they need; rows of one group share a prompt."""
    groups, prompt_index = torch.unique(rollouts.group_index[rows], return_inverse=True)
    first_row = {int(g): int(r) for g, r in zip(rollouts.group_index[rows].tolist(), rows.tolist())}
    prompts = [rollouts.prompt_ids[first_row[int(g)]] for g in groups]
    prompt_width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), prompt_width), rollouts.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for j, prompt in enumerate(prompts):
        prompt_ids[j, prompt_width - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[j, prompt_width - len(prompt) :] = 1
    width = int(rollouts.completion_lengths[rows].max())
    return PackedRows(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        prompt_index=prompt_index.to(device),
        targets=rollouts.completion_ids[rows, :width].to(device),
        mask=rollouts.completion_mask[rows, :width].to(device=device, dtype=torch.float32),
        temperatures=rollouts.temperatures[rows].to(device),
        environment_mask=rollouts.environment_mask[rows, :width].to(device=device, dtype=torch.float32),
    )


class CompletionScorer(torch.nn.Module):
    """The update's forward as one module, which DDP / FSDP wrap: :func:`completion_logprobs` of
    ``policy`` (so that DDP sees one forward, prompt pass included, per backward), on ``plan`` (default:
    planned here once from ``fast`` and ``sharded``)."""

    def __init__(self, policy: Any, share_prompts: bool = True, fast: FastPaths = FastPaths(), sharded: bool = False, plan: BackendPlan | None = None):
        super().__init__()
        self.policy, self.share_prompts = policy, share_prompts
        self.plan = plan or plan_backend(policy, fast, sharded=sharded)

    def forward(self, batch: PackedRows, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return completion_logprobs(self.policy, batch, self.share_prompts, with_entropy, plan=self.plan)


def completion_logprobs(
    model: Any,
    batch: PackedRows,
    share_prompts: bool = True,
    with_entropy: bool = False,
    fast: FastPaths = FastPaths(),
    sharded: bool = False,
    plan: BackendPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(o_t | q, o_<t) for every policy token of ``batch`` ([rows, width], 0 on padding and on the
    environment's tokens, which are only context), and π's entropy there when asked (no gradient).

    ``share_prompts`` runs each distinct prompt once and reuses its KV cache (gradient attached) for all
    its completions; without it, one forward over [prompt | completion] per row (gradient checkpointing
    drops the cache). ``plan`` (default: planned from ``fast`` and ``sharded``) says whether the completions
    skip their padding and whether the chunked output head replaces the model's logits (docs/architecture.md,
    "GRPO"); both need the plain head the model still has (adapters may wrap it after planning).
    """
    plan = plan or plan_backend(model, fast, sharded=sharded)
    head = plain_output_head(model) if plan.chunked_head else None
    real, scored = batch.mask.bool(), batch.policy_mask.bool()
    targets = batch.targets[scored]
    temperatures = batch.temperatures.unsqueeze(1).expand_as(batch.targets)[scored]
    if head is not None:
        decoder = model.get_decoder()
        run = lambda **kwargs: decoder(**kwargs).last_hidden_state  # noqa: E731
    else:
        run = lambda **kwargs: model(**kwargs).logits  # noqa: E731
    if share_prompts:
        cache = DynamicCache(config=model.config)
        positions = (batch.prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        last = {} if head is not None else {"logits_to_keep": 1}
        first = run(
            input_ids=batch.prompt_ids,
            attention_mask=batch.prompt_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **last,
        )
        if plan.unpadded_update and head is not None:
            features = unpadded_completion_features(model, batch, first[:, -1], cache)[scored[real]]
            logprobs, entropy = head_logprobs(features, head.weight, targets, temperatures, with_entropy)
            return _scatter_rows(logprobs, entropy, scored)
        outputs = [first[:, -1:][batch.prompt_index]]  # predicts the first completion token
        if batch.width > 1:
            cache.batch_select_indices(batch.prompt_index)
            attention_mask = torch.cat([batch.prompt_mask[batch.prompt_index], batch.mask[:, :-1].long()], dim=1)
            offsets = torch.arange(batch.width - 1, device=positions.device)
            positions = batch.prompt_mask.sum(dim=1)[batch.prompt_index].unsqueeze(1) + offsets
            outputs.append(
                run(
                    input_ids=batch.targets[:, :-1],
                    attention_mask=attention_mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
            )
        features = torch.cat(outputs, dim=1)
    else:
        input_ids = torch.cat([batch.prompt_ids[batch.prompt_index], batch.targets[:, :-1]], dim=1)
        attention_mask = torch.cat([batch.prompt_mask[batch.prompt_index], batch.mask[:, :-1].long()], dim=1)
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        last = {} if head is not None else {"logits_to_keep": batch.width}
        features = run(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **last)[:, -batch.width :]
    if head is not None:
        logprobs, entropy = head_logprobs(features[scored], head.weight, targets, temperatures, with_entropy)
    else:
        logprobs, entropy = token_logprobs_and_entropy(features[scored].unsqueeze(1), targets.unsqueeze(1), temperatures, with_entropy)
    return _scatter_rows(logprobs, entropy, scored)


def _scatter_rows(logprobs: torch.Tensor, entropy: torch.Tensor | None, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token values of the scored positions back into [rows, width], 0 elsewhere."""
    out = torch.zeros(scored.shape, dtype=logprobs.dtype, device=logprobs.device)
    out = out.index_put((scored,), logprobs.flatten())
    if entropy is None:
        return out, None
    return out, torch.zeros_like(out).index_put_((scored,), entropy.flatten())
