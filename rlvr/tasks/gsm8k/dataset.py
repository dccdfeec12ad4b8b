"""GSM8k problems from interchangeable sources, parsed and validated.

``local``: a folder with the official ``train.jsonl`` and ``test.jsonl`` (default: the MIT copy shipped
in ``rlvr/data/gsm8k``); ``hub``: ``openai/gsm8k`` through ``datasets`` (needs the network);
``gsm_symbolic``: reasoning-gym's offline generator, whose templates come from GSM8k's *test* split, so
its policies are never evaluated on it (:func:`check_no_contamination`); ``reasoning_gym``: another
reasoning-gym task with numeric answers (e.g. ``chain_sum``), where a small policy already succeeds
sometimes and GRPO has a signal.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from rlvr.answers import count_reasoning_steps, normalize_answer, parse_number, split_gsm8k_answer
from rlvr.tasks.base import normalized_text_hash

SOURCES = ("local", "hub", "gsm_symbolic", "reasoning_gym")
SPLITS = ("train", "test")
OFFICIAL_COUNTS = {"train": 7473, "test": 1319}


class DataSourceError(ValueError):
    """Bad data or configuration for a problem source; the message names what was wrong."""


@dataclass(frozen=True)
class Problem:
    """One row of the ``gsm8k_problems`` table."""

    problem_id: str
    split: str
    question: str
    solution: str
    answer_text: str
    answer_value: float
    num_steps: int
    source: str
    content_hash: str

    def as_row(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CheckOutcome:
    """The result of one data-quality check over a set of problems."""

    name: str
    passed: bool
    description: str
    metadata: dict


def make_problem(question: str, answer: str, split: str, index: int, source: str, where: str) -> Problem:
    """Parse one GSM8k record; ``where`` names it in errors (e.g. ``train.jsonl line 12``)."""
    if not isinstance(question, str) or not question.strip():
        raise DataSourceError(f"{where}: 'question' is missing or empty")
    if not isinstance(answer, str) or not answer.strip():
        raise DataSourceError(f"{where}: 'answer' is missing or empty")
    try:
        solution, final = split_gsm8k_answer(answer)
    except ValueError as err:
        raise DataSourceError(f"{where}: {err}") from None
    answer_text, answer_value = normalize_answer(final), parse_number(final)
    if answer_text is None or answer_value is None:
        raise DataSourceError(f"{where}: final answer {final!r} is not a number")
    content = json.dumps({"question": question, "answer": answer}, sort_keys=True)
    return Problem(
        problem_id=f"{source}-{split}-{index:05d}",
        split=split,
        question=question.strip(),
        solution=solution,
        answer_text=answer_text,
        answer_value=answer_value,
        num_steps=count_reasoning_steps(solution),
        source=source,
        content_hash=hashlib.sha256(content.encode()).hexdigest(),
    )


def verify_checksums(folder: Path) -> list[str]:
    """Check every file that ``folder/SHA256SUMS`` lists against its SHA-256; return the names verified.

    A folder without ``SHA256SUMS`` (a user's own copy) verifies nothing; a listed file that is missing
    or differs raises ``DataSourceError`` naming it, before any row is read.
    """
    sums = folder / "SHA256SUMS"
    if not sums.is_file():
        return []
    verified = []
    for line_no, line in enumerate(sums.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        digest, _, name = line.strip().partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name:
            raise DataSourceError(f"{sums} line {line_no}: expected '<sha256>  <file name>', got {line!r}")
        path = folder / name.lstrip("*")
        if not path.is_file():
            raise DataSourceError(f"{sums} lists {name}, which is not in {folder}")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != digest:
            raise DataSourceError(f"{path} does not match {sums}: sha256 {actual}, expected {digest} (the file was changed or damaged)")
        verified.append(name)
    return verified


def load_local(folder: str | Path, limit: int | None = None) -> list[Problem]:
    """Read ``train.jsonl`` and ``test.jsonl`` from ``folder`` (the official GSM8k release files),
    after checking them against the folder's ``SHA256SUMS`` where it has one."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataSourceError(f"GSM8k folder not found: {folder}")
    verify_checksums(folder)
    problems = []
    for split in SPLITS:
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            raise DataSourceError(f"GSM8k folder {folder} has no {split}.jsonl")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise DataSourceError(f"cannot read {path}: {err}") from None
        records = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
        for index, (line_no, line) in enumerate(records[:limit] if limit else records):
            where = f"{path} line {line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataSourceError(f"{where}: malformed JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise DataSourceError(f"{where}: expected a JSON object")
            problems.append(make_problem(record.get("question"), record.get("answer"), split, index, "local", where))
    return problems


def load_hub(dataset: str = "openai/gsm8k", config: str = "main", limit: int | None = None) -> list[Problem]:
    """Download GSM8k from the Hugging Face hub (needs the network and the ``datasets`` package)."""
    from datasets import load_dataset

    try:
        splits = load_dataset(dataset, config)
    except Exception as err:  # noqa: BLE001 - any hub failure becomes one clear message
        raise DataSourceError(f"could not load {dataset!r} ({config}) from the hub: {err}") from err
    problems = []
    for split in SPLITS:
        if split not in splits:
            raise DataSourceError(f"hub dataset {dataset!r} has no {split!r} split")
        rows = splits[split]
        for index, record in enumerate(rows.select(range(min(limit, len(rows)))) if limit else rows):
            where = f"{dataset} {split} row {index}"
            problems.append(make_problem(record.get("question"), record.get("answer"), split, index, "hub", where))
    return problems


def generate_reasoning_gym(task: str, train_size: int, test_size: int, seed: int = 0, task_config: dict | None = None) -> list[Problem]:
    """Generate problems offline with a reasoning-gym task whose answers are numbers.

    The two splits come from different seeds; a generated question already taken (by either
    split) is skipped and generation continues, so each split gets exactly its size and the splits
    never overlap. Tasks without a worked solution get an empty ``solution`` (0 steps).
    """
    import reasoning_gym

    if train_size < 1 or test_size < 1:
        raise DataSourceError(f"{task} needs train_size and test_size of at least 1")
    source = "gsm_symbolic" if task == "gsm_symbolic" else f"reasoning_gym:{task}"
    problems: list[Problem] = []
    seen: set[str] = set()
    for split, size, split_seed in (("train", train_size, seed), ("test", test_size, seed + 1_000_003)):
        try:
            dataset = reasoning_gym.create_dataset(task, size=4 * size + 16, seed=split_seed, **(task_config or {}))
        except Exception as err:  # noqa: BLE001 - unknown task or bad task config, named in one message
            raise DataSourceError(f"reasoning-gym task {task!r} with config {task_config or {}}: {err}") from None
        index = 0
        for entry in dataset:
            if index == size:
                break
            key = normalized_text_hash(entry["question"])
            if key in seen:
                continue
            seen.add(key)
            cot = entry["metadata"].get("answer_cot") or f"#### {entry['answer']}"
            where = f"{task} {split} item {entry['metadata'].get('source_index', index)}"
            problems.append(make_problem(entry["question"], cot, split, index, source, where))
            index += 1
        if index < size:
            raise DataSourceError(f"{task} produced only {index} distinct {split} problems of {size} asked")
    return problems


def validate_problems(problems: Iterable[Problem], expected_counts: dict[str, int] | None) -> list[CheckOutcome]:
    """Data-quality checks: row counts, parseable answers, no question in both splits, no nulls."""
    problems = list(problems)
    counts = Counter(p.split for p in problems)
    outcomes = []
    if expected_counts is not None:
        wrong = {s: (counts.get(s, 0), n) for s, n in expected_counts.items() if counts.get(s, 0) != n}
        failure = "; ".join(f"{s}: {got} rows, expected {n}" for s, (got, n) in wrong.items())
        outcomes.append(_outcome("row_counts", wrong, "row counts match", failure, {f"{s}_rows": counts.get(s, 0) for s in SPLITS}))
    unparsed = [p.problem_id for p in problems if parse_number(p.answer_text) is None]
    failure = f"{len(unparsed)} final answers do not parse, e.g. {unparsed[:5]}"
    outcomes.append(_outcome("answers_parse", unparsed, "every final answer parses as a number", failure, {"unparsed": len(unparsed)}))
    by_split: dict[str, set[str]] = {s: set() for s in SPLITS}
    for p in problems:
        by_split.setdefault(p.split, set()).add(normalized_text_hash(p.question))
    overlap = by_split["train"] & by_split["test"]
    failure = f"{len(overlap)} questions appear in both train and test"
    outcomes.append(_outcome("no_split_overlap", overlap, "no question appears in both splits", failure, {"overlapping_questions": len(overlap)}))
    # an empty solution is allowed: generated tasks may have no worked solution
    nulls = Counter(k for p in problems for k, v in p.as_row().items() if v is None or (v == "" and k != "solution"))
    failure = f"null or empty fields: {dict(nulls)}"
    outcomes.append(_outcome("no_nulls", nulls, "no null or empty fields", failure, {"null_fields": sum(nulls.values())}))
    return outcomes


def _outcome(name: str, offending, passed: str, failed: str, metadata: dict) -> CheckOutcome:
    """A check that passes when ``offending`` (what breaks it) is empty, described by ``passed`` or ``failed``."""
    return CheckOutcome(name, not offending, failed if offending else passed, metadata)


def check_no_contamination(train_source: str, eval_source: str, eval_split: str) -> None:
    """Refuse to evaluate on GSM8k test a policy trained on problems generated from GSM8k test."""
    if train_source == "gsm_symbolic" and eval_source in ("local", "hub") and eval_split == "test":
        raise DataSourceError(
            "contaminated evaluation: gsm_symbolic templates come from the GSM8k test split, so a policy "
            "trained on gsm_symbolic must not be evaluated on GSM8k test; evaluate on gsm_symbolic's own "
            "test split or on another benchmark"
        )
