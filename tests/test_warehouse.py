"""The DuckDB warehouse resource on a real file: atomic writes, upserts, loaders."""

import logging

import duckdb
import pandas as pd
import pytest
from dagster import Failure

from resources import Append, Replace, Upsert, Warehouse
from rlvr.tasks import TaskProblem, normalized_text_hash, problem_record
from rlvr.tasks.gsm8k import gsm8k_task_problem


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


def older_gsm8k_table(ids: list[str], splits: list[str], questions: list[str]) -> pd.DataFrame:
    """``gsm8k_problems`` as a file written before every task's problems shared ``task_problems`` held it."""
    n = len(ids)
    return pd.DataFrame(
        {"problem_id": ids, "split": splits, "question": questions, "solution": ["2 + 2 = 4"] * n, "answer_text": ["4"] * n}
        | {"answer_value": [4.0] * n, "num_steps": [1] * n, "source": ["local"] * n, "content_hash": [f"hash-{i}" for i in ids]}
    )


def create_as_older_code(warehouse, table: str, frame: pd.DataFrame) -> None:
    """``table`` written into the file by another process, as code of an older layout did."""
    with duckdb.connect(warehouse.database) as conn:
        conn.register("older", frame)
        conn.execute(f'CREATE TABLE "{table}" AS SELECT * FROM older')


def test_problem_loaders_fail_the_step_without_problems(warehouse):
    with pytest.raises(Failure, match="materialize gsm8k_problems or its partition 'gsm8k' first"):
        warehouse.task_problems("gsm8k", "train")
    assert warehouse.problem_tasks() == [] and warehouse.held_out_question_hashes() == set() and warehouse.reference_questions(5) == []
    problems = [gsm8k_task_problem(row) for row in older_gsm8k_table(["p2", "p1", "q1"], ["train", "train", "test"], ["b", "a", "c"]).to_dict("records")]
    warehouse.replace_task_problems("gsm8k", pd.DataFrame([p.as_row() for p in problems]))
    assert [p["problem_id"] for p in warehouse.task_problems("gsm8k", "train")] == ["p1", "p2"]
    assert [p["problem_id"] for p in warehouse.task_problems("gsm8k", "train", limit=1)] == ["p1"]
    with pytest.raises(Failure, match="no rows of task 'gsm8k' in split 'dev'"):
        warehouse.task_problems("gsm8k", "dev")
    assert sorted(warehouse.reference_questions(5)) == ["a", "b"] and warehouse.problem_tasks() == ["gsm8k"]
    assert warehouse.eval_results("e1") is None and warehouse.latest_evaluation("v1") is None
    assert warehouse.traffic_cursor() == {} and all(w.empty for w in warehouse.traffic_window("2026-11-23", 10))


def test_an_older_files_gsm8k_problems_table_moves_once_into_task_problems_and_keeps_its_name_as_a_view(warehouse, caplog):
    older = older_gsm8k_table(["p1", "p2", "q1"], ["train", "train", "test"], ["a", "b", "c"])
    create_as_older_code(warehouse, "gsm8k_problems", older)
    with caplog.at_level(logging.WARNING):
        [first, second] = map(problem_record, warehouse.task_problems("gsm8k", "train"))  # moved before the first connection is used
    assert [r.getMessage() for r in caplog.records if "moved 3 rows of the table gsm8k_problems into task_problems" in r.getMessage()]
    assert warehouse.upgrade() == []  # once
    assert first["answer_value"] == 4.0 and first["answer_text"] == "4" and first["solution"] == "2 + 2 = 4" and first["task"] == "gsm8k"
    assert [first["content_hash"], second["content_hash"]] == ["hash-p1", "hash-p2"]  # stored evaluations keep their identity
    with duckdb.connect(warehouse.database, read_only=True) as conn:
        kind = conn.execute("SELECT table_type FROM information_schema.tables WHERE table_name = 'gsm8k_problems'").fetchone()[0]
        view = conn.execute("SELECT * FROM gsm8k_problems ORDER BY problem_id").df()
    assert kind == "VIEW" and list(view["answer_value"]) == [4.0] * 3 and set(older.columns) <= set(view.columns)
    assert view[list(older.columns)].equals(older[list(older.columns)].sort_values("problem_id").reset_index(drop=True))
    assert warehouse.held_out_question_hashes() == {normalized_text_hash("c")}
    warehouse.replace_task_problems("other", pd.DataFrame([TaskProblem("other", "o1", "test", "d", {"x": 1}).as_row()]))
    assert warehouse.problem_tasks() == ["gsm8k", "other"] and len(warehouse.task_problems("gsm8k", "train")) == 2  # other tasks' rows kept


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


def test_each_tasks_evaluation_and_train_questions_are_read_apart(warehouse):
    def evaluation(eval_id, at, **columns):
        return pd.DataFrame({"eval_id": [eval_id], "policy_version": ["v1"], "completion": ["x"], "well_formed": [True], **columns}).assign(
            evaluated_at=pd.Timestamp(at, tz="UTC")
        )

    warehouse.upsert("eval_results", evaluation("old", "2026-01-01"), key="eval_id")  # stored before evaluations named their task
    assert warehouse.latest_evaluation("v1", "gsm8k")["eval_id"].tolist() == ["old"] and warehouse.latest_evaluation("v1", "arith") is None
    warehouse.upsert("eval_results", evaluation("g", "2026-01-02", task=["gsm8k"]), key="eval_id")
    warehouse.upsert("eval_results", evaluation("a", "2026-01-03", task=["arith"]), key="eval_id")
    assert warehouse.latest_evaluation("v1")["eval_id"].tolist() == ["a"]  # the newest, of any task
    assert warehouse.latest_evaluation("v1", "gsm8k")["eval_id"].tolist() == ["g"] and warehouse.latest_evaluation("v1", "arith")["eval_id"].tolist() == ["a"]
    assert warehouse.task_reference_questions("arith", 5) == []  # no task_problems yet
    train = pd.DataFrame({"task": "arith", "problem_id": ["p1", "p2", "p3"], "split": ["train", "train", "test"], "question": ["1+1", "2+2", "3+3"]})
    warehouse.replace_tables({"task_problems": train})
    create_as_older_code(warehouse, "gsm8k_problems", older_gsm8k_table(["g1", "g2", "g3"], ["train", "train", "test"], ["q1", "q2", "q3"]))
    assert sorted(warehouse.task_reference_questions("arith", 5)) == ["1+1", "2+2"]
    assert sorted(warehouse.reference_questions(4, {"arith": 1.0, "gsm8k": 1.0})) == ["1+1", "2+2", "q1", "q2"]


def test_drift_history_keeps_each_tasks_rows_of_a_metric(warehouse):
    frame = pd.DataFrame({"reported_at": pd.Timestamp("2026-11-23", tz="UTC"), "run_id": "r", "metric": "psi/x", "value": [0.1, 0.3], "task": [None, "arith"]})
    history = warehouse.append_drift_history(frame.assign(threshold=0.2, drifted=frame["value"] > 0.2, day="2026-11-23"))
    assert sorted(history["value"]) == [0.1, 0.3]
