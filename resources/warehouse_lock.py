"""Opening the single-writer warehouse file: a connection that finds it held by another process waits, up
to ``lock_wait_s``, then fails naming the holder (its PID and command) and where read-only SQL belongs."""

from __future__ import annotations

import re
import time
from pathlib import Path

import duckdb
from dagster import Failure, get_dagster_logger

from resources.warehouse_snapshot import snapshot_path


def connect_waiting(database: str, lock_wait_s: float, config: dict):
    """A read-write connection to ``database``, waiting up to ``lock_wait_s`` while another process holds it."""
    deadline, told = time.monotonic() + lock_wait_s, None
    while True:
        try:
            return duckdb.connect(database, read_only=False, config=config)
        except duckdb.IOException as err:
            holder = lock_holder(str(err))
            if holder is None:
                raise
            if time.monotonic() > deadline:
                raise Failure(
                    description=f"DuckDB file {database} is held by {holder} (waited {lock_wait_s:.0f} s): end that session; "
                    f"read-only SQL belongs on the snapshot {snapshot_path(database)} (make sql)"
                ) from None
            if holder != told:
                get_dagster_logger().warning(f"waiting for DuckDB file {database}: it is held by {holder}")
                told = holder
            time.sleep(0.25)


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
