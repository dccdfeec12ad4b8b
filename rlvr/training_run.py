"""One GRPO training run on problem rows, from a stored checkpoint: what the training asset calls (and
what a process launched apart from the orchestrator would run), plus the rows it writes.

:func:`train_grpo` is the single place a run meets the trainer. ``on_step(step, metrics, records)``
sees every step's metrics and per-completion records (rank 0 under torchrun);
:func:`training_tables` turns records into the ``rollouts``, ``rewards`` and ``tool_calls`` rows, and
:func:`task_usages` splits a step's measured usage over its tasks.
"""

from __future__ import annotations

import hashlib
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd

from rlvr.costs import Usage
from rlvr.grpo import GRPOConfig, GRPOTrainer, export_merged
from rlvr.policy import load_policy, write_environment, write_tasks
from rlvr.process_lifetime import die_with_parent, let_signal_act
from rlvr.rewards import RewardPool
from rlvr.tasks import DEFAULT_TASK, TaskMixture, get_task
from rlvr.tasks.mixture import training_records

REWARD_WORKERS = 2


@dataclass
class TrainedPolicy:
    """The outcome of a run: the trained policy (exportable as a merged HF checkpoint) and its step metrics."""

    policy: Any
    tokenizer: Any
    history: list[dict]  # metrics of the steps run by this call (a resumed run: only the remaining ones)
    steps: int  # training steps completed in all, resumed ones included
    environment: Any = None  # the environment it rolled out in (None: single-turn), recorded with the checkpoint
    tasks: Mapping[str, float] | None = None  # the task mixture it was trained on, recorded with the checkpoint
    stopped: str | None = None  # why it stopped before its last step (``should_stop``'s reason), None when it ran to the end

    def export(self, folder: Path) -> None:
        """Write the policy (LoRA merged) with its tokenizer as a standard HF checkpoint, the environment it
        was trained in and its tasks (``rlvr.policy.write_environment``, ``write_tasks``)."""
        export_merged(self.policy, self.tokenizer, folder)
        write_environment(folder, self.environment)
        if self.tasks:
            write_tasks(folder, self.tasks)


def train_grpo(
    start: Path,
    rows: list[dict],
    config: GRPOConfig,
    rewards: Mapping[str, float],
    checkpoint_dir: Path,
    device: Any = None,
    on_step: Callable[[int, dict, list[dict]], None] | None = None,
    records_per_rank: bool = False,
    environment: Any = None,
    tasks: Mapping[str, float] | None = None,
    should_stop: Callable[[int], str | None] | None = None,
) -> TrainedPolicy:
    """Train the checkpoint at ``start`` with GRPO on problem ``rows``; resumes from ``checkpoint_dir``'s latest.
    ``environment`` (None: single-turn): where rollouts happen, its instructions in the prompt, recorded with
    the export. ``on_step``: rank 0 with every rank's records, or each rank with its own (``records_per_rank``).
    ``tasks`` (name -> weight): a mixture, each group one task's, rewarded by its own rewards; unset: one
    task, the rows' own (``DEFAULT_TASK`` where they name none), rewarded by ``rewards``. Each row stops on
    its task's rule; the exported checkpoint records the tasks. ``should_stop(step)`` (the same answer on every
    rank) may end the run after a step, with that step's checkpoint saved: the reason is ``stopped``."""
    model, tokenizer = load_policy(start, device)  # float32 master weights (GRPOConfig.compute_dtype: mixed precision)
    if environment is not None:
        config = replace(config, sampling=replace(config.sampling, environment=environment))
    if tasks:
        problems = TaskMixture(training_records(rows, tokenizer, environment), tasks)
    else:  # one task, the rows' own (DEFAULT_TASK's where they name none), rewarded by ``rewards``
        problems = training_records([{**row, "task": row.get("task") or DEFAULT_TASK} for row in rows], tokenizer, environment)
    with RewardPool(workers=REWARD_WORKERS) as pool:
        reward_fn = pool.reward_fn_by_task({name: get_task(name).rewards for name in tasks}) if tasks else pool.reward_fn(rewards)
        hooks = {"on_step": on_step, "records_per_rank": records_per_rank, "should_stop": should_stop}
        trainer = GRPOTrainer(model, tokenizer, config, reward_fn, checkpoint_dir=checkpoint_dir, **hooks)
        history = trainer.train(problems)
    trained_tasks = dict(tasks) if tasks else {name: 1.0 for name in dict.fromkeys(p["task"] for p in problems)}
    return TrainedPolicy(trainer.policy, tokenizer, history, trainer.step_count, environment, trained_tasks, trainer.stopped)


