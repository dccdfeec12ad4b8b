"""One DuckDB writer at a time, enforced by the instance: every asset that writes the warehouse is in
one pool, the instance configs (local, docker, Helm) hold one step of it at a time, and two writers
launched at once on a real instance with deploy/local/dagster.yaml queue: the second waits for the first."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dagster import DagsterEventType, DagsterInstance

from resources import WRITER_POOL
from rlvr_assets.definitions import defs
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
WRITERS = {
    "gsm8k_problems",
    "baseline_eval",
    "eval_report",
    "policy_evaluation",
    "serving_traffic",
    "drift_report",
    "task_problems",
    "task_evaluation",
    "cross_task_report",
}

# Materializes gsm8k_problems alone (no run tag: a single-asset materialization) on the instance in argv[1];
# with argv[4], its write first says it is in the step (argv[4]) and waits for argv[4].release.
WRITER = """
import json, sys, time
from pathlib import Path
from dagster import DagsterInstance, materialize
from resources import Warehouse
from rlvr_assets import data

class Held(Warehouse):
    def write(self, *writes):
        if len(sys.argv) > 4:
            Path(sys.argv[4]).touch()
            while not Path(sys.argv[4] + ".release").exists():
                time.sleep(0.05)
        super().write(*writes)

with DagsterInstance.from_config(sys.argv[1]) as instance:
    result = materialize([data.gsm8k_problems], resources={"duckdb": Held(database=sys.argv[2], lock_wait_s=5)},
                         run_config=json.loads(sys.argv[3]), instance=instance, raise_on_error=False)
sys.exit(0 if result.success else 1)
"""


def test_every_warehouse_writer_is_in_the_one_writer_pool():
    pools = {node.key.to_user_string(): node.pools for node in defs.resolve_asset_graph().asset_nodes}
    assert {name for name, pool in pools.items() if WRITER_POOL in pool} == WRITERS


def test_every_instance_config_holds_one_step_of_an_unconfigured_pool():
    for path in (ROOT / "deploy/local/dagster.yaml", ROOT / "deploy/docker/dagster.yaml"):
        pools = yaml.safe_load(path.read_text())["concurrency"]["pools"]
        assert pools == {"default_limit": 1, "granularity": "op"}, path
    helm = yaml.safe_load((ROOT / "deploy/k8s/dagster-values.yaml").read_text())["concurrency"]["pools"]
    assert helm == {"defaultLimit": 1, "granularity": "op"}  # the chart renders it as dagster.yaml's concurrency.pools


def events(instance: DagsterInstance, event_type: DagsterEventType) -> dict[str, float]:
    """run id -> timestamp of its first event of ``event_type``."""
    found: dict[str, float] = {}
    for run in instance.get_runs():
        for entry in instance.all_logs(run.run_id, of_type=event_type):
            found.setdefault(run.run_id, entry.timestamp)
    return found


def blocked_runs(instance: DagsterInstance) -> set[str]:
    """Runs with a step that waited for the writer pool (Dagster's engine event)."""
    return {r.run_id for r in instance.get_runs() for e in instance.all_logs(r.run_id) if f"blocked by limit for pool {WRITER_POOL}" in (e.message or "")}


@pytest.mark.slow  # materializes in two processes
def test_two_writers_launched_at_once_queue_on_a_real_instance(tmp_path, gsm8k_dir):
    home = tmp_path / "dagster"
    home.mkdir()
    shutil.copy(ROOT / "deploy/local/dagster.yaml", home / "dagster.yaml")  # what make ui's instance reads
    config = json.dumps({"ops": {"gsm8k_problems": {"config": {"local_dir": str(gsm8k_dir), "limit": 30}}}})
    database, held = str(tmp_path / "rlvr.duckdb"), tmp_path / "in-step"
    first = subprocess.Popen([sys.executable, "-c", WRITER, str(home), database, config, str(held)])
    second = None
    try:
        wait_for(lambda: held.exists() or first.poll() is not None, 120, "the first writer to be in its step")
        assert first.poll() is None, "the first writer ended before its write"
        second = subprocess.Popen([sys.executable, "-c", WRITER, str(home), database, config])
        with DagsterInstance.from_config(str(home)) as instance:
            blocked = wait_for(lambda: blocked_runs(instance), 120, "the second writer to wait for the pool")
            held.with_name(held.name + ".release").touch()
            assert first.wait(120) == 0 and second.wait(120) == 0
            started, succeeded = events(instance, DagsterEventType.STEP_START), events(instance, DagsterEventType.STEP_SUCCESS)
    finally:
        held.with_name(held.name + ".release").touch()
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
    (waiting_run,) = blocked
    (other_run,) = set(started) - {waiting_run}
    assert started[waiting_run] >= succeeded[other_run]  # it started its step only once the first writer's was done
