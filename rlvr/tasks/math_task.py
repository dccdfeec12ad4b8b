"""``math``: MATH-style problems with a LaTeX final answer, graded by math-verify (``math_verify``).

Options: ``path`` (a local .jsonl, .json or .parquet file; a row goes to its ``split`` field, else to
"test") or ``dataset`` (a ``datasets.load_dataset`` name or local folder, with ``config`` and the
``train_split``/``test_split`` names, default "train"/"test", None to skip one); ``limit``: the first
N rows of each split. Rows hold ``problem`` and ``solution``, whose last ``\\boxed{}`` is the answer,
or an ``answer`` field, which takes precedence; ``level`` and ``type`` are kept. Reference:
``{"gold", "level", "type"}``. Trained with ``math_verify`` + 0.1 ``boxed`` (:mod:`rlvr.rewards.symbolic`).
"""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path
from typing import Iterator

from rlvr.answers import last_boxed
from rlvr.rewards.math import explosive_reason
from rlvr.tasks.base import Task, TaskError, TaskProblem, require_fields

NAME = "math"
SYSTEM_PROMPT = "Solve the math problem step by step. Then give the final answer, in simplest form, inside \\boxed{}."
OPTIONS = ("path", "dataset", "config", "train_split", "test_split", "limit")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
logger = logging.getLogger("rlvr.tasks")


def load(options: dict) -> list[TaskProblem]:
    """The problems of a local file or a ``datasets`` dataset (see the module docstring for ``options``)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TaskError(f"task {NAME!r}: unknown options {unknown}; known: {list(OPTIONS)}")
    path, dataset, limit = options.get("path"), options.get("dataset"), options.get("limit")
    if (path is None) == (dataset is None):
        raise TaskError(f"task {NAME!r} needs exactly one of 'path' (a local {'/'.join(FILE_SUFFIXES)} file) or 'dataset' (a datasets.load_dataset name)")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1):
        raise TaskError(f"task {NAME!r}: option 'limit' must be a positive integer or None, got {limit!r}")
    if path is not None:
        misplaced = sorted({"config", "train_split", "test_split"} & set(options))
        if misplaced:
            raise TaskError(f"task {NAME!r}: options {misplaced} apply to 'dataset', not to 'path' (a file's rows carry their 'split')")
        rows, source = _file_rows(Path(path)), Path(path).name
    else:
        rows, source = _dataset_rows(dataset, options.get("config"), options.get("train_split", "train"), options.get("test_split", "test")), dataset
    problems: list[TaskProblem] = []
    counts = {"train": 0, "test": 0}
    for split, where, record in rows:
        if limit is None or counts[split] < limit:
            problems.append(math_problem(record, split, counts[split], where, source))
            counts[split] += 1
    refused = sum(explosive_reason(p.reference["gold"]) is not None for p in problems)
    if refused:
        logger.warning("task %r: %d of %d gold answers exceed the symbolic guards of rlvr.rewards.math: never verified", NAME, refused, len(problems))
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


def _file_rows(path: Path) -> Iterator[tuple[str, str, dict]]:
    """(split, where, row) of a local file; rows without a ``split`` field are test rows."""
    if path.suffix not in FILE_SUFFIXES:
        raise TaskError(f"task {NAME!r}: {path} is not a {', '.join(FILE_SUFFIXES)} file")
    if not path.is_file():
        raise TaskError(f"task {NAME!r}: no file at {path}")
    if path.suffix == ".jsonl":
        numbered = ((f"{path} line {n}", line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip())
        rows = ((where, _json(text, where)) for where, text in numbered)
    elif path.suffix == ".json":
        data = _json(path.read_text(), str(path))
        if not isinstance(data, list):
            raise TaskError(f"task {NAME!r}: {path} must hold a JSON list of rows, got {type(data).__name__}")
        rows = ((f"{path} row {i}", row) for i, row in enumerate(data))
    else:
        import pyarrow.parquet

        rows = ((f"{path} row {i}", row) for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist()))
    for where, row in rows:
        split = (row.get("split") if isinstance(row, dict) else None) or "test"
        if split not in ("train", "test"):
            raise TaskError(f"{where}: field 'split' must be 'train' or 'test', got {split!r}")
        yield split, where, row


def _dataset_rows(name: str, config: str | None, train_split: str | None, test_split: str | None) -> Iterator[tuple[str, str, dict]]:
    """(split, where, row) of a ``datasets`` dataset's two named splits; a failure to load names its cause."""
    import datasets

    for split, split_name in (("train", train_split), ("test", test_split)):
        if split_name is None:
            continue
        try:
            data = datasets.load_dataset(name, config, split=split_name)
        except Exception as err:  # noqa: BLE001 - hub, network, missing split or config: one message with the cause
            cause = f"{type(err).__name__}: {err}" + (f" ({type(err.__cause__).__name__}: {err.__cause__})" if err.__cause__ else "")
            raise TaskError(f"task {NAME!r}: cannot load dataset {name!r} (config {config!r}, split {split_name!r}): {cause}") from None
        for i, row in enumerate(data):
            yield split, f"dataset {name!r} split {split_name!r} row {i}", row


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TaskError(f"{where}: not valid JSON: {err}") from None


MATH = Task(
    name=NAME,
    load=load,
    correctness="math_verify",
    rewards={"math_verify": 1.0, "boxed": 0.1},
    system_prompt=SYSTEM_PROMPT,
    description="MATH-style problems with a LaTeX final answer in \\boxed{}, checked for equivalence by math-verify",
    format_reward="boxed",
    max_new_tokens=512,
)
