"""The part tables (rollouts, rewards, tool_calls, serving_traffic) as Parquet parts on real files: a write
costs its rows, readers keep their snapshot across appends and compactions, an older file's tables move into
parts once, a corrupt part is named, and a write killed at any instant leaves the old state or the new one."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys

import duckdb
import pandas as pd
import pytest
from dagster import Failure

from resources import Upsert, Warehouse, part_compaction, table_parts
from resources import warehouse as warehouse_module
from resources.warehouse import SCHEMAS, Append


@pytest.fixture
def warehouse(tmp_path):
    return Warehouse(database=str(tmp_path / "rlvr.duckdb"))


def step_rows(run: str, step: int, n: int = 16, text: str = "x") -> tuple[Upsert, Upsert]:
    """One training step's writes: ``n`` rollouts and their rewards."""
    ids = [f"{run}-s{step}-{i}" for i in range(n)]
    rollouts = pd.DataFrame({"run_id": run, "completion_id": ids, "step": step, "completion": text, "finish_reason": "eos"})
    rewards = pd.DataFrame({"run_id": run, "completion_id": ids, "reward_name": "math_answer", "value": 0.5})
    return Upsert("rollouts", rollouts, "completion_id"), Upsert("rewards", rewards, "completion_id")


def count(database, sql: str = "SELECT count(*), count(DISTINCT completion_id) FROM rollouts") -> tuple:
    with duckdb.connect(str(database), read_only=True) as conn:
        return conn.execute(sql).fetchone()


def live_parts(warehouse, table: str = "rollouts") -> list[str]:
    return warehouse.query("SELECT path FROM _part_files WHERE table_name = ? AND retired_at IS NULL", [table])["path"].tolist()


def test_a_reader_keeps_its_snapshot_across_many_appends_and_the_snapshot_stays_small(warehouse):
    warehouse.write(*step_rows("r1", 0, text="x" * 2000))
    reader = duckdb.connect(str(warehouse.snapshot_path), read_only=True)
    try:
        assert reader.execute("SELECT count(*) FROM rollouts").fetchone() == (16,)
        for step in range(1, 41):  # past TIER_PARTS: the writes merge the run's parts as they go
            warehouse.write(*step_rows("r1", step, text="x" * 2000))
        assert reader.execute("SELECT count(*), sum(length(completion)) FROM rollouts").fetchone() == (16, 16 * 2000)
    finally:
        reader.close()
    assert count(warehouse.snapshot_path) == (41 * 16, 41 * 16) == count(warehouse.database)
    assert len(live_parts(warehouse)) < 2 * part_compaction.TIER_PARTS
    assert warehouse.training_run_summary("r1")["reward_rows"] == 41 * 16
    parts_bytes = sum(f.stat().st_size for f in warehouse.parts_root.rglob("*.parquet"))
    assert warehouse.snapshot_path.stat().st_size < 4 * 2**20 and count(
        warehouse.database, "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'rollouts'"
    ) == (0,)
    assert parts_bytes > 0


def test_upserts_replace_keys_appends_skip_them_and_deletes_drop_whole_days(warehouse):
    warehouse.write(*step_rows("r1", 1), *step_rows("r2", 1)[:1])
    warehouse.write(Upsert("rollouts", step_rows("r1", 1)[0].frame.assign(completion="again"), "completion_id"))  # a re-executed step
    assert count(warehouse.database) == (32, 32) and count(warehouse.database, "SELECT count(*) FROM rollouts WHERE completion = 'again'") == (16,)
    files = sorted(warehouse.parts_root.rglob("*.parquet"))
    with pytest.raises(duckdb.Error):  # the second write fails: the first's part is not kept either
        warehouse.write(step_rows("r1", 2)[0], Upsert("rewards", step_rows("r1", 2)[1].frame, key="no_such_column"))
    assert count(warehouse.database) == (32, 32) and sorted(warehouse.parts_root.rglob("*.parquet")) == files
    day = lambda d: f"traffic-202611{d:02d}T000000.000000000-1.jsonl"  # noqa: E731
    traffic = pd.DataFrame({"record_id": ["a", "b", "c"], "source_file": [day(1), day(1), day(2)], "status": 200})
    warehouse.write(
        Append("serving_traffic", traffic, key="record_id"), Upsert("serving_traffic_cursor", pd.DataFrame({"file": [day(1)], "offset": [9]}), "file")
    )
    warehouse.write(Append("serving_traffic", traffic.assign(status=500), key="record_id"))  # stored keys: nothing added
    assert warehouse.query("SELECT sum(status) AS s FROM serving_traffic")["s"].iloc[0] == 600
    assert warehouse.delete_traffic_before("2026-11-02") == 2
    assert warehouse.query("SELECT record_id FROM serving_traffic")["record_id"].tolist() == ["c"]
    assert warehouse.query("SELECT DISTINCT partition FROM _part_files WHERE table_name = 'serving_traffic' AND retired_at IS NULL")["partition"].tolist() == [
        "20261102"
    ]


