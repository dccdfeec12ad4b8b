"""Group ``training``: GRPO on the train split, its rollouts and rewards in DuckDB, the trained checkpoint.

GRPO is on-policy: each step's rollouts come from the policy being trained, so the three assets
are produced by one step (a multi-asset) while the graph still reads rollouts -> rewards -> checkpoint.
"""

import hashlib
import json
import shutil
from dataclasses import asdict
from typing import Optional

import pandas as pd
from dagster import AssetExecutionContext, AssetSpec, Config, Failure, MaterializeResult, MetadataValue, multi_asset
from dagster_duckdb import DuckDBResource
from pydantic import Field

from resources import ComputeResource, MLflowResource, ModelStore, replace_rows
from resources.tracking import CHAMPION, POLICY_VERSION_TAG
from rlvr.grpo import GRPOTrainer, export_merged, gsm8k_prompts
from rlvr.grpo.profiles import PROFILES, build_config
from rlvr.policy import load_policy
from rlvr.rewards import DEFAULT_GSM8K_REWARD, RewardPool

GPU_TAGS = {  # each training run asks the Kubernetes run launcher for a GPU (deploy/k8s)
    "dagster-k8s/config": json.dumps({
        "container_config": {"resources": {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}},
        "pod_spec_config": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    })
}


class GRPORunConfig(Config):
    """A GRPO run: a named profile, and any of its knobs overridden."""

    profile: str = Field(default="default", description=f"one of {sorted(PROFILES)}: 'default' finishes on 2 CPU cores in minutes, 'full' is for a GPU")
    overrides: dict = Field(default={}, description="GRPOConfig fields to override, e.g. {'total_steps': 20, 'lr': 1e-6, 'sampling': {'max_new_tokens': 256}}")
    rewards: dict[str, float] = Field(default=dict(DEFAULT_GSM8K_REWARD), description="reward name -> weight (a weighted mean, in [0, 1])")
    init_from: str = Field(default="base", description="'base' (the base_policy asset) or 'champion' (the registry's champion, for retraining)")
    split: str = Field(default="train", description="split of gsm8k_problems to train on")
    limit: Optional[int] = Field(default=None, description="train on the first N problems of the split only")
    sample_completions: int = Field(default=64, description="completions logged to MLflow as a table")


def load_train_problems(duckdb: DuckDBResource, split: str, limit: Optional[int]) -> list[dict]:
    with duckdb.get_connection() as conn:
        frame = conn.execute(
            f"SELECT * FROM gsm8k_problems WHERE split = ? ORDER BY problem_id {f'LIMIT {int(limit)}' if limit else ''}", [split]
        ).df()
    if frame.empty:
        raise Failure(description=f"gsm8k_problems has no rows in split {split!r}: materialize gsm8k_problems first")
    return frame.to_dict(orient="records")


