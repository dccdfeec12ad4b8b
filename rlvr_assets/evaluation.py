"""Group ``evaluation``: the base policy's baseline, the trained policy's report, and every stored
policy's own evaluation (``policy_evaluation``, one dynamic partition per policy version).

Per-problem results land in the DuckDB table ``eval_results`` keyed by ``eval_id`` (policy version
x protocol x problem set; ``resources.Evaluator``), so an evaluation that already ran is reused,
never recomputed, and every number in a report can be re-derived with SQL. The report's MLflow run
keeps the protocol it ran under, which the promotion gate reads. Each policy is evaluated in the
environment its checkpoint records (how it was trained: single-turn, a calculator, ...) unless the
protocol's ``environment`` overrides it; ``eval_results`` counts each completion's tool calls and errors.
"""

import json
import time

import pandas as pd
from dagster import AssetExecutionContext, AutomationCondition, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from resources import WRITER_POOL, EvalProtocol, Evaluation, Evaluator, MLflowResource, ModelStore, Warehouse, build_environment
from resources.costs import policy_cost
from resources.tracking import EVAL_PROTOCOL_TAG, POLICY_VERSION_TAG, run_name
from rlvr.costs import configured_prices
from rlvr.evaluation.report import TRAINING_CURVES, evaluation_report, headline, moved_accuracy
from rlvr.evaluation.runner import summarize
from rlvr.tasks import DEFAULT_TASK
from rlvr.tasks.gsm8k import dataset as gsm8k
from rlvr_assets.metadata import evaluation_headline, markdown_table, metrics_table, percent, policy_cost_metadata, rounded
from rlvr_assets.metering import cost_metrics, count_evaluation, metered
from rlvr_assets.partitions import parse_policy_key, policy_versions

EVAL_RUN_METRICS = (
    "trained.pass@1_strict",
    "trained.pass@1_flexible",
    "trained.format_compliance",
    "trained.num_problems",
    "paired.delta",
    "paired.mcnemar_p_value",
)
"""The evaluation run's metrics in MLflow (the rest are its ``report/metrics.json`` table)."""
STAGE_COLUMNS = {"pass@1_strict": "pass@1 strict", "format_compliance": "format", "delta": "Δ pass@1", "p_value": "McNemar p", "format_delta": "Δ format"}


@asset(group_name="evaluation", kinds={"duckdb", "pytorch"}, owners=["team:rlvr-eval"], deps=["gsm8k_problems", "base_policy"], pool=WRITER_POOL)
@metered
def baseline_eval(context: AssetExecutionContext, config: EvalProtocol, duckdb: Warehouse, model_store: ModelStore, evaluator: Evaluator) -> MaterializeResult:
    """The base policy evaluated under the protocol, computed once per base-policy version and
    reused while only the trained policy changes. Rows in ``eval_results`` (``policy_role`` ``base_policy``)."""
    check_environment(config, "baseline_eval")
    base = model_store.require("base_policy")
    problems = duckdb.task_problems(DEFAULT_TASK, config.split, config.limit)
    evaluation = evaluator.evaluate("base_policy", base.version, base.path, config, problems, context.log)
    count_evaluation(DEFAULT_TASK, evaluation)
    metrics = summarize(evaluation.results, config.to_core())
    return MaterializeResult(
        metadata={
            "eval_id": evaluation.eval_id,
            **evaluation_headline(metrics),
            "policy_version": base.version,
            "reused": evaluation.reused,
            **environment_metadata(evaluation, metrics),
            "metrics": metrics_table({"base": headline(metrics)}),
            "accuracy_by_steps": markdown_table(metrics["accuracy_by_steps"]),
        }
    )


