"""Group ``evaluation``: the base policy's baseline, the trained policy's report, and every stored
policy's own evaluation (``policy_evaluation``, one dynamic partition per policy version).

Per-problem results land in the DuckDB table ``eval_results`` keyed by ``eval_id`` (policy version
x protocol x problem set; ``resources.Evaluator``), so an evaluation that already ran is reused,
never recomputed, and every number in a report can be re-derived with SQL. The report's MLflow run
keeps the protocol it ran under, which the promotion gate reads.
"""

import json

import pandas as pd
from dagster import AssetExecutionContext, AutomationCondition, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from resources import EvalProtocol, Evaluator, MLflowResource, ModelStore, Warehouse
from resources.tracking import EVAL_PROTOCOL_TAG, POLICY_VERSION_TAG
from rlvr import gsm8k
from rlvr.evaluation.report import TRAINING_CURVES, evaluation_report, headline, moved_accuracy
from rlvr.evaluation.runner import summarize
from rlvr_assets.partitions import parse_policy_key, policy_versions


@asset(group_name="evaluation", kinds={"duckdb", "pytorch"}, owners=["team:rlvr-eval"], deps=["gsm8k_problems", "base_policy"])
def baseline_eval(context: AssetExecutionContext, config: EvalProtocol, duckdb: Warehouse, model_store: ModelStore, evaluator: Evaluator) -> MaterializeResult:
    """The base policy evaluated under the protocol, computed once per base-policy version and
    reused while only the trained policy changes. Rows in ``eval_results`` (role ``base``)."""
    base = model_store.require("base_policy")
    problems = duckdb.problems(config.split, config.limit)
    evaluation = evaluator.evaluate("base", base.version, base.path, config, problems, context.log)
    metrics = summarize(evaluation.results, config.to_core())
    return MaterializeResult(
        metadata={
            "eval_id": evaluation.eval_id,
            "policy_version": base.version,
            "reused": evaluation.reused,
            **headline(metrics),
            "accuracy_by_steps": MetadataValue.md(pd.DataFrame(metrics["accuracy_by_steps"]).to_markdown(index=False)),
        }
    )


@asset(group_name="evaluation", kinds={"duckdb", "mlflow"}, owners=["team:rlvr-eval"], deps=["grpo_checkpoint", "baseline_eval"])
def eval_report(
    context: AssetExecutionContext,
    config: EvalProtocol,
    duckdb: Warehouse,
    model_store: ModelStore,
    evaluator: Evaluator,
    mlflow: MLflowResource,
) -> MaterializeResult:
    """The trained policy against the base policy on the same held-out problems: pass@1 (strict
    and flexible) with 95% bootstrap CIs, a paired McNemar test and bootstrap of the difference,
    rewards, format compliance, lengths, accuracy by difficulty, and plots. Shown here and logged
    to MLflow with the report as artifacts."""
    trained = model_store.require("grpo_checkpoint")
    base = model_store.require("base_policy", trained.manifest["base_policy_version"])
    problems = duckdb.problems(config.split, config.limit)
    try:
        gsm8k.check_no_contamination(trained.manifest.get("data_source", ""), problems[0]["source"], config.split)
    except gsm8k.DataSourceError as err:
        raise Failure(description=f"eval_report: {err}") from None
    base_eval = evaluator.evaluate("base", base.version, base.path, config, problems, context.log)
    trained_eval = evaluator.evaluate("trained", trained.version, trained.path, config, problems, context.log)
    start, stage = trained.manifest.get("parent_name"), None
    if start not in (None, "base_policy"):  # trained from an SFT policy or the champion: that stage is paired too
        parent = model_store.require(start, trained.manifest["parent_version"])
        stage = (STAGE_NAMES.get(start, start), evaluator.evaluate(start, parent.version, parent.path, config, problems, context.log).results)
    training_run = trained.manifest.get("mlflow_run_id")
    report = evaluation_report(
        base_eval.results,
        trained_eval.results,
        config.to_core(),
        trained.version,
        base.version,
        config.split,
        mlflow.metric_history(training_run, TRAINING_CURVES),
        start=stage,
    )

    tags = {"rlvr.kind": "evaluation", POLICY_VERSION_TAG: trained.version, "rlvr.training_run_id": training_run or "", "dagster.run_id": context.run.run_id}
    with mlflow.start_run(f"eval-{trained.version}", tags) as run:
        run.log_params({f"eval.{name}": value for name, value in config.model_dump().items()})
        run.log_metrics(report.metrics())
        run.log_files(
            {**report.figures, "report.md": report.markdown, "eval_results.csv": pd.DataFrame(trained_eval.results).to_csv(index=False)}, artifact_path="report"
        )
        run.set_tags({EVAL_PROTOCOL_TAG: json.dumps(config.model_dump(), sort_keys=True)})  # what the promotion gate reads
    return MaterializeResult(
        metadata={
            "report": MetadataValue.md(report.markdown_with_figures()),
            "trained_eval_id": trained_eval.eval_id,
            "base_eval_id": base_eval.eval_id,
            "policy_version": trained.version,
            "protocol": MetadataValue.json(config.model_dump()),
            "mlflow_eval_run_id": run.run_id,
            **headline(report.trained),
            "delta_pass@1_strict": report.paired["delta"],
            "mcnemar_p_value": report.paired["mcnemar_p_value"],
            "stages": MetadataValue.md(pd.DataFrame(report.stages).to_markdown(index=False, floatfmt=".3f")),
            "moved_accuracy": moved_accuracy(report.stages),
        }
    )


