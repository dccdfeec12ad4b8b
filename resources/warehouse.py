"""The shared DuckDB file: the tables assets read, and atomic writes (one transaction per ``write``).

Tables the assets write: ``gsm8k_problems`` (replaced), ``rollouts`` / ``rewards`` (upserted by
completion), ``eval_results`` (upserted by evaluation), ``serving_traffic`` and its per-file cursor
(appended / upserted together), ``drift_history`` (appended). Tables with declared columns are
created from :data:`SCHEMAS` (an older file gains later columns through :data:`MIGRATIONS`); the others from the
first frame written to them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Iterator, Mapping

import pandas as pd
from dagster import Failure
from dagster_duckdb import DuckDBResource

from rlvr.traffic import TRAFFIC_COLUMNS, TrafficBatch, day_prefix, traffic_row

SCHEMAS = {
    "serving_traffic": """CREATE TABLE IF NOT EXISTS serving_traffic (
  record_id VARCHAR PRIMARY KEY, "timestamp" TIMESTAMPTZ, request_id VARCHAR, endpoint VARCHAR, model_version VARCHAR,
  status INTEGER, latency_s DOUBLE, prompt VARCHAR, answer VARCHAR, vote_share DOUBLE, num_completions INTEGER,
  well_formed DOUBLE, completion_chars DOUBLE, completion_tokens DOUBLE, truncated DOUBLE, ground_truth VARCHAR,
  mean_reward DOUBLE, best_reward DOUBLE, source_file VARCHAR, source_offset BIGINT)""",
    "serving_traffic_cursor": 'CREATE TABLE IF NOT EXISTS serving_traffic_cursor (file VARCHAR PRIMARY KEY, "offset" BIGINT)',
    "drift_history": "CREATE TABLE IF NOT EXISTS drift_history (reported_at TIMESTAMPTZ, run_id VARCHAR, metric VARCHAR, "
    "value DOUBLE, threshold DOUBLE, drifted BOOLEAN, day VARCHAR)",
}
MIGRATIONS = {  # columns added since a table was first declared: an older database gains them (empty) on its next write
    "drift_history": ["ALTER TABLE drift_history ADD COLUMN IF NOT EXISTS day VARCHAR"],
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


Write = Replace | Upsert | Append


class Warehouse(DuckDBResource):
    """The DuckDB file of rlvr-ops: loaders of the tables assets read, and atomic writes."""

    # --- transactions and writes ---------------------------------------------------------------

    @contextmanager
    def get_connection(self) -> Iterator:
        """A connection to the file, closed when the block ends, also when it raises (so a failed
        write never keeps the single-writer file open)."""
        with super().get_connection() as conn:
            try:
                yield conn
            finally:
                conn.close()

    @contextmanager
    def transaction(self) -> Iterator:
        """A connection inside one transaction: committed when the block ends, rolled back if it raises."""
        with self.get_connection() as conn:
            conn.execute("BEGIN TRANSACTION")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def write(self, *writes: Write) -> None:
        """Apply every write in one transaction: all of them land, or none does. An empty upsert or
        append changes nothing and is skipped (an empty frame's columns have no types to compare)."""
        with self.transaction() as conn:
            for index, op in enumerate(w for w in writes if isinstance(w, Replace) or len(w.frame)):
                view = f"_incoming_{index}"
                conn.register(view, op.frame)
                try:
                    _apply(conn, op, view)
                finally:
                    conn.unregister(view)

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

    def row_count(self, table: str) -> int:
        return int(self.query(f'SELECT count(*) AS n FROM "{table}"')["n"].iloc[0]) if self.table_exists(table) else 0

    def problems(self, split: str, limit: int | None = None) -> list[dict]:
        """Rows of ``gsm8k_problems`` in ``split``, ordered by id, the first ``limit`` only when given."""
        if not self.table_exists("gsm8k_problems"):
            raise Failure(description="gsm8k_problems does not exist: materialize gsm8k_problems first")
        frame = self.query(f"SELECT * FROM gsm8k_problems WHERE split = ? ORDER BY problem_id {f'LIMIT {int(limit)}' if limit else ''}", [split])
        if frame.empty:
            raise Failure(description=f"gsm8k_problems has no rows in split {split!r}: materialize gsm8k_problems first")
        return frame.to_dict(orient="records")

    def reference_questions(self, size: int) -> list[str]:
        """``size`` train questions in a fixed pseudo-random order (by hash of the problem id): the drift reference."""
        return self.query("SELECT question FROM gsm8k_problems WHERE split = 'train' ORDER BY hash(problem_id) LIMIT ?", [size])["question"].tolist()

    def eval_results(self, eval_id: str) -> pd.DataFrame | None:
        """The stored per-problem rows of one evaluation (ordered by problem), or None."""
        if not self.table_exists("eval_results"):
            return None
        frame = self.query("SELECT * FROM eval_results WHERE eval_id = ? ORDER BY problem_id", [eval_id])
        return frame if len(frame) else None

    def latest_evaluation(self, policy_version: str | None) -> pd.DataFrame | None:
        """Per-problem rows of the most recent evaluation of ``policy_version`` (with ``completion_chars``), or None."""
        if policy_version is None or not self.table_exists("eval_results"):
            return None
        frame = self.query(
            "SELECT *, length(completion) AS completion_chars, well_formed::DOUBLE AS well_formed FROM eval_results "
            "WHERE policy_version = ? AND eval_id = "
            "(SELECT eval_id FROM eval_results WHERE policy_version = ? ORDER BY evaluated_at DESC LIMIT 1)",
            [policy_version, policy_version],
        )
        return frame if len(frame) else None

    def training_run_summary(self, run_id: str) -> dict:
        """Finish reasons of a training run's rollouts, its mean value per reward and its reward rows."""
        finish = self.query("SELECT finish_reason, count(*) AS n FROM rollouts WHERE run_id = ? GROUP BY 1", [run_id])
        rewards = self.query("SELECT reward_name, avg(value) AS mean, count(*) AS n FROM rewards WHERE run_id = ? GROUP BY 1", [run_id])
        return {
            "finish_reasons": {r: int(n) for r, n in zip(finish["finish_reason"], finish["n"])},
            "reward_means": {r: float(m) for r, m in zip(rewards["reward_name"], rewards["mean"])},
            "reward_rows": int(rewards["n"].sum()),
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

    def traffic_rows(self, day: str) -> int:
        """Rows stored of ``day`` (``YYYY-MM-DD``: the UTC day their log lines were written)."""
        if not self.table_exists("serving_traffic"):
            return 0
        return int(self.query("SELECT count(*) AS n FROM serving_traffic WHERE starts_with(source_file, ?)", [day_prefix(day)])["n"].iloc[0])

    def traffic_window(self, day: str, rows: int) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The last ``rows`` successful requests of ``day``, and the ``rows`` successful requests before
        them (of that day or earlier ones), each newest first."""
        if not self.table_exists("serving_traffic"):
            empty = pd.DataFrame(columns=list(TRAFFIC_COLUMNS))
            return empty, empty
        order = 'ORDER BY "timestamp" DESC, record_id DESC LIMIT ?'
        current = self.query(f"SELECT * FROM serving_traffic WHERE status = 200 AND starts_with(source_file, ?) {order}", [day_prefix(day), rows])
        if current.empty:
            return current, current
        next_day = day_prefix((date.fromisoformat(day) + timedelta(days=1)).isoformat())
        previous = self.query(
            f'SELECT * FROM serving_traffic WHERE status = 200 AND source_file < ? AND "timestamp" < ? {order}', [next_day, current["timestamp"].min(), rows]
        )
        return current, previous

    def append_drift_history(self, frame: pd.DataFrame) -> pd.DataFrame:
        """Append a report's rows to ``drift_history``; returns the history by traffic day, each day's
        latest report only (a backfill re-reports a day in place, not at the end), oldest first."""
        self.write(Append("drift_history", frame))
        return self.query(
            "SELECT * FROM drift_history QUALIFY row_number() OVER (PARTITION BY coalesce(day, run_id), metric ORDER BY reported_at DESC) = 1 "
            "ORDER BY coalesce(day, strftime(reported_at AT TIME ZONE 'UTC', '%Y-%m-%d')), reported_at"
        )


def _apply(conn, op: Write, view: str) -> None:
    table = f'"{op.table}"'
    if isinstance(op, Replace):
        conn.execute(f'CREATE OR REPLACE TABLE {table} AS SELECT * FROM "{view}"')
        return
    conn.execute(SCHEMAS.get(op.table) or f'CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM "{view}" LIMIT 0')
    for statement in MIGRATIONS.get(op.table, []):
        conn.execute(statement)
    if isinstance(op, Upsert):
        conn.execute(f'DELETE FROM {table} WHERE "{op.key}" IN (SELECT DISTINCT "{op.key}" FROM "{view}")')
        conn.execute(f'INSERT INTO {table} BY NAME SELECT * FROM "{view}"')
    elif op.key is None:
        conn.execute(f'INSERT INTO {table} BY NAME SELECT * FROM "{view}"')
    else:
        conn.execute(f'INSERT INTO {table} BY NAME SELECT * FROM "{view}" WHERE "{op.key}" NOT IN (SELECT "{op.key}" FROM {table})')
