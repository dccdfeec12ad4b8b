"""The champion/challenger registry flow against a real local MLflow store."""

import mlflow
import pytest

from resources import MLflowResource
from resources.tracking import CHAMPION, CHALLENGER
from rlvr.evaluation import decide_promotion


@pytest.fixture
def tracking(tmp_path):
    resource = MLflowResource(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=str(tmp_path / "artifacts"),
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
