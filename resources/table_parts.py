"""The big, growing tables (:data:`resources.part_keys.PART_TABLES`) as immutable Parquet parts beside the DuckDB file.

A part is written under a hidden temporary name, fsynced and renamed into ``<db>.parts/<table>/<partition>/``;
it is seen only once the catalog table ``_part_files`` lists it, a row committed in the same DuckDB transaction
as the write's other changes. Each part table is a view over its listed files, kept in the DuckDB file (so in
its snapshot too). Parts never change: an upsert of stored keys rewrites the parts of that partition holding
them, and retired files are deleted ``grace_s`` later, so a reader on an older snapshot keeps its files.
Merging parts: :mod:`resources.part_compaction`; a row's partition: :mod:`resources.part_keys`.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb
from dagster import Failure

from resources.part_keys import partition_sql

CATALOG = [
    "CREATE TABLE IF NOT EXISTS _part_files (table_name VARCHAR, partition VARCHAR, path VARCHAR, rows BIGINT, bytes BIGINT, "
    "added_at TIMESTAMPTZ, retired_at TIMESTAMPTZ, width INTEGER, bucket INTEGER)",
    "CREATE TABLE IF NOT EXISTS _part_columns (table_name VARCHAR, position INTEGER, column_name VARCHAR, data_type VARCHAR)",
    "CREATE TABLE IF NOT EXISTS _part_root (path VARCHAR)",
]
BUCKETS = 16  # each part table's view is a union of this many views, each over the parts of its share of partitions


def parts_root(database: str | Path) -> Path:
    """Where a DuckDB file's parts live: ``rlvr.duckdb`` -> ``rlvr.parts/``."""
    path = Path(database)
    return path.with_name(f"{path.stem}.parts")


def bucket(partition: str) -> int:
    """Which of a table's bucket views lists a partition's parts: a write re-creates that one only."""
    return int(hashlib.sha1(partition.encode()).hexdigest()[:8], 16) % BUCKETS


def bucket_view(table: str, index: int) -> str:
    return f"_{table}_parts_{index:02d}"


@functools.lru_cache(maxsize=256)
def migrated_columns(table: str, columns: tuple, declared: str | None, migrations: tuple) -> list[tuple[str, str]]:
    """A table's columns after its later migrations: its declared schema (or ``columns``), migrated in memory."""
    with duckdb.connect() as memory:
        memory.execute(declared or f'CREATE TABLE "{table}" (' + ", ".join(f'"{n}" {t}' for n, t in columns) + ")")
        for statement in migrations:
            memory.execute(statement)
        return [(name, dtype) for name, dtype, *_ in memory.execute(f'DESCRIBE "{table}"').fetchall()]


def literal(text: str) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def partition_dir(partition: str) -> str:
    """A folder name for a partition: its readable characters, and a hash so two never share one."""
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", partition)[:80]
    return f"{readable}-{hashlib.sha1(partition.encode()).hexdigest()[:8]}"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_disk_full(err: BaseException) -> bool:
    return getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)