def test_an_old_layout_file_is_moved_into_parts_once_and_nothing_is_lost(tmp_path, caplog):
    database = tmp_path / "rlvr.duckdb"
    with duckdb.connect(str(database)) as conn:  # as the code before parts wrote it: the big tables in the file
        conn.execute("CREATE TABLE rollouts (run_id VARCHAR, completion_id VARCHAR, step INTEGER, completion VARCHAR)")
        conn.execute("INSERT INTO rollouts SELECT 'r' || (i % 3), 'r' || (i % 3) || '-' || i, i, 'text ' || i FROM range(300) t(i)")
        conn.execute("CREATE TABLE rewards AS SELECT run_id, completion_id, 'math_answer' AS reward_name, 0.25 AS value FROM rollouts")
        conn.execute(SCHEMAS["serving_traffic"].replace(", api_key_id VARCHAR", ""))
        conn.execute("INSERT INTO serving_traffic (record_id, source_file, status) VALUES ('a', 'traffic-20261101T0-1.jsonl', 200), ('b', NULL, 200)")
        conn.execute(
            "CREATE TABLE gsm8k_problems AS SELECT 'p1' AS problem_id, 'train' AS split, 'q' AS question, '4' AS solution, '4' AS answer_text, "
            "4.0 AS answer_value, 1 AS num_steps, 'local' AS source, 'h1' AS content_hash"
        )
        before = {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall()) for t in ("rollouts", "rewards", "serving_traffic")}
    old_size, warehouse = database.stat().st_size, Warehouse(database=str(database))
    with caplog.at_level(logging.WARNING):
        assert warehouse.row_count("rollouts") == 300
    assert database.stat().st_size < old_size  # the moved tables' space is given back: the snapshot copies the small file
    moved = [r.getMessage() for r in caplog.records if "into Parquet parts" in r.getMessage()]
    assert len(moved) == 3 and "moved table rollouts (300 rows, 3 partitions)" in " ".join(moved)
    assert [r for r in caplog.records if "moved 1 rows of the table gsm8k_problems into task_problems" in r.getMessage()]
    with duckdb.connect(str(database), read_only=True) as conn:
        for table, rows in before.items():
            columns = [c for c, *_ in conn.execute(f"DESCRIBE {table}").fetchall()]
            assert sorted(conn.execute(f"SELECT {', '.join(columns[: len(rows[0])])} FROM {table}").fetchall()) == rows, table
        assert {t for (t,) in conn.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()} >= {"rollouts", "rewards", "serving_traffic"}
        assert "policy_tokens" in {c for c, *_ in conn.execute("DESCRIBE rollouts").fetchall()}  # the later migrations applied on the way
    caplog.clear()
    warehouse.write(Upsert("rollouts", pd.DataFrame({"run_id": ["r0"], "completion_id": ["r0-0"], "step": [0], "completion": ["new"]}), "completion_id"))
    assert not [r for r in caplog.records if "into Parquet parts" in r.getMessage()]  # once
    assert count(database) == (300, 300) and count(warehouse.snapshot_path, "SELECT completion FROM rollouts WHERE completion_id = 'r0-0'") == ("new",)


def test_a_corrupt_part_is_named_by_readers_and_refused_by_the_next_write_to_its_partition(warehouse):
    warehouse.write(*step_rows("r2", 1))
    warehouse.write(*step_rows("r1", 1))
    (broken,) = [warehouse.parts_root / p for p in live_parts(warehouse) if "/r1-" in p]
    broken.write_bytes(broken.read_bytes()[:40])  # truncated
    with pytest.raises(duckdb.Error, match=str(broken)):
        count(warehouse.snapshot_path)
    with pytest.raises(Failure, match=rf"(?s){broken}.*drop-partition .* rollouts r1"):
        warehouse.write(*step_rows("r1", 2))
    warehouse.write(*step_rows("r2", 2))  # another partition: written
    assert warehouse.drop_partition("rollouts", "r1") == 1
    warehouse.write(*step_rows("r1", 1), *step_rows("r1", 2))  # the run re-executed
    assert count(warehouse.database) == (64, 64)


