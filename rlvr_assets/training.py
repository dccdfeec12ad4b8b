"""Group ``training``: GRPO on the train split, its rollouts and rewards in DuckDB, the trained checkpoint.

GRPO is on-policy: each step's rollouts come from the policy being trained, so the three assets
are produced by one step (a multi-asset) while the graph still reads rollouts -> rewards -> checkpoint.
"""

import functools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, Optional

from dagster import AssetExecutionContext, AssetSpec, Config, DagsterInstance, Failure, MaterializeResult, MetadataValue, multi_asset
from pydantic import Field

from resources import (
    CHAMPION,
    ComputeResource,
    EnvironmentConfig,
    MLflowResource,
    ModelStore,
    Settings,
    StoredModel,
    Upsert,
    Warehouse,
    build_environment,
    config_from,
)
from resources.costs import COSTS, cost_frame, cost_row, with_money
from resources.grpo_worker import run_spend
from resources.launcher import TrainingJob, TrainingLauncher, budget_stopped, step_costs
from resources.tracking import POLICY_VERSION_TAG, TRAINING_RUN_TAG, flat_params, run_name
from rlvr.costs import configured_prices, machine_kind
from rlvr.costs.budget import Budget
from rlvr.grpo import GRPOConfig
from rlvr.grpo.checkpoint import latest_checkpoint
from rlvr.grpo.profiles import PROFILES, build_config
from rlvr.policy import environment_spec, stored_environment
from rlvr.rewards import CompositeReward
from rlvr.tasks import DEFAULT_TASK, TaskError, TaskMixture, get_task, normalized_text_hash
from rlvr.training_run import problems_hash, sample_completions
from rlvr_assets.metadata import metrics_table, percent, rounded
from rlvr_assets.metering import count_training, metered
from rlvr_assets.partitions import add_policy_version

GPU_TAGS = {  # a run that trains in its own pod (the local launcher) asks the Kubernetes run launcher for a GPU (deploy/k8s)
    "dagster-k8s/config": json.dumps(
        {
            "container_config": {"resources": {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}},
            "pod_spec_config": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        }
    )
}


def run_pod_tags(launcher: str) -> dict:
    """The training step's op tags: a GPU for the run pod when it trains itself (``local``); none with the
    K8s launcher, whose training pods hold the GPUs while the run pod only follows them."""
    return GPU_TAGS if launcher == "local" else {}


GRPOOverrides = config_from(GRPOConfig, overrides=True)
LEDGER_ASSET = "grpo_checkpoint"  # the asset a training step's cost rows name: the policy the steps train


class BudgetConfig(Config):
    """Limits on a training run's spend, over all its attempts; any subset (docs/configuration.md, "Budgets")."""

    core_hours: Optional[float] = Field(default=None, description="CPU core-hours of the training processes (reward workers included)")
    gpu_hours: Optional[float] = Field(default=None, description="GPU-hours (wall time x GPUs held)")
    usd: Optional[float] = Field(default=None, description="money at this machine kind's prices (RLVR_PRICES); refused without prices")

    def budget(self, machine: str) -> Budget:
        """The budget on ``machine``, priced at its configured prices; ValueError naming what is wrong."""
        return Budget(self.core_hours, self.gpu_hours, self.usd, configured_prices().for_machine(machine))


