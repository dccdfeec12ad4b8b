"""``gsm8k``: grade-school math with a numeric final answer, from any ``rlvr.tasks.gsm8k.source`` source.

Its options are :class:`rlvr.tasks.gsm8k.source.ProblemSource`'s fields (``source``, ``local_dir``,
``limit``, ...); the default is the GSM8k copy shipped in ``rlvr/data/gsm8k``. Graded by
``math_answer`` (strict ``####`` extraction), trained with ``math_answer`` + 0.2 ``format``.
"""

from __future__ import annotations

from rlvr.tasks.base import Task, TaskError, TaskProblem
from rlvr.tasks.gsm8k import dataset as gsm8k
from rlvr.tasks.gsm8k.prompt import SYSTEM_PROMPT
from rlvr.tasks.gsm8k.source import ProblemSource, load_problems
from rlvr.tasks.parsers import HASH_NUMBER

NAME = "gsm8k"
REWARDS: dict[str, float] = {"math_answer": 1.0, "format": 0.2}
"""The default GSM8k reward: correctness plus a small format term, ``(1.0 * correct + 0.2 * format) / 1.2``.

GRPO learns only from groups whose rewards differ. The embedded model is right on about 1% of
GSM8k problems, so with correctness alone a group of 8 is all zeros with probability
0.99^8 = 92%; about 60% of its answers are well formed, so the format term separates the
samples of 1 - 0.6^8 - 0.4^8 = 98% of groups. Its weight is small enough that any correct answer
(at least 1/1.2 = 0.83) outranks any wrong, well-formed one (0.2/1.2 = 0.17).
"""


def gsm8k_task_problem(problem: gsm8k.Problem | dict, task: str = NAME) -> TaskProblem:
    """A ``gsm8k_problems`` row (or :class:`rlvr.tasks.gsm8k.dataset.Problem`) as a task problem."""
    row = problem.as_row() if hasattr(problem, "as_row") else problem
    reference = {"answer_text": row["answer_text"], "answer_value": float(row["answer_value"]), "solution": row["solution"]}
    return TaskProblem(task, row["problem_id"], row["split"], row["question"], reference, row["source"], int(row["num_steps"]), row["content_hash"])


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
    rewards=dict(REWARDS),
    system_prompt=SYSTEM_PROMPT,
    description="GSM8k word problems; the number on the last '#### <number>' line is compared with the reference",
    format_reward="format",
    parser=HASH_NUMBER,
    max_new_tokens=256,
)
