"""End to end on a tiny policy: data -> base -> GRPO -> evaluation -> promotion gate -> Bento,
real DuckDB, model store, MLflow store and BentoML store under a temporary RLVR_HOME."""

import importlib.metadata

import duckdb
import pytest
from dagster import AssetKey, DagsterInstance, materialize

from resources.tracking import CHAMPION, POLICY_VERSION_TAG
from rlvr.rewards import register_reward
from rlvr_assets import data, evaluation, registry, serving, training
from support.pipeline import PROTOCOL, TRAINING, resources_for, run_config

pytestmark = pytest.mark.slow  # materializes the pipeline and trains


def test_training_path_end_to_end(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        result = materialize(TRAINING, resources=res, run_config=run_config(gsm8k_dir, tiny_llama_dir), instance=instance)
        assert result.success
        with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
            assert conn.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 2 * 2 * 2  # steps x prompts x G
            names = {r[0] for r in conn.execute("SELECT DISTINCT reward_name FROM rewards").fetchall()}
            assert names == {"math_answer", "format", "total"}
            roles = dict(conn.execute("SELECT policy_role, count(*) FROM eval_results GROUP BY 1").fetchall())
            assert roles == {"base_policy": 4, "grpo_checkpoint": 4}  # the policies' stores: a role belongs to a report
        trained = res["model_store"].latest("grpo_checkpoint")
        assert not any((home / "models" / ".work" / "grpo-runs").iterdir())  # resume points removed once complete
        assert trained.manifest["steps"] == 2 and trained.manifest["parent_version"] == res["model_store"].latest("base_policy").version
        report = result.asset_materializations_for_node("eval_report")[0].metadata
        assert "vs base" in report["report"].value and "![accuracy.png]" in report["report"].value
        client = res["mlflow"].client()
        training_run = client.get_run(trained.manifest["mlflow_run_id"])
        assert len(client.get_metric_history(training_run.info.run_id, "reward_mean")) == 2
        assert "sample_completions.json" in {a.path for a in client.list_artifacts(training_run.info.run_id)}
        (policy,) = training_run.outputs.model_outputs  # the checkpoint as an MLflow model of the run
        assert training_run.info.run_name == f"grpo-{trained.version}-run-{result.run_id[:8]}" and "step" not in training_run.data.metrics
        champion = res["mlflow"].registry().version_for(CHAMPION)
        assert champion.tags[POLICY_VERSION_TAG] == trained.version  # first policy: promoted, no champion before
        assert champion.source == client.get_logged_model(policy.model_id).artifact_location
        eval_run = client.get_run(report["MLflow evaluation run"].value.split("/runs/")[1].split("?")[0])
        headline = {name for name in eval_run.data.metrics if not name.startswith("cost/")}
        assert len(headline) == 6 and eval_run.info.end_time - eval_run.info.start_time > 500  # the evaluation's own duration
        assert eval_run.data.metrics["cost/cpu_core_s"] > 0  # and what it cost
        gate = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert gate["promotion_gate"] is True

        # the baseline is reused, not recomputed, when only the trained policy changes
        again = materialize([evaluation.baseline_eval], resources=res, run_config={"ops": {"baseline_eval": {"config": PROTOCOL}}}, instance=instance)
        assert again.asset_materializations_for_node("baseline_eval")[0].metadata["reused"].value is True


def test_bento_is_built_once_per_champion(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        assert materialize(TRAINING, resources=res, run_config=run_config(gsm8k_dir, tiny_llama_dir, steps=1), instance=instance).success
        installed = {d.metadata["Name"] for d in importlib.metadata.distributions()}
        first = materialize([serving.bento], resources=res, instance=instance)
        assert {d.metadata["Name"] for d in importlib.metadata.distributions()} == installed  # the build installed nothing
        meta = first.asset_materializations_for_node("bento")[0].metadata
        assert meta["bento_tag"].value.startswith("rlvr_policy:") and meta["size_mb"].value > 0
        assert "bentoml serve" in meta["serve_command"].value
        second = materialize([serving.bento], resources=res, instance=instance)
        assert second.success and not second.asset_materializations_for_node("bento")  # champion unchanged: no new Bento
        assert instance.get_latest_materialization_event(AssetKey("bento")).run_id == first.run_id


def test_grpo_on_the_embedded_model(home, gsm8k_dir, embedded_policy, session_store):
    """rollouts -> rewards -> grpo_checkpoint on the real SmolLM2-135M with the local GSM8k source."""
    res = {**resources_for(home), "model_store": session_store}
    config = {
        "ops": {
            "gsm8k_problems": {"config": {"local_dir": str(gsm8k_dir), "limit": 20}},
            "grpo_training": {"config": {"overrides": {"total_steps": 1, "prompts_per_step": 2, "group_size": 4, "sampling": {"max_new_tokens": 48}}}},
        }
    }
    with DagsterInstance.ephemeral() as instance:
        result = materialize([data.gsm8k_problems, training.grpo_training], resources=res, run_config=config, instance=instance)
    assert result.success
    with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
        rows = conn.execute("SELECT completion, finish_reason, completion_tokens FROM rollouts").fetchall()
        totals = [r[0] for r in conn.execute("SELECT value FROM rewards WHERE reward_name = 'total'").fetchall()]
    assert len(rows) == 8 and len(totals) == 8 and all(0 <= t <= 1 for t in totals)
    assert all(text.strip() and tokens <= 48 for text, _, tokens in rows)  # real text from the real model
    trained = session_store.latest("grpo_checkpoint")
    assert trained.manifest["base_policy_version"] == embedded_policy.version
    assert trained.manifest["data_source"] == "local" and trained.manifest["steps"] == 1
    metadata = result.asset_materializations_for_node("grpo_training")
    assert {m.asset_key.to_user_string() for m in metadata} == {"rollouts", "rewards", "grpo_checkpoint"}


@register_reward("test_completion_length", replace=True)
def completion_length(completion: str, **_) -> float:
    return min(1.0, len(completion) / 400)


def test_retraining_starts_from_the_champion_and_rebuilds_the_bento(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        assert materialize(TRAINING + [serving.bento], resources=res, instance=instance, run_config=run_config(gsm8k_dir, tiny_llama_dir, steps=1)).success
        first_champion = res["mlflow"].registry().version_for(CHAMPION).tags[POLICY_VERSION_TAG]
        first_bento = instance.get_latest_materialization_event(AssetKey("bento")).asset_materialization.metadata

        config = run_config(gsm8k_dir, tiny_llama_dir, steps=1, init_from="champion", seed=1)
        # a random tiny policy never answers right: a reward with variance makes the update move the weights
        config["ops"]["grpo_training"]["config"]["rewards"] = {"test_completion_length": 1.0}
        retrain = [training.grpo_training, evaluation.eval_report, registry.champion_policy, serving.bento]
        result = materialize(
            retrain,
            resources=res,
            run_config={"ops": {k: v for k, v in config["ops"].items() if k in ("grpo_training", "eval_report")}},
            instance=instance,
            selection=[key for a in retrain for key in a.keys],
        )
        assert result.success
        retrained = res["model_store"].latest("grpo_checkpoint")
        assert retrained.manifest["parent_version"] == first_champion and retrained.version != first_champion
        champion = res["mlflow"].registry().version_for(CHAMPION).tags[POLICY_VERSION_TAG]
        gate = {e.check_name: e for e in result.get_asset_check_evaluations()}["promotion_gate"]
        bento = result.asset_materializations_for_node("bento")
        if gate.passed:  # promoted: a new Bento around the new champion
            assert champion == retrained.version and bento[0].metadata["model_version"].value == retrained.version
            assert bento[0].metadata["bento_tag"].value != first_bento["bento_tag"].value
        else:  # refused: the champion and its Bento stay
            assert champion == first_champion and not bento
