"""Real materializations of ``gsm8k_problems`` into a temporary DuckDB file."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from dagster import DagsterInstance, materialize

from resources import Warehouse
from rlvr_assets.data import gsm8k_problems

pytestmark = pytest.mark.slow  # materializes Dagster assets and runs dg launch

ROOT = Path(__file__).resolve().parents[1]


def run(db_path, instance, **config):
    return materialize(
        [gsm8k_problems],
        resources={"duckdb": Warehouse(database=str(db_path))},
        run_config={"ops": {"gsm8k_problems": {"config": config}}},
        instance=instance,
        raise_on_error=False,
    )


def table_counts(db_path):
    with duckdb.connect(str(db_path), read_only=True) as conn:
        return dict(conn.execute("SELECT split, count(*) FROM gsm8k_problems GROUP BY split").fetchall())


def failure_message(result):
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return failures[0].event_specific_data.error.message if failures else ""


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def test_full_local_source_materializes_with_checks(tmp_path, gsm8k_dir, instance):
    db = tmp_path / "rlvr.duckdb"
    result = run(db, instance, source="local", local_dir=str(gsm8k_dir))
    assert result.success
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {"row_counts": True, "answers_parse": True, "no_split_overlap": True, "no_nulls": True}
    assert table_counts(db) == {"train": 7473, "test": 1319}
    metadata = result.asset_materializations_for_node("gsm8k_problems")[0].metadata
    assert metadata["train_rows"].value == 7473 and metadata["dagster/row_count"].value == 8792
    assert metadata["num_steps"].value.startswith("![")
    with duckdb.connect(str(db), read_only=True) as conn:
        row = conn.execute("SELECT answer_text, answer_value, num_steps FROM gsm8k_problems WHERE problem_id = 'local-train-00000'").fetchone()
    assert row == ("72", 72.0, 2)
    # idempotent: a second run replaces, never appends
    assert run(db, instance, source="local", local_dir=str(gsm8k_dir)).success
    assert table_counts(db) == {"train": 7473, "test": 1319}


def write_corrupt_copy(src, dst, extra_test_lines):
    dst.mkdir()
    (dst / "train.jsonl").write_text("".join((src / "train.jsonl").read_text().splitlines(True)[:50]))
    (dst / "test.jsonl").write_text("".join((src / "test.jsonl").read_text().splitlines(True)[:20]) + extra_test_lines)


def test_failing_check_keeps_previous_table(tmp_path, gsm8k_dir, instance):
    db = tmp_path / "rlvr.duckdb"
    assert run(db, instance, source="local", local_dir=str(gsm8k_dir), limit=30).success
    corrupt = tmp_path / "corrupt"
    leaked = (gsm8k_dir / "train.jsonl").read_text().splitlines(True)[0]  # a train question copied into test
    write_corrupt_copy(gsm8k_dir, corrupt, leaked)
    result = run(db, instance, source="local", local_dir=str(corrupt), limit=30)
    assert not result.success
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["no_split_overlap"] is False and checks["answers_parse"] is True
    assert "no_split_overlap: 1 questions appear in both train and test" in failure_message(result)
    assert "previous table was kept" in failure_message(result)
    assert table_counts(db) == {"train": 30, "test": 30}


@pytest.mark.parametrize(
    "config, message",
    [
        ({"source": "kaggle"}, "unknown source 'kaggle'"),
        ({"source": "local", "local_dir": "/nonexistent/gsm8k"}, "GSM8k folder not found: /nonexistent/gsm8k"),
        ({"source": "local", "limit": 0}, "limit must be at least 1"),
    ],
)
def test_bad_config_is_named_and_table_untouched(tmp_path, gsm8k_dir, instance, config, message):
    db = tmp_path / "rlvr.duckdb"
    assert run(db, instance, source="local", local_dir=str(gsm8k_dir), limit=10).success
    result = run(db, instance, **config)
    assert not result.success
    assert message in failure_message(result)
    assert table_counts(db) == {"train": 10, "test": 10}


def test_malformed_jsonl_line_is_named(tmp_path, gsm8k_dir, instance):
    db = tmp_path / "rlvr.duckdb"
    assert run(db, instance, source="local", local_dir=str(gsm8k_dir), limit=10).success
    corrupt = tmp_path / "corrupt"
    write_corrupt_copy(gsm8k_dir, corrupt, '{"question": "cut off mid-wri\n')
    result = run(db, instance, source="local", local_dir=str(corrupt))
    assert not result.success
    assert "test.jsonl line 21: malformed JSON" in failure_message(result)
    assert table_counts(db) == {"train": 10, "test": 10}


def test_gsm_symbolic_source(tmp_path, instance):
    db = tmp_path / "rlvr.duckdb"
    result = run(db, instance, source="gsm_symbolic", generated_train_size=40, generated_test_size=10)
    assert result.success
    assert table_counts(db) == {"train": 40, "test": 10}
    with duckdb.connect(str(db), read_only=True) as conn:
        assert conn.execute("SELECT DISTINCT source FROM gsm8k_problems").fetchall() == [("gsm_symbolic",)]


def test_dg_launch_on_the_shipped_files_and_a_clear_failure(tmp_path):
    """`dg launch --assets` in the project, as a user types it: the shipped GSM8k copy by default,
    no supersession or deprecation warning, a bad folder named and the table kept."""
    env = {**os.environ, "RLVR_HOME": str(tmp_path / "home"), "DAGSTER_HOME": str(tmp_path / "dagster"), "VIRTUAL_ENV": sys.prefix}
    env.pop("RLVR_GSM8K_DIR", None)
    (tmp_path / "dagster").mkdir()
    cmd = [str(Path(sys.executable).parent / "dg"), "launch", "--assets", "gsm8k_problems", "--config-json"]
    good = {"ops": {"gsm8k_problems": {"config": {"limit": 25}}}}
    ok = subprocess.run(cmd + [json.dumps(good)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert not re.findall(r"\w*(?:Supersession|Deprecation|Preview|Beta)Warning.*", ok.stdout + ok.stderr)
    assert table_counts(tmp_path / "home" / "rlvr.duckdb") == {"train": 25, "test": 25}
    bad = {"ops": {"gsm8k_problems": {"config": {"local_dir": str(tmp_path / "missing")}}}}
    failed = subprocess.run(cmd + [json.dumps(bad)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0
    assert f"GSM8k folder not found: {tmp_path / 'missing'}" in failed.stdout + failed.stderr
    assert table_counts(tmp_path / "home" / "rlvr.duckdb") == {"train": 25, "test": 25}
