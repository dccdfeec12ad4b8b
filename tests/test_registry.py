"""The MLflow resource against a real local store: runs, the evaluation record, the champion/challenger registry."""

import json
import time

import mlflow
import pandas as pd
import pytest

from resources import MLflowResource, StoredModel
from resources.tracking import CHALLENGER, CHAMPION, EVAL_PROTOCOL_TAG, POLICY_VERSION_TAG, flat_params
from rlvr.evaluation import decide_promotion


@pytest.fixture
def tracking(tmp_path):
    resource = MLflowResource(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        artifact_location=str(tmp_path / "artifacts"),
        registered_model="test-policy",
    )
    resource.activate()
    return resource


def logged_checkpoint(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(folder), artifact_path="checkpoint")
    return f"runs:/{run.info.run_id}/checkpoint", run.info.run_id


def test_register_alias_promote_refuse(tracking, tmp_path):
    registry = tracking.registry()
    assert registry.version_for(CHAMPION) is None

    source, run_id = logged_checkpoint(tmp_path, "first")
    first = registry.register("v1", source, run_id, {"data_hash": "abc", "base_policy": "v0", "eval.strict_accuracy": 0.1})
    assert str(registry.version_for(CHALLENGER).version) == first
    decision = decide_promotion(None, [True, False, False, False])
    registry.record_decision(first, decision.promote, decision.reason)
    assert str(registry.version_for(CHAMPION).version) == first

    source, run_id = logged_checkpoint(tmp_path, "second")
    second = registry.register("v2", source, run_id, {"data_hash": "abc"})
    assert str(registry.version_for(CHALLENGER).version) == second
    worse = decide_promotion([True] * 30 + [False] * 10, [False] * 30 + [True] * 2 + [False] * 8, alpha=0.05)
    assert not worse.promote
    registry.record_decision(second, worse.promote, worse.reason)
    assert str(registry.version_for(CHAMPION).version) == first  # refused: champion unchanged
    refused = tracking.client().get_model_version(tracking.registered_model, second)
    assert refused.tags["promotion.verdict"] == "refused"
    assert "kept champion" in refused.tags["promotion.reason"]
    kept = tracking.client().get_model_version(tracking.registered_model, first)
    assert kept.tags["data_hash"] == "abc" and kept.tags["eval.strict_accuracy"] == "0.1"

    source, run_id = logged_checkpoint(tmp_path, "third")
    third = registry.register("v3", source, run_id, {})
    assert registry.register("v3", source, run_id, {}) == third  # idempotent per policy version
    better = decide_promotion([True] * 2 + [False] * 8, [True] * 6 + [False] * 4)
    registry.record_decision(third, better.promote, better.reason)
    assert str(registry.version_for(CHAMPION).version) == third


def test_runs_params_metrics_artifacts_and_the_evaluation_record(tracking, tmp_path):
    client = tracking.client()
    with tracking.start_run("train", {"rlvr.kind": "training"}) as run:
        run.log_params(flat_params({"grpo": {"lr": 1e-6, "sampling": {"max_new_tokens": 8}}, "rewards": {"format": 0.2}}))
        for step in (1, 2):
            run.log_metrics({"reward_mean": 0.1 * step, "checkpoint": "/tmp/x", "done": True}, step=step)
        checkpoint = tmp_path / "ckpt"
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text("{}")
        run.log_artifacts(checkpoint, "checkpoint")
        run.log_table(pd.DataFrame({"completion": ["#### 1"], "reward": [1.0]}), "sample_completions.json")
    logged = client.get_run(run.run_id)
    assert logged.info.status == "FINISHED" and logged.data.tags["rlvr.kind"] == "training"
    assert logged.data.params == {"grpo.lr": "1e-06", "grpo.sampling.max_new_tokens": "8", "rewards.format": "0.2"}
    assert set(logged.data.metrics) == {"reward_mean"}  # strings and booleans are not metrics
    assert tracking.metric_history(run.run_id, ("reward_mean",)) == {"reward_mean": [(1, 0.1), (2, 0.2)]}
    assert {a.path for a in client.list_artifacts(run.run_id)} == {"checkpoint", "sample_completions.json"}
    downloaded = tracking.download_checkpoint(f"runs:/{run.run_id}/checkpoint")
    assert (downloaded / "config.json").read_text() == "{}"

    assert tracking.latest_evaluation("v1") is None
    protocol = {"split": "test", "limit": 4, "ks": [1]}
    with pytest.raises(RuntimeError):
        with tracking.start_run("eval-v1", {"rlvr.kind": "evaluation", "rlvr.policy_version": "v1"}) as failed:
            failed.set_tags({EVAL_PROTOCOL_TAG: json.dumps(protocol)})
            raise RuntimeError("the evaluation broke")
    assert client.get_run(failed.run_id).info.status == "FAILED"
    assert tracking.latest_evaluation("v1") is None  # a failed run is no evaluation
    with tracking.start_run("eval-v1", {"rlvr.kind": "evaluation", "rlvr.policy_version": "v1"}) as evaluation:
        evaluation.log_metrics({"trained.pass@1_strict": 0.5, "trained.num_problems": 4})
        evaluation.log_files({"report.md": "# report", "accuracy.png": b"\x89PNG"}, artifact_path="report")
        evaluation.set_tags({EVAL_PROTOCOL_TAG: json.dumps(protocol)})
    found = tracking.latest_evaluation("v1")
    assert found.run_id == evaluation.run_id and found.protocol == protocol
    assert found.metrics == {"trained.pass_at_1_strict": 0.5, "trained.num_problems": 4.0}  # "@" is not allowed in MLflow names
    assert {a.path for a in client.list_artifacts(evaluation.run_id, "report")} == {"report/report.md", "report/accuracy.png"}

    trained = StoredModel("grpo_checkpoint", "v1", tmp_path, {"mlflow_run_id": run.run_id, "data_hash": "abc"})
    version = tracking.registry().register_trained(trained, found)
    tags = client.get_model_version(tracking.registered_model, version).tags
    assert tags["data_hash"] == "abc" and tags["eval.pass_at_1_strict"] == "0.5" and tags["eval.mlflow_run_id"] == found.run_id
    assert tags[POLICY_VERSION_TAG] == "v1" and str(tracking.registry().version_for(CHALLENGER).version) == version


def test_a_run_with_system_metrics_logs_the_machines_use_over_time(tmp_path):
    resource = MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=str(tmp_path / "art"), system_metrics_interval_s=0.5)
    with resource.start_run("busy", system_metrics=True) as run:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            pass
    history = resource.client().get_metric_history(run.run_id, "system/cpu_utilization_percentage")
    assert len(history) >= 2 and all(0 <= point.value <= 100 for point in history)
    with resource.start_run("quiet") as run:  # without: nothing sampled
        pass
    assert not any(name.startswith("system/") for name in resource.client().get_run(run.run_id).data.metrics)
