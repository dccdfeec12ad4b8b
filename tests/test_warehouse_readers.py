"""Readers never fail writers: a SQL session on the published snapshot stays open through a real
materialization, and a writer that finds the DuckDB file held by another process waits for it,
naming that process, or fails after its bounded wait with the same words."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from dagster import DagsterInstance, Failure, materialize

from resources import Upsert, Warehouse
from rlvr_assets import data
from support.waiting import wait_for

# Opens a DuckDB file read-only in its own process, says so (argv[2]), reads until argv[2].release exists.
HOLDER = """
import sys, time, duckdb, pathlib
ready = pathlib.Path(sys.argv[2])
with duckdb.connect(sys.argv[1], read_only=True) as conn:
    ready.write_text(str(conn.execute("SELECT count(*) FROM gsm8k_problems").fetchone()[0]))
    while not ready.with_suffix(".release").exists():
        time.sleep(0.05)
    print(conn.execute("SELECT count(*) FROM gsm8k_problems").fetchone()[0])
"""


def hold(database: Path, ready: Path) -> subprocess.Popen:
    """A process holding ``database`` open read-only, once it has read it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(database), str(ready)], stdout=subprocess.PIPE, text=True)

    def opened() -> bool:
        assert holder.poll() is None, "the reader ended before it opened the file"
        return ready.exists()

    wait_for(opened, 60, "the reader to open the file")
    return holder


def release(holder: subprocess.Popen, ready: Path) -> str:
    ready.with_suffix(".release").touch()
    out, _ = holder.communicate(timeout=60)
    return out.strip()


def problems(gsm8k_dir: Path, limit: int) -> dict:
    return {"ops": {"gsm8k_problems": {"config": {"local_dir": str(gsm8k_dir), "limit": limit}}}}


@pytest.mark.slow  # materializes Dagster assets
def test_a_sql_session_on_the_snapshot_stays_open_through_a_materialization(tmp_path, gsm8k_dir):
    warehouse = Warehouse(database=str(tmp_path / "rlvr.duckdb"), lock_wait_s=5)
    with DagsterInstance.ephemeral() as instance:
        assert materialize([data.gsm8k_problems], resources={"duckdb": warehouse}, run_config=problems(gsm8k_dir, 20), instance=instance).success
        assert warehouse.snapshot_path.is_file()  # published by the committed write
        first = warehouse.row_count("gsm8k_problems")
        session = hold(warehouse.snapshot_path, tmp_path / "ready")
        try:
            result = materialize([data.gsm8k_problems], resources={"duckdb": warehouse}, run_config=problems(gsm8k_dir, 40), instance=instance)
            assert result.success
        finally:
            seen = release(session, tmp_path / "ready")
    assert (tmp_path / "ready").read_text() == seen == str(first) and warehouse.row_count("gsm8k_problems") > first  # it kept the copy it opened
    count = "import duckdb, sys; print(duckdb.connect(sys.argv[1], read_only=True).sql('SELECT count(*) FROM gsm8k_problems').fetchall()[0][0])"
    fresh = subprocess.run([sys.executable, "-c", count, str(warehouse.snapshot_path)], capture_output=True, text=True)
    assert fresh.stdout.strip() == str(warehouse.row_count("gsm8k_problems")), fresh.stderr  # a new session sees what was committed


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen, self.event = [], threading.Event()

    def emit(self, record):
        self.seen.append(record.getMessage())
        self.event.set()


@pytest.fixture
def warnings():
    handler, logger = Messages(), logging.getLogger("dagster")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_a_writer_waits_for_the_process_holding_the_file_and_names_it(tmp_path, warnings):
    warehouse = Warehouse(database=str(tmp_path / "rlvr.duckdb"), lock_wait_s=120)
    warehouse.write(Upsert("gsm8k_problems", pd.DataFrame({"problem_id": ["a"]}), "problem_id"))
    holder = hold(Path(warehouse.database), tmp_path / "ready")
    writer = threading.Thread(target=warehouse.write, args=(Upsert("gsm8k_problems", pd.DataFrame({"problem_id": ["b"]}), "problem_id"),))
    writer.start()
    assert warnings.event.wait(60), "the writer never said what it waits for"
    assert f"it is held by PID {holder.pid} (" in warnings.seen[0] and "-c" in warnings.seen[0]
    assert writer.is_alive()  # waiting, not failed
    release(holder, tmp_path / "ready")
    writer.join(60)
    assert warehouse.row_count("gsm8k_problems") == 2


def test_a_writer_held_off_past_its_wait_fails_naming_the_holder(tmp_path):
    warehouse = Warehouse(database=str(tmp_path / "rlvr.duckdb"), lock_wait_s=1)
    warehouse.write(Upsert("gsm8k_problems", pd.DataFrame({"problem_id": ["a"]}), "problem_id"))
    holder = hold(Path(warehouse.database), tmp_path / "ready")
    try:
        with pytest.raises(Failure, match=rf"(?s)is held by PID {holder.pid} \(.*waited 1 s.*make sql"):
            warehouse.write(Upsert("gsm8k_problems", pd.DataFrame({"problem_id": ["b"]}), "problem_id"))
    finally:
        release(holder, tmp_path / "ready")
    with duckdb.connect(str(warehouse.snapshot_path), read_only=True) as conn:  # the snapshot of the first write only
        assert conn.execute("SELECT count(*) FROM gsm8k_problems").fetchone()[0] == 1
