"""Serving traffic logs: rotating JSONL files written by the service, read incrementally by ingestion.

One JSON object per line. The writer appends each line with a single ``write`` on a file opened
in append mode and starts a new file past ``max_bytes`` and at every UTC midnight, so each file
holds the lines of one UTC day, named in its file name (``traffic-YYYYMMDDT...``): the day a request
belongs to is the day its line was written. The reader resumes from a cursor (byte offset per
file), optionally over one day's files; a last line without its newline is still being written, so
it is left for the next pass, and a malformed complete line is counted and reported, never fatal.
``tokens_by_key`` sums one day's tokens per API key (the service's daily quotas, restored at its start).
Retention keeps today's files and those of the ``retention_days`` days before it, and deletes the rest.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Callable

FILE_PREFIX = "traffic-"
FILE_SUFFIX = ".jsonl"
_DAY = re.compile(rf"^{FILE_PREFIX}(\d{{4}})(\d{{2}})(\d{{2}})T")
RETENTION_DAYS_ENV = "RLVR_TRAFFIC_RETENTION_DAYS"
DEFAULT_RETENTION_DAYS = 30


def file_day(name: str) -> str | None:
    """The UTC day (``YYYY-MM-DD``) whose lines a log file holds, from its name; None for other names."""
    match = _DAY.match(name)
    if not match:
        return None
    try:
        return date(*map(int, match.groups())).isoformat()
    except ValueError:
        return None


def day_prefix(day: str) -> str:
    """The name prefix of the log files of ``day`` (``YYYY-MM-DD``): names sort by day, so every file of an
    earlier day sorts before it. A ValueError names a malformed day."""
    try:
        parsed = date.fromisoformat(day)
    except (TypeError, ValueError):
        raise ValueError(f"day must be an ISO date YYYY-MM-DD, got {day!r}") from None
    return f"{FILE_PREFIX}{parsed:%Y%m%d}T"


def retention_days_from_env() -> int:
    """Days of traffic kept before today: ``$RLVR_TRAFFIC_RETENTION_DAYS``, else 30; a ValueError names a bad value."""
    value = os.environ.get(RETENTION_DAYS_ENV, str(DEFAULT_RETENTION_DAYS))
    try:
        days = int(value)
    except ValueError:
        days = 0
    if days < 1:
        raise ValueError(f"{RETENTION_DAYS_ENV} must be a whole number of days, at least 1; got {value!r}")
    return days


def first_kept_day(today: date, retention_days: int) -> str:
    """The oldest UTC day whose traffic is kept: ``retention_days`` before ``today``. At least 1, so neither
    today's files (being written) nor yesterday's (still written by a service whose clock is behind) expire."""
    if not isinstance(retention_days, int) or retention_days < 1:
        raise ValueError(f"retention_days must be a whole number of days, at least 1; got {retention_days!r}")
    return (today - timedelta(days=retention_days)).isoformat()


def delete_expired_files(folder: str | Path, first_kept: str) -> tuple[list[str], list[str]]:
    """Delete the log files in ``folder`` of days before ``first_kept`` (``YYYY-MM-DD``). Returns the names
    deleted, and ``"name: error"`` of those that could not be (left for the next pass)."""
    cutoff = day_prefix(first_kept)  # the files of earlier days sort before it
    folder, deleted, failed = Path(folder), [], []
    if not folder.is_dir():
        return deleted, failed
    for path in sorted(folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}")):
        if file_day(path.name) is None or path.name >= cutoff:
            continue
        try:
            path.unlink(missing_ok=True)
            deleted.append(path.name)
        except OSError as err:
            failed.append(f"{path.name}: {err.strerror or err}")
    return deleted, failed


class TrafficLog:
    """Append-only JSONL log in ``folder``, rotated by size and by UTC day (thread-safe within a process).
    ``clock`` gives the time in nanoseconds (``time.time_ns``)."""

    def __init__(self, folder: str | Path, max_bytes: int = 16 * 2**20, clock: Callable[[], int] = time.time_ns):
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, got {max_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._day: tuple[int, int, int] | None = None  # the UTC (year, month, day) of the open file

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode()
        with self._lock:
            now_ns = self.clock()
            day = time.gmtime(now_ns / 1e9)[:3]
            if (
                self._path is None
                or day != self._day  # a new UTC day
                or not self._path.exists()  # removed (retention)
                or self._path.stat().st_size + len(line) > self.max_bytes
            ):
                self._path, self._day = self._new_path(now_ns), day
            with open(self._path, "ab") as f:
                f.write(line)

    def _new_path(self, now_ns: int) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ns / 1e9)) + f".{now_ns % 10**9:09d}"  # names sort in creation order
        path = self.folder / f"{FILE_PREFIX}{stamp}-{os.getpid()}-{uuid.uuid4().hex[:8]}{FILE_SUFFIX}"
        path.touch()
        return path


@dataclass
class TrafficBatch:
    """What one incremental read found: parsed records, malformed lines, and the cursor to resume from."""

    records: list[dict] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # "file:line: reason"
    cursor: dict[str, int] = field(default_factory=dict)  # file name -> byte offset already consumed


def read_traffic(folder: str | Path, cursor: dict[str, int] | None = None, day: str | None = None) -> TrafficBatch:
    """Read every complete line appended to the log files in ``folder`` (those of ``day`` only, when
    given) since ``cursor``. Each record gets ``_file`` and ``_offset`` (its byte offset), which
    identify it uniquely.
    """
    folder = Path(folder)
    batch = TrafficBatch(cursor=dict(cursor or {}))
    prefix = day_prefix(day) if day is not None else FILE_PREFIX
    if not folder.is_dir():
        return batch
    for path in sorted(folder.glob(f"{prefix}*{FILE_SUFFIX}")):
        start = batch.cursor.get(path.name, 0)
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        offset = start
        for raw in complete.splitlines(keepends=True):
            line_offset, offset = offset, offset + len(raw)
            text = raw.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, UnicodeDecodeError) as err:
                batch.malformed.append(f"{path.name}@{line_offset}: {str(err)[:120]}")
                continue
            record["_file"], record["_offset"] = path.name, line_offset
            batch.records.append(record)
        batch.cursor[path.name] = offset
    return batch


TRAFFIC_COLUMNS = (
    "record_id",
    "timestamp",
    "request_id",
    "endpoint",
    "model_version",
    "task",
    "status",
    "latency_s",
    "prompt",
    "answer",
    "vote_share",
    "num_completions",
    "well_formed",
    "completion_chars",
    "completion_tokens",
    "truncated",
    "ground_truth",
    "mean_reward",
    "best_reward",
    "source_file",
    "source_offset",
    "api_key_id",
    "prompt_tokens",
    "generated_tokens",
    "compute_s",
)
NATIVE_ENDPOINTS = ("/generate", "/solve")  # the service's own routes: each request rendered with one of the policy's tasks


def request_task(task: str | None, endpoint: str | None) -> str | None:
    """The task a request was rendered with: its record's ``task``; without one, a native route's request
    (written before records named their task) was GSM8k's (``DEFAULT_TASK``), an OpenAI route's (``/v1/...``) none."""
    if isinstance(task, str) and task:
        return task
    if endpoint in NATIVE_ENDPOINTS:
        from rlvr.tasks import DEFAULT_TASK  # imported on use: rlvr.tasks loads the generation stack

        return DEFAULT_TASK
    return None


@functools.lru_cache(maxsize=64)
def format_check(task: str | None) -> Callable[[str], bool] | None:
    """The format check of ``task`` (its parser's, :meth:`rlvr.tasks.Task.well_formed`); None for no task or an unknown one."""
    from rlvr.tasks import TaskError, get_task

    if task is None:
        return None
    try:
        return get_task(task).well_formed
    except (TaskError, ImportError):  # a plugin task, or a family whose package, this process lacks
        return None


def traffic_row(record: dict) -> dict:
    """One ``serving_traffic`` row from a traffic record: identity, request, its task, outputs and their quality.

    ``well_formed`` is the share of the request's completions in its task's answer format (the task's own
    check); None for a request without a task (the OpenAI routes) or of a task this process cannot resolve,
    so those are not counted in well-formedness. ``completion_chars`` / ``completion_tokens`` are means;
    ``prompt_tokens`` / ``generated_tokens`` / ``compute_s`` the request's totals (:func:`request_usage`).
    Missing fields become None.
    """
    completions = [c for c in record.get("completions") or [] if isinstance(c, str)]
    tokens = [t for t in record.get("completion_tokens") or [] if isinstance(t, (int, float))]
    reasons = record.get("finish_reasons") or []
    task = request_task(record.get("task"), record.get("endpoint"))
    check = format_check(task)

    def mean(values):
        return sum(values) / len(values) if values else None

    return {
        "record_id": f"{record.get('_file')}@{record.get('_offset')}",
        "timestamp": record.get("timestamp"),
        "request_id": record.get("request_id"),
        "endpoint": record.get("endpoint"),
        "model_version": record.get("model_version"),
        "task": task,
        "status": record.get("status"),
        "latency_s": record.get("latency_s"),
        "prompt": record.get("prompt"),
        "answer": record.get("answer"),
        "vote_share": record.get("vote_share"),
        "num_completions": len(completions),
        "well_formed": mean([float(check(c)) for c in completions]) if check is not None else None,
        "completion_chars": mean([float(len(c)) for c in completions]),
        "completion_tokens": mean([float(t) for t in tokens]),
        "truncated": mean([float(r == "length") for r in reasons]),
        "ground_truth": record.get("ground_truth"),
        "mean_reward": record.get("mean_reward"),
        "best_reward": record.get("best_reward"),
        "source_file": record.get("_file"),
        "source_offset": record.get("_offset"),
        "api_key_id": record.get("api_key_id"),  # who sent it: the id of its API key (None: an open service, an older log)
        **request_usage(record),
    }


def request_usage(record: dict) -> dict:
    """A record's ``prompt_tokens`` (each prompt once, whatever its samples), ``generated_tokens`` (all its
    samples') and ``compute_s`` (from its submission to the engine to its last token); each None when the
    record lacks it (an older log, a request that did not finish)."""

    def count(name: str) -> int | None:
        value = record.get(name)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None

    compute_s = record.get("compute_s")
    return {
        "prompt_tokens": count("prompt_tokens"),
        "generated_tokens": count("generated_tokens"),
        "compute_s": float(compute_s) if isinstance(compute_s, (int, float)) and not isinstance(compute_s, bool) else None,
    }


def request_tokens(record: dict) -> int | None:
    """The tokens a request counts against its key's daily quota: prompt + generated tokens of a request
    answered 200; None for any other record."""
    used = request_usage(record)
    if record.get("status") != 200 or used["prompt_tokens"] is None or used["generated_tokens"] is None:
        return None
    return used["prompt_tokens"] + used["generated_tokens"]


def tokens_by_key(folder: str | Path, day: str) -> Counter:
    """``request_tokens`` of ``day``'s log files in ``folder``, summed by ``api_key_id`` (None: no key). Read a
    line at a time (memory bounded by the longest line); incomplete and malformed lines are skipped."""
    used: Counter = Counter()
    folder = Path(folder)
    if not folder.is_dir():
        return used
    for path in sorted(folder.glob(f"{day_prefix(day)}*{FILE_SUFFIX}")):
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # still being written
                try:
                    record = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    continue
                tokens = request_tokens(record) if isinstance(record, dict) else None
                if tokens is not None:
                    used[record.get("api_key_id")] += tokens
    return used
