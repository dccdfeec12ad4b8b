"""Traffic ingestion into a real DuckDB file, drift reports on fixtures with and without drift, and
the sensors driven through Dagster's sensor testing API."""

import json
import random
from datetime import datetime, timedelta, timezone

import duckdb
import pytest
from dagster import DagsterInstance, RunRequest, SensorResult, SkipReason, build_sensor_context, materialize

from resources import MLflowResource, ModelStore, Upsert, Warehouse
from rlvr.monitoring.traffic import TrafficLog
from rlvr_assets import data, monitoring
from sensors import drift_sensor, traffic_sensor
from support.pipeline import register_champion

pytestmark = pytest.mark.slow  # materializes Dagster partitions and runs sensors

OFF_TOPIC = [
    "Write a haiku about the autumn sea and the moon over the harbor.",
    "Translate 'where is the train station' into French, German and Italian.",
    "Summarize the plot of Hamlet in two sentences for a school newsletter.",
    "Explain how a Python decorator works and show an example with functools.wraps.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Draft a polite email declining a meeting invitation next Tuesday afternoon.",
]


TODAY = datetime.now(timezone.utc).date()
DAY, NEXT_DAY = (TODAY - timedelta(days=3)).isoformat(), (TODAY - timedelta(days=2)).isoformat()  # within the partitions (traffic_start)


def at(day: str, hour: int = 10) -> int:
    """A clock for TrafficLog fixed at ``hour`` o'clock UTC of ``day``, in ns."""
    return int(datetime.fromisoformat(day).replace(hour=hour, tzinfo=timezone.utc).timestamp()) * 10**9


def traffic_record(prompt, well_formed=True, vote_share=0.75, model_version="v1", day=DAY):
    completion = "Step one.\n#### 12" if well_formed else "I think the answer is twelve."
    return {
        "timestamp": f"{day}T10:00:{random.random() * 59:06.3f}+00:00",
        "request_id": f"r{random.random()}",
        "endpoint": "/solve",
        "model_version": model_version,
        "status": 200,
        "latency_s": 0.3,
        "prompt": prompt,
        "answer": "12",
        "answers": ["12"] * 4,
        "vote_share": vote_share,
        "completions": [completion] * 4,
        "completion_tokens": [9] * 4,
        "finish_reasons": ["answer"] * 4,
    }


def write_traffic(folder, prompts, day=DAY, **kwargs):
    log = TrafficLog(folder, clock=lambda: at(day))
    for prompt in prompts:
        log.append(traffic_record(prompt, day=day, **kwargs))


@pytest.fixture
def env(tmp_path, gsm8k_dir, monkeypatch):
    monkeypatch.setenv("RLVR_HOME", str(tmp_path))
    traffic = tmp_path / "traffic"
    mlflow = MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=str(tmp_path / "mlartifacts"))
    resources = {"duckdb": Warehouse(database=str(tmp_path / "rlvr.duckdb")), "mlflow": mlflow, "model_store": ModelStore(root=str(tmp_path / "models"))}
    with DagsterInstance.ephemeral() as instance:
        assert materialize(
            [data.gsm8k_problems],
            resources=resources,
            instance=instance,
            run_config={"ops": {"gsm8k_problems": {"config": {"local_dir": str(gsm8k_dir), "limit": 400}}}},
        ).success
        yield {
            "instance": instance,
            "resources": resources,
            "traffic": traffic,
            "db": tmp_path / "rlvr.duckdb",
            "questions": [json.loads(line)["question"] for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()],
        }


def ingest_and_report(env, day=DAY, **drift_config):
    config = {
        "ops": {
            "serving_traffic": {"config": {"folder": str(env["traffic"])}},
            "drift_report": {"config": {"window": 120, "min_requests": 20, "reference_size": 400, **drift_config}},
        }
    }
    result = materialize(
        [monitoring.serving_traffic, monitoring.drift_report],
        resources=env["resources"],
        run_config=config,
        instance=env["instance"],
        selection=None,
        partition_key=day,
    )
    assert result.success
    return {k: v.value for k, v in result.asset_materializations_for_node("drift_report")[0].metadata.items()}


