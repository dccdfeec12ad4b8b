"""The promotion gate: register the trained policy in MLflow and move ``champion`` only to a policy
at least as good as the current champion on the same problems."""

from pathlib import Path

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)
from dagster_duckdb import DuckDBResource
from pydantic import Field

from resources import ComputeResource, MLflowResource, ModelStore
from resources.tracking import CHAMPION, POLICY_VERSION_TAG
from rlvr.evaluation import decide_promotion
from rlvr_assets.evaluation import EvalProtocol, evaluate_or_reuse, load_eval_problems
from rlvr_assets.freshness import WEEKLY


class PromotionConfig(Config):
    """When a challenger may replace the champion."""

    margin: float = Field(default=0.0, description="accuracy the challenger may lose and still be promoted")
    alpha: float = Field(default=0.05, description="significance level of the one-sided 'challenger is worse' McNemar test")


@asset(
    freshness_policy=WEEKLY,
    group_name="evaluation",
    kinds={"mlflow"},
    owners=["team:rlvr-eval"],
    deps=["eval_report"],
    check_specs=[AssetCheckSpec("promotion_gate", asset="champion_policy", description="Did the challenger become champion? The reason either way.")],
)
def champion_policy(
    context: AssetExecutionContext,
    config: PromotionConfig,
    duckdb: DuckDBResource,
    model_store: ModelStore,
    compute: ComputeResource,
    mlflow: MLflowResource,
):
    """The champion after the promotion gate. The trained policy is registered in the MLflow model
    registry as a new version (alias ``challenger``) with its evaluation metrics and lineage; the
    ``champion`` alias moves to it only when it is at least as good as the current champion on the
    same problems (``margin``, ``alpha``); otherwise the version records why not."""
    report = context.instance.get_latest_materialization_event(AssetKey("eval_report"))
    if report is None or report.asset_materialization is None:
        raise Failure(description="champion_policy: eval_report has not been materialized")
    meta = {k: v.value for k, v in report.asset_materialization.metadata.items()}
    trained = model_store.get("grpo_checkpoint", meta["policy_version"])
    if trained is None:
        raise Failure(description=f"champion_policy: grpo_checkpoint {meta['policy_version']} is not in the model store")
    protocol = EvalProtocol(**meta["protocol"])
    problems, _ = load_eval_problems(duckdb, protocol)
    challenger, _, _ = evaluate_or_reuse(context, duckdb, compute, "trained", trained.version, trained.path, protocol, problems)

    registry = mlflow.registry()
    current = registry.version_for(CHAMPION)
    champion_results = None
    if current is not None and current.tags.get(POLICY_VERSION_TAG) != trained.version:
        champion_stored = model_store.get("grpo_checkpoint", current.tags.get(POLICY_VERSION_TAG, ""))
        champion_path = champion_stored.path if champion_stored else download_checkpoint(mlflow, current.source)
        champion_results, _, _ = evaluate_or_reuse(
            context, duckdb, compute, "champion", current.tags[POLICY_VERSION_TAG], champion_path, protocol, problems
        )
    training_run = trained.manifest.get("mlflow_run_id")
    lineage = {
        "data_hash": trained.manifest.get("data_hash"),
        "data_source": trained.manifest.get("data_source"),
        "base_policy_version": trained.manifest.get("base_policy_version"),
        "training_config": trained.manifest.get("training_config"),
        "dagster_run_id": trained.manifest.get("dagster_run_id"),
        "eval.pass_at_1_strict": meta.get("pass@1_strict"),
        "eval.pass_at_1_flexible": meta.get("pass@1_flexible"),
        "eval.format_compliance": meta.get("format_compliance"),
        "eval.num_problems": meta.get("num_problems"),
        "eval.mlflow_run_id": meta.get("mlflow_eval_run_id"),
    }
    version = registry.register(trained.version, f"runs:/{training_run}/checkpoint", training_run, lineage)
    challenger_correct = [r["correct_strict"] for r in challenger]
    if current is not None and champion_results is None:  # re-run: the challenger already is the champion
        promote, reason = True, f"already champion (registry version {current.version})"
        delta, p_value = 0.0, 1.0
    else:
        decision = decide_promotion(
            [r["correct_strict"] for r in champion_results] if champion_results is not None else None,
            challenger_correct, margin=config.margin, alpha=config.alpha,
        )
        promote, reason, delta, p_value = decision.promote, decision.reason, decision.delta, decision.p_value
    registry.record_decision(version, promote, reason)
    champion = registry.version_for(CHAMPION)
    champion_version = champion.tags[POLICY_VERSION_TAG]
    champion_stored = model_store.get("grpo_checkpoint", champion_version)
    yield AssetCheckResult(
        check_name="promotion_gate",
        passed=bool(promote),
        severity=AssetCheckSeverity.WARN,
        description=reason,
        metadata={"challenger_registry_version": version, "champion_registry_version": str(champion.version),
                  "delta": 0.0 if delta is None else delta, "p_value": 1.0 if p_value is None else p_value},
    )
    yield MaterializeResult(
        metadata={
            "champion_policy_version": champion_version,
            "champion_registry_version": str(champion.version),
            "challenger_registry_version": version,
            "promoted": bool(promote),
            "reason": reason,
            "registered_model": mlflow.registered_model,
            "path": MetadataValue.path(str(champion_stored.path if champion_stored else champion.source)),
        }
    )


def download_checkpoint(mlflow: MLflowResource, source: str) -> Path:
    """Fetch a registered checkpoint's artifacts when the local model store does not hold them."""
    import tempfile

    import mlflow as mlflow_api

    mlflow.activate()
    return Path(mlflow_api.artifacts.download_artifacts(artifact_uri=source, dst_path=tempfile.mkdtemp(prefix="champion-")))
