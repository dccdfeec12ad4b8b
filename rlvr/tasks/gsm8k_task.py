"""``gsm8k``: grade-school math with a numeric final answer, from any ``rlvr.problem_source`` source.

Its options are :class:`rlvr.problem_source.ProblemSource`'s fields (``source``, ``local_dir``,
``limit``, ...); the default is the GSM8k copy shipped in ``rlvr/data/gsm8k``. Graded by
``math_answer`` (strict ``####`` extraction), trained with ``math_answer`` + 0.2 ``format``.
"""

from __future__ import annotations

from rlvr import gsm8k
from rlvr.problem_source import ProblemSource, load_problems
from rlvr.prompts import SYSTEM_PROMPT
from rlvr.rewards import DEFAULT_GSM8K_REWARD
from rlvr.tasks.base import Task, TaskError, TaskProblem

NAME = "gsm8k"


def gsm8k_task_problem(problem: gsm8k.Problem | dict, task: str = NAME) -> TaskProblem:
    """A ``gsm8k_problems`` row (or :class:`rlvr.gsm8k.Problem`) as a task problem."""
    row = problem.as_row() if hasattr(problem, "as_row") else problem
    reference = {"answer_text": row["answer_text"], "answer_value": float(row["answer_value"]), "solution": row["solution"]}
    return TaskProblem(task, row["problem_id"], row["split"], row["question"], reference, row["source"], int(row["num_steps"]))


def load(options: dict) -> list[TaskProblem]:
    try:
        source = ProblemSource(**options)
    except TypeError as err:
        raise TaskError(f"task {NAME!r}: bad options {options}: {err}") from None
    try:
        problems, _ = load_problems(source)
    except gsm8k.DataSourceError as err:
        raise TaskError(f"task {NAME!r}: {err}") from None
    return [gsm8k_task_problem(p) for p in problems]


GSM8K = Task(
    name=NAME,
    load=load,
    correctness="math_answer",
    rewards=dict(DEFAULT_GSM8K_REWARD),
    system_prompt=SYSTEM_PROMPT,
    description="GSM8k word problems; the number on the last '#### <number>' line is compared with the reference",
    format_reward="format",
    stop_at_final_answer=True,
    max_new_tokens=256,
)