def sensor_context(env, cursor=None):
    return build_sensor_context(instance=env["instance"], cursor=cursor, resources={k: env["resources"][k] for k in ("mlflow", "model_store")})


def count_rows(env):
    with duckdb.connect(str(env["db"]), read_only=True) as conn:
        return conn.execute("SELECT count(*) FROM serving_traffic").fetchone()[0]


def test_ingestion_is_incremental_and_survives_malformed_lines(env):
    write_traffic(env["traffic"], env["questions"][:30])
    log_file = next(env["traffic"].glob("traffic-*.jsonl"))
    with open(log_file, "a") as f:
        f.write("this is not json\n")
        f.write(json.dumps(traffic_record(env["questions"][30])) + "\n")
        f.write('{"prompt": "half a li')  # the service is mid-write
    config = {"ops": {"serving_traffic": {"config": {"folder": str(env["traffic"])}}}}
    first = materialize([monitoring.serving_traffic], resources=env["resources"], run_config=config, instance=env["instance"], partition_key=DAY)
    meta = first.asset_materializations_for_node("serving_traffic")[0].metadata
    assert meta["new_rows"].value == 31 and meta["malformed_lines"].value == 1
    assert count_rows(env) == 31
    with duckdb.connect(str(env["resources"]["duckdb"].database), read_only=True) as conn:  # the answering policy of each row
        assert conn.execute("SELECT DISTINCT model_version FROM serving_traffic").fetchall() == [("v1",)]
    materialize([monitoring.serving_traffic], resources=env["resources"], run_config=config, instance=env["instance"], partition_key=DAY)
    assert count_rows(env) == 31  # re-run: no duplicates
    with open(log_file, "a") as f:
        f.write('ne", "status": 200}\n')
    materialize([monitoring.serving_traffic], resources=env["resources"], run_config=config, instance=env["instance"], partition_key=DAY)
    assert count_rows(env) == 32  # the completed line, once


def test_clean_traffic_does_not_drift_and_requests_no_run(env):
    write_traffic(env["traffic"], env["questions"][:120])
    report = ingest_and_report(env)
    assert report["drifted"] is False, report["metrics"]
    assert report["requests"] == 120 and "psi_num_words" in report and "mmd" in report
    context = sensor_context(env)
    assert isinstance(drift_sensor(context), SkipReason)


def test_drifted_traffic_requests_exactly_one_run_per_episode(env):
    prompts = [f"{OFF_TOPIC[i % len(OFF_TOPIC)]} (request {i})" for i in range(120)]
    write_traffic(env["traffic"], prompts, well_formed=False)
    report = ingest_and_report(env)
    assert report["drifted"] is True
    assert any(reason.startswith(("psi/", "ks/", "mmd", "mean_cosine")) for reason in report["drift_reasons"])
    skipped = drift_sensor(sensor_context(env))  # no champion yet: retraining (from the champion) cannot start
    assert isinstance(skipped, SkipReason) and "the registry has no champion to retrain from" in skipped.skip_message
    register_champion(env["resources"]["mlflow"], env["db"].parent, "v1")
    context = sensor_context(env)
    requests = drift_sensor(context)
    assert len(requests) == 1 and isinstance(requests[0], RunRequest)
    assert requests[0].tags["rlvr/trigger"] == "drift" and requests[0].tags["rlvr/drift_reasons"]
    assert requests[0].tags["rlvr/tasks"] == '{"gsm8k": 1.0}'  # a champion that records no tasks retrains on GSM8k
    # the same episode goes on: a second drifted report requests nothing new
    write_traffic(env["traffic"], prompts[:10], well_formed=False)
    assert ingest_and_report(env)["drifted"] is True
    again = sensor_context(env, context.cursor)
    assert isinstance(drift_sensor(again), SkipReason)


def sensor_requests(result):
    return result.run_requests if isinstance(result, SensorResult) else []