def start_training_process(parent: int | None = None) -> None:
    """What every training process (torchrun, each rank) runs first: SIGTERM's default action, unblocked
    (a launcher's ignored or blocked SIGTERM is inherited across fork and exec, and a stop must reach the
    training), and SIGKILL when its parent dies (:func:`~rlvr.process_lifetime.die_with_parent`)."""
    let_signal_act(signal.SIGTERM)
    die_with_parent(signal.SIGKILL, parent)


def problems_hash(rows: list[dict]) -> str:
    """Identity of the training data: a hash of the problems' content hashes, in order."""
    return hashlib.sha256("".join(r["content_hash"] for r in rows).encode()).hexdigest()[:16]


TOOL_CALL_COLUMNS = ("run_id", "completion_id", "step", "call_index", "tool", "call", "result", "error", "latency_s")


def training_tables(records: list[dict], run_id: str, weights: Mapping[str, float]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The ``rollouts`` rows (one per completion), ``rewards`` rows (one per completion and reward,
    plus ``total``) and ``tool_calls`` rows (one per call an environment answered) of a run from the
    trainer's per-completion records; keyed by ``completion_id``."""
    rollouts, rewards, tool_calls = [], [], []
    for r in records:
        completion_id = f"{run_id}:{r['step']}:{r['group_index']}:{r['sample_index']}"
        calls = r.get("tool_calls") or []
        rollouts.append(
            {
                "run_id": run_id,
                "completion_id": completion_id,
                "step": r["step"],
                "problem_id": r["problem_id"],
                "task": r["task"],
                "group_index": r["group_index"],
                "sample_index": r["sample_index"],
                "temperature": r["temperature"],
                "prompt": r["prompt"],
                "completion": r["completion"],
                "prompt_tokens": r["prompt_tokens"],
                "completion_tokens": r["completion_tokens"],
                "policy_tokens": r.get("policy_tokens", r["completion_tokens"]),
                "environment_tokens": r.get("environment_tokens", 0),
                "tool_calls": len(calls),
                "finish_reason": r["finish_reason"],
                "policy_version": r["policy_version"],
                "trained": r["trained"],
            }
        )
        for call in calls:
            tool_calls.append(
                {
                    "run_id": run_id,
                    "completion_id": completion_id,
                    "step": r["step"],
                    "call_index": call["index"],
                    "tool": call["tool"],
                    "call": call["call"],
                    "result": call["result"],
                    "error": call["error"],
                    "latency_s": float(call["latency_s"]),
                }
            )
        for name, value in {**r["rewards"], "total": r["reward"]}.items():
            rewards.append(
                {
                    "run_id": run_id,
                    "completion_id": completion_id,
                    "step": r["step"],
                    "task": r["task"],
                    "reward_name": name,
                    "value": value,
                    "weight": weights.get(name, 1.0),
                    "advantage": r["advantage"],
                }
            )
    return pd.DataFrame(rollouts), pd.DataFrame(rewards), pd.DataFrame(tool_calls, columns=list(TOOL_CALL_COLUMNS))


def task_usages(usage: Usage, records: list[dict]) -> dict[str, Usage]:
    """A step's ``usage`` per task of its ``records``: each task's share of the step's (prompt + completion) tokens,
    with its own tokens exactly (trained: the policy tokens of completions the update trained on)."""
    tokens: dict[str, list[int]] = {}
    for r in records:
        counts = tokens.setdefault(r["task"] or DEFAULT_TASK, [0, 0, 0])
        counts[0] += r["prompt_tokens"]
        counts[1] += r["completion_tokens"]
        counts[2] += r.get("policy_tokens", r["completion_tokens"]) if r["trained"] else 0
    step_tokens = sum(prompt + completion for prompt, completion, _ in tokens.values())
    return {
        task: usage.share((prompt + completion) / step_tokens if step_tokens else 1 / len(tokens)).with_tokens(prompt, completion, trained)
        for task, (prompt, completion, trained) in tokens.items()
    }


def sample_completions(rollouts: pd.DataFrame, rewards: pd.DataFrame, count: int) -> pd.DataFrame:
    """The last ``count`` completions (by step) with each reward's value: a table to read next to the run's curves."""
    if rollouts.empty:
        return pd.DataFrame()
    values = rewards.pivot_table(index="completion_id", columns="reward_name", values="value").rename(columns={"total": "reward"})
    last = rollouts.sort_values(["step", "group_index", "sample_index"]).tail(count)
    columns = ["completion_id", "step", "problem_id", "completion", "finish_reason"]
    return last[columns].join(values, on="completion_id").drop(columns="completion_id").reset_index(drop=True)
