"""The two rules that merge a partition's small Parquet parts into one, so reads open few files.

On every write (:func:`merge_tiers`): ``TIER_PARTS`` parts of one size tier (within a factor of 4) in a
partition the write touched become one, so a row is rewritten once per tier. On demand (:func:`compact`,
``python -m resources.warehouse compact <db>``): every partition's parts under ``SMALL_PART_BYTES`` become
one, merged outside the writer's file. Parts of ``SMALL_PART_BYTES`` and more are left alone by both.
"""

from __future__ import annotations

import math
from pathlib import Path

import duckdb

from resources.part_keys import PART_TABLES
from resources.table_parts import PartTables, partition_dir, write_parquet
from resources.warehouse_snapshot import publish_snapshot
from resources.warehouse_writes import transaction

TIER_PARTS = 8  # a write that leaves this many parts of one size tier (a power of 4 bytes) in a partition merges them
SMALL_PART_BYTES = 64 * 2**20  # parts this big are left alone by merges


def merge_tiers(parts: PartTables) -> None:
    """Inside a write, before its commit: in each partition it touched, ``TIER_PARTS`` small parts of one size
    tier become one part of the next, so a growing run's big parts are not rewritten by every few appends."""
    for table, partition in sorted(parts.touched):
        tiers: dict[int, list[str]] = {}
        for path, _, size in parts.live(table, partition):
            if size < SMALL_PART_BYTES:
                tiers.setdefault(int(math.log(max(size, 1), 4)), []).append(path)
        for paths in tiers.values():
            if len(paths) >= TIER_PARTS:
                parts.write_part(table, partition, parts.relation(table, paths))
                parts.retire(paths)


def compact(warehouse, table: str | None = None) -> int:
    """Merge each partition's small parts of ``table`` (None: every part table) into one; returns the parts merged
    away. The merge reads and writes files without holding the DuckDB file (a live run goes on writing); one short
    transaction then swaps the catalog for the partitions whose parts are still those merged. Replaced files go
    after ``part_grace_s``, as do files a killed write or compaction left unlisted."""
    with warehouse.get_connection() as conn:
        parts = warehouse._parts(conn)
        if parts is None:
            return 0
        parts.sweep_orphans()
        plan = []
        for name in [table] if table else PART_TABLES:
            by_partition: dict[str, list[str]] = {}
            for path, partition, size in parts.live(name):
                if size < SMALL_PART_BYTES:
                    by_partition.setdefault(partition, []).append(path)
            width = len(parts.columns(name))
            plan += [(name, p, paths, parts.relation(name, paths), width) for p, paths in by_partition.items() if len(paths) > 1]
    merged = []
    with duckdb.connect() as memory:  # outside the writer's file
        for name, partition, paths, relation, width in plan:
            final, rows = write_parquet(memory, relation, warehouse.parts_root / name / partition_dir(partition), name)
            merged.append((name, partition, paths, final, rows, width))
    swapped = 0
    with warehouse.get_connection() as conn:
        parts = warehouse._parts(conn)
        with transaction(conn):
            for name, partition, paths, final, rows, width in merged:
                live = {p for p, _, _ in parts.live(name, partition)}
                if set(paths) <= live and final is not None:
                    parts.add(name, partition, final, rows, width)
                    parts.retire(paths)
                    swapped += len(paths)
                elif final is not None:
                    final.unlink(missing_ok=True)  # a write rewrote the partition meanwhile: this merge is stale
            for name in sorted({t for t, _ in parts.touched}):
                parts.refresh_view(name, {p for t, p in parts.touched if t == name})
        if warehouse.publish_snapshot:
            publish_snapshot(conn, Path(warehouse.database))
    return swapped