@asset(group_name="evaluation", kinds={"duckdb", "mlflow"}, owners=["team:rlvr-eval"], deps=["grpo_checkpoint", "baseline_eval"], pool=WRITER_POOL)
@metered
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
    started = time.time()  # the evaluation run's start in MLflow
    check_environment(config, "eval_report")
    trained = model_store.require("grpo_checkpoint")
    base = model_store.require("base_policy", trained.manifest["base_policy_version"])
    problems = duckdb.task_problems(DEFAULT_TASK, config.split, config.limit)
    try:
        gsm8k.check_no_contamination(trained.manifest.get("data_source", ""), problems[0]["source"], config.split)
    except gsm8k.DataSourceError as err:
        raise Failure(description=f"eval_report: {err}") from None
    base_eval = evaluator.evaluate("base_policy", base.version, base.path, config, problems, context.log)
    trained_eval = evaluator.evaluate("grpo_checkpoint", trained.version, trained.path, config, problems, context.log)
    count_evaluation(DEFAULT_TASK, base_eval, trained_eval)
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
    tags["rlvr.environment"] = trained_eval.environment["name"]
    with mlflow.start_run(run_name("eval", trained.version, context.run.run_id), tags, started_at=started) as run:
        run.log_params({f"eval.{name}": value for name, value in config.model_dump().items()})
        metrics = report.metrics()  # a few as metrics (charts), every one in a table
        run.log_metrics({name: metrics[name] for name in EVAL_RUN_METRICS} | cost_metrics())
        run.log_table(pd.DataFrame({"metric": list(metrics), "value": list(metrics.values())}), "report/metrics.json")
        run.log_files(
            {**report.figures, "report.md": report.markdown, "eval_results.csv": pd.DataFrame(trained_eval.results).to_csv(index=False)}, artifact_path="report"
        )
        run.set_tags({EVAL_PROTOCOL_TAG: json.dumps(config.model_dump(), sort_keys=True)})  # what the promotion gate reads
    ids = {"policy_version": trained.version, "trained_eval_id": trained_eval.eval_id, "base_eval_id": base_eval.eval_id}
    return MaterializeResult(
        metadata={
            **report_metadata(report, mlflow.links(), run.run_id, training_run, trained_eval),
            **ids,
            **policy_cost_metadata(policy_cost(duckdb, trained.manifest.get("root_run_id"), configured_prices()), percent(report.paired["delta"])),
            "protocol": MetadataValue.json(config.model_dump()),
        }
    )


def report_metadata(report, links, eval_run_id: str, training_run_id: str | None, trained_eval: Evaluation | None = None) -> dict:
    """``eval_report``'s metadata: the headline numbers and MLflow links on top, then the report and one table of every metric."""
    return {
        **evaluation_headline(report.trained),
        **(environment_metadata(trained_eval, report.trained) if trained_eval is not None else {}),
        "Δ pass@1 strict vs base (points)": percent(report.paired["delta"]),
        "McNemar p": rounded(report.paired["mcnemar_p_value"]),
        "moved_accuracy": moved_accuracy(report.stages),
        "MLflow evaluation run": MetadataValue.url(links.run(eval_run_id)),
        **({"MLflow training run": MetadataValue.url(links.run(training_run_id))} if training_run_id else {}),
        "report": MetadataValue.md(report.markdown_with_figures()),
        "metrics": metrics_table({"base": headline(report.base), "trained": headline(report.trained), "paired": headline(report.paired)}),
        "stages": markdown_table(report.stages, STAGE_COLUMNS),
    }


STAGE_NAMES = {"sft_policy": "SFT", "grpo_checkpoint": "champion"}  # the stage a training's start policy stands for


def check_environment(config: EvalProtocol, asset: str) -> None:
    """Fail before any work when the protocol's environment cannot be built (unknown name or option)."""
    if config.environment is None:
        return
    try:
        build_environment(config.environment.spec(), "environment")
    except ValueError as err:
        raise Failure(description=f"{asset}: bad run config: {err}") from None


def environment_metadata(evaluation: Evaluation, metrics: dict) -> dict:
    """The environment an evaluation ran in and, with a tool, how the completions used it: the share
    that called it, calls per completion, the share of calls that failed."""
    found = {"environment": evaluation.environment["name"]}
    if evaluation.environment["options"]:
        found["environment options"] = MetadataValue.json(evaluation.environment["options"])
    if evaluation.environment["name"] != "single_turn" and "tool_use_rate" in metrics:
        found |= {
            "completions calling a tool (%)": percent(metrics["tool_use_rate"]),
            "tool calls per completion": rounded(metrics["mean_tool_calls"]),
            "tool call errors (%)": percent(metrics["tool_error_rate"]),
        }
    return found


