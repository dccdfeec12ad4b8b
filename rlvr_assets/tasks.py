"""Group ``tasks``: each task's problems (a partition per task), each task's evaluation of each stored
policy (task x policy version: the base-vs-trained matrix), and the cross-task report.

A task is named as ``rlvr.tasks.get_task`` resolves it; the partitions are ``RLVR_TASKS``'s. Every task's
problems land in ``task_problems``, one partition replacing only its own rows (GSM8k's also through the
pipeline's ``gsm8k_problems``). Evaluations land in ``eval_results`` with their ``task``.
"""

import time
from typing import Optional

import pandas as pd
from dagster import (
    AllPartitionMapping,
    AssetCheckSpec,
    AssetDep,
    AssetExecutionContext,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from resources import WRITER_POOL, EvalProtocol, Evaluator, MLflowResource, ModelStore, Warehouse
from resources.costs import policy_cost
from resources.tracking import POLICY_VERSION_TAG, run_name
from rlvr import plots
from rlvr.costs import configured_prices
from rlvr.evaluation.cross_task import MACRO, cross_task_table
from rlvr.evaluation.report import headline
from rlvr.evaluation.runner import summarize
from rlvr.tasks import Task, TaskError, get_task
from rlvr.tasks.checks import CHECKS, validate_task_problems
from rlvr_assets.checks import blocking_checks
from rlvr_assets.metadata import evaluation_headline, markdown_table, metrics_table, percent, policy_cost_metadata, rounded, task_cost_rows
from rlvr_assets.metering import cost_metrics, count_evaluation, metered
from rlvr_assets.partitions import TASKS, parse_policy_key, task_names, task_policy_versions

CROSS_TASK_COLUMNS = {
    "task": "task",
    "problems": "problems",
    "base": "base pass@1",
    "base_ci_low": "base CI low",
    "base_ci_high": "base CI high",
    "trained": "trained pass@1",
    "trained_ci_low": "trained CI low",
    "trained_ci_high": "trained CI high",
    "delta": "Δ",
    "delta_ci_low": "Δ CI low",
    "delta_ci_high": "Δ CI high",
    "mcnemar_p_value": "McNemar p",
    "paired_bootstrap_p_value": "bootstrap p",
}


def task_or_failure(name: str, asset: str) -> Task:
    """The task called ``name``; a Failure naming the registered ones, before any work."""
    try:
        return get_task(name)
    except TaskError as err:
        raise Failure(description=f"{asset}: {err}") from None


class TaskProblemsConfig(Config):
    options: dict = Field(
        default_factory=dict,
        description="the task's own options: {limit: N} (humaneval); {train_size, test_size, seed, config} (reasoning_gym:<name>); "
        "{path} or {dataset, config, train_split, test_split} (math); ProblemSource's fields (gsm8k)",
    )


@asset(
    group_name="tasks",
    kinds={"duckdb"},
    owners=["team:rlvr-data"],
    partitions_def=task_names,
    pool=WRITER_POOL,
    check_specs=[AssetCheckSpec(name, asset="task_problems", description=text, blocking=True) for name, text in CHECKS.items()],
)
@metered
def task_problems(context: AssetExecutionContext, config: TaskProblemsConfig, duckdb: Warehouse):
    """One task's problems, one row per problem: task, id, split, the prompt text (``question``), the
    ``reference`` its rewards grade against (JSON: tests, scorer entry, gold answer), source, hashes.
    Checked before it is written; the partition's rows are replaced in one transaction, other tasks' kept."""
    task = task_or_failure(context.partition_key, "task_problems")
    try:
        problems = task.load_problems(config.options)
    except TaskError as err:
        raise Failure(description=f"task_problems {task.name}: {err}") from None
    results = yield from blocking_checks(validate_task_problems(task, problems), f"task_problems {task.name}")
    frame = pd.DataFrame([p.as_row() for p in problems])
    duckdb.replace_task_problems(task.name, frame)
    counts = frame.groupby("split").size().to_dict()
    context.log.info(f"task_problems {task.name}: {counts}")
    yield MaterializeResult(
        metadata={
            "dagster/row_count": len(frame),
            "table": f"{duckdb.database}:task_problems",
            "task": task.name,
            "description": task.description,
            "graded by": task.correctness,
            "training reward": MetadataValue.json(dict(task.rewards)),
            "test set only": task.eval_only,
            **{f"{split}_rows": int(n) for split, n in counts.items()},
            "preview": MetadataValue.md(
                frame.head(5)[["problem_id", "split", "question"]].assign(question=lambda f: f.question.str.slice(0, 120)).to_markdown(index=False)
            ),
        },
        check_results=results,
    )


@asset(
    group_name="tasks",
    kinds={"duckdb", "mlflow"},
    owners=["team:rlvr-eval"],
    partitions_def=task_policy_versions,
    deps=["gsm8k_problems", AssetDep("task_problems", partition_mapping=AllPartitionMapping())],  # GSM8k's rows come from either
    pool=WRITER_POOL,
)
@metered
def task_evaluation(
    context: AssetExecutionContext, config: EvalProtocol, duckdb: Warehouse, model_store: ModelStore, evaluator: Evaluator, mlflow: MLflowResource
) -> MaterializeResult:
    """One stored policy on one task's held-out problems, under the protocol: pass@1 with its CI (and
    pass@k when sampling), the task's partial credit and format rate. Rows in ``eval_results`` (reused
    by the cross-task report); metrics and per-problem results in an MLflow run."""
    started = time.time()
    keys = context.partition_key.keys_by_dimension
    task = task_or_failure(keys["task"], "task_evaluation")
    try:
        name, version = parse_policy_key(keys["policy"])
    except ValueError as err:
        raise Failure(description=f"task_evaluation: {err}") from None
    stored = model_store.require(name, version)
    problems = duckdb.task_problems(task.name, config.split, config.limit)
    evaluation = evaluator.evaluate(name, version, stored.path, config, problems, context.log, task=task)
    count_evaluation(task.name, evaluation)
    metrics = summarize(evaluation.results, config.to_core())
    tags = {"rlvr.kind": "task_evaluation", "rlvr.task": task.name, POLICY_VERSION_TAG: version, "rlvr.policy": name, "dagster.run_id": context.run.run_id}
    with mlflow.start_run(run_name(f"task-eval-{task.name.replace(':', '-')}-{name}", version, context.run.run_id), tags, started_at=started) as run:
        run.log_params({f"eval.{k}": v for k, v in config.model_dump().items()})
        run.log_metrics(headline(metrics) | cost_metrics())
        run.log_files({"eval_results.csv": pd.DataFrame(evaluation.results).to_csv(index=False)}, artifact_path="evaluation")
    return MaterializeResult(
        metadata={
            **evaluation_headline(metrics),
            **({"mean partial credit": rounded(metrics["mean_score"])} if "mean_score" in metrics else {}),
            "task": task.name,
            "policy": name,
            "policy_version": version,
            "reused": evaluation.reused,
            "grading errors": sum(bool(r.get("grading_error")) for r in evaluation.results),
            "metrics": metrics_table({f"{name} on {task.name}": headline(metrics)}),
            "MLflow run": MetadataValue.url(mlflow.links().run(run.run_id)),
            "eval_id": evaluation.eval_id,
        }
    )


class CrossTaskReportConfig(EvalProtocol):
    tasks: Optional[list[str]] = Field(default=None, description="tasks to compare; unset: every task whose problems the warehouse holds")
    base: str = Field(default="base_policy", description="the base policy: a model-store name (its latest version) or '<name>/<version>'")
    trained: str = Field(default="grpo_checkpoint", description="the trained policy: a model-store name (its latest version) or '<name>/<version>'")


@asset(group_name="tasks", kinds={"duckdb", "mlflow"}, owners=["team:rlvr-eval"], deps=["task_evaluation"], pool=WRITER_POOL)
@metered
def cross_task_report(
    context: AssetExecutionContext, config: CrossTaskReportConfig, duckdb: Warehouse, model_store: ModelStore, evaluator: Evaluator, mlflow: MLflowResource
) -> MaterializeResult:
    """Base against trained on every task: pass@1 with 95% CIs, the paired difference (bootstrap CI,
    McNemar), and the macro average over tasks (stratified bootstrap); a table and a plot here and in
    MLflow. Evaluations already in ``eval_results`` (``task_evaluation``) are reused, missing ones computed."""
    started = time.time()
    names = config.tasks or available_tasks(duckdb)
    tasks = [task_or_failure(name, "cross_task_report") for name in names]
    base, trained = (stored_policy(model_store, key) for key in (config.base, config.trained))
    protocol = EvalProtocol(**config.model_dump(exclude={"tasks", "base", "trained"}))
    evaluations = {}
    for task in tasks:
        problems = duckdb.task_problems(task.name, protocol.split, protocol.limit)
        pair = [evaluator.evaluate(s.name, s.version, s.path, protocol, problems, context.log, task=task) for s in (base, trained)]
        count_evaluation(task.name, *pair)
        evaluations[task.name] = tuple(evaluation.results for evaluation in pair)
    rows = cross_task_table(evaluations, seed=protocol.seed)
    png = plots.figure_png(plots.task_comparison_figure(rows))
    table = pd.DataFrame(rows)
    macro = rows[-1]
    gains = {r["task"]: percent(r["delta"]) if r["delta"] is not None else 0.0 for r in rows[:-1]}
    training_cost = policy_cost(duckdb, trained.manifest.get("root_run_id"), configured_prices())
    tags = {"rlvr.kind": "cross_task_report", POLICY_VERSION_TAG: trained.version, "rlvr.base_version": base.version, "dagster.run_id": context.run.run_id}
    with mlflow.start_run(run_name("cross-task", trained.version, context.run.run_id), tags, started_at=started) as run:
        run.log_params({"tasks": ",".join(names), "base": f"{base.name}/{base.version}", "trained": f"{trained.name}/{trained.version}"})
        run.log_params({f"eval.{k}": v for k, v in protocol.model_dump().items()})
        run.log_metrics({f"{r['task'] if r['task'] != MACRO else 'macro'}.{k}": r[k] for r in rows for k in ("base", "trained", "delta") if r[k] is not None})
        run.log_metrics(cost_metrics())
        run.log_table(table, "cross_task/table.json")
        run.log_files({"cross_task.png": png, "cross_task.csv": table.to_csv(index=False)}, artifact_path="cross_task")
    return MaterializeResult(
        metadata={
            "macro base pass@1 (%)": percent(macro["base"]),
            "macro trained pass@1 (%)": percent(macro["trained"]),
            "macro Δ (points)": percent(macro["delta"]),
            "macro Δ 95% CI (points)": f"[{percent(macro['delta_ci_low'])}, {percent(macro['delta_ci_high'])}]",
            "tasks": len(tasks),
            "base": f"{base.name}/{base.version}",
            "trained": f"{trained.name}/{trained.version}",
            "table": markdown_table([{k: rounded(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows], CROSS_TASK_COLUMNS),
            "plot": MetadataValue.md(plots.png_markdown(png, "pass@1 per task")),
            **policy_cost_metadata(training_cost, percent(macro["delta"])),
            **({"training cost by task": markdown_table(task_cost_rows(training_cost, gains))} if training_cost is not None else {}),
            "MLflow run": MetadataValue.url(mlflow.links().run(run.run_id)),
        }
    )


def available_tasks(duckdb: Warehouse) -> list[str]:
    """The tasks whose problems the warehouse holds, in ``RLVR_TASKS`` order, then any others."""
    held = duckdb.problem_tasks()
    if not held:
        raise Failure(description="cross_task_report: the warehouse holds no task's problems: materialize gsm8k_problems or a task_problems partition first")
    return sorted(held, key=lambda name: TASKS.index(name) if name in TASKS else len(TASKS))


def stored_policy(model_store: ModelStore, key: str):
    """A stored policy by model-store name (its latest version) or ``<name>/<version>``."""
    name, _, version = key.partition("/")
    return model_store.require(name, version or None)
