"""``classification``: label a text with one of a set of labels (IMDb-style sentiment), graded by accuracy.

Options: the ``qa`` task's source options (``path`` or ``dataset`` with ``config``, ``train_split``/
``test_split``, default "train"/"test", and ``limit``: :func:`rlvr.tasks.sources.source_rows`); ``labels``:
the label set, whose order names integer labels (IMDb's 0, 1 as ``["negative", "positive"]``), else a
dataset's ``ClassLabel`` names, else the distinct labels of the rows; ``text_field``/``label_field``
rename ``text``/``label``. The prompt shows the text and the label set and asks for a final line
``Label: <label>``. Reference: ``{"label", "labels"}``. Trained with ``label_match`` (the
``classification`` reward on the span after ``Label:``; its mean is the accuracy) + 0.1 ``label_line``.
"""

from __future__ import annotations

import numbers

from rlvr.rewards.text import label_key
from rlvr.tasks.base import Task, TaskError, TaskProblem, require_fields
from rlvr.tasks.parsers import LABEL_COLON
from rlvr.tasks.sources import source_rows

NAME = "classification"
SYSTEM_PROMPT = "Classify the text with exactly one of the labels given. End with a final line of the form 'Label: <label>', the label written as given."
OPTIONS = ("labels", "text_field", "label_field")


def load(options: dict) -> list[TaskProblem]:
    """The problems of a local file or a ``datasets`` dataset (see the module docstring for ``options``)."""
    source = source_rows(NAME, options, OPTIONS, default_test_split="test")
    text_field, label_field = options.get("text_field", "text"), options.get("label_field", "label")
    for _, _, where, row in source.rows:
        require_fields(row, (text_field,), where)
        if row.get(label_field) is None or str(row[label_field]).strip() == "":
            raise TaskError(f"{where}: field {label_field!r} is missing or empty")
    named = options.get("labels")
    labels = _label_set(named, "option 'labels'") if named is not None else source.class_names.get(label_field)
    if labels is None:
        labels = _label_set(_data_labels(source.rows, label_field), f"the {label_field!r} values of {source.source}")
    problems = []
    for split, index, where, row in source.rows:
        label = row_label(row[label_field], labels, f"{where}: field {label_field!r}")
        question = f"Text:\n{str(row[text_field]).strip()}\n\nLabels: {', '.join(labels)}"
        problems.append(TaskProblem(NAME, f"{NAME}-{split}-{index:05d}", split, question, {"label": label, "labels": labels}, source.source))
    return problems


def row_label(value, labels: list[str], where: str) -> str:
    """A row's label as spelt in ``labels``: an integer (or a string of digits) indexes them, a string
    names one of them (as ``classification`` compares labels: case, spaces and end punctuation aside)."""
    if isinstance(value, str):
        by_key = {label_key(label): label for label in labels}
        if label_key(value) in by_key:
            return by_key[label_key(value)]
        if not value.strip().isdigit():
            raise TaskError(f"{where} is {value!r}, not one of the labels {labels}")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < len(labels):
        raise TaskError(f"{where} is {value!r}: an integer label indexes the labels {labels} (set them with the option 'labels')")
    return labels[int(value)]


def _label_set(labels, where: str) -> list[str]:
    """``labels`` checked: at least two non-empty strings, distinct as ``classification`` compares them."""
    if isinstance(labels, str) or not isinstance(labels, (list, tuple)) or not all(isinstance(x, str) and label_key(x) for x in labels):
        raise TaskError(f"task {NAME!r}: {where} must be a list of non-empty label strings, got {labels!r:.120}")
    keys = [label_key(x) for x in labels]
    if len(set(keys)) != len(keys) or len(keys) < 2:
        raise TaskError(f"task {NAME!r}: {where} must name at least two distinct labels, got {list(labels)}")
    return [str(x).strip() for x in labels]


def _data_labels(rows: list, label_field: str) -> list[str]:
    """The distinct string labels of ``rows``, sorted; an integer label needs the option ``labels``."""
    found: dict[str, str] = {}
    for _, _, where, row in rows:
        value = row[label_field]
        if not isinstance(value, str) or value.strip().isdigit():
            raise TaskError(f"{where}: field {label_field!r} is the index {value!r}; name the labels with the option 'labels' (index -> name)")
        found.setdefault(label_key(value), value.strip())
    return [found[key] for key in sorted(found)]


CLASSIFICATION = Task(
    name=NAME,
    load=load,
    correctness="label_match",
    rewards={"label_match": 1.0, "label_line": 0.1},
    system_prompt=SYSTEM_PROMPT,
    description="text classification (IMDb-style sentiment): the 'Label:' line names the reference label; accuracy",
    format_reward="label_line",
    parser=LABEL_COLON,
    max_new_tokens=128,
)
