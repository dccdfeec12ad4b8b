"""Training on several tasks at once: each GRPO group from one task, the step's groups drawn by weight.

``TaskMixture.step_problems(step, n, seed)`` is a pure function of its arguments, as
``rlvr.grpo.sampler.step_problems`` is: slot ``p`` of the run (``step * n + i``) draws its task from a
seeded stream of uniforms (prefix-stable, so a resumed run sees the same data), then takes that
task's next problem in its own seeded walk (one permutation per epoch of the task).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np

from rlvr.generation.sampler import derive_seed
from rlvr.grpo.sampler import problem_at
from rlvr.tasks.base import TaskError

_DRAW = 0x7A5C  # the seed stream of the task draws, apart from the problems' walks
TRAINING_FIELDS = {"prompt", "correctness", "task", "problem_id", "stop"}  # what a training record holds besides the reference


class TaskMixture:
    """Problem rows (each with ``task``) of several tasks and the weight of each task."""

    def __init__(self, problems: Sequence[Mapping], weights: Mapping[str, float]):
        if not weights:
            raise TaskError("a task mixture needs at least one task with a weight")
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
                raise TaskError(f"task {name!r}: weight must be a finite number > 0, got {weight!r}")
        by_task: dict[str, list] = defaultdict(list)
        for row in problems:
            by_task[row["task"]].append(row)
        missing = [name for name in weights if not by_task.get(name)]
        if missing:
            raise TaskError(f"no problems to train on for task(s) {missing}")
        unweighted = sorted(set(by_task) - set(weights))
        if unweighted:
            raise TaskError(f"problems of task(s) {unweighted} have no weight in the mixture {dict(weights)}")
        self.names = list(weights)
        self.weights = np.array([float(weights[n]) for n in self.names]) / sum(float(w) for w in weights.values())
        self.by_task = {name: by_task[name] for name in self.names}

    def draws(self, slots: int, seed: int) -> np.ndarray:
        """The task index of each of the run's first ``slots`` groups."""
        uniforms = np.random.default_rng(derive_seed(seed, _DRAW)).random(slots)
        return np.minimum(np.searchsorted(np.cumsum(self.weights), uniforms, side="right"), len(self.names) - 1)

    def step_problems(self, step: int, prompts_per_step: int, seed: int) -> list:
        """The ``prompts_per_step`` problems of training step ``step``, each group's task drawn by weight."""
        draws = self.draws((step + 1) * prompts_per_step, seed)
        seen_before = np.bincount(draws[: step * prompts_per_step], minlength=len(self.names))
        picked, permutations = [], defaultdict(dict)
        for task_index in draws[step * prompts_per_step :]:
            name = self.names[task_index]
            position = int(seen_before[task_index])
            seen_before[task_index] += 1
            picked.append(problem_at(self.by_task[name], position, derive_seed(seed, task_index), permutations[name]))
        return picked


def training_records(rows: Sequence[Mapping], tokenizer, environment=None) -> list[dict]:
    """Training records of problems-table rows: the rendered ``prompt`` (the row's task's, with
    ``environment``'s instructions), the reference fields spread on top, the task's ``correctness`` and
    its ``stop`` rule (each row stops on its own task's stops, whatever the mixture)."""
    from rlvr.tasks.base import problem_record
    from rlvr.tasks.registry import get_task

    tasks, records = {}, []
    for row in rows:
        task = tasks.get(row["task"]) or tasks.setdefault(row["task"], get_task(row["task"]))
        reference = json.loads(row["reference"]) if isinstance(row.get("reference"), str) else row.get("reference") or {}
        taken = sorted(set(reference) & TRAINING_FIELDS)
        if taken:
            raise TaskError(f"task {task.name!r}: reference field(s) {taken} collide with the training record's own; rename them to train on it")
        record = problem_record({**row, "reference": reference})
        prompt = task.render_prompt(tokenizer, record, environment)
        records.append({**record, "prompt": prompt, "correctness": task.correctness, "stop": task.stop_rule})
    return records