# Every stored policy without an evaluation, also one stored before the daemon started (on_missing only
# sees partitions added after its first tick), one run at a time, and not again after a failed one.
EVALUATE_WHILE_MISSING = (
    AutomationCondition.missing() & ~AutomationCondition.in_progress() & ~AutomationCondition.execution_failed() & ~AutomationCondition.any_deps_missing()
).with_label("evaluate while missing")


class PolicyEvaluationConfig(EvalProtocol):
    recompute: bool = Field(default=False, description="evaluate again even when eval_results holds this evaluation (e.g. after a grading fix)")


@asset(
    group_name="evaluation",
    kinds={"duckdb", "mlflow"},
    owners=["team:rlvr-eval"],
    deps=["gsm8k_problems"],
    partitions_def=policy_versions,
    pool=WRITER_POOL,
    automation_condition=EVALUATE_WHILE_MISSING,
)
@metered
def policy_evaluation(
    context: AssetExecutionContext, config: PolicyEvaluationConfig, duckdb: Warehouse, model_store: ModelStore, evaluator: Evaluator, mlflow: MLflowResource
) -> MaterializeResult:
    """One stored policy (base, SFT, each GRPO checkpoint, so each champion) under the protocol, as
    its own partition ``<model store name>/<version>``: added when the policy is stored and
    materialized by the automation daemon when missing; a backfill (``recompute``) re-evaluates any.
    Rows in ``eval_results``; metrics and per-problem results in an MLflow run of the policy."""
    started = time.time()  # the evaluation run's start in MLflow
    try:
        name, version = parse_policy_key(context.partition_key)
    except ValueError as err:
        raise Failure(description=f"policy_evaluation: {err}") from None
    check_environment(config, "policy_evaluation")
    stored = model_store.require(name, version)
    problems = duckdb.task_problems(DEFAULT_TASK, config.split, config.limit)
    protocol = EvalProtocol(**config.model_dump(exclude={"recompute"}))
    evaluation = evaluator.evaluate(name, version, stored.path, protocol, problems, context.log, reuse=not config.recompute)
    count_evaluation(DEFAULT_TASK, evaluation)
    metrics = summarize(evaluation.results, protocol.to_core())
    tags = {"rlvr.kind": "policy_evaluation", POLICY_VERSION_TAG: version, "rlvr.policy": name, "dagster.run_id": context.run.run_id}
    tags["rlvr.environment"] = evaluation.environment["name"]
    with mlflow.start_run(run_name(f"policy-eval-{name}", version, context.run.run_id), tags, started_at=started) as run:
        run.log_params({f"eval.{k}": v for k, v in protocol.model_dump().items()})
        logged = ("pass@1_strict", "pass@1_flexible", "format_compliance", "num_problems", "tool_use_rate", "mean_tool_calls", "tool_error_rate")
        run.log_metrics({key: metrics[key] for key in logged if key in metrics} | cost_metrics())
        run.log_table(pd.DataFrame({"metric": list(headline(metrics)), "value": list(headline(metrics).values())}), "evaluation/metrics.json")
        run.log_files({"eval_results.csv": pd.DataFrame(evaluation.results).to_csv(index=False)}, artifact_path="evaluation")
    return MaterializeResult(
        metadata={
            **evaluation_headline(metrics),
            "MLflow run": MetadataValue.url(mlflow.links().run(run.run_id)),
            "policy": name,
            "policy_version": version,
            "reused": evaluation.reused,
            **environment_metadata(evaluation, metrics),
            "metrics": metrics_table({name: headline(metrics)}),
            "protocol": MetadataValue.json(protocol.model_dump()),
            "eval_id": evaluation.eval_id,
            "mlflow_run_id": run.run_id,
        }
    )
