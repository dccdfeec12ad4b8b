"""The GRPO training loop (Shao et al. 2024, DeepSeekMath), on one process or under torchrun.

One step (:meth:`GRPOTrainer.step`): generate G completions per prompt, score them with the reward
callback, group-relative advantages, drop rows without signal (zero-variance groups, truncated
completions when masked), then μ passes of minibatch updates: per-token log-probs of the policy's own
tokens, the registered policy loss (times the TIS weight when on), the optional KL to the reference,
the chosen aggregation; backward, clip, AdamW. ``reward_fn(completions, problems) -> (totals, {name:
values})`` plugs in any reward; ``on_step(step, metrics, records)`` sees each step before its
checkpoint. Optimizer, schedule, checkpoints and resume: :mod:`rlvr.grpo.trainer_loop`.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from rlvr.environments.driver import drives_episodes
from rlvr.fastpaths.attention import use_fast_attention
from rlvr.fastpaths.heap import keep_freed_memory
from rlvr.fastpaths.plan import BackendPlan, log_plan, plan_backend
from rlvr.generation import Rollouts, concat_rollouts
from rlvr.generation.generator import make_generator
from rlvr.generation.sampler import derive_seed
from rlvr.generation.vllm_engine import hf_weights

from .config import GRPOConfig, LoRAConfig
from .distributed import (
    all_gather_objects,
    all_reduce_sum,
    gathered_parameters,
    gradient_sync,
    init_distributed,
    shard_for_rank,
    wrap_model,
)
from .loss import (
    POLICY_LOSSES,
    aggregate_loss,
    group_advantages,
    kl_k3,
    rollout_mismatch,
    truncated_importance_weights,
    zero_variance_groups,
)
from .sampler import ProblemWalk
from .scoring import CompletionScorer, completion_logprobs, pack_rows
from .trainer_loop import StopHook, TrainerLoop, float32_master_weights

_REFILL = 1  # derive_seed tag of the problems that refill a step (dynamic sampling)

RewardFn = Callable[[list[str], list[dict]], tuple[list[float], dict[str, list[float]]]]
OnStep = Callable[[int, dict, list[dict]], None]

# token-weighted sums all-reduced over ranks after each step's update
_TOKEN_STATS = (
    "tokens",
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "kl",
    "entropy",
    "entropy_tokens",
    "loss",
    "rollout_logprob_abs_diff",
    "rollout_kl",
    "rollout_tokens",
)


class GRPOTrainer(TrainerLoop):
    """Trains ``model`` in place with GRPO. See the module docstring for the step."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: GRPOConfig,
        reward_fn: RewardFn,
        ref_model: Any = None,
        checkpoint_dir: str | Path | None = None,
        on_step: OnStep | None = None,
        records_per_rank: bool = False,
        should_stop: StopHook | None = None,
    ):
        self.reward_fn, self.on_step, self.records_per_rank = reward_fn, on_step, records_per_rank
        self.should_stop = should_stop  # after each step: a reason to end the run there (a budget), or None
        self.dist = init_distributed(device=None if _launched_distributed() else next(model.parameters()).device)
        if config.prompts_per_step < self.dist.world_size:
            raise ValueError(f"prompts_per_step ({config.prompts_per_step}) < world size ({self.dist.world_size})")
        fast = config.fast_paths
        # the update's backend, decided once (float32 master weights, the compute dtype; rollouts plan their own engine)
        self.plan = plan_backend(model, fast, device=self.dist.device, dtype=torch.float32, sharded=config.fsdp, compute_dtype=config.compute_dtype)
        log_plan(self.plan, "GRPO training")
        if self.plan.keep_freed_memory:
            keep_freed_memory()  # the update's large temporaries would otherwise be page-faulted in every step
        model = float32_master_weights(model).to(self.dist.device)
        model = use_fast_attention(model, self.plan.fast_attention)  # bf16 autocast attention in float32 on CPU
        self.ref_model = _reference_model(model, ref_model, config, self.dist.device)  # before adapters / sharding
        reference = self.ref_model if self.ref_model is not None else model
        self._reference_plan = self.plan if reference is model and not config.fsdp else plan_backend(reference, fast, device=self.dist.device)
        if config.lora is not None:
            model = _apply_lora(model, config.lora)
        if config.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        compute_dtype = getattr(torch, self.plan.compute_dtype)
        mixed = compute_dtype != torch.float32  # weights and optimizer state are float32 (float32_master_weights)
        # the update's forwards run through this (DDP / FSDP when distributed; DDP syncs rank 0's weights)
        share_prompts = config.share_prompt_forward and not config.gradient_checkpointing
        scorer = CompletionScorer(model, share_prompts, plan=self.plan)
        self.model = wrap_model(scorer, self.dist, fsdp=config.fsdp, param_dtype=compute_dtype if mixed else None)
        autocast = mixed and not config.fsdp
        self._autocast = partial(torch.autocast, self.dist.device.type, compute_dtype, enabled=autocast)
        # generation runs on a low-precision copy in mixed precision (FSDP casts on its own)
        self.rollout_policy = copy.deepcopy(model).to(compute_dtype) if autocast else model
        # the one generation interface (ours on the rollout policy, or vLLM holding its own copy), for the whole run
        self.generator = make_generator(
            config.rollout,
            self.rollout_policy,
            tokenizer,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            seed=config.seed,
            tools=drives_episodes(config.sampling.environment),
        )
        self._weights_pushed = True  # the generator holds the policy's current weights
        self.tis_cap = config.tis_weight_cap(other_rollouts=self.rollout_policy is not model or self.generator.name != "native")
        if self.generator.name != "native":
            self.rollout_policy = model  # vLLM holds its own low-precision copy: ours would only be kept in sync for nothing
        self._share_prompts = share_prompts
        # the policy is the module itself (generation, checkpoints); optimizer, schedule, step count
        super().__init__(model, tokenizer, config, checkpoint_dir, self.dist, sharded=config.fsdp)

    # --- the loop ------------------------------------------------------------------------------

    def train(self, problems: Iterable[dict], resume: bool = True) -> list[dict]:
        """Train until ``config.total_steps``; a fresh trainer first resumes from the latest
        checkpoint when there is one. ``should_stop`` may end it early, at a step boundary (:meth:`stop_early`).

        ``problems`` are dicts with a rendered ``prompt`` and the reference fields the reward needs, or
        a schedule with ``step_problems(step, n, seed)`` (``rlvr.tasks.TaskMixture``). Returns the
        per-step metrics of this call.
        """
        schedule = problems if hasattr(problems, "step_problems") else ProblemWalk(problems)
        if resume and self.step_count == 0:
            self.resume()
        history = []
        while self.step_count < self.config.total_steps:
            step, n, seed = self.step_count, self.config.prompts_per_step, self.config.seed
            batch = schedule.step_problems(step, n, seed)
            refill = partial(_refill_problems, schedule, step, n, seed)
            metrics, records = self.step(batch, refill)
            if self.on_step is not None and (self.dist.is_main or self.records_per_rank):
                self.on_step(self.step_count, metrics, records)  # the step's rows before its resume point: a kill loses nothing
            history.append(self.record_step(metrics))  # and the step's checkpoint, when one is due
            if self.stop_early(self.should_stop, metrics):  # stopped at this boundary (its checkpoint saved): why is self.stopped
                break
        return history

    def step(self, problems: list[dict], refill: Callable[[int], list[dict]] | None = None) -> tuple[dict, list[dict]]:
        """One GRPO step on ``problems`` (the whole step's batch; each rank takes its share).

        With ``config.dynamic_sampling_rounds`` (DAPO's dynamic sampling), groups whose rewards are
        all equal are replaced, for up to that many extra rounds, by groups of ``refill(round)``'s
        problems (this rank's share), until this rank has as many groups with signal as it had
        prompts; the update trains on at most that many. Every generation counts in the step's time
        and throughput and is recorded (``trained`` False when dropped).
        """
        config, group = self.config, self.config.group_size
        timing = dict.fromkeys(("gen_time_s", "reward_time_s", "update_time_s"), 0.0)
        offset, local = shard_for_rank(problems, self.dist)
        quota = len(local)  # groups with signal this rank trains on
        group_ids = [offset + j for j in range(quota)]  # unique within the step, across ranks and rounds
        rollouts, rewards, per_reward = self._generate_and_score(local, timing)
        rounds = config.dynamic_sampling_rounds if refill is not None else 0
        for round_ in range(1, rounds + 1):
            missing = quota - int((~zero_variance_groups(rewards, group)).sum())
            refill_offset, candidates = shard_for_rank(refill(round_), self.dist)
            candidates = candidates[: max(missing, 0)]
            if not candidates:
                break
            extra, extra_rewards, extra_per_reward = self._generate_and_score(candidates, timing)
            extra.group_index += len(local)
            group_ids += [round_ * config.prompts_per_step + refill_offset + j for j in range(len(candidates))]
            local, rollouts = local + candidates, concat_rollouts([rollouts, extra])
            rewards = torch.cat([rewards, extra_rewards])
            per_reward = {name: values + extra_per_reward[name] for name, values in per_reward.items()}

        started = time.perf_counter()
        advantages = group_advantages(rewards, group, config.scale_rewards, config.advantage_eps)
        zero_variance = zero_variance_groups(rewards, group)
        trained, kept_groups = torch.ones(len(rollouts), dtype=torch.bool), len(local)
        if config.skip_zero_variance:
            signal = ~zero_variance
            signal &= signal.cumsum(0) <= quota  # refills beyond the quota are recorded, not trained on
            trained &= signal.repeat_interleave(group)
            kept_groups = int(signal.sum())
        if config.mask_truncated:
            trained &= torch.tensor([reason != "length" for reason in rollouts.finish_reasons])
        update_stats = self._update(rollouts, advantages, trained.nonzero().flatten())
        self.scheduler.step()
        self.step_count += 1
        timing["update_time_s"] = time.perf_counter() - started
        local_rows = {
            "rewards": rewards.tolist(),
            "per_reward": per_reward,
            "lengths": rollouts.completion_lengths.tolist(),
            "tool_calls": [len(calls) for calls in rollouts.tool_calls],
            "tool_errors": [sum(call.error is not None for call in calls) for calls in rollouts.tool_calls],
            "finish": rollouts.finish_reasons,
            "zero_variance": zero_variance.tolist(),
            "group_tasks": [problem.get("task") for problem in local],
            "row_correct": [_correct(problem, per_reward, i) for i, problem in enumerate(problem_of_rows(rollouts, local))],
            "trained": int(trained.sum()),
            "groups": (kept_groups, len(local)),  # (trained on, generated)
        }
        metrics = self._metrics(all_gather_objects(local_rows, self.dist), update_stats, timing)
        records = self._records(rollouts, local, group_ids, rewards, per_reward, advantages, trained)
        return metrics, records if self.records_per_rank else sum(all_gather_objects(records, self.dist), [])

    # --- generation and rewards -----------------------------------------------------------------

    def _generate_and_score(self, problems: list[dict], timing: dict) -> tuple[Rollouts, torch.Tensor, dict[str, list[float]]]:
        started = time.perf_counter()
        rollouts = self._generate(problems)
        generated = time.perf_counter()
        rewards, per_reward = self._score(rollouts, problems)
        timing["gen_time_s"] += generated - started
        timing["reward_time_s"] += time.perf_counter() - generated
        return rollouts, rewards, per_reward

    def _generate(self, problems: list[dict]) -> Rollouts:
        seed = derive_seed(self.config.seed, self.step_count, self.dist.rank)
        sampling = replace(self.config.sampling, seed=seed)
        self.rollout_policy.eval()
        gather = gathered_parameters(self.model) if self.config.fsdp else contextlib.nullcontext()
        with gather:
            prompts, stops = [p["prompt"] for p in problems], [p.get("stop") for p in problems]  # each problem's task's stop rule
            rollouts = concat_rollouts(list(self.generator.stream(prompts, self.config.group_size, sampling, stops)))
        self.policy.train()
        return rollouts

    @torch.no_grad()
    def _sync_rollout_policy(self) -> None:
        """Copy the updated weights into the low-precision rollout copy (trainable ones only: the rest never change);
        an engine holding its own copy (vLLM) takes them before the next generation."""
        self._weights_pushed = self.generator.name == "native"  # vLLM takes them once the update is done (_push_weights)
        if self.rollout_policy is self.policy:
            return
        copies = dict(self.rollout_policy.named_parameters())
        for name, param in self.policy.named_parameters():
            if param.requires_grad:
                copies[name].copy_(param)

    def _push_weights(self) -> None:
        """An engine holding its own copy of the policy (vLLM) takes the updated weights, once per update."""
        if not self._weights_pushed:
            self.generator.load_weights(hf_weights(self.policy))
            self._weights_pushed = True

    def _score(self, rollouts: Rollouts, problems: list[dict]) -> tuple[torch.Tensor, dict[str, list[float]]]:
        totals, per_reward = self.reward_fn(rollouts.texts, problem_of_rows(rollouts, problems))
        if len(totals) != len(rollouts):
            raise ValueError(f"reward_fn returned {len(totals)} rewards for {len(rollouts)} completions")
        return torch.tensor(totals, dtype=torch.float32), {k: list(map(float, v)) for k, v in per_reward.items()}

    # --- the update ------------------------------------------------------------------------------

    def _update(self, rollouts: Rollouts, advantages: torch.Tensor, rows: torch.Tensor) -> dict:
        """μ passes of minibatch updates over ``rows``; returns token-weighted stat sums (all ranks)."""
        config = self.config
        stats = dict.fromkeys(_TOKEN_STATS, 0.0) | {"optimizer_steps": 0, "grad_norm": 0.0}
        if all_reduce_sum(torch.tensor([len(rows)]), self.dist).item() == 0:
            return stats
        policy_tokens = rollouts.policy_mask.sum(dim=1)
        ref_logprobs = self._reference_logprobs(rollouts, rows) if config.beta > 0 else None
        one_update = config.num_iterations == 1 and config.num_minibatches == 1  # then each forward's own log-probs are π_old
        old_logprobs = None if one_update else self._old_logprobs(rollouts, rows)
        shuffle = torch.Generator().manual_seed(derive_seed(config.seed, self.step_count, self.dist.rank, 1))
        for iteration in range(config.num_iterations):
            order = rows[torch.randperm(len(rows), generator=shuffle)] if config.num_minibatches > 1 else rows
            for minibatch in order.tensor_split(config.num_minibatches):
                totals = all_reduce_sum(torch.tensor([len(minibatch), int(policy_tokens[minibatch].sum())]), self.dist)
                num_seqs, num_tokens = totals.tolist()
                if num_seqs == 0:
                    continue
                micro_batches = _micro_batches(rollouts, minibatch, config.micro_batch_size)
                dummy = not micro_batches  # this rank has no rows here but must join the gradient all-reduce
                micro_batches = micro_batches or [rows[:1] if len(rows) else torch.tensor([0])]
                for i, micro in enumerate(micro_batches):
                    with gradient_sync(self.model, enabled=i == len(micro_batches) - 1):
                        loss = self._micro_batch_loss(
                            rollouts,
                            advantages,
                            ref_logprobs,
                            micro,
                            num_seqs,
                            num_tokens,
                            stats=None if dummy else stats,
                            first_pass=iteration == 0,
                            old_logprobs=old_logprobs,
                        )
                        (loss * (0.0 if dummy else self.dist.world_size)).backward()
                grad_norm = self.optimizer_step()
                self._sync_rollout_policy()
                stats["optimizer_steps"] += 1
                stats["grad_norm"] += grad_norm
        self._push_weights()
        sums = all_reduce_sum(torch.tensor([stats[k] for k in _TOKEN_STATS], dtype=torch.float64), self.dist)
        return stats | dict(zip(_TOKEN_STATS, sums.tolist()))

    def _micro_batch_loss(
        self,
        rollouts: Rollouts,
        advantages: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        rows: torch.Tensor,
        num_seqs: int,
        num_tokens: int,
        stats: dict | None,
        first_pass: bool,
        old_logprobs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This micro-batch's share of the minibatch loss (normalized by the minibatch totals, of
        policy tokens); adds its token-weighted metrics to ``stats`` unless that is None.
        ``old_logprobs``: π_old of every row, None when this forward's own (detached) are π_old."""
        config, device = self.config, self.dist.device
        batch = pack_rows(rollouts, rows, device)
        with_entropy = first_pass and stats is not None
        with self._autocast():
            logprobs, entropy = self.model(batch, with_entropy=with_entropy)
        mask = batch.policy_mask  # the environment's tokens were not sampled: no ratio, no KL, no loss
        rollout_logprobs = rollouts.logprobs[rows, : batch.width].to(device) * mask
        old = logprobs.detach() if old_logprobs is None else old_logprobs[rows, : batch.width].to(device) * mask
        loss_mat, loss_metrics = POLICY_LOSSES[config.loss_type](logprobs, old, advantages[rows].to(device), mask, config)
        if self.tis_cap is not None:
            loss_mat = loss_mat * truncated_importance_weights(old, rollout_logprobs, self.tis_cap)
        kl = None
        if ref_logprobs is not None:
            kl = kl_k3(logprobs, ref_logprobs[rows, : batch.width].to(device))
            loss_mat = loss_mat + config.beta * kl
        loss = aggregate_loss(
            loss_mat,
            mask,
            config.aggregation,
            max_new_tokens=config.sampling.max_new_tokens,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
        )
        if stats is None:
            return loss
        tokens = float(mask.sum())
        stats["tokens"] += tokens
        if kl is not None:
            stats["kl"] += float((kl.detach() * mask).sum())
        stats["loss"] += float(loss.detach())
        for name in ("clip_frac_low", "clip_frac_high", "ratio_mean"):
            stats[name] += float(loss_metrics[name]) * tokens
        if entropy is not None:
            stats["entropy"] += float((entropy * mask).sum())
            stats["entropy_tokens"] += tokens
        if first_pass:  # each row once, scored by the policy before the step's update
            for name, value in rollout_mismatch(old, rollout_logprobs, mask).items():
                stats[name] += float(value) * tokens
            stats["rollout_tokens"] += tokens
        return loss

    def _reference_logprobs(self, rollouts: Rollouts, rows: torch.Tensor) -> torch.Tensor:
        """log π_ref of the policy tokens of ``rows`` (zeros elsewhere), at the sampling temperature."""
        with self._reference() as reference:
            return self._scored_logprobs(reference, rollouts, rows, self._reference_plan)

    def _old_logprobs(self, rollouts: Rollouts, rows: torch.Tensor) -> torch.Tensor:
        """log π_old of the policy tokens of ``rows`` (zeros elsewhere): the policy before the step's
        first update, scored as the update scores (for a step of several optimizer steps)."""
        gather = gathered_parameters(self.model) if self.config.fsdp else contextlib.nullcontext()
        with gather:  # FSDP: ranks may score different numbers of micro-batches
            return self._scored_logprobs(self.policy, rollouts, rows, self.plan)

    @torch.no_grad()
    def _scored_logprobs(self, model: Any, rollouts: Rollouts, rows: torch.Tensor, plan: BackendPlan) -> torch.Tensor:
        """``model``'s log-probs of the policy tokens of ``rows`` (zeros elsewhere) on ``plan``, no gradient, at the sampling temperature."""
        out = torch.zeros_like(rollouts.logprobs)
        for micro in _micro_batches(rollouts, rows, self.config.micro_batch_size):
            batch = pack_rows(rollouts, micro, self.dist.device)
            with self._autocast():
                logprobs, _ = completion_logprobs(model, batch, self._share_prompts, plan=plan)
            out[micro, : batch.width] = (logprobs.float() * batch.policy_mask).cpu()
        return out

    @contextlib.contextmanager
    def _reference(self) -> Iterator[Any]:
        """The frozen reference policy: a separate copy, or the policy with its LoRA adapters off."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.policy.disable_adapter():
                yield self.policy

    # --- checkpoints ---------------------------------------------------------------------------

    def resume(self) -> bool:
        """:meth:`TrainerLoop.resume`, then the rollout copy (or vLLM's) takes the loaded weights."""
        resumed = super().resume()
        if resumed:
            self._sync_rollout_policy()
            self._push_weights()
        return resumed

    # --- metrics and records ---------------------------------------------------------------------

    def _metrics(self, ranks: list[dict], update: dict, timing: dict) -> dict:
        rewards = torch.tensor([r for rank in ranks for r in rank["rewards"]])
        lengths = torch.tensor([n for rank in ranks for n in rank["lengths"]], dtype=torch.float32)
        finish = Counter(reason for rank in ranks for reason in rank["finish"])
        zero_variance = [z for rank in ranks for z in rank["zero_variance"]]
        tokens, optimizer_steps = max(update["tokens"], 1.0), max(update["optimizer_steps"], 1)
        wall = sum(timing.values())
        metrics = {
            "step": self.step_count,
            "lr": self.optimizer.param_groups[0]["lr"],
            "loss": update["loss"] / optimizer_steps,
            "kl": update["kl"] / tokens,
            "entropy": update["entropy"] / max(update["entropy_tokens"], 1.0),
            "clip_frac_low": update["clip_frac_low"] / tokens,
            "clip_frac_high": update["clip_frac_high"] / tokens,
            "ratio_mean": update["ratio_mean"] / tokens,
            "rollout_logprob_abs_diff": update["rollout_logprob_abs_diff"] / max(update["rollout_tokens"], 1.0),
            "rollout_kl": update["rollout_kl"] / max(update["rollout_tokens"], 1.0),
            "grad_norm": update["grad_norm"] / optimizer_steps,
            "optimizer_steps": update["optimizer_steps"],
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        }
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        for name in ranks[0]["per_reward"]:
            values = torch.tensor([v for rank in ranks for v in rank["per_reward"][name]])
            values = values[~values.isnan()]  # a mixture's rows of tasks without this reward
            if len(values):
                metrics[f"reward_{name}_mean"] = values.mean().item()
                metrics[f"reward_{name}_std"] = values.std().item() if len(values) > 1 else 0.0
        metrics |= {
            "frac_zero_variance_groups": sum(zero_variance) / len(zero_variance),
            "groups_generated": sum(rank["groups"][1] for rank in ranks),
            "frac_groups_kept": sum(rank["groups"][0] for rank in ranks) / sum(rank["groups"][1] for rank in ranks),
            "trained_rows": sum(rank["trained"] for rank in ranks),
            "completion_len_mean": lengths.mean().item(),
            "completion_len_max": int(lengths.max()),
            "truncation_rate": finish["length"] / len(lengths),
            "answer_stop_rate": finish["answer"] / len(lengths),
            "tokens_per_s": float(lengths.sum()) / wall,
            "step_time_s": wall,
            **timing,
        }
        metrics |= per_task_metrics(ranks, self.config.group_size)
        calls = sum(n for rank in ranks for n in rank["tool_calls"])
        if calls:
            metrics["tool_calls_mean"] = calls / len(lengths)  # per completion
            metrics["tool_error_rate"] = sum(n for rank in ranks for n in rank["tool_errors"]) / calls  # per call
        return metrics

    def _records(
        self,
        rollouts: Rollouts,
        problems: list[dict],
        group_ids: list[int],
        rewards: torch.Tensor,
        per_reward: dict[str, list[float]],
        advantages: torch.Tensor,
        trained: torch.Tensor,
    ) -> list[dict]:
        records = []
        lengths = rollouts.completion_lengths.tolist()
        policy_tokens = rollouts.policy_mask.sum(dim=1).tolist()
        for i in range(len(rollouts)):
            problem = problems[int(rollouts.group_index[i])]
            records.append(
                {
                    "step": self.step_count,
                    "policy_version": self.step_count - 1,  # updates applied to the policy that sampled this
                    "rank": self.dist.rank,
                    "problem_id": problem.get("problem_id", problem.get("id")),
                    "task": problem.get("task"),
                    "group_index": group_ids[int(rollouts.group_index[i])],
                    "sample_index": int(rollouts.sample_index[i]),
                    "temperature": float(rollouts.temperatures[i]),
                    "prompt": problem["prompt"],
                    "completion": rollouts.texts[i],
                    "prompt_tokens": len(rollouts.prompt_ids[i]),
                    "completion_tokens": lengths[i],
                    "policy_tokens": policy_tokens[i],
                    "environment_tokens": lengths[i] - policy_tokens[i],
                    "tool_calls": [call.as_dict() for call in rollouts.tool_calls[i]],
                    "finish_reason": rollouts.finish_reasons[i],
                    "reward": float(rewards[i]),
                    "rewards": {name: values[i] for name, values in per_reward.items() if values[i] == values[i]},  # NaN: not this task's reward
                    "advantage": float(advantages[i]),
                    "trained": bool(trained[i]),
                }
            )
        return records


def problem_of_rows(rollouts: Rollouts, problems: list[dict]) -> list[dict]:
    """The problem each completion answers (its group's)."""
    return [problems[int(g)] for g in rollouts.group_index]


def _correct(problem: dict, per_reward: dict[str, list[float]], row: int) -> float:
    """The row's correctness (its task's ``correctness`` reward), NaN where the problem names none."""
    values = per_reward.get(problem.get("correctness") or "")
    return float(values[row]) if values is not None else float("nan")


def per_task_metrics(ranks: list[dict], group_size: int) -> dict:
    """Per task (problems that name one): reward mean, accuracy, zero-advantage fraction, response length,
    groups; keys ``task/<name>/<metric>``. Empty when no problem names its task."""
    rows: dict[str, dict[str, list]] = {}
    for rank in ranks:
        for g, task in enumerate(rank["group_tasks"]):
            if task is None:
                continue
            found = rows.setdefault(task, {"rewards": [], "correct": [], "lengths": [], "zero_variance": []})
            span = slice(g * group_size, (g + 1) * group_size)
            found["rewards"] += rank["rewards"][span]
            found["correct"] += rank["row_correct"][span]
            found["lengths"] += rank["lengths"][span]
            found["zero_variance"].append(rank["zero_variance"][g])
    metrics = {}
    for task, found in sorted(rows.items()):
        correct = torch.tensor(found["correct"], dtype=torch.float64)
        metrics |= {
            f"task/{task}/groups": len(found["zero_variance"]),
            f"task/{task}/reward_mean": float(torch.tensor(found["rewards"]).mean()),
            f"task/{task}/frac_zero_variance_groups": sum(found["zero_variance"]) / len(found["zero_variance"]),
            f"task/{task}/completion_len_mean": float(torch.tensor(found["lengths"], dtype=torch.float32).mean()),
        }
        if not correct.isnan().all():
            metrics[f"task/{task}/accuracy"] = float(correct.nanmean())
    return metrics


def _refill_problems(schedule: Any, step: int, prompts_per_step: int, seed: int, round_: int) -> list[dict]:
    """The problems that refill step ``step``'s groups without signal in dynamic-sampling round ``round_``."""
    return schedule.step_problems(step, prompts_per_step, derive_seed(seed, _REFILL, round_))


def _micro_batches(rollouts: Rollouts, rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``rows`` ordered by group and cut into micro-batches, so that a group's rows share a prompt pass."""
    if len(rows) == 0:
        return []
    return list(rows[torch.argsort(rollouts.group_index[rows], stable=True)].split(size))


def _reference_model(model: Any, ref_model: Any, config: GRPOConfig, device: torch.device) -> Any:
    """The frozen reference for the KL term: none when beta = 0 or with LoRA (adapters off), else a
    copy of the initial policy."""
    if config.beta == 0 or (ref_model is None and config.lora is not None):
        return None
    reference = ref_model if ref_model is not None else copy.deepcopy(model)
    return reference.to(device).eval().requires_grad_(False)


def _apply_lora(model: Any, lora: LoRAConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model,
        LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )


def _enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant checkpointing)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _launched_distributed() -> bool:
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1
