"""The promotion gate: register the trained policy in MLflow and move ``champion`` only to a policy
at least as good as the current champion on the same problems."""

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from resources import CHAMPION, EvalProtocol, Evaluator, MLflowResource, ModelStore, Warehouse
from resources.tracking import POLICY_VERSION_TAG
from rlvr.evaluation import decide_promotion
from rlvr.tasks import DEFAULT_TASK
from rlvr_assets.freshness import WEEKLY
from rlvr_assets.metadata import percent, rounded
from rlvr_assets.metering import metered


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
@metered
def champion_policy(
    context: AssetExecutionContext,
    config: PromotionConfig,
    duckdb: Warehouse,
    model_store: ModelStore,
    evaluator: Evaluator,
    mlflow: MLflowResource,
):
    """The champion after the promotion gate. The trained policy is registered in the MLflow model
    registry as a new version (alias ``challenger``) with its evaluation metrics and lineage; the
    ``champion`` alias moves to it only when it is at least as good as the current champion on the
    same problems (``margin``, ``alpha``) under the protocol of its evaluation (eval_report's MLflow
    run); otherwise the version records why not."""
    trained = model_store.require("grpo_checkpoint")
    evaluation = mlflow.latest_evaluation(trained.version)
    if evaluation is None:
        raise Failure(description=f"champion_policy: grpo_checkpoint {trained.version} has no evaluation: materialize eval_report first")
    protocol = EvalProtocol(**evaluation.protocol)
    problems = duckdb.task_problems(DEFAULT_TASK, protocol.split, protocol.limit)
    challenger = evaluator.evaluate("grpo_checkpoint", trained.version, trained.path, protocol, problems, context.log)

    registry = mlflow.registry()
    current, champion = registry.version_for(CHAMPION), None
    if current is not None and current.tags[POLICY_VERSION_TAG] != trained.version:  # the current champion, on the same problems
        stored = model_store.get("grpo_checkpoint", current.tags[POLICY_VERSION_TAG])
        path = stored.path if stored is not None else mlflow.download_checkpoint(current.source)
        champion = evaluator.evaluate("grpo_checkpoint", current.tags[POLICY_VERSION_TAG], path, protocol, problems, context.log)
    version = registry.register_trained(trained, evaluation)
    ids = {"champion_id": current and f"registry version {current.version}", "challenger_id": f"registry version {version}"}
    decision = decide_promotion(champion.correct if champion else None, challenger.correct, margin=config.margin, alpha=config.alpha, **ids)
    registry.record_decision(version, decision.promote, decision.reason)
    champion_version = registry.version_for(CHAMPION)
    stored = model_store.get("grpo_checkpoint", champion_version.tags[POLICY_VERSION_TAG])
    yield AssetCheckResult(
        check_name="promotion_gate",
        passed=decision.promote,
        severity=AssetCheckSeverity.WARN,
        description=decision.reason,
        metadata={
            "challenger_registry_version": version,
            "champion_registry_version": str(champion_version.version),
            "delta (%)": percent(decision.delta or 0.0),
            "p_value": 1.0 if decision.p_value is None else rounded(decision.p_value),
        },
    )
    links = mlflow.links()
    yield MaterializeResult(
        metadata={
            "promoted": decision.promote,
            "reason": decision.reason,
            "champion in MLflow": MetadataValue.url(links.model_version(champion_version.version)),
            "challenger in MLflow": MetadataValue.url(links.model_version(version)),
            "champion_policy_version": champion_version.tags[POLICY_VERSION_TAG],
            "champion_registry_version": str(champion_version.version),
            "challenger_registry_version": version,
            "registered_model": mlflow.registered_model,
            "path": MetadataValue.path(str(stored.path if stored else champion_version.source)),
        }
    )
