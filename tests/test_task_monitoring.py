"""Monitoring a policy of another task than GSM8k: traffic held to the task's own format, drift per task
against the task's own training questions, and retraining on the champion's own mixture. Real DuckDB file,
real Dagster materializations and sensor ticks; traffic written as the service writes it (TrafficLog)."""

import json
import logging
from datetime import datetime, timedelta, timezone

import duckdb
import pandas as pd
import pytest
from dagster import DagsterInstance, RunRequest, build_sensor_context, materialize, validate_run_config

from resources import MLflowResource, ModelStore, Warehouse
from rlvr.answers import is_well_formed
from rlvr.monitoring.traffic import TrafficLog
from rlvr_assets import monitoring, tasks
from sensors import drift_sensor
from sensors.drift import champion_tasks
from support.pipeline import register_champion

pytestmark = pytest.mark.slow  # materializes Dagster partitions and runs sensors

ARITHMETIC = "reasoning_gym:basic_arithmetic"
TODAY = datetime.now(timezone.utc).date()
DAY, NEXT_DAY = (TODAY - timedelta(days=3)).isoformat(), (TODAY - timedelta(days=2)).isoformat()  # within the partitions
TAGGED = "Add the terms left to right.\n<answer>42</answer>"  # a reasoning-gym completion: one constant length


def at(day: str) -> int:
    return int(datetime.fromisoformat(day).replace(hour=10, tzinfo=timezone.utc).timestamp()) * 10**9


def service_record(prompt: str, i: int, day: str, task: str | None = ARITHMETIC, endpoint: str = "/solve", completion: str = TAGGED) -> dict:
    """A traffic record as the service writes it (``task``: the task the request was rendered with; None: left out, as before)."""
    record = {
        "timestamp": f"{day}T10:{i // 60:02d}:{i % 60:02d}+00:00",
        "request_id": f"{day}-{i}",
        "endpoint": endpoint,
        "model_version": "rg1",
        "status": 200,
        "latency_s": 0.3,
        "prompt": prompt,
        "answer": "42",
        "answers": ["42"] * 4,
        "vote_share": 1.0,
        "completions": [completion] * 4,
        "completion_tokens": [12] * 4,
        "finish_reasons": ["stop"] * 4,
    }
    return record | ({"task": task} if task is not None else {})


def write_traffic(folder, records, day):
    log = TrafficLog(folder, clock=lambda: at(day))
    for record in records:
        log.append(record)


@pytest.fixture
def env(tmp_path, monkeypatch, gsm8k_dir):
    """A warehouse holding the arithmetic task's problems, and a stored policy trained on that task alone."""
    monkeypatch.setenv("RLVR_HOME", str(tmp_path))
    mlflow = MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=str(tmp_path / "mlartifacts"))
    resources = {"duckdb": Warehouse(database=str(tmp_path / "rlvr.duckdb")), "mlflow": mlflow, "model_store": ModelStore(root=str(tmp_path / "models"))}
    resources["model_store"].put("grpo_checkpoint", lambda folder: (folder / "config.json").write_text("{}"), "rg1", {"tasks": {ARITHMETIC: 1.0}})
    with DagsterInstance.ephemeral() as instance:
        options = {"options": {"train_size": 400, "test_size": 120}}
        assert materialize(
            [tasks.task_problems], resources=resources, instance=instance, partition_key=ARITHMETIC, run_config={"ops": {"task_problems": {"config": options}}}
        ).success
        problems = resources["duckdb"].task_problems(ARITHMETIC, "test")
        yield {
            "instance": instance,
            "resources": resources,
            "traffic": tmp_path / "traffic",
            "db": tmp_path / "rlvr.duckdb",
            "arithmetic": [p["question"] for p in problems],  # held out from the reference: in distribution, never seen
            "gsm8k": [json.loads(line)["question"] for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()][:120],
        }


def monitor(env, day):
    """serving_traffic then drift_report of ``day``; returns drift_report's metadata."""
    config = {
        "ops": {
            "serving_traffic": {"config": {"folder": str(env["traffic"])}},
            "drift_report": {"config": {"window": 120, "min_requests": 20, "reference_size": 400}},
        }
    }
    result = materialize(
        [monitoring.serving_traffic, monitoring.drift_report], resources=env["resources"], run_config=config, instance=env["instance"], partition_key=day
    )
    assert result.success
    return {k: v.value for k, v in result.asset_materializations_for_node("drift_report")[0].metadata.items()}


def stored(env, sql):
    with duckdb.connect(str(env["db"]), read_only=True) as conn:
        return conn.execute(sql).fetchall()


def ingest(env) -> None:
    """``serving_traffic``'s day ``DAY`` from the traffic folder."""
    materialize(
        [monitoring.serving_traffic],
        resources=env["resources"],
        run_config={"ops": {"serving_traffic": {"config": {"folder": str(env["traffic"])}}}},
        instance=env["instance"],
        partition_key=DAY,
    )


def test_a_reasoning_gym_policys_traffic_is_well_formed_by_its_own_format(env):
    write_traffic(env["traffic"], [service_record(q, i, DAY) for i, q in enumerate(env["arithmetic"][:30])], DAY)
    ingest(env)
    assert stored(env, "SELECT task, count(*), avg(well_formed) FROM serving_traffic GROUP BY 1") == [(ARITHMETIC, 30, 1.0)]
    assert not is_well_formed(TAGGED)  # the GSM8k rule the table applied before: 0% well formed