class GRPORunConfig(Config):
    """A GRPO run: a named profile, and any of its knobs overridden."""

    profile: str = Field(default="default", description=f"one of {sorted(PROFILES)}: 'default' finishes on 2 CPU cores in minutes, 'full' is for a GPU")
    overrides: GRPOOverrides = Field(
        default_factory=GRPOOverrides,
        description="GRPOConfig fields set on top of the profile, e.g. {'total_steps': 20, 'lr': 1e-6, "
        "'sampling': {'max_new_tokens': 256}}; nested sampling / lora merge into the profile's",
    )
    rewards: Optional[dict[str, float]] = Field(
        default=None,
        description="reward name -> weight (a weighted mean, in [0, 1]); unset: the task's own training reward (GSM8k's: math_answer + 0.2 format)",
    )
    init_from: str = Field(
        default="base",
        description="'base' (the base_policy asset), 'sft' (the sft_policy asset: the cold start) or 'champion' (the registry's champion, for retraining)",
    )
    split: str = Field(default="train", description="split of the task's problems to train on")
    limit: Optional[int] = Field(default=None, description="train on the first N problems of the split only")
    sample_completions: int = Field(default=64, description="completions logged to MLflow as a table")
    nproc: str = Field(default="1", description="training processes under torchrun: 'auto' (one per visible GPU, else 1) or an integer (CPU processes too)")
    restart: bool = Field(default=False, description="drop this run's resume points first (needed to re-execute it with another nproc)")
    tasks: Optional[dict[str, float]] = Field(
        default=None,
        description="train on a task mixture, task name -> weight, e.g. {gsm8k: 0.5, 'reasoning_gym:basic_arithmetic': 0.5}: each group from one "
        "task drawn by weight, each task rewarded by its own rewards (``rewards`` is then unused); unset: GSM8k with ``rewards``",
    )
    environment: Optional[EnvironmentConfig] = Field(
        default=None,
        description="where rollouts happen, e.g. {name: calculator, max_calls: 8}; unset: the start policy's own (single_turn for the base policy). "
        "Recorded with the trained checkpoint, so evaluation and the Bento use it too",
    )
    budget: Optional[BudgetConfig] = Field(
        default=None,
        description="stop the run once it has spent this much, e.g. {core_hours: 2} or {usd: 5}: its last step's checkpoint is kept and "
        "a re-execution with a larger budget resumes from it; unset: no limit",
    )

    def environment_spec(self) -> dict | None:
        """The set environment as lineage holds it (``{"name", "options"}``), None when unset; ValueError naming what is wrong."""
        return environment_spec(build_environment(self.environment.spec(), "environment")) if self.environment is not None else None

    def grpo_config(self) -> GRPOConfig:
        """The profile's GRPOConfig with the overrides applied; ValueError / TypeError when they do not fit."""
        if self.rewards is not None:
            CompositeReward(self.rewards)  # unknown reward names fail here, before any work
        return build_config(self.profile, self.overrides.set_fields())