def test_traffic_sensor_requests_the_days_whose_logs_grew(env, monkeypatch):
    context = build_sensor_context(instance=env["instance"])
    assert isinstance(traffic_sensor(context), SkipReason)
    write_traffic(env["traffic"], env["questions"][:3])
    write_traffic(env["traffic"], env["questions"][3:5], day=NEXT_DAY)
    write_traffic(env["traffic"], env["questions"][5:6], day=(TODAY - timedelta(days=400)).isoformat())  # before the first partition
    requests = sensor_requests(traffic_sensor(context))
    assert [r.partition_key for r in requests] == [DAY, NEXT_DAY] and all(r.job_name in (None, "monitoring") for r in requests)
    context = build_sensor_context(instance=env["instance"], cursor=traffic_sensor(context).cursor)
    assert sensor_requests(traffic_sensor(context)) == []  # nothing grew since
    write_traffic(env["traffic"], env["questions"][6:7], day=NEXT_DAY)
    again = sensor_requests(traffic_sensor(context))
    assert [r.partition_key for r in again] == [NEXT_DAY] and again[0].run_key not in {r.run_key for r in requests}


def test_each_day_is_its_own_partition_and_a_backfill_rebuilds_one(env):
    write_traffic(env["traffic"], env["questions"][:120])
    prompts = [f"{OFF_TOPIC[i % len(OFF_TOPIC)]} (request {i})" for i in range(120)]
    write_traffic(env["traffic"], prompts, day=NEXT_DAY, well_formed=False)
    drifted = ingest_and_report(env, day=NEXT_DAY)
    assert drifted["drifted"] is True and drifted["requests"] == 120
    assert count_rows(env) == 120  # only that day's files were read
    clean = ingest_and_report(env, day=DAY)
    assert clean["drifted"] is False and clean["requests"] == 120 and count_rows(env) == 240
    warehouse = env["resources"]["duckdb"]  # a day's rows damaged: a backfill with reread restores them
    damaged = warehouse.query(f"SELECT * FROM serving_traffic WHERE starts_with(source_file, 'traffic-{DAY.replace('-', '')}T')")
    warehouse.write(Upsert("serving_traffic", damaged.assign(well_formed=None), "record_id"))
    assert count_rows(env) == 240 and warehouse.query("SELECT count(well_formed) AS n FROM serving_traffic")["n"].iloc[0] == 120
    config = {"ops": {"serving_traffic": {"config": {"folder": str(env["traffic"]), "reread": True}}}}
    rebuilt = materialize([monitoring.serving_traffic], resources=env["resources"], run_config=config, instance=env["instance"], partition_key=DAY)
    assert rebuilt.asset_materializations_for_node("serving_traffic")[0].metadata["new_rows"].value == 120
    with duckdb.connect(str(env["db"]), read_only=True) as conn:
        assert conn.execute("SELECT count(*), count(well_formed) FROM serving_traffic").fetchone() == (240, 240)


def test_a_day_without_traffic_is_an_empty_partition(env):
    write_traffic(env["traffic"], env["questions"][:3], day=NEXT_DAY)
    report = ingest_and_report(env)  # DAY has no log file: nothing to read, nothing to report
    assert report["drifted"] is False and report["requests"] == 0
    assert ingest_and_report(env, day=NEXT_DAY)["requests"] == 3  # the other day has its rows
    assert ingest_and_report(env)["requests"] == 0 and count_rows(env) == 3  # and the empty day stays empty once the table exists


def test_a_backfilled_past_day_does_not_start_a_retraining(env):
    prompts = [f"{OFF_TOPIC[i % len(OFF_TOPIC)]} (request {i})" for i in range(120)]
    write_traffic(env["traffic"], env["questions"][:120], day=NEXT_DAY)
    assert ingest_and_report(env, day=NEXT_DAY)["drifted"] is False
    context = sensor_context(env)
    assert isinstance(drift_sensor(context), SkipReason)
    write_traffic(env["traffic"], prompts, well_formed=False)  # an older day, drifted, backfilled afterwards
    assert ingest_and_report(env, day=DAY)["drifted"] is True
    assert isinstance(drift_sensor(sensor_context(env, context.cursor)), SkipReason)
