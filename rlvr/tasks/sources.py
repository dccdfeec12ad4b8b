"""Where a task's rows come from: a local file or a ``datasets`` dataset, named by the task's options.

``path``: a local .jsonl/.json/.parquet/.csv file (those the task reads); a row goes to its ``split``
field, else to "test". ``dataset``: a ``datasets.load_dataset`` name or local folder, with ``config`` and
the ``train_split``/``test_split`` names (None skips one). ``limit``: the first N rows of each split.
Shared by the math, qa and classification tasks; each documents its own defaults and fields.
"""

from __future__ import annotations

import csv
import json
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from rlvr.tasks.base import TaskError

SOURCE_OPTIONS = ("path", "dataset", "config", "train_split", "test_split", "limit")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class SourceRows:
    """The rows of a task's file or dataset, ``(split, index within the split, where, row)``; ``source``
    names the file or dataset; ``class_names``: a dataset's ``ClassLabel`` columns' names, by field."""

    rows: list[tuple[str, int, str, dict]]
    source: str
    class_names: dict[str, list[str]]


def source_rows(
    task: str, options: dict, own_options: tuple[str, ...] = (), default_test_split: str = "test", suffixes: tuple[str, ...] = FILE_SUFFIXES
) -> SourceRows:
    """The rows named by ``options``' source keys (:data:`SOURCE_OPTIONS`, as the module docstring says), at
    most ``limit`` per split; other keys must be in ``own_options``; a file must end in one of ``suffixes``.
    A :class:`TaskError` names the task, the file line or the dataset row at fault."""
    unknown = sorted(set(options) - set(SOURCE_OPTIONS) - set(own_options))
    if unknown:
        raise TaskError(f"task {task!r}: unknown options {unknown}; known: {[*SOURCE_OPTIONS, *own_options]}")
    path, dataset, limit = options.get("path"), options.get("dataset"), options.get("limit")
    if (path is None) == (dataset is None):
        raise TaskError(f"task {task!r} needs exactly one of 'path' (a local {'/'.join(suffixes)} file) or 'dataset' (a datasets.load_dataset name)")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1):
        raise TaskError(f"task {task!r}: option 'limit' must be a positive integer or None, got {limit!r}")
    class_names: dict[str, list[str]] = {}
    if path is not None:
        misplaced = sorted({"config", "train_split", "test_split"} & set(options))
        if misplaced:
            raise TaskError(f"task {task!r}: options {misplaced} apply to 'dataset', not to 'path' (a file's rows carry their 'split')")
        if Path(path).suffix not in suffixes:
            raise TaskError(f"task {task!r}: {path} is not a {', '.join(suffixes)} file")
        rows, source = _file_rows(task, Path(path)), Path(path).name
    else:
        splits = options.get("train_split", "train"), options.get("test_split", default_test_split)
        rows, source = _dataset_rows(task, dataset, options.get("config"), splits, class_names), str(dataset)
    counts = {"train": 0, "test": 0}
    kept = []
    for split, where, row in rows:
        if limit is None or counts[split] < limit:
            kept.append((split, counts[split], where, row))
            counts[split] += 1
    return SourceRows(kept, source, class_names)


def _file_rows(task: str, path: Path) -> Iterator[tuple[str, str, dict]]:
    """(split, where, row) of a local file; rows without a ``split`` field are test rows."""
    if not path.is_file():
        raise TaskError(f"task {task!r}: no file at {path}")
    if path.suffix == ".jsonl":
        numbered = ((f"{path} line {n}", line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip())
        rows = [(where, _json(text, where)) for where, text in numbered]
    elif path.suffix == ".json":
        data = _json(path.read_text(), str(path))
        if not isinstance(data, list):
            raise TaskError(f"task {task!r}: {path} must hold a JSON list of rows, got {type(data).__name__}")
        rows = [(f"{path} row {i}", row) for i, row in enumerate(data)]
    elif path.suffix == ".csv":
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            rows = [(f"{path} line {reader.line_num}", row) for row in reader]
    else:
        import pyarrow.parquet

        rows = [(f"{path} row {i}", row) for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist())]
    for where, row in rows:
        if not isinstance(row, dict):
            raise TaskError(f"{where}: expected an object of fields, got {type(row).__name__}")
        split = row.get("split") or "test"
        if split not in ("train", "test"):
            raise TaskError(f"{where}: field 'split' must be 'train' or 'test', got {split!r}")
        yield split, where, row


def _dataset_rows(task: str, name: str, config: str | None, splits: tuple, class_names: dict) -> Iterator[tuple[str, str, dict]]:
    """(split, where, row) of a ``datasets`` dataset's train and test splits (``splits``: their names, None
    to skip one); fills ``class_names`` from its ``ClassLabel`` columns; a failure to load names its cause."""
    import datasets

    for split, split_name in zip(("train", "test"), splits):
        if split_name is None:
            continue
        try:
            data = datasets.load_dataset(name, config, split=split_name)
        except Exception as err:  # noqa: BLE001 - hub, network, missing split or config: one message with the cause
            cause = f"{type(err).__name__}: {err}" + (f" ({type(err.__cause__).__name__}: {err.__cause__})" if err.__cause__ else "")
            raise TaskError(f"task {task!r}: cannot load dataset {name!r} (config {config!r}, split {split_name!r}): {cause}") from None
        class_names.update({field: list(f.names) for field, f in data.features.items() if isinstance(f, datasets.ClassLabel)})
        for i, row in enumerate(data):
            yield split, f"dataset {name!r} split {split_name!r} row {i}", row


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TaskError(f"{where}: not valid JSON: {err}") from None