@multi_asset(
    specs=[
        AssetSpec(
            "rollouts",
            group_name="training",
            kinds={"duckdb"},
            deps=["gsm8k_problems", "base_policy", "sft_policy"],
            owners=["team:rlvr-training"],
            description="One row per sampled completion of the GRPO run: step, problem, group and sample index, temperature, "
            "prompt and completion, token counts (the policy's and its environment's), tool calls, finish reason, policy version; "
            "each tool call in the table tool_calls (call, result, error), written with it.",
        ),
        AssetSpec(
            "rewards",
            group_name="training",
            kinds={"duckdb"},
            deps=["rollouts"],
            owners=["team:rlvr-training"],
            description="One row per (completion, reward function): value, weight and the group-relative advantage.",
        ),
        AssetSpec(
            "grpo_checkpoint",
            group_name="training",
            kinds={"pytorch", "mlflow"},
            deps=["rewards"],
            owners=["team:rlvr-training"],
            description="The GRPO-trained policy as a standard HF checkpoint in the model store; each run is an MLflow run.",
        ),
    ],
    op_tags=run_pod_tags(Settings.from_env().launcher),
)  # not in WRITER_POOL: its rows are its own run's, written in short keyed transactions; the pool would hold every writer for the whole training
@metered
def grpo_training(
    context: AssetExecutionContext,
    config: GRPORunConfig,
    duckdb: Warehouse,
    model_store: ModelStore,
    mlflow: MLflowResource,
    compute: ComputeResource,
    launcher: TrainingLauncher,
):
    """Train the base policy with GRPO on the train split, in a torchrun job launched through Dagster
    Pipes (``nproc`` processes); resumable from its last checkpoint when the Dagster run is re-executed."""
    run_id = untrained_run_id(context, model_store)  # the root run's: every re-execution trains (and resumes) the same run
    try:
        grpo_config, nproc, env_spec = config.grpo_config(), launcher.processes(config.nproc), config.environment_spec()
        machine = machine_kind()  # what the cost rows name and the budget is priced for
        budget = config.budget.budget(machine) if config.budget is not None else None
    except (ValueError, TypeError) as err:
        raise Failure(description=f"grpo_training: bad run config: {err}") from None
    start = start_policy(config.init_from, base := model_store.require("base_policy"), model_store, mlflow)
    config = with_start_tasks(config, start, context.log)  # retraining without tasks: the champion's own mixture
    env_spec = env_spec or stored_environment(start.path)  # unset: the start policy's own
    rows = training_rows(context, config, duckdb)
    lineage = {"base_policy_version": base.version, "parent_version": start.version, "parent_name": start.name, "data_hash": problems_hash(rows)}
    tags = {"rlvr.kind": "training", TRAINING_RUN_TAG: run_id, "dagster.run_id": context.run.run_id, "rlvr.init_from": config.init_from}
    tags |= {"rlvr.profile": config.profile, "rlvr.nproc": str(nproc), "rlvr.environment": env_spec["name"], **{f"rlvr.{k}": v for k, v in lineage.items()}}
    work_dir, device = f"grpo-runs/{run_id}", str(compute.torch_device()) if nproc == 1 else None  # work_dir: resume points, rows, export
    rewards = mixture_rewards(config.tasks) if config.tasks else config.rewards or dict(get_task(DEFAULT_TASK).rewards)
    scratch = model_store.work_dir(work_dir)
    job = TrainingJob(run_id, start.path, rows, grpo_config, rewards, scratch, device, env_spec, config.tasks, attempt_id=context.run.run_id, budget=budget)
    if budget is not None and not config.restart:  # a re-execution whose budget is already spent trains nothing
        refuse_spent_budget(budget, job.scratch, grpo_config.total_steps)
    for ended in mlflow.end_abandoned_runs(TRAINING_RUN_TAG, run_id, functools.partial(run_ended, context.instance)):  # killed before it could
        context.log.warning(f"MLflow run {ended} of an earlier attempt of this run, whose Dagster run has ended, was left RUNNING: marked KILLED")
    with mlflow.start_run(
        run_name("grpo", None, context.run.run_id), tags, system_metrics=True
    ) as run:  # the machine's use, over time  # named by its policy version once stored
        run.log_params(flat_params({"grpo": asdict(grpo_config), "rewards": rewards, "nproc": nproc, "environment": env_spec, "tasks": config.tasks or {}}))
        try:  # each step's metrics reach MLflow as it ends; a resumed run's curve starts with the earlier attempts' steps
            history = launcher.train(context, job, nproc, restart=config.restart, on_step=lambda step, metrics: run.log_metrics(metrics, step=step))
            if (stop := budget_stopped(job.scratch)) is not None:
                raise Failure(description=budget_spent(stop["reason"], stop["step"], grpo_config.total_steps), allow_retries=False)
        finally:  # one writer: every rank's rows and step costs, also those of a failed run's finished steps (keyed: no duplicates)
            step_rows, ledger = write_step_rows(duckdb, launcher, job, machine)
            run.log_metrics(cost_totals := ledger_totals(ledger))
            ours = [row for row in ledger if row["run_id"] == context.run.run_id]  # this attempt's steps: its asset row's tokens
            count_training(*(int(sum(row[name] for row in ours)) for name in ("prompt_tokens", "completion_tokens", "trained_tokens")))
        manifest = checkpoint_manifest(lineage, rows, grpo_config, rewards, config.tasks, env_spec, nproc, history)
        manifest |= {"mlflow_run_id": run.run_id, "dagster_run_id": context.run.run_id, "root_run_id": run_id}
        stored = model_store.put("grpo_checkpoint", launcher.exported(job.scratch), metadata=manifest)
        if ledger:  # the steps' costs name the policy they trained
            duckdb.write(Upsert(COSTS, cost_frame([{**row, "policy_version": stored.version} for row in ledger]), "cost_id"))
        run.log_policy(stored.path, {POLICY_VERSION_TAG: stored.version})  # the MLflow model the registry registers
        run.log_table(sample_completions(step_rows["rollouts"], step_rows["rewards"], config.sample_completions), "sample_completions.json")
        run.set_tags({POLICY_VERSION_TAG: stored.version})
        run.rename(run_name("grpo", stored.version, context.run.run_id))
    model_store.remove_work_dir(work_dir)
    add_policy_version(context.instance, "grpo_checkpoint", stored.version)
    yield from materializations(duckdb, run_id, rewards, stored, base, grpo_config, nproc, mlflow.links().run(run.run_id), history, env_spec, cost_totals)