def test_drift_is_quiet_on_the_tasks_own_questions_and_fires_on_gsm8k_questions_sent_to_it(env):
    evaluation = pd.DataFrame(  # the served policy's evaluation on its task, as task_evaluation stores it
        {"problem_id": [f"p{i}" for i in range(20)], "task": ARITHMETIC, "completion": TAGGED, "well_formed": True, "reward_total": 1.0}
    ).assign(eval_id="e1", policy_version="rg1", policy_role="grpo_checkpoint", split="test", evaluated_at=pd.Timestamp("2026-01-01", tz="UTC"))
    env["resources"]["duckdb"].upsert("eval_results", evaluation, key="eval_id")
    write_traffic(env["traffic"], [service_record(q, i, DAY) for i, q in enumerate(env["arithmetic"])], DAY)
    quiet = monitor(env, DAY)
    assert quiet["drifted"] is False, quiet["drift_reasons"]
    assert quiet["requests_by_task"] == {ARITHMETIC: 120} and quiet["served_tasks"] == {ARITHMETIC: 1.0}
    assert quiet[f"[{ARITHMETIC}] format_compliance_drop"] == 0.0  # its traffic against its own evaluation's format rate
    assert f"[{ARITHMETIC}] psi_num_words" in quiet and "psi_num_words" in quiet and f"| {ARITHMETIC} | mmd |" in quiet["metrics"]

    write_traffic(env["traffic"], [service_record(q, i, NEXT_DAY) for i, q in enumerate(env["gsm8k"])], NEXT_DAY)
    drifted = monitor(env, NEXT_DAY)
    assert drifted["drifted"] is True
    assert any(reason.startswith(f"[{ARITHMETIC}] psi/") for reason in drifted["drift_reasons"])
    assert any(reason.startswith("mmd") for reason in drifted["drift_reasons"])  # the whole window, against the policy's mixture
    history = stored(env, "SELECT day, task, bool_or(drifted) FROM drift_history GROUP BY ALL ORDER BY ALL")
    assert history == [(DAY, ARITHMETIC, False), (DAY, None, False), (NEXT_DAY, ARITHMETIC, True), (NEXT_DAY, None, True)]


def test_an_older_solve_record_without_a_task_counts_as_gsm8k_and_an_openai_one_as_no_task(env):
    older = service_record("Tom has 3 apples. How many?", 0, DAY, task=None, completion="3 apples.\n#### 3")
    chat = service_record("Hello", 1, DAY, task=None, endpoint="/v1/chat/completions", completion="Hi!")
    write_traffic(env["traffic"], [older, chat], DAY)
    assert "task" not in older
    ingest(env)
    assert stored(env, "SELECT endpoint, task, well_formed FROM serving_traffic ORDER BY 1") == [("/solve", "gsm8k", 1.0), ("/v1/chat/completions", None, None)]
    current, _ = env["resources"]["duckdb"].traffic_window(DAY, 10)
    assert sorted(current["task"].fillna("-")) == ["-", "gsm8k"]


def test_retraining_trains_the_champions_own_mixture(env):
    from rlvr_assets.definitions import defs

    write_traffic(env["traffic"], [service_record(q, i, DAY) for i, q in enumerate(env["gsm8k"])], DAY)
    assert monitor(env, DAY)["drifted"] is True
    register_champion(env["resources"]["mlflow"], env["db"].parent, "rg1")
    context = build_sensor_context(instance=env["instance"], resources={k: env["resources"][k] for k in ("mlflow", "model_store")})
    (request,) = drift_sensor(context)
    assert isinstance(request, RunRequest) and json.loads(request.tags["rlvr/tasks"]) == {ARITHMETIC: 1.0}
    assert request.run_config == {"ops": {"grpo_training": {"config": {"init_from": "champion", "tasks": {ARITHMETIC: 1.0}}}}}
    assert validate_run_config(defs.resolve_job_def("retraining"), request.run_config)  # the job takes it as it is
    store = env["resources"]["model_store"]  # a champion trained before policies recorded their tasks: GSM8k's
    store.put("grpo_checkpoint", lambda folder: (folder / "config.json").write_text("{}"), "old1", {})
    assert champion_tasks(store, "old1") == {"gsm8k": 1.0} and champion_tasks(store, "rg1") == {ARITHMETIC: 1.0}


def test_a_run_from_the_champion_without_tasks_trains_the_champions_recorded_mixture(tmp_path):
    from resources import StoredModel
    from rlvr_assets.training import GRPORunConfig, with_start_tasks

    log = logging.getLogger("test")
    champion = StoredModel("grpo_checkpoint", "rg1", tmp_path, {"tasks": {ARITHMETIC: 0.7, "gsm8k": 0.3}})
    older = StoredModel("grpo_checkpoint", "old1", tmp_path, {})  # trained before policies recorded their tasks
    assert with_start_tasks(GRPORunConfig(init_from="champion"), champion, log).tasks == {ARITHMETIC: 0.7, "gsm8k": 0.3}
    assert with_start_tasks(GRPORunConfig(init_from="champion"), older, log).tasks is None  # one task, GSM8k, with its rewards
    gsm8k_only = StoredModel("grpo_checkpoint", "g1", tmp_path, {"tasks": {"gsm8k": 1.0}})
    assert with_start_tasks(GRPORunConfig(init_from="champion", rewards={"math_answer": 1.0}), gsm8k_only, log).tasks is None
    assert with_start_tasks(GRPORunConfig(init_from="champion", tasks={"gsm8k": 1.0}), champion, log).tasks == {"gsm8k": 1.0}  # set: kept
    assert with_start_tasks(GRPORunConfig(init_from="base"), champion, log).tasks is None  # not a retraining: GSM8k with its rewards
