"""Traffic retention: the monitoring assets materialized on a real DuckDB file and real log files of several
days, written as the service writes them (``TrafficLog``); expired days' files and rows go, the rest stays."""

from datetime import date, datetime, timedelta, timezone
from typing import NamedTuple

import duckdb
import pandas as pd
import pytest
from dagster import DagsterInstance, build_sensor_context, materialize

from resources import ModelStore, Upsert, Warehouse
from resources.warehouse import Delete
from rlvr.monitoring.traffic import RETENTION_DAYS_ENV, TrafficLog, delete_expired_files, file_day, first_kept_day
from rlvr_assets import monitoring
from sensors import traffic_sensor


class Calendar(NamedTuple):
    """The days a test writes, from today as the test starts (not as the module loads: a run may cross midnight)."""

    today: date
    expired: list[str]  # past a 3-day retention, within the partitions
    kept: list[str]  # the first day kept, and yesterday


@pytest.fixture
def calendar() -> Calendar:
    today = datetime.now(timezone.utc).date()
    return Calendar(today, [(today - timedelta(days=n)).isoformat() for n in (6, 4)], [(today - timedelta(days=n)).isoformat() for n in (3, 1)])


def at(day: str, hour: int = 10) -> int:
    """A clock for TrafficLog fixed at ``hour`` o'clock UTC of ``day``, in ns."""
    return int(datetime.fromisoformat(day).replace(hour=hour, tzinfo=timezone.utc).timestamp()) * 10**9


def record(day: str, i: int) -> dict:
    return {"timestamp": f"{day}T10:00:00+00:00", "request_id": f"{day}-{i}", "status": 200, "prompt": f"secret question {i} of {day}"}


def write_day(folder, day: str, requests: int, max_bytes: int = 16 * 2**20) -> None:
    log = TrafficLog(folder, max_bytes=max_bytes, clock=lambda: at(day))
    for i in range(requests):
        log.append(record(day, i))


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVR_HOME", str(tmp_path))
    monkeypatch.delenv(RETENTION_DAYS_ENV, raising=False)
    with DagsterInstance.ephemeral() as instance:
        yield {"instance": instance, "traffic": tmp_path / "traffic", "duckdb": Warehouse(database=str(tmp_path / "rlvr.duckdb"))}


def monitor(env, day: str, raise_on_error: bool = True, **traffic_config):
    """One run of the monitoring assets for ``day``; returns serving_traffic's metadata (None when it failed)."""
    config = {
        "ops": {
            "serving_traffic": {"config": {"folder": str(env["traffic"]), **traffic_config}},
            "drift_report": {"config": {"use_embeddings": False}},  # a handful of requests: below min_requests, no verdict
        }
    }
    result = materialize(
        [monitoring.serving_traffic, monitoring.drift_report],
        resources={"duckdb": env["duckdb"], "model_store": ModelStore(root=str(env["traffic"].parent / "models"))},
        run_config=config,
        instance=env["instance"],
        partition_key=day,
        raise_on_error=raise_on_error,
    )
    if not result.success:
        return None
    return {k: v.value for k, v in result.asset_materializations_for_node("serving_traffic")[0].metadata.items()}


def failure_message(env, day: str, **traffic_config) -> str:
    config = {"ops": {"serving_traffic": {"config": {"folder": str(env["traffic"]), **traffic_config}}}}
    result = materialize(
        [monitoring.serving_traffic], resources={"duckdb": env["duckdb"]}, run_config=config, instance=env["instance"], partition_key=day, raise_on_error=False
    )
    assert not result.success
    return "\n".join(e.step_failure_data.error.to_string() for e in result.all_node_events if e.is_step_failure)


def days_on_disk(env) -> dict[str, int]:
    files = sorted(env["traffic"].glob("traffic-*.jsonl"))
    return {day: sum(file_day(f.name) == day for f in files) for day in sorted({file_day(f.name) for f in files})}


def stored(env) -> tuple[dict[str, int], set[str]]:
    """Rows stored per day, and the files named in the ingestion cursor."""
    with duckdb.connect(env["duckdb"].database, read_only=True) as conn:
        rows = conn.execute("SELECT source_file, count(*) FROM serving_traffic GROUP BY 1").fetchall()
        cursor = {name for (name,) in conn.execute("SELECT file FROM serving_traffic_cursor").fetchall()}
    per_day: dict[str, int] = {}
    for name, n in rows:
        per_day[file_day(name)] = per_day.get(file_day(name), 0) + n
    return per_day, cursor