def checkpoint_manifest(
    lineage: dict, rows: list[dict], grpo_config: GRPOConfig, rewards: dict, tasks: dict | None, environment: dict, nproc: int, history: list
) -> dict:
    """What the stored ``grpo_checkpoint`` records of its training: lineage, data, config, rewards, tasks, environment, final metrics."""
    return {
        **lineage,
        "data_source": rows[0]["source"],
        "training_config": asdict(grpo_config),
        "rewards": rewards,
        "tasks": tasks or {DEFAULT_TASK: 1.0},
        "environment": environment,
        "steps": grpo_config.total_steps,
        "nproc": nproc,
        "final_metrics": history[-1][1] if history else {},
    }


def write_step_rows(duckdb: Warehouse, launcher: TrainingLauncher, job: TrainingJob, machine: str) -> tuple[dict, list[dict]]:
    """Write every rank's rows of the run's finished steps (``rollouts``, ``rewards``, ``tool_calls``) and their
    ``costs`` rows (scope ``step``, one per step and task) in one transaction; returns them."""
    step_rows = {table: launcher.step_rows(job.scratch, table) for table in ("rollouts", "rewards", "tool_calls")}
    ledger = [
        cost_row(cost.usage, run_id=cost.run_id, root_run_id=job.run_id, asset=LEDGER_ASSET, scope="step", machine=machine, step=cost.step, task=cost.task)
        for cost in step_costs(job.scratch)
    ]
    writes = [Upsert(table, frame, "completion_id") for table, frame in step_rows.items()] if not step_rows["rollouts"].empty else []
    writes += [Upsert(COSTS, cost_frame(ledger), "cost_id")] if ledger else []
    if writes:  # a completion's rows in the three tables land together, or none do
        duckdb.write(*writes)
    return step_rows, ledger


def ledger_totals(ledger: list[dict]) -> dict:
    """The run's totals of its step costs (MLflow metrics, checkpoint metadata): ``cost/<measure>``, ``cost/usd`` where priced."""
    if not ledger:
        return {}
    frame = with_money(cost_frame(ledger), configured_prices())
    measures = ("wall_s", "cpu_core_s", "gpu_s", "energy_kwh", "prompt_tokens", "completion_tokens", "trained_tokens", "cost_usd")
    totals = {f"cost/{name.removeprefix('cost_')}": float(frame[name].sum()) for name in measures if name in frame}
    return totals | {"cost/tokens": totals["cost/prompt_tokens"] + totals["cost/completion_tokens"]}


def refuse_spent_budget(budget: Budget, scratch: Path, total_steps: int) -> None:
    """A :class:`dagster.Failure` when the run's finished steps (earlier attempts') already spent ``budget``."""
    if (reason := budget.reached(run_spend(scratch / "steps", budget.prices))) is not None:
        resume = latest_checkpoint(scratch / "checkpoints")
        raise Failure(description=budget_spent(reason, int(resume.name.removeprefix("step-")) if resume else 0, total_steps), allow_retries=False)


def budget_spent(reason: str, step: int, total_steps: int) -> str:
    return (
        f"grpo_training: {reason} at step {step} of {total_steps}. The checkpoint of step {step} is kept: re-execute this run "
        "with a larger budget to resume from it."
    )


def checkpoint_of_run(model_store: ModelStore, run_id: str, root_of: Callable[[str], str | None]) -> StoredModel | None:
    """The ``grpo_checkpoint`` an attempt of the run whose root run is ``run_id`` already stored, or None:
    by the manifest's ``root_run_id``, else (older manifests) the root run of its ``dagster_run_id``."""
    for stored in reversed(model_store.versions("grpo_checkpoint")):
        manifest = stored.manifest
        root = manifest.get("root_run_id") or (root_of(manifest["dagster_run_id"]) if manifest.get("dagster_run_id") else None)
        if root == run_id:
            return stored
    return None


