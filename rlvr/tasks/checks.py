"""Data-quality checks of one task's problems (the ``task_problems`` asset's checks)."""

from __future__ import annotations

from collections import Counter

from rlvr.tasks.base import Task, TaskProblem, normalized_text_hash
from rlvr.tasks.gsm8k.dataset import CheckOutcome

CHECKS = {
    "no_split_overlap": "No question (case- and whitespace-normalized) is in both the train and the test split.",
    "no_empty_fields": "Every problem has a question and a reference.",
    "held_out_only": "A test-set task (eval_only, e.g. HumanEval) has no train split.",
}


def validate_task_problems(task: Task, problems: list[TaskProblem]) -> list[CheckOutcome]:
    """The outcome of each check of :data:`CHECKS` over ``problems`` of ``task``."""
    splits: dict[str, set[str]] = {"train": set(), "test": set()}
    for problem in problems:
        splits[problem.split].add(normalized_text_hash(problem.question))
    overlap = splits["train"] & splits["test"]
    empty = Counter(name for p in problems for name, value in (("question", p.question.strip()), ("reference", p.reference)) if not value)
    train_rows = sum(p.split == "train" for p in problems)
    return [
        CheckOutcome(
            "no_split_overlap", not overlap, f"{len(overlap)} questions in both splits" if overlap else CHECKS["no_split_overlap"], {"overlap": len(overlap)}
        ),
        CheckOutcome("no_empty_fields", not empty, f"empty fields: {dict(empty)}" if empty else CHECKS["no_empty_fields"], {"empty": sum(empty.values())}),
        CheckOutcome(
            "held_out_only",
            not (task.eval_only and train_rows),
            f"test-set task with {train_rows} train rows" if task.eval_only and train_rows else CHECKS["held_out_only"],
            {"train_rows": train_rows, "eval_only": task.eval_only},
        ),
    ]