class PartTables:
    """The part tables of one open connection: writes inside its transaction, views, retired files.

    ``written`` lists the files this connection's current write added: removed if it rolls back."""

    def __init__(self, conn, root: Path, schemas: dict, migrations: dict, grace_s: float):
        self.conn, self.root, self.schemas, self.migrations, self.grace_s = conn, root, schemas, migrations, grace_s
        self.written: list[Path] = []
        self.touched: set[tuple[str, str]] = set()
        self.reshaped: set[str] = set()  # tables whose columns changed: every view of theirs is re-created
        self._columns: dict[str, list[tuple[str, str]]] = {}

    # --- the catalog ----------------------------------------------------------------------------

    def columns(self, table: str) -> list[tuple[str, str]]:
        if table not in self._columns:
            rows = self.conn.execute("SELECT column_name, data_type FROM _part_columns WHERE table_name = ? ORDER BY position", [table]).fetchall()
            self._columns[table] = [(name, dtype) for name, dtype in rows]
        return self._columns[table]

    def set_columns(self, table: str, columns: list[tuple[str, str]]) -> None:
        self.conn.execute("DELETE FROM _part_columns WHERE table_name = ?", [table])
        self.conn.executemany("INSERT INTO _part_columns VALUES (?, ?, ?, ?)", [[table, i, n, t] for i, (n, t) in enumerate(columns)])
        self._columns[table] = list(columns)
        self.reshaped.add(table)

    def live(self, table: str, partition: str | None = None) -> list[tuple[str, str, int]]:
        """(path, partition, bytes) of the parts a reader of ``table`` sees, oldest first."""
        where, params = ("AND partition = ?", [table, partition]) if partition is not None else ("", [table])
        return self.conn.execute(
            f"SELECT path, partition, bytes FROM _part_files WHERE table_name = ? AND retired_at IS NULL {where} ORDER BY added_at, path", params
        ).fetchall()

    def file(self, path: str) -> Path:
        return self.root / path

    def partitions(self, table: str) -> list[str]:
        """The partitions of ``table`` with live parts, sorted."""
        sql = "SELECT DISTINCT partition FROM _part_files WHERE table_name = ? AND retired_at IS NULL ORDER BY 1"
        return [p for (p,) in self.conn.execute(sql, [table]).fetchall()]

    def partition_relation(self, table: str, partitions: list[str]) -> str:
        """SQL of the rows of ``table`` in ``partitions`` only: their parts are read, not every part's footer."""
        sql = "SELECT path FROM _part_files WHERE table_name = ? AND retired_at IS NULL AND partition IN (SELECT unnest(?::VARCHAR[]))"
        return self.relation(table, [p for (p,) in self.conn.execute(sql, [table, partitions]).fetchall()])

    def relation(self, table: str, paths: list[str]) -> str:
        """SQL of the rows of ``paths`` with every column of ``table`` (NULL where an older part lacks one).
        Columns are only ever added, so parts of one width share their columns: one ``read_parquet`` per
        width, whose binding reads one file's footer, not every file's."""
        columns = self.columns(table)
        sql = "SELECT " + ", ".join(f'CAST(NULL AS {dtype}) AS "{name}"' for name, dtype in columns) + " WHERE false"
        if not paths:
            return sql
        widths = self.conn.execute(
            "SELECT width, list(path ORDER BY added_at, path) FROM _part_files WHERE path IN (SELECT unnest(?::VARCHAR[])) GROUP BY 1 ORDER BY 1", [paths]
        ).fetchall()
        for _, group in widths:
            root = str(self.root)  # joined as strings: a view over thousands of parts is built at every write
            sql += f" UNION ALL BY NAME SELECT * FROM read_parquet([{', '.join(literal(f'{root}/{p}') for p in group)}])"
        return sql

    def refresh_view(self, table: str, partitions: set[str] | None = None) -> None:
        """Point ``table``'s views at its live parts: the bucket views of ``partitions`` only, or (None) every
        bucket view and the table's view, their union."""
        indexes = range(BUCKETS) if partitions is None else sorted({bucket(p) for p in partitions})
        for index in indexes:
            paths = [
                p
                for (p,) in self.conn.execute(
                    "SELECT path FROM _part_files WHERE table_name = ? AND bucket = ? AND retired_at IS NULL", [table, index]
                ).fetchall()
            ]
            try:
                self.conn.execute(f'CREATE OR REPLACE VIEW "{bucket_view(table, index)}" AS {self.relation(table, paths)}')
            except (duckdb.IOException, duckdb.InvalidInputException) as err:  # a part's footer unreadable: name it and its partition
                named = [(p, part) for p, part, _ in self.live(table) if str(self.file(p)) in str(err)]
                raise self.broken(table, named[0][1] if named else "<partition>", f"a part is unreadable ({err})") from err
        if partitions is None:
            union = " UNION ALL ".join(f'SELECT * FROM "{bucket_view(table, i)}"' for i in range(BUCKETS))
            self.conn.execute(f'CREATE OR REPLACE VIEW "{table}" AS {union}')

    # --- writing parts --------------------------------------------------------------------------

    def write_part(self, table: str, partition: str, sql: str) -> int:
        """Write the rows of ``sql`` as a new part of ``partition`` (none when it has no rows); returns the rows."""
        final, rows = write_parquet(self.conn, sql, self.root / table / partition_dir(partition), table)
        if final is not None:
            self.written.append(final)
            self.add(table, partition, final, rows)
        return rows

    def add(self, table: str, partition: str, final: Path, rows: int, width: int | None = None) -> None:
        """List a written file as a live part; ``width``: its columns (default: all the table's now)."""
        self.conn.execute(
            "INSERT INTO _part_files VALUES (?, ?, ?, ?, ?, now(), NULL, ?, ?)",
            [table, partition, str(final.relative_to(self.root)), rows, final.stat().st_size, width or len(self.columns(table)), bucket(partition)],
        )
        self.touched.add((table, partition))

    def retire(self, paths: list[str]) -> None:
        if paths:
            self.conn.execute("UPDATE _part_files SET retired_at = now() WHERE path IN (SELECT unnest(?::VARCHAR[]))", [paths])

    def check(self, table: str, partition: str) -> list[str]:
        """The live parts of a partition, each found whole (its size as written, Parquet's end marker), else a
        Failure naming the file and how to repair."""
        paths = []
        for path, _, size in self.live(table, partition):
            file = self.file(path)
            try:
                whole = file.stat().st_size == size and _tail(file) == b"PAR1"
            except OSError:
                whole = False
            if not whole:
                raise self.broken(table, partition, f"{file} is missing, truncated or not Parquet")
            paths.append(path)
        return paths

    def broken(self, table: str, partition: str, what: str) -> Failure:
        return Failure(
            description=f"{table}: {what}. Repair: drop that partition (`python -m resources.warehouse drop-partition <db> {table} {partition}`) "
            f"and re-execute the run (or day) that wrote it; nothing was written"
        )

    def read(self, table: str, partition: str, sql: str, params: list | None = None) -> list[tuple]:
        try:
            return self.conn.execute(sql, params or []).fetchall()
        except (duckdb.IOException, duckdb.InvalidInputException) as err:
            raise self.broken(table, partition, f"a part is unreadable ({err})") from err

    # --- the writes -----------------------------------------------------------------------------

    def incoming(self, table: str, view: str, index: int, replace: bool) -> str:
        """A temporary table of the frame ``view`` in the table's columns (new columns added), with its partitions."""
        frame_columns = [(name, dtype) for name, dtype, *_ in self.conn.execute(f'DESCRIBE SELECT * FROM "{view}"').fetchall()]
        stored = [] if replace else self.columns(table)
        if not stored:
            stored = self.initial_columns(table, frame_columns, declared=not replace)
        elif table in self.migrations:  # a table stored before a later migration gains its columns (empty)
            stored = migrated_columns(table, tuple(stored), None, tuple(self.migrations[table]))
        known = {name for name, _ in stored}
        columns = stored + [(n, t) for n, t in frame_columns if n not in known]
        if columns != self.columns(table):
            self.set_columns(table, columns)
        present = {name for name, _ in frame_columns}
        typed = ", ".join(f'CAST("{n}" AS {t}) AS "{n}"' if n in present else f'CAST(NULL AS {t}) AS "{n}"' for n, t in columns)
        name = f"_incoming_parts_{index}"
        self.conn.execute(
            f'CREATE OR REPLACE TEMP TABLE "{name}" AS SELECT *, {partition_sql(table, {n for n, _ in columns})} AS __partition '
            f'FROM (SELECT {typed} FROM "{view}")'
        )
        return name

    def initial_columns(self, table: str, frame_columns: list[tuple[str, str]], declared: bool) -> list[tuple[str, str]]:
        """A new table's columns: its declared schema (or the frame's), with its later migrations."""
        schema = self.schemas.get(table) if declared else None
        return migrated_columns(table, tuple(frame_columns), schema, tuple(self.migrations.get(table, [])))

    def declare(self, table: str) -> None:
        """An empty write to a declared table: create it (its view), empty."""
        if not self.columns(table):
            self.set_columns(table, self.initial_columns(table, [], declared=True))
            self.refresh_view(table)

    def apply(self, mode: str, table: str, view: str, index: int, key: str | None = None) -> None:
        """``mode`` (replace, upsert or append; see resources.warehouse) the frame registered as ``view`` into ``table``."""
        if mode == "replace":
            self.retire([p for p, _, _ in self.live(table)])
        incoming = self.incoming(table, view, index, replace=mode == "replace")
        for (partition,) in self.conn.execute(f'SELECT DISTINCT __partition FROM "{incoming}" ORDER BY 1').fetchall():
            rows = f'SELECT * EXCLUDE (__partition) FROM "{incoming}" WHERE __partition = {literal(partition)}'
            paths = self.check(table, partition)
            if key is not None and paths:
                keys = f'SELECT "{key}" FROM "{incoming}" WHERE __partition = {literal(partition)}'
                stored = f"SELECT * FROM read_parquet([{', '.join(literal(str(self.file(p))) for p in paths)}], union_by_name = true, filename = true)"
                hits = self.read(table, partition, f'SELECT filename, count(*) FROM ({stored}) WHERE "{key}" IN ({keys}) GROUP BY 1')
                if hits and mode == "upsert":  # the parts holding replaced keys are rewritten without them
                    for filename, _ in hits:
                        path = str(Path(filename).relative_to(self.root))
                        self.write_part(table, partition, f'SELECT * FROM ({self.relation(table, [path])}) WHERE ("{key}" IN ({keys})) IS NOT TRUE')
                        self.retire([path])
                elif hits:  # append: only the rows whose key is not stored yet
                    rows += f' AND "{key}" NOT IN (SELECT "{key}" FROM ({stored}) WHERE "{key}" IN ({keys}))'
            self.write_part(table, partition, rows)
        self.conn.execute(f'DROP TABLE "{incoming}"')

    def delete(self, table: str, where: str, params: tuple) -> None:
        """Delete the rows where ``where`` holds: parts all of whose rows match are retired, parts with some are rewritten."""
        for path, partition, _ in self.live(table):
            relation = self.relation(table, [path])
            matched, total = self.read(table, partition, f"SELECT count(*) FILTER (WHERE {where}), count(*) FROM ({relation})", list(params))[0]
            if matched:
                if matched < total:
                    self.conn.execute(f'CREATE OR REPLACE TEMP TABLE "_kept_part" AS SELECT * FROM ({relation}) WHERE ({where}) IS NOT TRUE', list(params))
                    self.write_part(table, partition, 'SELECT * FROM "_kept_part"')
                    self.conn.execute('DROP TABLE "_kept_part"')
                self.retire([path])
                self.touched.add((table, partition))

    def finish(self) -> None:
        """Before the commit: point the touched tables' views at their live parts."""
        for table in sorted(self.reshaped | {t for t, _ in self.touched}):
            self.refresh_view(table, None if table in self.reshaped else {p for t, p in self.touched if t == table})

    def discard(self) -> None:
        """After a rollback: delete the files this write added (none is listed in the catalog)."""
        for file in self.written:
            file.unlink(missing_ok=True)
        self.written.clear()

    # --- upkeep -----------------------------------------------------------------------------------

    def collect_garbage(self) -> int:
        """Delete retired parts older than ``grace_s`` (their files, then their catalog rows); returns how many."""
        before = datetime.now(timezone.utc) - timedelta(seconds=self.grace_s)
        old = [p for (p,) in self.conn.execute("SELECT path FROM _part_files WHERE retired_at < ?", [before]).fetchall()]
        for path in old:
            self.file(path).unlink(missing_ok=True)
        if old:
            self.conn.execute("DELETE FROM _part_files WHERE path IN (SELECT unnest(?::VARCHAR[]))", [old])
        return len(old)

    def sweep_orphans(self) -> int:
        """Delete files under the parts folder the catalog does not list and older than ``grace_s``: what a
        killed write or compaction left. Returns how many."""
        if not self.root.is_dir():
            return 0
        listed = {p for (p,) in self.conn.execute("SELECT path FROM _part_files").fetchall()}
        before, swept = datetime.now().timestamp() - self.grace_s, 0
        for file in self.root.rglob("*.parquet*"):
            if str(file.relative_to(self.root)) not in listed and file.stat().st_mtime < before:
                file.unlink(missing_ok=True)
                swept += 1
        return swept


def write_parquet(conn, sql: str, folder: Path, table: str) -> tuple[Path | None, int]:
    """The rows of ``sql`` as a new Parquet file in ``folder``: written under a hidden temporary name, fsynced,
    renamed (None when there are no rows). A full disk fails the step naming the folder."""
    name = uuid.uuid4().hex
    tmp, final = folder / f".{name}.parquet.tmp", folder / f"{name}.parquet"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (rows,) = conn.execute(f"COPY ({sql}) TO {literal(str(tmp))} (FORMAT parquet, COMPRESSION zstd)").fetchone()
        if rows:
            fsync_path(tmp)
            os.replace(tmp, final)
            fsync_path(folder)
    except (OSError, duckdb.Error) as err:
        if is_disk_full(err):
            raise Failure(
                description=f"no space left on the device of {folder} while writing {table}: free space there and re-execute; "
                "the warehouse still holds its previous state"
            ) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)  # no rows, or a failed write
    return (final if rows else None), int(rows)


def _tail(file: Path) -> bytes:
    with open(file, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return f.read(4)