def untrained_run_id(context: AssetExecutionContext, model_store: ModelStore) -> str:
    """This run's training run id (its root run's id), or a Failure naming the checkpoint an attempt of it already stored."""
    run_id = context.run.root_run_id or context.run.run_id
    if (done := checkpoint_of_run(model_store, run_id, functools.partial(root_run_of, context.instance))) is not None:
        raise Failure(description=already_trained(done, run_id), allow_retries=False)
    return run_id


def root_run_of(instance: DagsterInstance, dagster_run_id: str) -> str | None:
    run = instance.get_run_by_id(dagster_run_id)
    return (run.root_run_id or run.run_id) if run is not None else None


def already_trained(stored: StoredModel, run_id: str) -> str:
    return (
        f"grpo_training: run {stored.manifest.get('dagster_run_id')} (of root run {run_id}) already completed this training and stored "
        f"grpo_checkpoint {stored.version} ({stored.path}); this re-execution trains nothing. Its rows are in the warehouse under run_id "
        f"{run_id}; launch a new run (not a re-execution) to train again."
    )


def materializations(
    duckdb: Warehouse,
    run_id: str,
    weights: dict,
    stored: StoredModel,
    base: StoredModel,
    grpo_config: GRPOConfig,
    nproc: int,
    mlflow_run_url: str,
    history: list,
    environment: dict,
    cost_totals: dict,
) -> Iterator[MaterializeResult]:
    """The run's three materializations: row counts, reward means and tool use from DuckDB, the checkpoint's lineage and curve."""
    summary, last = duckdb.training_run_summary(run_id), history[-1][1] if history else {}
    completions = sum(summary["finish_reasons"].values())
    yield MaterializeResult(
        asset_key="rollouts",
        metadata={
            "dagster/row_count": completions,
            "run_id": run_id,
            "table": f"{duckdb.database}:rollouts",
            "finish_reasons": MetadataValue.json(summary["finish_reasons"]),
            "environment": environment["name"],
            **(tool_use_metadata(summary, completions, f"{duckdb.database}:tool_calls") if environment["name"] != "single_turn" else {}),
        },
    )
    yield MaterializeResult(
        asset_key="rewards",
        metadata={
            "dagster/row_count": summary["reward_rows"],
            "run_id": run_id,
            "table": f"{duckdb.database}:rewards",
            **{f"mean_{name}": rounded(summary["reward_means"][name]) for name in weights if name in summary["reward_means"]},
        },
    )
    yield MaterializeResult(
        asset_key="grpo_checkpoint",
        metadata={
            **({"final reward_mean": rounded(last["reward_mean"]), "final format reward (%)": percent(last.get("reward_format_mean", 0.0))} if last else {}),
            "reward_curve": MetadataValue.md(" → ".join(f"{m['reward_mean']:.3f}" for _, m in history)),
            "steps": grpo_config.total_steps,
            "MLflow training run": MetadataValue.url(mlflow_run_url),
            "path": MetadataValue.path(str(stored.path)),
            "version": stored.version,
            "tasks": MetadataValue.json(stored.manifest.get("tasks") or {}),
            "parent_base_policy": base.version,
            "environment": MetadataValue.json(environment),
            "nproc": nproc,
            "final step": metrics_table({"value": {k: v for k, v in last.items() if k != "step"}}),
            "training_config": MetadataValue.json(asdict(grpo_config)),
            **cost_totals,  # the run's step costs, all attempts
        },
    )


def tool_use_metadata(summary: dict, completions: int, table: str) -> dict:
    """How the run's completions used their environment's tool: calls, share of completions calling,
    calls per completion, share of calls that failed (rows in the ``tool_calls`` table)."""
    calls = summary["tool_calls"]
    return {
        "tool_calls": calls,
        "completions calling a tool (%)": percent(summary["completions_calling"] / completions) if completions else 0.0,
        "tool calls per completion": rounded(calls / completions) if completions else 0.0,
        "tool call errors (%)": percent(summary["tool_errors"] / calls) if calls else 0.0,
        "tool_calls_table": table,
    }


