"""Writing tables to the shared DuckDB file atomically."""

from __future__ import annotations

from typing import Mapping

import pandas as pd
from dagster_duckdb import DuckDBResource


def replace_tables(duckdb: DuckDBResource, tables: Mapping[str, pd.DataFrame]) -> None:
    """Replace each named table by its DataFrame in one transaction: all swap in, or none do."""
    with duckdb.get_connection() as conn:
        conn.execute("BEGIN TRANSACTION")
        try:
            for name, frame in tables.items():
                view = f"_incoming_{name}"
                conn.register(view, frame)
                conn.execute(f'CREATE OR REPLACE TABLE "{name}" AS SELECT * FROM "{view}"')
                conn.unregister(view)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def replace_rows(duckdb: DuckDBResource, table: str, frame: pd.DataFrame, key: str) -> None:
    """Upsert by ``key``: delete the rows whose ``key`` values appear in ``frame``, insert ``frame``; one transaction.

    Creates the table from ``frame`` when it does not exist yet. Re-running with the same keys
    replaces rows instead of duplicating them.
    """
    with duckdb.get_connection() as conn:
        conn.register("_incoming", frame)
        conn.execute("BEGIN TRANSACTION")
        try:
            conn.execute(f'CREATE TABLE IF NOT EXISTS "{table}" AS SELECT * FROM _incoming LIMIT 0')
            conn.execute(f'DELETE FROM "{table}" WHERE "{key}" IN (SELECT DISTINCT "{key}" FROM _incoming)')
            conn.execute(f'INSERT INTO "{table}" BY NAME SELECT * FROM _incoming')
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        finally:
            conn.unregister("_incoming")
