"""The shared DuckDB file: the tables assets read, and atomic writes (one transaction per ``write``).

Tables with declared columns are created from :data:`SCHEMAS` (older files gain later columns through
:data:`MIGRATIONS`); the others from the first frame written to them. The big, growing tables are views
over Parquet parts (:mod:`resources.table_parts`), so a write costs the rows it writes. Readers never fail
writers: every committed ``write`` also publishes a read-only copy, ``<name>.snapshot.duckdb``, for SQL
sessions (``make sql``: :func:`main`), and a connection that finds the file held by another process waits
(``lock_wait_s``), naming the holder.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Iterator, Mapping

import duckdb
import pandas as pd
from dagster import Failure, get_dagster_logger
from dagster_duckdb import DuckDBResource
from pydantic import Field

from resources.table_parts import PART_TABLES, SMALL_PART_BYTES, PartTables, partition_dir, parts_root, write_parquet
from rlvr.monitoring.traffic import TRAFFIC_COLUMNS, TrafficBatch, day_prefix, request_task, traffic_row
from rlvr.tasks import DEFAULT_TASK
from rlvr.tasks.gsm8k import NAME as GSM8K_NAME
from rlvr.tasks.gsm8k import gsm8k_task_problem

SCHEMAS = {
    "serving_traffic": """CREATE TABLE IF NOT EXISTS serving_traffic (
  record_id VARCHAR PRIMARY KEY, "timestamp" TIMESTAMPTZ, request_id VARCHAR, endpoint VARCHAR, model_version VARCHAR, task VARCHAR,
  status INTEGER, latency_s DOUBLE, prompt VARCHAR, answer VARCHAR, vote_share DOUBLE, num_completions INTEGER,
  well_formed DOUBLE, completion_chars DOUBLE, completion_tokens DOUBLE, truncated DOUBLE, ground_truth VARCHAR,
  mean_reward DOUBLE, best_reward DOUBLE, source_file VARCHAR, source_offset BIGINT, api_key_id VARCHAR)""",
    "serving_traffic_cursor": 'CREATE TABLE IF NOT EXISTS serving_traffic_cursor (file VARCHAR PRIMARY KEY, "offset" BIGINT)',
    "drift_history": "CREATE TABLE IF NOT EXISTS drift_history (reported_at TIMESTAMPTZ, run_id VARCHAR, metric VARCHAR, "
    "value DOUBLE, threshold DOUBLE, drifted BOOLEAN, day VARCHAR, task VARCHAR)",
    # one row per tool call an environment answered in a rollout (error NULL: the call succeeded)
    "tool_calls": "CREATE TABLE IF NOT EXISTS tool_calls (run_id VARCHAR, completion_id VARCHAR, step INTEGER, call_index INTEGER, "
    "tool VARCHAR, call VARCHAR, result VARCHAR, error VARCHAR, latency_s DOUBLE, PRIMARY KEY (completion_id, call_index))",
}
MIGRATIONS = {  # columns added since a table was first declared: an older database gains them (empty) on its next write
    "drift_history": [f"ALTER TABLE drift_history ADD COLUMN IF NOT EXISTS {c} VARCHAR" for c in ("day", "task")],
    "serving_traffic": [f"ALTER TABLE serving_traffic ADD COLUMN IF NOT EXISTS {c} VARCHAR" for c in ("api_key_id", "task")],
    "rollouts": [f"ALTER TABLE rollouts ADD COLUMN IF NOT EXISTS {c} BIGINT" for c in ("policy_tokens", "environment_tokens", "tool_calls")],
    "eval_results": [
        "ALTER TABLE eval_results ADD COLUMN IF NOT EXISTS environment VARCHAR",
        *(f"ALTER TABLE eval_results ADD COLUMN IF NOT EXISTS {c} BIGINT" for c in ("tool_calls", "tool_errors")),
    ],
}


@dataclass(frozen=True)
class Replace:
    """Replace ``table`` by ``frame``."""

    table: str
    frame: pd.DataFrame


@dataclass(frozen=True)
class Upsert:
    """Delete the rows of ``table`` whose ``key`` values appear in ``frame``, then insert ``frame``."""

    table: str
    frame: pd.DataFrame
    key: str


@dataclass(frozen=True)
class Append:
    """Insert ``frame`` into ``table``; with a ``key``, only the rows whose key is not stored yet."""

    table: str
    frame: pd.DataFrame
    key: str | None = None


@dataclass(frozen=True)
class Delete:
    """Delete the rows of ``table`` where the SQL condition ``where`` holds (``?`` bound to ``params``); a table not created yet has none."""

    table: str
    where: str
    params: tuple = ()


Write = Replace | Upsert | Append | Delete
PROBLEMS = "task_problems"  # every task's problems, one row each: task, id, split, question, reference (JSON), source, hashes
PROBLEM_VIEWS = {  # a task whose problems had a table of their own in older files: the view that keeps its name and columns
    GSM8K_NAME: (
        "gsm8k_problems",
        "CREATE OR REPLACE VIEW gsm8k_problems AS SELECT problem_id, split, question, reference->>'$.solution' AS solution, "
        "reference->>'$.answer_text' AS answer_text, CAST(reference->>'$.answer_value' AS DOUBLE) AS answer_value, num_steps, source, "
        f"content_hash, task, reference, question_hash FROM {PROBLEMS} WHERE task = '{GSM8K_NAME}'",
    )
}
WRITER_POOL = "duckdb_writer"  # the Dagster pool of every asset that writes the file; the instance runs one step of it at a time (deploy/)


class Warehouse(DuckDBResource):
    """The DuckDB file of rlvr-ops: loaders of the tables assets read, and atomic writes."""

    lock_wait_s: float = Field(default=900.0, description="how long a connection waits while another process holds the file, then fails naming it")
    publish_snapshot: bool = Field(default=True, description="after every committed write, publish the read-only copy SQL sessions open")
    part_grace_s: float = Field(
        default=3600.0, description="how long a Parquet part a write or compaction replaced is kept for readers of older snapshots, then deleted"
    )

    # --- transactions and writes ---------------------------------------------------------------

    @property
    def snapshot_path(self) -> Path:
        """The read-only copy published after each committed write: ``rlvr.duckdb`` -> ``rlvr.snapshot.duckdb``."""
        return snapshot_path(self.database)

    @contextmanager
    def get_connection(self) -> Iterator:
        """A connection to the file, closed when the block ends, also when it raises (so a failed
        write never keeps the single-writer file open). While another process holds the file it
        waits, up to ``lock_wait_s``, saying which process that is."""
        conn = self._connect()
        try:
            parts = self._parts(conn)
            if parts is not None and parts.upgrade(Path(self.database)):
                shrink(conn, Path(self.database))  # the moved tables' space, once: so the snapshot copies the small file only
                conn.close()
                conn = self._connect()
            yield conn
        finally:
            conn.close()

    def _connect(self):
        deadline, told = time.monotonic() + self.lock_wait_s, None
        while True:
            try:
                return duckdb.connect(self.database, read_only=False, config={"custom_user_agent": "dagster", **self.connection_config})
            except duckdb.IOException as err:
                holder = lock_holder(str(err))
                if holder is None:
                    raise
                if time.monotonic() > deadline:
                    raise Failure(
                        description=f"DuckDB file {self.database} is held by {holder} (waited {self.lock_wait_s:.0f} s): end that session; "
                        f"read-only SQL belongs on the snapshot {self.snapshot_path} (make sql)"
                    ) from None
                if holder != told:
                    get_dagster_logger().warning(f"waiting for DuckDB file {self.database}: it is held by {holder}")
                    told = holder
                time.sleep(0.25)

    @property
    def parts_root(self) -> Path:
        """Where the part tables' Parquet files live: ``rlvr.duckdb`` -> ``rlvr.parts/``."""
        return parts_root(self.database)

    def _parts(self, conn) -> PartTables | None:
        if self.database == ":memory:":  # no folder for parts: the part tables are DuckDB tables
            return None
        return PartTables(conn, self.parts_root, SCHEMAS, MIGRATIONS, self.part_grace_s)

    @contextmanager
    def transaction(self) -> Iterator:
        """A connection inside one transaction: committed when the block ends, rolled back if it raises."""
        with self.get_connection() as conn:
            with _transaction(conn):
                yield conn

    def write(self, *writes: Write) -> None:
        """Apply every write, in order, in one transaction: all of them land, or none does; then publish the
        snapshot (still holding the file, so it is exactly what was committed). An empty upsert or
        append changes nothing and is skipped (an empty frame's columns have no types to compare), but
        creates its table when it is declared (:data:`SCHEMAS`), so queries of it find it, empty. A part
        table's new files are written before the commit and listed by it; a rolled-back write deletes them."""
        with self.get_connection() as conn:
            parts = self._parts(conn)
            try:
                with _transaction(conn):
                    for index, op in enumerate(writes):
                        _apply_one(conn, parts if op.table in PART_TABLES else None, op, index)
                    if parts is not None:
                        parts.finish()
            except BaseException:
                if parts is not None:
                    parts.discard()
                raise
            if self.publish_snapshot:
                publish_snapshot(conn, Path(self.database))
            if parts is not None:
                parts.collect_garbage()

    def compact(self, table: str | None = None) -> int:
        """Merge each partition's small parts into one; returns the parts merged away. The merge reads and
        writes files without holding the DuckDB file (a live run goes on writing); one short transaction then
        swaps the catalog for the partitions whose parts are still those merged. Replaced files go after
        ``part_grace_s``, as do files a killed write or compaction left unlisted."""
        with self.get_connection() as conn:
            parts = self._parts(conn)
            if parts is None:
                return 0
            parts.sweep_orphans()
            plan = []
            for name in [table] if table else PART_TABLES:
                by_partition: dict[str, list[str]] = {}
                for path, partition, size in parts.live(name):
                    if size < SMALL_PART_BYTES:
                        by_partition.setdefault(partition, []).append(path)
                width = len(parts.columns(name))
                plan += [(name, p, paths, parts.relation(name, paths), width) for p, paths in by_partition.items() if len(paths) > 1]
        merged = []
        with duckdb.connect() as memory:  # outside the writer's file
            for name, partition, paths, relation, width in plan:
                final, rows = write_parquet(memory, relation, self.parts_root / name / partition_dir(partition), name)
                merged.append((name, partition, paths, final, rows, width))
        swapped = 0
        with self.get_connection() as conn:
            parts = self._parts(conn)
            with _transaction(conn):
                for name, partition, paths, final, rows, width in merged:
                    live = {p for p, _, _ in parts.live(name, partition)}
                    if set(paths) <= live and final is not None:
                        parts.add(name, partition, final, rows, width)
                        parts.retire(paths)
                        swapped += len(paths)
                    elif final is not None:
                        final.unlink(missing_ok=True)  # a write rewrote the partition meanwhile: this merge is stale
                for name in sorted({t for t, _ in parts.touched}):
                    parts.refresh_view(name, {p for t, p in parts.touched if t == name})
            if self.publish_snapshot:
                publish_snapshot(conn, Path(self.database))
        return swapped

    def drop_partition(self, table: str, partition: str) -> int:
        """Retire every part of one partition (a run's rows, a traffic day's), also unreadable ones; returns the parts dropped."""
        with self.get_connection() as conn:
            parts = self._parts(conn)
            with _transaction(conn):
                dropped = [p for p, _, _ in parts.live(table, partition)]
                parts.retire(dropped)
                parts.refresh_view(table, {partition})
            if self.publish_snapshot:
                publish_snapshot(conn, Path(self.database))
        return len(dropped)

    def replace_tables(self, tables: Mapping[str, pd.DataFrame]) -> None:
        """Replace each named table by its DataFrame in one transaction."""
        self.write(*(Replace(name, frame) for name, frame in tables.items()))

    def upsert(self, table: str, frame: pd.DataFrame, key: str) -> None:
        """Upsert ``frame`` by ``key``: re-running with the same keys replaces rows instead of duplicating them."""
        self.write(Upsert(table, frame, key))

    # --- reads ---------------------------------------------------------------------------------

    def table_exists(self, table: str) -> bool:
        with self.get_connection() as conn:
            return bool(conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]).fetchone()[0])

    def query(self, sql: str, params: list | None = None) -> pd.DataFrame:
        with self.get_connection() as conn:
            return conn.execute(sql, params or []).df()

    def query_partitions(self, table: str, partitions: list[str], sql: str, params: list | None = None) -> pd.DataFrame:
        """``sql`` where ``{rows}`` stands for the rows of ``table`` in ``partitions`` (training runs, traffic
        days ``YYYYMMDD``): a part table reads only those partitions' parts, so the cost follows them, not the table."""
        with self.get_connection() as conn:
            parts = self._parts(conn)
            pruned = parts is not None and table in PART_TABLES and parts.columns(table)
            rows = f"({parts.partition_relation(table, partitions)})" if pruned else f'"{table}"'
            return conn.execute(sql.replace("{rows}", rows), params or []).df()

    def traffic_days(self) -> list[str]:
        """The traffic partitions stored (``YYYYMMDD``, and ``_`` for rows of other log names), newest first
        (none in memory: there the table is one DuckDB table)."""
        with self.get_connection() as conn:
            parts = self._parts(conn)
            return [] if parts is None else parts.partitions("serving_traffic")[::-1]

    def row_count(self, table: str) -> int:
        return int(self.query(f'SELECT count(*) AS n FROM "{table}"')["n"].iloc[0]) if self.table_exists(table) else 0

    def replace_task_problems(self, task: str, frame: pd.DataFrame) -> None:
        """Replace one task's rows of ``task_problems`` by ``frame`` in one transaction (other tasks' kept); a task
        whose problems once had a table of their own (:data:`PROBLEM_VIEWS`) gets that name back as a view of them."""
        with self.get_connection() as conn:
            _move_problem_tables(conn)
        self.write(Upsert(PROBLEMS, frame, "task"))
        if task in PROBLEM_VIEWS:
            with self.get_connection() as conn:
                conn.execute(PROBLEM_VIEWS[task][1])
                if self.publish_snapshot:
                    publish_snapshot(conn, Path(self.database))

    def task_problems(self, task: str, split: str, limit: int | None = None) -> list[dict]:
        """One task's rows of ``task_problems`` in ``split``, ordered by id (the first ``limit`` when given); the
        ``reference`` stays JSON text (``rlvr.tasks.problem_record`` spreads it). A Failure names what to materialize."""
        first = f"LIMIT {int(limit)}" if limit else ""
        frame = self._problem_rows(f"SELECT * FROM {PROBLEMS} WHERE task = ? AND split = ? ORDER BY problem_id {first}", [task, split])
        if frame is None or frame.empty:
            also = f"{PROBLEM_VIEWS[task][0]} or " if task in PROBLEM_VIEWS else ""
            raise Failure(description=f"task_problems has no rows of task {task!r} in split {split!r}: materialize {also}its partition {task!r} first")
        return frame.to_dict(orient="records")

    def problem_tasks(self) -> list[str]:
        """The tasks whose problems the warehouse holds."""
        frame = self._problem_rows(f"SELECT DISTINCT task FROM {PROBLEMS} ORDER BY task")
        return [] if frame is None else frame["task"].tolist()

    def held_out_question_hashes(self) -> set[str]:
        """The normalized-question hashes of every held-out (test) problem of every task: what training never sees."""
        frame = self._problem_rows(f"SELECT DISTINCT question_hash FROM {PROBLEMS} WHERE split = 'test'")
        return set() if frame is None else set(frame["question_hash"])

    def reference_questions(self, size: int, tasks: Mapping[str, float] | None = None) -> list[str]:
        """About ``size`` train questions: the drift reference of a policy trained on ``tasks`` (name -> weight;
        None: ``DEFAULT_TASK``), each task's share by its weight (:meth:`task_reference_questions`)."""
        tasks = tasks or {DEFAULT_TASK: 1.0}
        total = sum(tasks.values())
        return [q for task, weight in tasks.items() for q in self.task_reference_questions(task, max(1, round(size * weight / total)))]

    def task_reference_questions(self, task: str, size: int) -> list[str]:
        """Up to ``size`` of one task's train questions in a fixed pseudo-random order (by hash of the problem id);
        none while the warehouse holds no problems."""
        frame = self._problem_rows(f"SELECT question FROM {PROBLEMS} WHERE split = 'train' AND task = ? ORDER BY hash(problem_id) LIMIT ?", [task, size])
        return [] if frame is None else frame["question"].tolist()

    def _problem_rows(self, sql: str, params: list | None = None) -> pd.DataFrame | None:
        """``sql`` over ``task_problems`` (None while it does not exist), after an older file's own problem tables
        moved into it (:func:`_move_problem_tables`, once)."""
        with self.get_connection() as conn:
            moved = _move_problem_tables(conn)
            if moved and self.publish_snapshot:
                publish_snapshot(conn, Path(self.database))
            if not conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [PROBLEMS]).fetchone()[0]:
                return None
            return conn.execute(sql, params or []).df()

    def eval_results(self, eval_id: str) -> pd.DataFrame | None:
        """The stored per-problem rows of one evaluation (ordered by problem), or None."""
        if not self.table_exists("eval_results"):
            return None
        frame = self.query("SELECT * FROM eval_results WHERE eval_id = ? ORDER BY problem_id", [eval_id])
        return frame if len(frame) else None

    def latest_evaluation(self, policy_version: str | None, task: str | None = None) -> pd.DataFrame | None:
        """Per-problem rows of the most recent evaluation of ``policy_version`` (with ``completion_chars``), of
        ``task`` only when given (rows stored before evaluations named their task are GSM8k's), or None."""
        if policy_version is None or not self.table_exists("eval_results"):
            return None
        columns = self.query("SELECT column_name FROM information_schema.columns WHERE table_name = 'eval_results'")["column_name"]
        of_task = "" if task is None else f"AND {'coalesce(task, ?)' if 'task' in set(columns) else '?'} = ?"
        params = [policy_version] + ([] if task is None else [DEFAULT_TASK, task])
        frame = self.query(
            "SELECT *, length(completion) AS completion_chars, well_formed::DOUBLE AS well_formed FROM eval_results "
            f"WHERE policy_version = ? {of_task} AND eval_id = "
            f"(SELECT eval_id FROM eval_results WHERE policy_version = ? {of_task} ORDER BY evaluated_at DESC LIMIT 1)",
            params + params,
        )
        return frame if len(frame) else None

    def training_run_summary(self, run_id: str) -> dict:
        """Finish reasons of a training run's rollouts, its mean value per reward and its reward rows, and
        its tool use: completions that called a tool, calls, calls that failed."""
        runs = [run_id]
        finish = self.query_partitions("rollouts", runs, "SELECT finish_reason, count(*) AS n FROM {rows} WHERE run_id = ? GROUP BY 1", runs)
        rewards = self.query_partitions("rewards", runs, "SELECT reward_name, avg(value) AS mean, count(*) AS n FROM {rows} WHERE run_id = ? GROUP BY 1", runs)
        tools = {"completions_calling": 0, "tool_calls": 0, "tool_errors": 0}
        if self.table_exists("tool_calls"):
            used = self.query_partitions(
                "tool_calls",
                runs,
                "SELECT count(DISTINCT completion_id) AS completions_calling, count(*) AS tool_calls, count(error) AS tool_errors FROM {rows} WHERE run_id = ?",
                runs,
            )
            tools = {k: int(used[k].iloc[0]) for k in tools}
        return {
            "finish_reasons": {r: int(n) for r, n in zip(finish["finish_reason"], finish["n"])},
            "reward_means": {r: float(m) for r, m in zip(rewards["reward_name"], rewards["mean"])},
            "reward_rows": int(rewards["n"].sum()),
            **tools,
        }

    # --- serving traffic and drift ---------------------------------------------------------------

    def traffic_cursor(self) -> dict[str, int]:
        """Bytes of each traffic log file already ingested."""
        if not self.table_exists("serving_traffic_cursor"):
            return {}
        cursor = self.query('SELECT file, "offset" FROM serving_traffic_cursor')
        return {f: int(o) for f, o in zip(cursor["file"], cursor["offset"])}

    def ingest_traffic(self, batch: TrafficBatch, replace: bool = False) -> int:
        """Store a batch's records and move the cursor, in one transaction; returns the rows read. Rows
        already stored (same ``record_id``) are kept, or replaced by the batch's with ``replace``."""
        frame = pd.DataFrame([traffic_row(r) for r in batch.records], columns=list(TRAFFIC_COLUMNS))
        frame["timestamp"] = pd.to_datetime(frame["timestamp"], utc=True, errors="coerce")
        cursor = pd.DataFrame({"file": list(batch.cursor), "offset": list(batch.cursor.values())})
        rows = Upsert("serving_traffic", frame, key="record_id") if replace else Append("serving_traffic", frame, key="record_id")
        self.write(rows, Upsert("serving_traffic_cursor", cursor, key="file"))
        return len(frame)

    def delete_traffic_before(self, day: str) -> int:
        """Delete the ``serving_traffic`` rows of the days before ``day`` (``YYYY-MM-DD``) and their files'
        cursor entries, in one transaction; returns the rows deleted. Delete the days' log files first: a file
        whose cursor entry is gone would be read again from its first byte."""
        if not self.table_exists("serving_traffic"):
            return 0
        before = day_prefix(day)  # the files of earlier days sort before it
        counts = self.query(
            "SELECT (SELECT count(*) FROM serving_traffic WHERE source_file < ?) AS n_rows, "
            "(SELECT count(*) FROM serving_traffic_cursor WHERE file < ?) AS n_files",
            [before, before],
        )
        rows, files = int(counts["n_rows"].iloc[0]), int(counts["n_files"].iloc[0])
        if rows or files:
            self.write(Delete("serving_traffic", "source_file < ?", (before,)), Delete("serving_traffic_cursor", "file < ?", (before,)))
        return rows

    def traffic_rows(self, day: str) -> int:
        """Rows stored of ``day`` (``YYYY-MM-DD``: the UTC day their log lines were written)."""
        if not self.table_exists("serving_traffic"):
            return 0
        prefix = day_prefix(day)
        counted = self.query_partitions("serving_traffic", [prefix[-9:-1]], "SELECT count(*) AS n FROM {rows} WHERE starts_with(source_file, ?)", [prefix])
        return int(counted["n"].iloc[0])

    def traffic_window(self, day: str, rows: int) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The last ``rows`` successful requests of ``day``, and the ``rows`` successful requests before
        them (of that day or earlier ones), each newest first."""
        if not self.table_exists("serving_traffic"):
            empty = pd.DataFrame(columns=list(TRAFFIC_COLUMNS))
            return empty, empty
        order = 'ORDER BY "timestamp" DESC, record_id DESC LIMIT ?'
        prefix = day_prefix(day)
        current = self.query_partitions(
            "serving_traffic", [prefix[-9:-1]], f"SELECT * FROM {{rows}} WHERE status = 200 AND starts_with(source_file, ?) {order}", [prefix, rows]
        )
        if current.empty:
            return with_task(current), with_task(current)
        next_day = day_prefix((date.fromisoformat(day) + timedelta(days=1)).isoformat())
        sql = f'SELECT * FROM {{rows}} WHERE status = 200 AND source_file < ? AND "timestamp" < ? {order}'
        earlier = [d for d in self.traffic_days() if d != "_" and d <= prefix[-9:-1]]
        window = 1
        while True:  # the newest days first, doubling: a day's rows were logged that day, so older days cannot beat a full window
            previous = self.query_partitions("serving_traffic", earlier[:window] + ["_"], sql, [next_day, current["timestamp"].min(), rows])
            if window >= len(earlier) or (len(previous) == rows and previous["timestamp"].min() >= _day_end(earlier[window])):
                return with_task(current), with_task(previous)
            window *= 2

    def append_drift_history(self, frame: pd.DataFrame) -> pd.DataFrame:
        """Append a report's rows to ``drift_history``; returns the history by traffic day, each day's
        latest report only (a backfill re-reports a day in place, not at the end), oldest first. A row's
        ``task`` is the task whose requests it measures (NULL: the whole window)."""
        self.write(Append("drift_history", frame))
        return self.query(
            "SELECT * FROM drift_history QUALIFY row_number() OVER (PARTITION BY coalesce(day, run_id), task, metric ORDER BY reported_at DESC) = 1 "
            "ORDER BY coalesce(day, strftime(reported_at AT TIME ZONE 'UTC', '%Y-%m-%d')), reported_at"
        )


def _move_problem_tables(conn) -> int:
    """Move the rows of an older file's own problem tables (``gsm8k_problems``) into ``task_problems``, in one
    transaction, and leave a view of them under the old name; logged. Returns the rows moved (0: nothing to move)."""
    moved = 0
    for task, (table, view) in PROBLEM_VIEWS.items():
        kind = conn.execute("SELECT table_type FROM information_schema.tables WHERE table_name = ?", [table]).fetchone()
        if kind is None or kind[0] != "BASE TABLE":
            continue
        rows = conn.execute(f'SELECT * FROM "{table}"').df().to_dict(orient="records")
        frame = pd.DataFrame([gsm8k_task_problem(row, task).as_row() for row in rows])
        with _transaction(conn):
            if len(frame):
                conn.register("_moved_problems", frame)
                _apply(conn, Upsert(PROBLEMS, frame, "task"), "_moved_problems")
                conn.unregister("_moved_problems")
            conn.execute(f'DROP TABLE "{table}"')
            if len(frame):
                conn.execute(view)
        get_dagster_logger().warning(f"moved {len(frame)} rows of the table {table} into {PROBLEMS} (task {task!r}); {table} is now a view of them")
        moved += len(frame)
    return moved


@contextmanager
def _transaction(conn) -> Iterator:
    conn.execute("BEGIN TRANSACTION")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def snapshot_path(database: str | Path) -> Path:
    path = Path(database)
    return path.with_name(f"{path.stem}.snapshot{path.suffix}")


def with_task(traffic: pd.DataFrame) -> pd.DataFrame:
    """Traffic rows with the task each request was rendered with (:func:`rlvr.monitoring.traffic.request_task`): rows stored
    before rows named their task (older parts lack the column, or hold NULL) get it from their endpoint."""
    tasks = traffic["task"] if "task" in traffic else pd.Series(None, index=traffic.index, dtype=object)
    return traffic.assign(task=[request_task(t if isinstance(t, str) else None, e) for t, e in zip(tasks, traffic["endpoint"])])


def _day_end(day: str) -> pd.Timestamp:
    """The first instant after traffic day ``day`` (``YYYYMMDD``), UTC: every row logged that day is older."""
    return pd.Timestamp(day, tz="UTC") + pd.Timedelta(days=1)


def publish_snapshot(conn, database: Path) -> None:
    """Checkpoint the file (the write-ahead log into it) and copy it, through a temporary file renamed
    into place, to its snapshot: a session on the old snapshot keeps reading it until it reconnects."""
    if str(database) == ":memory:":
        return
    conn.execute("CHECKPOINT")
    target = snapshot_path(database)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(database, tmp)
    os.replace(tmp, target)


def shrink(conn, database: Path) -> None:
    """Rewrite the file without its free blocks (DuckDB keeps a dropped table's space): copied into a new
    file renamed over it while this connection still holds the old one, after a checkpoint (no write-ahead log)."""
    conn.execute("CHECKPOINT")
    (catalog,) = conn.execute("SELECT current_database()").fetchone()
    tmp = database.with_name(f".{database.name}.{os.getpid()}.shrink")
    tmp.unlink(missing_ok=True)
    conn.execute(f"ATTACH '{tmp}' AS shrunk")
    try:
        conn.execute(f'COPY FROM DATABASE "{catalog}" TO shrunk')
    finally:
        conn.execute("DETACH shrunk")
    os.replace(tmp, database)


LOCK_HOLDER = re.compile(r"Conflicting lock is held in (?P<program>.*?) \(PID (?P<pid>\d+)\)")


def lock_holder(error: str) -> str | None:
    """Who holds the file, from DuckDB's lock error: ``PID 123 (python -m ...)``; None for another error."""
    match = LOCK_HOLDER.search(error)
    if match is None:
        return None
    pid = match["pid"]
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = match["program"]
    return f"PID {pid} ({command[:200]})"


def _apply_one(conn, parts: PartTables | None, op: Write, index: int) -> None:
    """One write of a ``write`` call, inside its transaction: into a part table through ``parts``, else a DuckDB table."""
    if isinstance(op, Delete):
        parts.delete(op.table, op.where, op.params) if parts is not None else _delete(conn, op)
    elif not isinstance(op, Replace) and not len(op.frame):
        if op.table in SCHEMAS:
            parts.declare(op.table) if parts is not None else conn.execute(SCHEMAS[op.table])
    else:
        view = f"_incoming_{index}"
        conn.register(view, op.frame)
        try:
            if parts is None:
                _apply(conn, op, view)
            else:
                mode = "replace" if isinstance(op, Replace) else "upsert" if isinstance(op, Upsert) else "append"
                parts.apply(mode, op.table, view, index, getattr(op, "key", None))
        finally:
            conn.unregister(view)


def _delete(conn, op: Delete) -> None:
    if conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [op.table]).fetchone()[0]:
        conn.execute(f'DELETE FROM "{op.table}" WHERE {op.where}', list(op.params))