@multi_asset(
    specs=[
        AssetSpec("rollouts", group_name="training", kinds={"duckdb"}, deps=["gsm8k_problems", "base_policy"], owners=["team:rlvr-training"],
                  description="One row per sampled completion of the GRPO run: step, problem, group and sample index, temperature, prompt and completion, token counts, finish reason, policy version."),
        AssetSpec("rewards", group_name="training", kinds={"duckdb"}, deps=["rollouts"], owners=["team:rlvr-training"],
                  description="One row per (completion, reward function): value, weight and the group-relative advantage."),
        AssetSpec("grpo_checkpoint", group_name="training", kinds={"pytorch", "mlflow"}, deps=["rewards"], owners=["team:rlvr-training"],
                  description="The GRPO-trained policy as a standard HF checkpoint in the model store; each run is an MLflow run."),
    ],
    op_tags=GPU_TAGS,
)
def grpo_training(
    context: AssetExecutionContext,
    config: GRPORunConfig,
    duckdb: DuckDBResource,
    model_store: ModelStore,
    mlflow: MLflowResource,
    compute: ComputeResource,
):
    """Train the base policy with GRPO on the train split; resumable from its last checkpoint when
    the Dagster run is re-executed."""
    import mlflow as mlflow_api

    try:
        grpo_config = build_config(config.profile, config.overrides)
        pool = RewardPool(workers=2)
        reward_fn = pool.reward_fn(config.rewards)
    except (ValueError, TypeError) as err:
        raise Failure(description=f"grpo_training: bad run config: {err}") from None
    base = model_store.latest("base_policy")
    if base is None:
        raise Failure(description="grpo_training: base_policy is not in the model store: materialize it first")
    start = start_policy(config.init_from, base, model_store, mlflow)
    rows = load_train_problems(duckdb, config.split, config.limit)
    data_hash = hashlib.sha256("".join(r["content_hash"] for r in rows).encode()).hexdigest()[:16]
    model, tokenizer = load_policy(start.path, compute.torch_device())  # float32 master weights (GRPOConfig.compute_dtype: mixed precision)
    problems = gsm8k_prompts(rows, tokenizer)

    records, run_id = [], context.run.root_run_id or context.run.run_id
    mlflow.activate()
    with mlflow_api.start_run(run_name=f"grpo-{run_id[:8]}") as run:
        mlflow_api.set_tags({"rlvr.kind": "training", "dagster.run_id": context.run.run_id, "rlvr.base_policy_version": base.version,
                             "rlvr.parent_version": start.version, "rlvr.init_from": config.init_from,
                             "rlvr.data_hash": data_hash, "rlvr.profile": config.profile})
        mlflow_api.log_params(_flatten({"grpo": asdict(grpo_config), "rewards": config.rewards}))

        def on_step(step: int, metrics: dict, step_records: list[dict]) -> None:
            mlflow_api.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
            records.extend(step_records)
            step_rollouts, step_rewards = _tables(step_records, run_id, config.rewards)  # written as the run goes:
            replace_rows(duckdb, "rollouts", step_rollouts, key="completion_id")  # a killed run keeps its rows,
            replace_rows(duckdb, "rewards", step_rewards, key="completion_id")  # a resumed one never duplicates them
            context.log.info(
                f"step {step}/{grpo_config.total_steps}: reward {metrics['reward_mean']:.3f}, loss {metrics['loss']:.4f}, "
                f"zero-variance groups {metrics['frac_zero_variance_groups']:.0%}, {metrics['tokens_per_s']:.0f} tok/s"
            )

        work_dir = model_store.work_dir(f"grpo-runs/{run_id}")  # resumable checkpoints of this run
        trainer = GRPOTrainer(model, tokenizer, grpo_config, reward_fn, checkpoint_dir=work_dir, on_step=on_step)
        with pool:
            history = trainer.train(problems)
        stored = model_store.put(
            "grpo_checkpoint",
            lambda folder: export_merged(trainer.policy, tokenizer, folder),
            metadata={
                "base_policy_version": base.version, "parent_version": start.version, "data_hash": data_hash, "data_source": rows[0]["source"],
                "training_config": asdict(grpo_config), "rewards": config.rewards, "steps": trainer.step_count,
                "final_metrics": history[-1] if history else {}, "mlflow_run_id": run.info.run_id, "dagster_run_id": context.run.run_id,
            },
        )
        mlflow_api.log_artifacts(str(stored.path), artifact_path="checkpoint")
        if records:
            samples = pd.DataFrame([
                {"step": r["step"], "problem_id": r["problem_id"], "completion": r["completion"],
                 "finish_reason": r["finish_reason"], "reward": r["reward"], **r["rewards"]}
                for r in records[-config.sample_completions:]
            ])
            mlflow_api.log_table(samples, artifact_file="sample_completions.json")
        mlflow_api.set_tag("rlvr.policy_version", stored.version)
    shutil.rmtree(work_dir, ignore_errors=True)  # the run is complete: its resume points are no longer needed

    with duckdb.get_connection() as conn:
        finish = dict(conn.execute("SELECT finish_reason, count(*) FROM rollouts WHERE run_id = ? GROUP BY 1", [run_id]).fetchall())
        per_reward = conn.execute(
            "SELECT reward_name, avg(value), count(*) FROM rewards WHERE run_id = ? GROUP BY 1", [run_id]
        ).fetchall()
    means, reward_rows = {name: mean for name, mean, _ in per_reward}, sum(rows for *_, rows in per_reward)
    last = history[-1] if history else {}
    yield MaterializeResult(asset_key="rollouts", metadata={
        "dagster/row_count": sum(finish.values()), "run_id": run_id, "table": f"{duckdb.database}:rollouts",
        "finish_reasons": MetadataValue.json(finish),
    })
    yield MaterializeResult(asset_key="rewards", metadata={
        "dagster/row_count": reward_rows, "run_id": run_id, "table": f"{duckdb.database}:rewards",
        **{f"mean_{name}": float(means[name]) for name in config.rewards if name in means},
    })
    yield MaterializeResult(asset_key="grpo_checkpoint", metadata={
        "path": MetadataValue.path(str(stored.path)), "version": stored.version, "parent_base_policy": base.version,
        "steps": trainer.step_count, "mlflow_run_id": run.info.run_id, "training_config": MetadataValue.json(asdict(grpo_config)),
        **{f"final_{k}": float(v) for k, v in last.items() if isinstance(v, (int, float))},
        "reward_curve": MetadataValue.md(" → ".join(f"{m['reward_mean']:.3f}" for m in history)),
    })


def start_policy(init_from: str, base, model_store: ModelStore, mlflow: MLflowResource):
    """The stored checkpoint training starts from: the base policy, or the registry's champion."""
    if init_from == "base":
        return base
    if init_from != "champion":
        raise Failure(description=f"grpo_training: init_from must be 'base' or 'champion', got {init_from!r}")
    champion = mlflow.registry().version_for(CHAMPION)
    if champion is None:
        raise Failure(description="grpo_training: init_from='champion' but the registry has no champion yet")
    stored = model_store.get("grpo_checkpoint", champion.tags[POLICY_VERSION_TAG])
    if stored is None:
        raise Failure(description=f"grpo_training: champion {champion.tags[POLICY_VERSION_TAG]} is not in the model store")
    return stored


def _tables(records: list[dict], run_id: str, weights: dict[str, float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``rollouts`` and ``rewards`` rows of a run from the trainer's per-completion records."""
    rollouts, rewards = [], []
    for r in records:
        completion_id = f"{run_id}:{r['step']}:{r['group_index']}:{r['sample_index']}"
        rollouts.append({
            "run_id": run_id, "completion_id": completion_id, "step": r["step"], "problem_id": r["problem_id"],
            "group_index": r["group_index"], "sample_index": r["sample_index"], "temperature": r["temperature"],
            "prompt": r["prompt"], "completion": r["completion"], "prompt_tokens": r["prompt_tokens"],
            "completion_tokens": r["completion_tokens"], "finish_reason": r["finish_reason"],
            "policy_version": r["policy_version"], "trained": r["trained"],
        })
        for name, value in {**r["rewards"], "total": r["reward"]}.items():
            rewards.append({"run_id": run_id, "completion_id": completion_id, "step": r["step"], "reward_name": name,
                            "value": value, "weight": weights.get(name, 1.0), "advantage": r["advantage"]})
    return pd.DataFrame(rollouts), pd.DataFrame(rewards)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
