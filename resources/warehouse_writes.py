"""The writes a ``Warehouse.write`` applies in one transaction, and how each lands: into a DuckDB table here,
into a part table through :class:`resources.table_parts.PartTables`."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import pandas as pd

from resources.table_parts import PartTables
from resources.warehouse_tables import MIGRATIONS, SCHEMAS


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


@contextmanager
def transaction(conn) -> Iterator:
    """``BEGIN`` ... ``COMMIT`` around the block; ``ROLLBACK`` when it raises."""
    conn.execute("BEGIN TRANSACTION")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def apply_write(conn, parts: PartTables | None, op: Write, index: int) -> None:
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
                apply_to_table(conn, op, view)
            else:
                mode = "replace" if isinstance(op, Replace) else "upsert" if isinstance(op, Upsert) else "append"
                parts.apply(mode, op.table, view, index, getattr(op, "key", None))
        finally:
            conn.unregister(view)


def _delete(conn, op: Delete) -> None:
    if conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [op.table]).fetchone()[0]:
        conn.execute(f'DELETE FROM "{op.table}" WHERE {op.where}', list(op.params))


def apply_to_table(conn, op: Write, view: str) -> None:
    """One upsert, append or replace of the frame registered as ``view`` into a DuckDB table (created, migrated, widened)."""
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
