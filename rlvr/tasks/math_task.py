"""``math``: MATH-style problems with a LaTeX final answer, graded by math-verify (``math_verify``).

Options: ``path`` (a local .jsonl, .json or .parquet file; a row goes to its ``split`` field, else to
"test") or ``dataset`` (a ``datasets.load_dataset`` name or local folder, with ``config`` and the
``train_split``/``test_split`` names, default "train"/"test", None to skip one); ``limit``: the first
N rows of each split. Rows hold ``problem`` and ``solution``, whose last ``\\boxed{}`` is the answer,
or an ``answer`` field, which takes precedence; ``level`` and ``type`` are kept. Reference:
``{"gold", "level", "type"}``. Trained with ``math_verify`` + 0.1 ``boxed`` (:mod:`rlvr.rewards.symbolic`).
"""

from __future__ import annotations

import logging

from rlvr.answers import last_boxed
from rlvr.rewards.math import explosive_reason
from rlvr.tasks.base import Task, TaskError, TaskProblem, require_fields
from rlvr.tasks.parsers import BOXED
from rlvr.tasks.sources import source_rows

NAME = "math"
SYSTEM_PROMPT = "Solve the math problem step by step. Then give the final answer, in simplest form, inside \\boxed{}."
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
logger = logging.getLogger("rlvr.tasks")


def load(options: dict) -> list[TaskProblem]:
    """The problems of a local file or a ``datasets`` dataset (see the module docstring for ``options``)."""
    source = source_rows(NAME, options, suffixes=FILE_SUFFIXES)
    problems = [math_problem(record, split, index, where, source.source) for split, index, where, record in source.rows]
    refused = sum(explosive_reason(p.reference["gold"]) is not None for p in problems)
    if refused:
        logger.warning("task %r: %d of %d gold answers are powers too large for sympy: only an answer written as the gold scores", NAME, refused, len(problems))
    return problems


def math_problem(record: dict, split: str, index: int, where: str, source: str) -> TaskProblem:
    """One row as a problem; ``where`` (file and line, or dataset and row) names it in errors."""
    if not isinstance(record, dict):
        raise TaskError(f"{where}: expected an object with 'problem' and 'solution', got {type(record).__name__}")
    require_fields(record, ("problem",), where)
    answer = record.get("answer")
    if answer is not None and str(answer).strip():
        gold = str(answer).strip()
    else:
        require_fields(record, ("solution",), where)
        gold = last_boxed(str(record["solution"]))
        if gold is None:
            raise TaskError(f"{where}: field 'solution' has no \\boxed{{}} answer and there is no 'answer' field")
    reference = {"gold": gold, **{key: record[key] for key in ("level", "type") if record.get(key) is not None}}
    return TaskProblem(NAME, f"{NAME}-{split}-{index:05d}", split, str(record["problem"]), reference, source)


MATH = Task(
    name=NAME,
    load=load,
    correctness="math_verify",
    rewards={"math_verify": 1.0, "boxed": 0.1},
    system_prompt=SYSTEM_PROMPT,
    description="MATH-style problems with a LaTeX final answer in \\boxed{}, checked for equivalence by math-verify",
    format_reward="boxed",
    parser=BOXED,
    max_new_tokens=512,
)
