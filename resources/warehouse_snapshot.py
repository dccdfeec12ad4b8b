"""The read-only copy of the warehouse file SQL sessions open (``make sql``): published after every committed
write, so readers never hold the single-writer file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import duckdb


def snapshot_path(database: str | Path) -> Path:
    """The read-only copy of a DuckDB file: ``rlvr.duckdb`` -> ``rlvr.snapshot.duckdb``."""
    path = Path(database)
    return path.with_name(f"{path.stem}.snapshot{path.suffix}")


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
