"""The Definitions object as the UI shows it: groups, descriptions, owners, freshness, jobs, automation."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey, DefaultScheduleStatus, DefaultSensorStatus

from resources import Settings
from rlvr_assets.definitions import defs
from rlvr_assets.training import grpo_training, run_pod_tags

ROOT = Path(__file__).resolve().parents[1]
ASSET_MODULES = ("data", "models", "sft", "training", "evaluation", "registry", "serving", "monitoring", "tasks", "costs")


def test_every_asset_has_a_group_description_and_owner():
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.group_name in {"data", "models", "training", "evaluation", "serving", "monitoring", "tasks", "costs"}, key
        assert node.description and len(node.description) > 40, key
        assert node.owners, key


def test_freshness_policies_on_what_goes_stale():
    graph = defs.resolve_asset_graph()
    fresh = {k.to_user_string() for k in graph.get_all_asset_keys() if graph.get(k).freshness_policy is not None}
    assert fresh == {"champion_policy", "bento", "serving_traffic", "drift_report"}


def test_jobs_sensors_and_schedules():
    jobs = {job.name: job for job in defs.resolve_all_job_defs()}
    assert {"rlvr_pipeline", "monitoring", "retraining", "champion_evaluation"} <= set(jobs)
    for name in ("rlvr_pipeline", "monitoring", "retraining", "champion_evaluation"):
        assert jobs[name].tags["rlvr/duckdb"] == "writer"  # deploy/ runs these one at a time
    retraining = {key.to_user_string() for key in jobs["retraining"].asset_layer.executable_asset_keys}
    assert retraining == {"rollouts", "rewards", "grpo_checkpoint", "eval_report", "champion_policy", "bento"}
    sensors = {s.name: s for s in defs.sensors}
    assert sensors["drift_sensor"].job_name == "retraining" and sensors["traffic_sensor"].job_name == "monitoring"
    automation = sensors["evaluation_automation"]  # declarative automation, one DuckDB writer at a time like the jobs
    assert automation.asset_selection.resolve(defs.resolve_asset_graph()) == {AssetKey("policy_evaluation")}
    assert automation.run_tags["rlvr/duckdb"] == "writer"
    assert jobs["monitoring"].partitions_def is not None and jobs["rlvr_pipeline"].partitions_def is None
    assert all(s.default_status == DefaultSensorStatus.RUNNING for s in sensors.values())
    assert {s.name: s.default_status for s in defs.schedules} == {
        "weekly_retraining": DefaultScheduleStatus.STOPPED,
        "daily_champion_evaluation": DefaultScheduleStatus.STOPPED,
    }


def test_training_runs_ask_kubernetes_for_a_gpu_unless_their_pods_do(monkeypatch):
    tags = grpo_training.op.tags  # the default, local launcher: the run pod trains, so it gets the GPU
    resources = json.loads(tags["dagster-k8s/config"])["container_config"]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert AssetKey("grpo_checkpoint") in grpo_training.keys
    assert run_pod_tags("k8s") == {}  # K8sTrainingLauncher: the training pods hold the GPUs, the run pod follows them
    monkeypatch.setenv("RLVR_LAUNCHER", "slurm")
    with pytest.raises(ValueError, match="RLVR_LAUNCHER must be one of"):
        _ = Settings.from_env().launcher


def test_the_rl_core_knows_nothing_of_dagster():
    code = (
        "import importlib, pkgutil, sys, rlvr\n"
        "for m in pkgutil.walk_packages(rlvr.__path__, 'rlvr.'): importlib.import_module(m.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_duckdb', 'resources', 'rlvr_assets')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return names


def test_assets_use_resources_for_libraries_and_never_import_each_other():
    for name in ASSET_MODULES:
        imported = imported_modules(ROOT / "rlvr_assets" / f"{name}.py")
        libraries = {m for m in imported if m.split(".")[0] in ("mlflow", "duckdb", "dagster_duckdb", "bentoml", "bentos")}
        assert not libraries, f"rlvr_assets/{name}.py imports {libraries}: go through a resource"
        siblings = {m for m in imported if m.startswith("rlvr_assets.") and m.split(".")[1] in ASSET_MODULES}
        assert not siblings, f"rlvr_assets/{name}.py imports asset modules {siblings}"


def test_every_asset_is_short():
    for name in ASSET_MODULES:
        tree = ast.parse((ROOT / "rlvr_assets" / f"{name}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.decorator_list:
                assert node.end_lineno - node.lineno < 60, f"{name}.{node.name} is {node.end_lineno - node.lineno} lines"


def test_the_bento_is_upstream_of_the_traffic_it_serves():
    """Lineage: the graph shows which Bento produced the traffic the monitoring reads."""
    graph = defs.resolve_asset_graph()
    assert AssetKey("bento") in graph.get(AssetKey("serving_traffic")).parent_keys
