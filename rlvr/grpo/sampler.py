"""Which problems a training step sees, and the seeds it uses: pure functions of (seed, step).

A resumed run therefore sees the same data and the same sampling randomness as an
uninterrupted one, without storing any sampler state.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlvr.generation.sampler import derive_seed


def step_problems(problems: Sequence[Any], step: int, prompts_per_step: int, seed: int) -> list[Any]:
    """The ``prompts_per_step`` problems of training step ``step``.

    Steps walk through a seeded permutation of the problems, one fresh permutation per epoch.
    """
    permutations: dict[int, list[int]] = {}
    return [problem_at(problems, position, seed, permutations) for position in range(step * prompts_per_step, (step + 1) * prompts_per_step)]


def problem_at(problems: Sequence[Any], position: int, seed: int, permutations: dict[int, list[int]]) -> Any:
    """The problem at ``position`` of a seeded walk through ``problems`` (one permutation per epoch,
    cached in ``permutations``)."""
    if not problems:
        raise ValueError("no problems to train on")
    epoch, offset = divmod(position, len(problems))
    if epoch not in permutations:
        generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
        permutations[epoch] = torch.randperm(len(problems), generator=generator).tolist()
    return problems[permutations[epoch][offset]]


class ProblemWalk:
    """The schedule of a single-task run: :func:`step_problems` over one list (``TaskMixture`` is the other)."""

    def __init__(self, problems: Sequence[Any]):
        self.problems = list(problems)

    def step_problems(self, step: int, prompts_per_step: int, seed: int) -> list[Any]:
        return step_problems(self.problems, step, prompts_per_step, seed)