def _apply(conn, op: Write, view: str) -> None:
    table = f'"{op.table}"'
    if isinstance(op, Replace):
        conn.execute(f'CREATE OR REPLACE TABLE {table} AS SELECT * FROM "{view}"')
        return
    conn.execute(SCHEMAS.get(op.table) or f'CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM "{view}" LIMIT 0')
    for statement in MIGRATIONS.get(op.table, []):
        conn.execute(statement)
    if op.table not in SCHEMAS:  # a table made from frames takes the columns a later frame adds (earlier rows get NULL)
        existing = {name for (name,) in conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = ?", [op.table]).fetchall()}
        for name, dtype, *_ in conn.execute(f'DESCRIBE SELECT * FROM "{view}"').fetchall():
            if name not in existing:
                conn.execute(f'ALTER TABLE {table} ADD COLUMN "{name}" {dtype}')
    if isinstance(op, Upsert):
        conn.execute(f'DELETE FROM {table} WHERE "{op.key}" IN (SELECT DISTINCT "{op.key}" FROM "{view}")')
        conn.execute(f'INSERT INTO {table} BY NAME SELECT * FROM "{view}"')
    elif op.key is None:
        conn.execute(f'INSERT INTO {table} BY NAME SELECT * FROM "{view}"')
    else:
        conn.execute(f'INSERT INTO {table} BY NAME SELECT * FROM "{view}" WHERE "{op.key}" NOT IN (SELECT "{op.key}" FROM {table})')


def sql_session(snapshot: Path) -> None:
    """A SQL prompt on the snapshot, read-only: each statement (ended by ``;``) reads the latest published copy."""
    if not snapshot.is_file():
        raise SystemExit(f"{snapshot} does not exist yet: the next write to the warehouse publishes it")
    print(f"read-only SQL on {snapshot} (the latest committed data; Ctrl-D ends)")
    statement = ""
    while True:
        statement += input("sql> " if not statement else "...> ") + "\n"
        if statement.rstrip().endswith(";"):
            try:
                with duckdb.connect(str(snapshot), read_only=True) as conn:
                    result = conn.sql(statement)
                    print(result if result is not None else "ok")
            except duckdb.Error as err:
                print(f"error: {err}")
            statement = ""


def main() -> None:
    """``make sql``: a SQL session on the snapshot of the DuckDB file in argv[1] (default: $RLVR_HOME's);
    ``compact <db>``: merge the part tables' small parts; ``drop-partition <db> <table> <partition>``: retire one."""
    from rlvr.settings import Settings

    args = sys.argv[1:]
    if args[:1] == ["compact"] and len(args) == 2:
        print(f"{Warehouse(database=args[1]).compact()} parts merged away")
    elif args[:1] == ["drop-partition"] and len(args) == 4:
        print(f"{Warehouse(database=args[1]).drop_partition(args[2], args[3])} parts of {args[2]} partition {args[3]} dropped")
    else:
        try:
            sql_session(snapshot_path(args[0] if args else Settings.from_env().duckdb_path))
        except (EOFError, KeyboardInterrupt):
            print()


if __name__ == "__main__":
    main()
