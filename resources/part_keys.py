"""The partition of a part table's row, defined once: a training run's id, or a traffic row's day.

A traffic row's day is the UTC day its log file was written, named in the file's name
(:func:`rlvr.monitoring.traffic.day_prefix`): the partition ``YYYYMMDD``, ``_`` for other names.
"""

from __future__ import annotations

import pandas as pd

from rlvr.monitoring.traffic import FILE_PREFIX, day_prefix

PART_TABLES = {  # table -> the column naming a row's partition: a training run's rows, or a traffic day's
    "rollouts": "run_id",
    "rewards": "run_id",
    "tool_calls": "run_id",
    "serving_traffic": "source_file",
}
NO_PARTITION = "_"  # rows without a run id, or traffic rows of a file not named by day


def partition_sql(table: str, columns: set[str]) -> str:
    """The SQL of a row's partition: its run id, or its traffic file's day (``YYYYMMDD``); ``_`` without one."""
    column = PART_TABLES[table]
    if column not in columns:
        return f"'{NO_PARTITION}'"
    if column == "source_file":
        return rf"""coalesce(nullif(regexp_extract(source_file, '^{FILE_PREFIX}(\d{{8}})T', 1), ''), '{NO_PARTITION}')"""
    return f"coalesce(CAST(\"{column}\" AS VARCHAR), '{NO_PARTITION}')"


def traffic_partition(day: str) -> str:
    """The partition of traffic day ``day`` (``YYYY-MM-DD``): ``YYYYMMDD``, as its log files' names hold it."""
    return day_prefix(day)[len(FILE_PREFIX) : -1]


def traffic_partition_end(partition: str) -> pd.Timestamp:
    """The first instant after the traffic day of ``partition`` (``YYYYMMDD``), UTC: every row logged that day is older."""
    return pd.Timestamp(partition, tz="UTC") + pd.Timedelta(days=1)
