"""Bringing a file of an older layout to the current one: a step run once, logged, before a connection is used.

Older files kept the part tables (rollouts, rewards, tool_calls, serving_traffic) inside the DuckDB file, and
GSM8k's problems in a table of their own (``gsm8k_problems``). :func:`upgrade` moves them (into Parquet parts,
into ``task_problems``), logging each move, and points the part views at the parts folder when the data
directory moved. A process runs it on its first connection to a file, and again only after another process
changed the file (:func:`known_current`); ``python -m resources.warehouse upgrade <db>`` runs it alone.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
from dagster import Failure, get_dagster_logger

from resources.part_keys import PART_TABLES, partition_sql
from resources.table_parts import CATALOG, PartTables, fsync_path, literal, partition_dir
from resources.warehouse_tables import PROBLEM_VIEWS, PROBLEMS
from resources.warehouse_writes import Upsert, apply_to_table, transaction
from rlvr.tasks.gsm8k import gsm8k_task_problem

PROBLEM_COLUMNS = ("problem_id", "split", "question", "solution", "answer_text", "answer_value", "num_steps", "source", "content_hash")
_CURRENT: dict[str, tuple[int, int, int]] = {}  # file -> (inode, size, mtime) when this process last closed it, current


def known_current(database: str) -> bool:
    """Whether this process left ``database`` in the current layout and nothing changed it since."""
    return _CURRENT.get(os.path.abspath(database)) == _identity(database)


def remember(database: str) -> None:
    """Note ``database`` as current, as it is now (after this process closed its connection)."""
    identity = _identity(database)
    if identity is not None:
        _CURRENT[os.path.abspath(database)] = identity


def _identity(database: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(database)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def upgrade(conn, database: Path, parts: PartTables) -> list[str]:
    """Create the part catalog; move an older file's part tables into parts and its problem tables into
    ``task_problems``, each in one transaction, logged; point the views at ``parts.root``. Returns what moved
    (empty: the file was current). After a move the file is rewritten smaller: reconnect."""
    tables = {name for (name,) in conn.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND NOT temporary").fetchall()}
    if "_part_root" not in tables:
        for statement in CATALOG:
            conn.execute(statement)
    moved = [_logged(database, move_into_parts(parts, table, database)) for table in PART_TABLES if table in tables]
    if conn.execute("SELECT path FROM _part_root").fetchall() != [(str(parts.root),)]:
        with transaction(conn):
            conn.execute("DELETE FROM _part_root")
            conn.execute("INSERT INTO _part_root VALUES (?)", [str(parts.root)])
            for (table,) in conn.execute("SELECT DISTINCT table_name FROM _part_columns").fetchall():
                parts.refresh_view(table)
    moved += [_logged(database, move_problem_table(conn, task, table, view)) for task, (table, view) in PROBLEM_VIEWS.items() if table in tables]
    if moved:
        shrink(conn, database)  # the moved tables' space: so the snapshot copies the small file only
    return moved


def _logged(database: Path, moved: str) -> str:
    get_dagster_logger().warning(f"{database}: {moved}")
    return moved


def move_into_parts(parts: PartTables, table: str, database: Path) -> str:
    """One transaction: the DuckDB table's rows as parts (one per partition), then the table dropped."""
    conn = parts.conn
    conn.execute("BEGIN TRANSACTION")
    staging = parts.root / f".staging-{table}-{uuid.uuid4().hex}"
    try:
        for statement in parts.migrations.get(table, []):
            conn.execute(statement)
        columns = [(n, t) for n, t, *_ in conn.execute(f'DESCRIBE "{table}"').fetchall()]
        parts.set_columns(table, columns)
        partition = partition_sql(table, {n for n, _ in columns})
        keyed = f"md5({partition})"  # a safe folder name for any partition value
        values = conn.execute(f'SELECT DISTINCT {partition}, {keyed} FROM "{table}" ORDER BY 1').fetchall()
        staging.mkdir(parents=True)
        with bounded_memory(conn):  # one streamed pass (no sort of the whole table): a 10 GB table fits
            conn.execute(
                f'COPY (SELECT *, {keyed} AS __key FROM "{table}") TO {literal(str(staging))} (FORMAT parquet, COMPRESSION zstd, PARTITION_BY (__key))'
            )
        rows = 0
        for value, key in values:
            for piece in sorted((staging / f"__key={key}").glob("*.parquet")):
                folder = parts.root / table / partition_dir(value)
                folder.mkdir(parents=True, exist_ok=True)
                final = folder / f"{uuid.uuid4().hex}.parquet"
                fsync_path(piece)
                os.replace(piece, final)
                parts.written.append(final)
                (n,) = conn.execute(f"SELECT count(*) FROM read_parquet({literal(str(final))})").fetchone()
                rows += n
                parts.add(table, value, final, n)
        conn.execute(f'DROP TABLE "{table}"')
        parts.refresh_view(table)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        parts.discard()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    parts.written.clear()
    return f"moved table {table} ({rows} rows, {len(values)} partitions) into Parquet parts under {parts.root / table} (once, for the new layout)"


def move_problem_table(conn, task: str, table: str, view: str) -> str:
    """One transaction: the rows of an older file's problem table of ``task`` into ``task_problems``, then
    the table dropped and its name kept as a view of them."""
    stored = conn.execute(f'SELECT * FROM "{table}"').df()
    missing = sorted(set(PROBLEM_COLUMNS) - set(stored.columns))
    if missing:
        raise Failure(description=f"{table}: the table of an older layout lacks the columns {missing}: restore it from a backup, or drop it")
    rows = stored.to_dict(orient="records")
    frame = pd.DataFrame([gsm8k_task_problem(row, task).as_row() for row in rows])
    with transaction(conn):
        if len(frame):
            conn.register("_moved_problems", frame)
            apply_to_table(conn, Upsert(PROBLEMS, frame, "task"), "_moved_problems")
            conn.unregister("_moved_problems")
        conn.execute(f'DROP TABLE "{table}"')
        if len(frame):
            conn.execute(view)
    return f"moved {len(frame)} rows of the table {table} into {PROBLEMS} (task {task!r}); {table} is now a view of them"


@contextmanager
def bounded_memory(conn, share: float = 0.25):
    """Within the block, DuckDB holds at most ``share`` of the machine's memory and keeps no insertion order
    (so a big copy streams instead of buffering); the settings are restored after."""
    limit, order = conn.execute("SELECT current_setting('memory_limit'), current_setting('preserve_insertion_order')").fetchone()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    conn.execute(f"SET memory_limit = '{int(total * share) // 2**20}MiB'")
    conn.execute("SET preserve_insertion_order = false")
    try:
        yield
    finally:
        conn.execute(f"SET memory_limit = {literal(limit)}")
        conn.execute(f"SET preserve_insertion_order = {str(order).lower()}")


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