def test_compaction_beside_a_reader_keeps_the_readers_files_and_loses_no_row(tmp_path):
    warehouse = Warehouse(database=str(tmp_path / "rlvr.duckdb"), part_grace_s=0)
    steps = part_compaction.TIER_PARTS - 1  # below what a write merges itself
    for step in range(steps):
        warehouse.write(*step_rows("r1", step))
    old_parts = [warehouse.parts_root / p for p in live_parts(warehouse)]
    reader = duckdb.connect(str(warehouse.snapshot_path), read_only=True)
    try:
        warehouse.compact()
        assert len(live_parts(warehouse)) == 1 and all(p.exists() for p in old_parts)  # retired, kept until the next write
        assert reader.execute("SELECT count(*) FROM rollouts").fetchone() == (16 * steps,)
    finally:
        reader.close()
    assert count(warehouse.snapshot_path) == (16 * steps, 16 * steps)
    warehouse.write(*step_rows("r1", steps))  # past the grace: the retired files go
    assert not any(p.exists() for p in old_parts) and count(warehouse.database) == (16 * steps + 16, 16 * steps + 16)


def test_a_compaction_overtaken_by_a_write_is_dropped(warehouse, monkeypatch):
    for step in range(3):
        warehouse.write(*step_rows("r1", step))
    write_parquet = part_compaction.write_parquet

    def overtaken(conn, sql, folder, table):  # a live run's write lands between the merge's plan and its swap
        warehouse.write(Upsert("rollouts", step_rows("r1", 0)[0].frame.assign(completion="rewritten"), "completion_id"))
        return write_parquet(conn, sql, folder, table)

    monkeypatch.setattr(part_compaction, "write_parquet", overtaken)
    assert warehouse.compact("rollouts") == 0
    assert count(warehouse.database) == (48, 48) and count(warehouse.database, "SELECT count(*) FROM rollouts WHERE completion = 'rewritten'") == (16,)


