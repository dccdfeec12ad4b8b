"""The DuckDB warehouse resource on a real file: atomic writes, upserts, loaders."""

import duckdb
import pandas as pd
import pytest
from dagster import Failure

from resources import Append, Replace, Upsert, Warehouse


@pytest.fixture
def warehouse(tmp_path):
    return Warehouse(database=str(tmp_path / "rlvr.duckdb"))


def rows(warehouse, table):
    with duckdb.connect(warehouse.database, read_only=True) as conn:
        return conn.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall()


def test_upsert_replaces_by_key_and_append_skips_stored_keys(warehouse):
    warehouse.upsert("t", pd.DataFrame({"k": ["a", "b"], "v": [1, 2]}), key="k")
    warehouse.upsert("t", pd.DataFrame({"k": ["b", "c"], "v": [20, 30]}), key="k")
    assert rows(warehouse, "t") == [("a", 1), ("b", 20), ("c", 30)]
    warehouse.write(Append("t", pd.DataFrame({"k": ["c", "d"], "v": [300, 4]}), key="k"))
    assert rows(warehouse, "t") == [("a", 1), ("b", 20), ("c", 30), ("d", 4)]
    warehouse.write(Append("t", pd.DataFrame({"k": ["a"], "v": [5]})))  # no key: plain insert
    assert len(rows(warehouse, "t")) == 5
    warehouse.replace_tables({"t": pd.DataFrame({"k": ["z"], "v": [0]})})
    assert rows(warehouse, "t") == [("z", 0)] and warehouse.row_count("t") == 1 and warehouse.row_count("missing") == 0


def test_a_later_frame_with_more_columns_adds_them_and_keeps_the_stored_rows(warehouse):
    """An evaluation with several samples per problem writes columns a greedy one did not (num_samples,
    pass@k): the table takes them, the earlier rows keep their values with NULL in the new columns."""
    warehouse.upsert("e", pd.DataFrame({"k": ["a"], "v": [1]}), key="k")
    warehouse.upsert("e", pd.DataFrame({"k": ["b"], "v": [2], "num_samples": [4], "pass_at_4": [0.5]}), key="k")
    assert rows(warehouse, "e") == [("a", 1, None, None), ("b", 2, 4, 0.5)]
    warehouse.write(Append("e", pd.DataFrame({"k": ["c"], "v": [3]}), key="k"))  # fewer columns: NULL in the others
    assert rows(warehouse, "e")[-1] == ("c", 3, None, None)


def test_a_failing_write_leaves_every_table_as_it_was(warehouse):
    warehouse.replace_tables({"a": pd.DataFrame({"x": [1]}), "b": pd.DataFrame({"y": [1]})})
    with pytest.raises(duckdb.Error):
        warehouse.write(Replace("a", pd.DataFrame({"x": [2]})), Upsert("b", pd.DataFrame({"y": [2]}), key="no_such_column"))
    assert rows(warehouse, "a") == [(1,)] and rows(warehouse, "b") == [(1,)]
    with pytest.raises(RuntimeError):
        with warehouse.transaction() as conn:
            conn.execute("INSERT INTO a VALUES (3)")
            raise RuntimeError("stop")
    assert rows(warehouse, "a") == [(1,)]


def test_declared_tables_get_their_schema(warehouse):
    frame = pd.DataFrame(
        {"reported_at": [pd.Timestamp("2026-01-01", tz="UTC")], "run_id": ["r"], "metric": ["psi/x"], "value": [0.1], "threshold": [None], "drifted": [False]}
    )
    history = warehouse.append_drift_history(frame)
    assert len(history) == 1 and pd.isna(history["threshold"].iloc[0])
    with duckdb.connect(warehouse.database, read_only=True) as conn:
        types = dict(conn.execute("SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'drift_history'").fetchall())
    assert types["threshold"] == "DOUBLE" and types["drifted"] == "BOOLEAN"


def test_problem_loaders_fail_the_step_without_problems(warehouse):
    with pytest.raises(Failure, match="materialize gsm8k_problems first"):
        warehouse.problems("train")
    warehouse.replace_tables(
        {"gsm8k_problems": pd.DataFrame({"problem_id": ["p2", "p1", "q1"], "split": ["train", "train", "test"], "question": ["b", "a", "c"]})}
    )
    assert [p["problem_id"] for p in warehouse.problems("train")] == ["p1", "p2"]
    assert [p["problem_id"] for p in warehouse.problems("train", limit=1)] == ["p1"]
    with pytest.raises(Failure, match="no rows in split 'dev'"):
        warehouse.problems("dev")
    assert sorted(warehouse.reference_questions(5)) == ["a", "b"]
    assert warehouse.eval_results("e1") is None and warehouse.latest_evaluation("v1") is None
    assert warehouse.traffic_cursor() == {} and all(w.empty for w in warehouse.traffic_window("2026-11-23", 10))


def test_drift_history_is_by_traffic_day_with_each_days_latest_report(warehouse):
    def report(day, reported_at, value, run_id):
        frame = pd.DataFrame({"reported_at": [pd.Timestamp(reported_at, tz="UTC")], "run_id": [run_id], "metric": ["psi/x"], "value": [value]})
        return warehouse.append_drift_history(frame.assign(threshold=0.2, drifted=value > 0.2, day=day))

    with warehouse.transaction() as conn:  # a file written before drift_history had its day column
        conn.execute("CREATE TABLE drift_history (reported_at TIMESTAMPTZ, run_id VARCHAR, metric VARCHAR, value DOUBLE, threshold DOUBLE, drifted BOOLEAN)")
        conn.execute("INSERT INTO drift_history VALUES ('2026-11-01 09:00:00+00', 'old', 'psi/x', 0.05, 0.2, false)")
    report("2026-11-23", "2026-11-23 10:00", 0.1, "a")
    history = report("2026-11-22", "2026-11-23 11:00", 0.3, "backfill")  # an earlier day reported later
    assert list(history["run_id"]) == ["old", "backfill", "a"] and pd.isna(history["day"].iloc[0])
    history = report("2026-11-23", "2026-11-23 12:00", 0.4, "again")  # the day re-reported: its point moves, none is added
    assert list(history["run_id"]) == ["old", "backfill", "again"] and list(history["value"]) == [0.05, 0.3, 0.4]