STAGE_NAMES = {"sft_policy": "SFT", "grpo_checkpoint": "champion"}  # the stage a training's start policy stands for


class PolicyEvaluationConfig(EvalProtocol):
    recompute: bool = Field(default=False, description="evaluate again even when eval_results holds this evaluation (e.g. after a grading fix)")


@asset(
    group_name="evaluation",
    kinds={"duckdb", "mlflow"},
    owners=["team:rlvr-eval"],
    deps=["gsm8k_problems"],
    partitions_def=policy_versions,
    automation_condition=AutomationCondition.on_missing(),
)
def policy_evaluation(
    context: AssetExecutionContext, config: PolicyEvaluationConfig, duckdb: Warehouse, model_store: ModelStore, evaluator: Evaluator, mlflow: MLflowResource
) -> MaterializeResult:
    """One stored policy (base, SFT, each GRPO checkpoint, so each champion) under the protocol, as
    its own partition ``<model store name>/<version>``: added when the policy is stored and
    materialized by the automation daemon when missing; a backfill (``recompute``) re-evaluates any.
    Rows in ``eval_results``; metrics and per-problem results in an MLflow run of the policy."""
    try:
        name, version = parse_policy_key(context.partition_key)
    except ValueError as err:
        raise Failure(description=f"policy_evaluation: {err}") from None
    stored = model_store.require(name, version)
    problems = duckdb.problems(config.split, config.limit)
    protocol = EvalProtocol(**config.model_dump(exclude={"recompute"}))
    evaluation = evaluator.evaluate(name, version, stored.path, protocol, problems, context.log, reuse=not config.recompute)
    metrics = summarize(evaluation.results, protocol.to_core())
    tags = {"rlvr.kind": "policy_evaluation", POLICY_VERSION_TAG: version, "rlvr.policy": name, "dagster.run_id": context.run.run_id}
    with mlflow.start_run(f"policy-eval-{name}-{version}", tags) as run:
        run.log_params({f"eval.{k}": v for k, v in protocol.model_dump().items()})
        run.log_metrics(headline(metrics))
        run.log_files({"eval_results.csv": pd.DataFrame(evaluation.results).to_csv(index=False)}, artifact_path="evaluation")
    return MaterializeResult(
        metadata={
            "eval_id": evaluation.eval_id,
            "policy": name,
            "policy_version": version,
            "reused": evaluation.reused,
            "protocol": MetadataValue.json(protocol.model_dump()),
            "mlflow_run_id": run.run_id,
            **headline(metrics),
        }
    )