@pytest.mark.slow  # materializes Dagster partitions
def test_expired_days_files_and_rows_are_deleted_and_the_rest_stays(env, monkeypatch, calendar):
    for day in calendar.expired + calendar.kept:
        write_day(env["traffic"], day, 5)
    write_day(env["traffic"], calendar.expired[0], 12, max_bytes=1024)  # a busy day: several files
    today_log = TrafficLog(env["traffic"])  # today's file, as the running service writes it (the real clock)
    today = calendar.today.isoformat()
    for i in range(3):
        today_log.append(record(today, i))
    for day in [*calendar.expired, *calendar.kept, today]:
        assert monitor(env, day)["expired_files_deleted"] == 0  # the default retention (30 days) keeps them all
    rows_before, cursor_before = stored(env)
    assert rows_before == {calendar.expired[0]: 17, calendar.expired[1]: 5, calendar.kept[0]: 5, calendar.kept[1]: 5, today: 3}
    files_before = days_on_disk(env)
    assert files_before[calendar.expired[0]] > 2
    sensor = build_sensor_context(instance=env["instance"])
    sensor_cursor = traffic_sensor(sensor).cursor

    monkeypatch.setenv(RETENTION_DAYS_ENV, "3")
    meta = monitor(env, calendar.kept[1])
    assert meta["retention_days"] == 3 and meta["expired_rows_deleted"] == 22 and meta["expired_files_not_deleted"] == []
    assert meta["expired_files_deleted"] == files_before[calendar.expired[0]] + files_before[calendar.expired[1]]
    assert days_on_disk(env) == {day: files_before[day] for day in [*calendar.kept, today]}
    rows_after, cursor_after = stored(env)
    assert rows_after == {calendar.kept[0]: 5, calendar.kept[1]: 5, today: 3}
    assert cursor_after == {name for name in cursor_before if file_day(name) not in calendar.expired}
    with duckdb.connect(env["duckdb"].snapshot_path, read_only=True) as conn:  # SQL sessions' copy: gone there too
        assert conn.execute(f"SELECT count(*) FROM serving_traffic WHERE prompt LIKE '%of {calendar.expired[1]}'").fetchone() == (0,)

    again = monitor(env, calendar.kept[1])  # a re-run deletes nothing more
    assert (again["expired_files_deleted"], again["expired_rows_deleted"]) == (0, 0) and stored(env) == (rows_after, cursor_after)

    # ingestion goes on: the service appends to today's file and writes yesterday's late lines; nothing is read twice
    for i in range(3, 7):
        today_log.append(record(today, i))
    write_day(env["traffic"], calendar.kept[1], 2)
    grown = traffic_sensor(build_sensor_context(instance=env["instance"], cursor=sensor_cursor)).run_requests
    assert sorted(r.partition_key for r in grown) == [calendar.kept[1], today]  # deleted files are no reason to run
    assert monitor(env, today)["new_rows"] == 4 and monitor(env, calendar.kept[1])["new_rows"] == 2
    assert stored(env)[0] == {calendar.kept[0]: 5, calendar.kept[1]: 7, today: 7}


@pytest.mark.slow  # materializes Dagster partitions
def test_a_day_past_retention_is_not_ingested(env, calendar):
    write_day(env["traffic"], calendar.expired[1], 4)
    write_day(env["traffic"], calendar.kept[0], 2)
    meta = monitor(env, calendar.expired[1], retention_days=3)  # a backfill of an expired day
    assert meta["new_rows"] == 0 and meta["dagster/row_count"] == 0 and meta["expired_files_deleted"] == 1
    assert list(days_on_disk(env)) == [calendar.kept[0]]
    assert monitor(env, calendar.kept[0], retention_days=3)["new_rows"] == 2


@pytest.mark.parametrize("days", [0, -5])
@pytest.mark.slow  # materializes Dagster partitions
def test_a_retention_of_no_days_is_refused_in_run_config(env, days, calendar):
    write_day(env["traffic"], calendar.expired[0], 2)
    assert f"retention_days must be a whole number of days, at least 1; got {days}" in failure_message(env, calendar.kept[1], retention_days=days)
    assert list(days_on_disk(env)) == [calendar.expired[0]]  # nothing deleted


@pytest.mark.parametrize("value", ["0", "-1", "thirty", "1.5"])
@pytest.mark.slow  # materializes Dagster partitions
def test_a_bad_retention_variable_is_refused_naming_it(env, monkeypatch, value, calendar):
    write_day(env["traffic"], calendar.expired[0], 2)
    monkeypatch.setenv(RETENTION_DAYS_ENV, value)
    assert f"{RETENTION_DAYS_ENV} must be a whole number of days, at least 1; got {value!r}" in failure_message(env, calendar.kept[1])
    assert list(days_on_disk(env)) == [calendar.expired[0]]


def test_first_kept_day_keeps_today_and_yesterday_at_least(calendar):
    assert first_kept_day(calendar.today, 1) == (calendar.today - timedelta(days=1)).isoformat()
    assert first_kept_day(calendar.today, 30) == (calendar.today - timedelta(days=30)).isoformat()
    with pytest.raises(ValueError, match="at least 1"):
        first_kept_day(calendar.today, 0)


@pytest.mark.slow  # materializes Dagster partitions
def test_a_file_that_cannot_be_deleted_is_reported_and_other_names_are_left_alone(env, calendar):
    write_day(env["traffic"], calendar.expired[0], 3)
    write_day(env["traffic"], calendar.expired[1], 3)
    stuck = env["traffic"] / f"traffic-{calendar.expired[1].replace('-', '')}T000000.000000000-1-stuck.jsonl"
    stuck.mkdir()  # unlink fails on a directory, whoever runs the test
    others = [env["traffic"] / "notes.jsonl", env["traffic"] / "traffic-19990101-unnamed.jsonl"]
    for path in others:
        path.write_text("{}\n")
    deleted, failed = delete_expired_files(env["traffic"], calendar.kept[0])
    assert len(deleted) == 2 and [f.split(":")[0] for f in failed] == [stuck.name]
    assert all(path.exists() for path in [stuck, *others])


def test_a_delete_is_atomic_with_the_writes_beside_it(tmp_path):
    warehouse = Warehouse(database=str(tmp_path / "rlvr.duckdb"))
    warehouse.write(Delete("serving_traffic", "true"))  # no table yet: nothing to delete
    warehouse.upsert("t", pd.DataFrame({"k": [1, 2, 3]}), key="k")
    with pytest.raises(duckdb.Error):
        warehouse.write(Delete("t", "k < ?", (3,)), Upsert("t", pd.DataFrame({"k": ["not a number"]}), key="k"))
    assert warehouse.row_count("t") == 3  # the failed write deleted nothing
    warehouse.write(Delete("t", "k < ?", (3,)))
    assert warehouse.query("SELECT k FROM t")["k"].tolist() == [3]
