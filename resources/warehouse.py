"""The shared DuckDB file: the ``Warehouse`` resource, its atomic writes (one transaction per ``write``) and its CLI.

Its parts, one job each: the declared tables (:mod:`resources.warehouse_tables`), how a write lands
(:mod:`resources.warehouse_writes`), the big tables as Parquet parts (:mod:`resources.table_parts`, keyed by
:mod:`resources.part_keys`, merged by :mod:`resources.part_compaction`), waiting on a held file
(:mod:`resources.warehouse_lock`), the read-only snapshot for SQL sessions (:mod:`resources.warehouse_snapshot`),
an older file's one-time move to this layout (:mod:`resources.warehouse_layout`), and the readers of problems,
runs and traffic (``warehouse_problems``, ``warehouse_runs``, ``warehouse_traffic``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import pandas as pd
from dagster_duckdb import DuckDBResource
from pydantic import Field

from resources import warehouse_layout
from resources.part_compaction import compact, merge_tiers
from resources.part_keys import PART_TABLES
from resources.table_parts import PartTables, parts_root
from resources.warehouse_lock import connect_waiting
from resources.warehouse_problems import ProblemReads
from resources.warehouse_runs import RunReads
from resources.warehouse_snapshot import publish_snapshot, snapshot_path, sql_session
from resources.warehouse_tables import MIGRATIONS, PROBLEM_VIEWS, PROBLEMS, SCHEMAS, WRITER_POOL
from resources.warehouse_traffic import TrafficReads
from resources.warehouse_writes import Append, Delete, Replace, Upsert, Write, apply_write, transaction

__all__ = [  # the names other modules import from here
    "MIGRATIONS",
    "PROBLEMS",
    "PROBLEM_VIEWS",
    "SCHEMAS",
    "WRITER_POOL",
    "Append",
    "Delete",
    "Replace",
    "Upsert",
    "Warehouse",
    "Write",
    "snapshot_path",
]


class Warehouse(ProblemReads, RunReads, TrafficReads, DuckDBResource):
    """The DuckDB file of rlvr-ops: loaders of the tables assets read, and atomic writes."""

    lock_wait_s: float = Field(default=900.0, description="how long a connection waits while another process holds the file, then fails naming it")
    publish_snapshot: bool = Field(default=True, description="after every committed write, publish the read-only copy SQL sessions open")
    part_grace_s: float = Field(
        default=3600.0, description="how long a Parquet part a write or compaction replaced is kept for readers of older snapshots, then deleted"
    )

    # --- connections ---------------------------------------------------------------------------

    @property
    def snapshot_path(self) -> Path:
        """The read-only copy published after each committed write: ``rlvr.duckdb`` -> ``rlvr.snapshot.duckdb``."""
        return snapshot_path(self.database)

    @property
    def parts_root(self) -> Path:
        """Where the part tables' Parquet files live: ``rlvr.duckdb`` -> ``rlvr.parts/``."""
        return parts_root(self.database)

    @contextmanager
    def get_connection(self) -> Iterator:
        """A connection to the file, closed when the block ends, also when it raises (so a failed
        write never keeps the single-writer file open). While another process holds the file it
        waits, up to ``lock_wait_s``, saying which process that is. A process's first connection to
        the file (and its first after another process changed it) runs :meth:`upgrade` first."""
        conn = self._connect()
        try:
            if self.database != ":memory:" and not warehouse_layout.known_current(self.database):
                conn, _ = self._upgrade(conn)
            yield conn
        finally:
            conn.close()
        warehouse_layout.remember(self.database)

    def upgrade(self) -> list[str]:
        """Bring a file of an older layout to the current one (:mod:`resources.warehouse_layout`), each move
        logged; returns what moved (empty: it was current)."""
        if self.database == ":memory:":
            return []
        conn = self._connect()
        try:
            conn, moved = self._upgrade(conn)
        finally:
            conn.close()
        warehouse_layout.remember(self.database)
        return moved

    def _upgrade(self, conn) -> tuple:
        moved = warehouse_layout.upgrade(conn, Path(self.database), self._parts(conn))
        if moved:  # the file was rewritten without the moved tables' space
            conn.close()
            conn = self._connect()
            if self.publish_snapshot:
                publish_snapshot(conn, Path(self.database))
        return conn, moved

    def _connect(self):
        return connect_waiting(self.database, self.lock_wait_s, {"custom_user_agent": "dagster", **self.connection_config})

    def _parts(self, conn) -> PartTables | None:
        if self.database == ":memory:":  # no folder for parts: the part tables are DuckDB tables
            return None
        return PartTables(conn, self.parts_root, SCHEMAS, MIGRATIONS, self.part_grace_s)

    # --- transactions and writes ---------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator:
        """A connection inside one transaction: committed when the block ends, rolled back if it raises."""
        with self.get_connection() as conn:
            with transaction(conn):
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
                with transaction(conn):
                    for index, op in enumerate(writes):
                        apply_write(conn, parts if op.table in PART_TABLES else None, op, index)
                    if parts is not None:
                        merge_tiers(parts)
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
        """Merge each partition's small parts into one (:func:`resources.part_compaction.compact`); returns the parts merged away."""
        return compact(self, table)

    def drop_partition(self, table: str, partition: str) -> int:
        """Retire every part of one partition (a run's rows, a traffic day's), also unreadable ones; returns the parts dropped."""
        with self.get_connection() as conn:
            parts = self._parts(conn)
            with transaction(conn):
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

    def row_count(self, table: str) -> int:
        return int(self.query(f'SELECT count(*) AS n FROM "{table}"')["n"].iloc[0]) if self.table_exists(table) else 0


def main() -> None:
    """``make sql``: a SQL session on the snapshot of the DuckDB file in argv[1] (default: $RLVR_HOME's);
    ``compact <db>``: merge the part tables' small parts; ``drop-partition <db> <table> <partition>``: retire one;
    ``upgrade <db>``: bring a file of an older layout to the current one now."""
    from rlvr.settings import Settings

    args = sys.argv[1:]
    if args[:1] == ["compact"] and len(args) == 2:
        print(f"{Warehouse(database=args[1]).compact()} parts merged away")
    elif args[:1] == ["drop-partition"] and len(args) == 4:
        print(f"{Warehouse(database=args[1]).drop_partition(args[2], args[3])} parts of {args[2]} partition {args[3]} dropped")
    elif args[:1] == ["upgrade"] and len(args) == 2:
        print("\n".join(Warehouse(database=args[1]).upgrade()) or f"{args[1]} is in the current layout")
    else:
        try:
            sql_session(snapshot_path(args[0] if args else Settings.from_env().duckdb_path))
        except (EOFError, KeyboardInterrupt):
            print()


if __name__ == "__main__":
    main()
