"""``qa``: short-answer questions graded as SQuAD and Natural Questions (open) grade them: exact match and F1.

Options: ``path`` (a local .jsonl/.json/.parquet/.csv file; a row goes to its ``split`` field, else to
"test") or ``dataset`` (a ``datasets.load_dataset`` name or local folder, with ``config`` and the
``train_split``/``test_split`` names, default "train"/"validation", None to skip one); ``limit``: the
first N rows of each split; ``question_field``, ``answers_field``, ``context_field`` rename the fields.
A row holds ``question`` and ``answers`` (a list or one string, SQuAD's ``{"text": [...]}``, NQ-open's
``answer`` list), and optionally a ``context`` passage shown before the question. Reference:
``{"answers"}``. Trained with ``qa_exact_match`` + 0.1 ``answer_line``; ``qa_token_f1`` is the partial credit.
"""

from __future__ import annotations

import json
import numbers

from rlvr.tasks.base import Task, TaskError, TaskProblem, require_fields
from rlvr.tasks.parsers import ANSWER_COLON
from rlvr.tasks.sources import source_rows

NAME = "qa"
SYSTEM_PROMPT = (
    "Answer the question with a short answer: a name, a number, a date or a few words, not a sentence. End with a final line of the form 'Answer: <answer>'."
)
OPTIONS = ("question_field", "answers_field", "context_field")


def load(options: dict) -> list[TaskProblem]:
    """The problems of a local file or a ``datasets`` dataset (see the module docstring for ``options``)."""
    source = source_rows(NAME, options, OPTIONS, default_test_split="validation")
    fields = {key: options.get(f"{key}_field") for key in ("question", "answers", "context")}
    return [qa_problem(row, split, index, where, source.source, **fields) for split, index, where, row in source.rows]


def qa_problem(
    record: dict, split: str, index: int, where: str, source: str, question: str | None = None, answers: str | None = None, context: str | None = None
) -> TaskProblem:
    """One row as a problem (``question``, ``answers``, ``context``: field names other than the defaults)."""
    question_field = question or "question"
    require_fields(record, (question_field,), where)
    if context is not None:
        require_fields(record, (context,), where)
    passage = record.get(context or "context")
    text = str(record[question_field]).strip()
    if isinstance(passage, str) and passage.strip():
        text = f"{passage.strip()}\n\nQuestion: {text}"
    answers_field = answers or next((name for name in ("answers", "answer") if record.get(name) is not None), "answers")
    reference = {"answers": answer_list(record.get(answers_field), f"{where}: field {answers_field!r}")}
    return TaskProblem(NAME, f"{NAME}-{split}-{index:05d}", split, text, reference, source)


def answer_list(value, where: str) -> list[str]:
    """The acceptable answers of a row's field: a list, one string (a JSON list in a string, as CSV holds
    it), a number, or SQuAD's ``{"text": [...]}``; stripped, without blanks or repeats."""
    if isinstance(value, dict):
        value = value.get("text")
    if value is None:
        raise TaskError(f"{where} is missing or holds no non-empty answer")
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, str) or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, numbers.Real)) and not isinstance(v, bool) for v in value):
        raise TaskError(f"{where} must hold answers: a list of strings, one string or {{'text': [...]}}, got {value!r:.80}")
    found = list(dict.fromkeys(str(v).strip() for v in value if str(v).strip()))
    if not found:
        raise TaskError(f"{where} is missing or holds no non-empty answer")
    return found


QA = Task(
    name=NAME,
    load=load,
    correctness="qa_exact_match",
    rewards={"qa_exact_match": 1.0, "answer_line": 0.1},
    system_prompt=SYSTEM_PROMPT,
    description="short-answer questions (SQuAD, Natural Questions open): the 'Answer:' line against the references, SQuAD exact match",
    partial_credit="qa_token_f1",
    format_reward="answer_line",
    parser=ANSWER_COLON,
    max_new_tokens=256,
)
