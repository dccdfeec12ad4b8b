"""What a task is: where its problems come from, how one becomes a prompt, how a completion is graded.

A :class:`Task` is data plus a prompt plus a rubric (as in ``verifiers`` and verl's ``reward_score``):
``load(options)`` returns :class:`TaskProblem` rows whose ``reference`` (JSON-able) is fed to the
task's rewards, which are registered rewards (``rlvr.rewards``). ``correctness`` names the binary
reward that pass@k counts; ``rewards`` the weighted training reward (correctness plus format terms);
``parser`` reads a completion (answer span, format check, stop rule: ``rlvr.tasks.parsers``).
Tasks are registered by name (:mod:`rlvr.tasks.registry`), so a new task is a module, not an edit.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from rlvr.chat import render_messages, with_instructions
from rlvr.generation.stops import StopRule
from rlvr.tasks.parsers import FINAL_LINE, Parser

SPLITS = ("train", "test")


def normalized_text_hash(question: str) -> str:
    """Hash of a question after case and whitespace normalization: one normalization for every task (split overlap, held-out questions)."""
    normalized = re.sub(r"\s+", " ", question.strip().lower())
    return hashlib.sha256(normalized.encode()).hexdigest()


class TaskError(ValueError):
    """A task is unknown, badly defined or badly configured, or its data is missing what it needs."""


@dataclass(frozen=True)
class TaskProblem:
    """One problem of a task: its prompt text (``question``) and what its rewards grade against (``reference``)."""

    task: str
    problem_id: str
    split: str
    question: str
    reference: dict
    source: str = ""
    num_steps: int = 0  # reasoning steps of the reference solution, where the task knows them (difficulty)
    source_hash: str = ""  # the source's own content hash, where it has one (GSM8k's record hash): stored evaluations keep their identity

    @property
    def content_hash(self) -> str:
        """What identifies the problem's content in evaluations and training data: the source's hash, else one of task, question and reference."""
        if self.source_hash:
            return self.source_hash
        content = json.dumps({"task": self.task, "question": self.question, "reference": self.reference}, sort_keys=True, default=str)
        return hashlib.sha256(content.encode()).hexdigest()

    def as_row(self) -> dict:
        """The row of the ``problems`` table: the reference as JSON text."""
        return {
            "task": self.task,
            "problem_id": self.problem_id,
            "split": self.split,
            "question": self.question,
            "reference": json.dumps(self.reference, sort_keys=True, default=str),
            "source": self.source,
            "num_steps": int(self.num_steps),
            "content_hash": self.content_hash,
            "question_hash": normalized_text_hash(self.question),
        }


def problem_record(row: Mapping[str, Any]) -> dict:
    """A problems-table row as the rewards and the evaluation read it: its reference fields spread on
    top of the row (``reference`` as a dict). Rows that carry their reference fields already pass as they are."""
    record = dict(row)
    reference = record.pop("reference", None)
    if isinstance(reference, str):
        reference = json.loads(reference) if reference else {}
    if isinstance(reference, Mapping):
        for key, value in reference.items():
            record.setdefault(key, value)
    return record


@dataclass(frozen=True)
class Task:
    """A verifiable task, registered by name.

    ``load(options)`` returns the problems of every split it has (``options``: the task's own keyword
    arguments from run config). ``prompt_messages(problem)`` overrides the default system + user chat;
    ``completion_prefix`` is text the prompt already opens the assistant's turn with (e.g. a code fence).
    """

    name: str
    load: Callable[[dict], list[TaskProblem]]
    correctness: str  # registered reward, 1 when the completion is right and 0 otherwise: what pass@k counts
    rewards: Mapping[str, float]  # the training reward: registered reward name -> weight
    system_prompt: str = ""
    description: str = ""
    eval_only: bool = False  # a test set (HumanEval): never trained on
    partial_credit: str | None = None  # a reward in [0, 1] reported beside correctness (reasoning-gym's score)
    format_reward: str | None = None  # a reward that says whether the completion is well formed
    parser: Parser = FINAL_LINE  # how a completion is read: its answer span, format check and stop rule
    stop_strings: tuple[str, ...] = ()  # stop strings beside the parser's
    completion_prefix: str = ""
    max_new_tokens: int = 256  # the evaluation's default budget
    requires: tuple[str, ...] = ()  # distributions its prompt or rewards import beyond the core's (a served policy's image needs them)
    prompt_messages: Callable[[TaskProblem | Mapping], list[dict]] | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise TaskError(f"a task needs a non-empty name without surrounding spaces, got {self.name!r}")
        if self.correctness not in self.rewards:
            raise TaskError(f"task {self.name!r}: its correctness reward {self.correctness!r} must be one of its rewards {sorted(self.rewards)}")

    def messages(self, problem: TaskProblem | Mapping) -> list[dict]:
        """The chat messages of one problem: the task's own builder, else its system prompt and the question."""
        if self.prompt_messages is not None:
            return self.prompt_messages(problem)
        question = (problem.question if isinstance(problem, TaskProblem) else problem["question"]).strip()
        if not question:
            raise TaskError(f"task {self.name!r}: problem {problem_id(problem)} has an empty question")
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": question}]

    @property
    def stop_rule(self) -> StopRule:
        """Where this task's rows end: its parser's stop strings and answer line, and its own stop strings."""
        return self.parser.stop_rule(self.stop_strings)

    def parse(self, completion: str) -> str | None:
        """The answer span of ``completion`` (after ``completion_prefix``, which the prompt opened it with)."""
        return self.parser.answer(self.completion_prefix + completion)

    def well_formed(self, completion: str) -> bool:
        """Whether ``completion`` is in this task's answer format."""
        return bool(self.parser.well_formed(self.completion_prefix + completion))

    def render_prompt(self, tokenizer: Any, problem: TaskProblem | Mapping, environment: Any = None) -> str:
        """The prompt the policy continues: the messages (with ``environment``'s instructions) under the chat
        template, then ``completion_prefix``. Training and evaluation both render here."""
        return render_messages(tokenizer, with_instructions(self.messages(problem), environment)) + self.completion_prefix

    def load_problems(self, options: dict | None = None) -> list[TaskProblem]:
        """The task's problems, checked (ids unique, splits known), each named by this task's name."""
        problems = [replace(problem, task=self.name) for problem in self.load(dict(options or {}))]
        seen: set[str] = set()
        for problem in problems:
            if problem.split not in SPLITS:
                raise TaskError(f"task {self.name!r}: problem {problem.problem_id} has split {problem.split!r}, expected one of {SPLITS}")
            if problem.problem_id in seen:
                raise TaskError(f"task {self.name!r}: problem id {problem.problem_id} appears twice")
            seen.add(problem.problem_id)
        if not problems:
            raise TaskError(f"task {self.name!r} loaded no problems")
        return problems


def problem_id(problem: TaskProblem | Mapping) -> str:
    return problem.problem_id if isinstance(problem, TaskProblem) else str(problem.get("problem_id", "?"))


def require_fields(record: Mapping, fields: tuple[str, ...], where: str) -> None:
    """Raise TaskError naming the first of ``fields`` that ``record`` (at ``where``) lacks or has empty."""
    for name in fields:
        value = record.get(name) if isinstance(record, Mapping) else None
        if value is None or (isinstance(value, str) and not value.strip()):
            raise TaskError(f"{where}: field {name!r} is missing or empty")