def training_rows(context: AssetExecutionContext, config: GRPORunConfig, duckdb: Warehouse) -> list[dict]:
    """The problems a run trains on: GSM8k's split, or each task's of a mixture. A test split or a test-set
    task is refused; a problem whose question is in any task's held-out split is dropped (and counted)."""
    if config.split == "test":
        raise Failure(description="grpo_training: split 'test' is held out for evaluation and never feeds training")
    if not config.tasks:
        return duckdb.task_problems(DEFAULT_TASK, config.split, config.limit)
    try:
        tasks = [get_task(name) for name in config.tasks]
        TaskMixture([{"task": t.name} for t in tasks], config.tasks)  # weights checked before any work
    except TaskError as err:
        raise Failure(description=f"grpo_training: bad run config: {err}") from None
    held_out = [t.name for t in tasks if t.eval_only]
    if held_out:
        raise Failure(description=f"grpo_training: {held_out} are test sets (evaluation only) and cannot be trained on")
    rows = [row for task in tasks for row in duckdb.task_problems(task.name, config.split, config.limit)]
    held_out_questions = duckdb.held_out_question_hashes()
    kept = [row for row in rows if normalized_text_hash(row["question"]) not in held_out_questions]
    if len(kept) < len(rows):
        context.log.warning(f"grpo_training: {len(rows) - len(kept)} training problems also appear in a task's held-out split: left out")
    for task in tasks:
        if not any(row["task"] == task.name for row in kept):
            raise Failure(description=f"grpo_training: task {task.name!r} has no training problems left after removing held-out questions")
    return kept


def mixture_rewards(tasks: dict[str, float]) -> dict[str, float]:
    """Every reward a mixture's tasks use, with its weight in the first task that has it (the rewards rows' ``weight``)."""
    rewards: dict[str, float] = {}
    for name in tasks:
        for reward, weight in get_task(name).rewards.items():
            rewards.setdefault(reward, weight)
    return rewards


def run_ended(instance: DagsterInstance, dagster_run_id: str) -> bool:
    """The Dagster run has ended (succeeded, failed, cancelled): nothing of it still logs to its MLflow runs."""
    run = instance.get_run_by_id(dagster_run_id)
    return run is not None and run.is_finished


def with_start_tasks(config: GRPORunConfig, start: StoredModel, log) -> GRPORunConfig:
    """``config``, training from the champion with no ``tasks`` set: on the champion's recorded mixture (its manifest's
    ``tasks``), so a retraining keeps the served policy's tasks; ``DEFAULT_TASK`` alone (or none recorded) stays the
    one-task run, with its ``rewards``. Logs the mixture trained."""
    recorded = start.manifest.get("tasks")
    if config.init_from == "champion" and not config.tasks and recorded and dict(recorded) != {DEFAULT_TASK: 1.0}:
        config = config.model_copy(update={"tasks": dict(recorded)})
    log.info(f"grpo_training: training {start.name} {start.version} on the tasks {config.tasks or {DEFAULT_TASK: 1.0}}")
    return config


def start_policy(init_from: str, base: StoredModel, model_store: ModelStore, mlflow: MLflowResource) -> StoredModel:
    """The stored checkpoint training starts from: the base policy, the SFT cold start, or the registry's champion."""
    if init_from == "base":
        return base
    if init_from == "sft":
        stored = model_store.latest("sft_policy")
        if stored is None:
            raise Failure(description="grpo_training: init_from='sft' but sft_policy is not in the model store: materialize it first")
        return stored
    if init_from != "champion":
        raise Failure(description=f"grpo_training: init_from must be 'base', 'sft' or 'champion', got {init_from!r}")
    champion = mlflow.registry().version_for(CHAMPION)
    if champion is None:
        raise Failure(description="grpo_training: init_from='champion' but the registry has no champion yet")
    return model_store.require("grpo_checkpoint", champion.tags[POLICY_VERSION_TAG])
