"""The warehouse's serving traffic: ingestion with its cursor, retention by day, a day's windows for drift,
and the drift history. A row's day is its log file's (:mod:`resources.part_keys`)."""

from __future__ import annotations

from datetime import date, timedelta

import pandas as pd

from resources.part_keys import NO_PARTITION, traffic_partition, traffic_partition_end
from resources.warehouse_writes import Append, Delete, Upsert
from rlvr.monitoring.traffic import TRAFFIC_COLUMNS, TrafficBatch, day_prefix, request_task, traffic_row


class TrafficReads:
    """Part of :class:`resources.warehouse.Warehouse`: serving traffic in, traffic days and windows out."""

    def traffic_days(self) -> list[str]:
        """The traffic partitions stored (``YYYYMMDD``, and ``_`` for rows of other log names), newest first
        (none in memory: there the table is one DuckDB table)."""
        with self.get_connection() as conn:
            parts = self._parts(conn)
            return [] if parts is None else parts.partitions("serving_traffic")[::-1]

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
        counted = self.query_partitions(
            "serving_traffic", [traffic_partition(day)], "SELECT count(*) AS n FROM {rows} WHERE starts_with(source_file, ?)", [prefix]
        )
        return int(counted["n"].iloc[0])

    def traffic_window(self, day: str, rows: int) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The last ``rows`` successful requests of ``day``, and the ``rows`` successful requests before
        them (of that day or earlier ones), each newest first."""
        if not self.table_exists("serving_traffic"):
            empty = pd.DataFrame(columns=list(TRAFFIC_COLUMNS))
            return empty, empty
        order = 'ORDER BY "timestamp" DESC, record_id DESC LIMIT ?'
        prefix, partition = day_prefix(day), traffic_partition(day)
        current = self.query_partitions(
            "serving_traffic", [partition], f"SELECT * FROM {{rows}} WHERE status = 200 AND starts_with(source_file, ?) {order}", [prefix, rows]
        )
        if current.empty:
            return with_task(current), with_task(current)
        next_day = day_prefix((date.fromisoformat(day) + timedelta(days=1)).isoformat())
        sql = f'SELECT * FROM {{rows}} WHERE status = 200 AND source_file < ? AND "timestamp" < ? {order}'
        earlier = [d for d in self.traffic_days() if d != NO_PARTITION and d <= partition]
        window = 1
        while True:  # the newest days first, doubling: a day's rows were logged that day, so older days cannot beat a full window
            previous = self.query_partitions("serving_traffic", earlier[:window] + [NO_PARTITION], sql, [next_day, current["timestamp"].min(), rows])
            if window >= len(earlier) or (len(previous) == rows and previous["timestamp"].min() >= traffic_partition_end(earlier[window])):
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


def with_task(traffic: pd.DataFrame) -> pd.DataFrame:
    """Traffic rows with the task each request was rendered with (:func:`rlvr.monitoring.traffic.request_task`): rows stored
    before rows named their task (older parts lack the column, or hold NULL) get it from their endpoint."""
    tasks = traffic["task"] if "task" in traffic else pd.Series(None, index=traffic.index, dtype=object)
    return traffic.assign(task=[request_task(t if isinstance(t, str) else None, e) for t, e in zip(tasks, traffic["endpoint"])])