def test_a_full_disk_fails_the_write_naming_the_folder_and_keeps_the_previous_state(warehouse, monkeypatch):
    warehouse.write(*step_rows("r1", 1))

    def no_space(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(table_parts, "fsync_path", no_space)
    with pytest.raises(Failure, match=rf"no space left on the device of {warehouse.parts_root}/rollouts/r1-"):
        warehouse.write(*step_rows("r1", 2))
    monkeypatch.undo()
    assert count(warehouse.database) == (16, 16) and count(warehouse.snapshot_path) == (16, 16)
    assert len(list(warehouse.parts_root.rglob("*.parquet*"))) == 2  # the first write's two parts, nothing left over


# Writes one step to the warehouse in argv[1] and SIGKILLs itself at the argv[2]-th rename of a Parquet file
# (a write's parts, or a compaction's merged part), before or after it.
KILL_AT = """
import os, signal, sys
import pandas as pd
from resources import Upsert, Warehouse
from resources import table_parts
database, at, when, what = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
renames, replace = [0], os.replace
def killing_replace(src, dst):
    renames[0] += 1
    if renames[0] == at and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)
    if renames[0] == at and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
table_parts.os.replace = killing_replace
warehouse = Warehouse(database=database)
if what == "compact":
    warehouse.compact()
else:
    ids = [f"r1-s9-{i}" for i in range(16)]
    warehouse.write(Upsert("rollouts", pd.DataFrame({"run_id": "r1", "completion_id": ids, "step": 9, "completion": "y"}), "completion_id"),
                    Upsert("rewards", pd.DataFrame({"run_id": "r1", "completion_id": ids, "reward_name": "a", "value": 1.0}), "completion_id"))
"""


@pytest.mark.slow  # a subprocess per case
@pytest.mark.parametrize("what,at,when", [("write", 1, "before"), ("write", 1, "after"), ("write", 2, "after"), ("compact", 1, "after")])
def test_a_write_or_compaction_killed_at_a_rename_leaves_the_old_state_and_reexecutes_without_duplicates(tmp_path, what, at, when):
    warehouse = Warehouse(database=str(tmp_path / "rlvr.duckdb"), part_grace_s=0)
    for step in range(3):
        warehouse.write(*step_rows("r1", step))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    killed = subprocess.run([sys.executable, "-c", KILL_AT, warehouse.database, str(at), when, what], env=env, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    totals = "SELECT (SELECT count(*) FROM rollouts), (SELECT count(*) FROM rewards)"
    assert count(warehouse.database, totals) == (48, 48)  # the old state, whole: neither table has the killed write's rows
    warehouse.write(*step_rows("r1", 2), *step_rows("r1", 9))  # the step re-executed, with one already stored
    assert count(warehouse.database, totals) == (64, 64) and count(warehouse.database) == (64, 64)
    warehouse.compact()  # what the killed one left unlisted goes (grace 0)
    listed = {str(warehouse.parts_root / p) for p in warehouse.query("SELECT path FROM _part_files")["path"]}
    assert {str(p) for p in warehouse.parts_root.rglob("*.parquet*")} == listed


def test_queries_of_one_run_or_day_read_its_parts_and_equal_the_whole_table_sql(warehouse):
    """Drift's window and the per-run and per-day metadata read only their partitions' parts (newest days
    first, widening until no older day can hold a newer row) and return what SQL over the whole view does."""
    rows, days = [], 9
    for d in range(1, days + 1):
        for i in range(d % 4 * 3):  # days of 0, 3, 6 and 9 requests; one logged just after midnight of the next day
            stamp = (
                pd.Timestamp(f"2026-11-{d:02d}T23:59:{50 + i % 10:02d}", tz="UTC")
                if i == 0 and d > 1
                else pd.Timestamp(f"2026-11-{d:02d}T{i:02d}:00", tz="UTC")
            )
            logged = d + 1 if i == 0 and d > 1 else d
            rows.append(
                {
                    "record_id": f"r{d}-{i}",
                    "timestamp": stamp,
                    "status": 500 if i % 5 == 3 else 200,
                    "source_file": f"traffic-202611{logged:02d}T000000.000000000-1.jsonl",
                }
            )
    for d in range(1, days + 2):  # one write per logged day: one part per day partition
        frame = pd.DataFrame([r for r in rows if r["source_file"].startswith(f"traffic-202611{d:02d}T")])
        if len(frame):
            warehouse.write(Append("serving_traffic", frame, key="record_id"))
    warehouse.write(*step_rows("r1", 1), *step_rows("r2", 1))
    order = 'ORDER BY "timestamp" DESC, record_id DESC LIMIT ?'
    for d in range(2, days + 1):
        day = f"2026-11-{d:02d}"
        for window in (1, 2, 4, 50):
            current, previous = warehouse.traffic_window(day, window)
            prefix = f"traffic-202611{d:02d}T"
            expected = warehouse.query(f"SELECT * FROM serving_traffic WHERE status = 200 AND starts_with(source_file, ?) {order}", [prefix, window])
            assert current["record_id"].tolist() == expected["record_id"].tolist()
            if len(current):
                older = warehouse.query(
                    f'SELECT * FROM serving_traffic WHERE status = 200 AND source_file < ? AND "timestamp" < ? {order}',
                    [f"traffic-202611{d + 1:02d}T", current["timestamp"].min(), window],
                )
                assert previous["record_id"].tolist() == older["record_id"].tolist(), (day, window)
        assert warehouse.traffic_rows(day) == sum(r["source_file"].startswith(prefix) for r in rows)
    assert warehouse.training_run_summary("r2") == {
        "finish_reasons": {"eos": 16},
        "reward_means": {"math_answer": 0.5},
        "reward_rows": 16,
        "completions_calling": 0,
        "tool_calls": 0,
        "tool_errors": 0,
    }


def test_traffic_parts_written_before_the_task_column_still_read_and_name_their_task(warehouse, monkeypatch):
    """Parts of serving_traffic from before rows named their task lack the column: read by name beside newer
    parts, their native requests are GSM8k's, an OpenAI route's request has none."""
    day = "traffic-20261101T000000.000000000-1.jsonl"
    old = pd.DataFrame({"record_id": ["a", "b"], "endpoint": ["/solve", "/v1/completions"], "status": 200, "source_file": day})
    old["timestamp"] = pd.Timestamp("2026-11-01T10:00", tz="UTC")
    before = {**SCHEMAS, "serving_traffic": SCHEMAS["serving_traffic"].replace(" task VARCHAR,", "")}
    with monkeypatch.context() as patched:  # the code before the column: its schema and migrations
        patched.setattr(warehouse_module, "SCHEMAS", before)
        patched.setitem(warehouse_module.MIGRATIONS, "serving_traffic", ["ALTER TABLE serving_traffic ADD COLUMN IF NOT EXISTS api_key_id VARCHAR"])
        warehouse.write(Append("serving_traffic", old, key="record_id"))
    assert "task" not in warehouse.query("SELECT * FROM serving_traffic").columns
    current, _ = warehouse.traffic_window("2026-11-01", 10)
    assert dict(zip(current["record_id"], current["task"].fillna("-"))) == {"a": "gsm8k", "b": "-"}
    new = old.head(1).assign(record_id="c", task="reasoning_gym:basic_arithmetic", timestamp=pd.Timestamp("2026-11-01T11:00", tz="UTC"))
    warehouse.write(Append("serving_traffic", new, key="record_id"))
    assert warehouse.query("SELECT record_id, coalesce(task, '-') AS task FROM serving_traffic ORDER BY 1").values.tolist() == [
        ["a", "-"],  # the older parts: NULL, read by name
        ["b", "-"],
        ["c", "reasoning_gym:basic_arithmetic"],
    ]
    current, _ = warehouse.traffic_window("2026-11-01", 10)
    assert dict(zip(current["record_id"], current["task"].fillna("-"))) == {"a": "gsm8k", "b": "-", "c": "reasoning_gym:basic_arithmetic"}
