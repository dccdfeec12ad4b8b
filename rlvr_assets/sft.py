"""``sft_policy``: the cold start between the base policy and GRPO (supervised fine-tuning on the
train split's worked solutions, in the project's answer format); ``grpo_training`` starts from it
with ``init_from: sft``."""

from dataclasses import asdict, replace
from typing import Any, Optional

from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from resources import ComputeResource, EnvironmentConfig, MLflowResource, ModelStore, Warehouse, build_environment, config_from
from resources.tracking import POLICY_VERSION_TAG, flat_params, run_name
from rlvr.policy import environment_spec
from rlvr.sft import PROFILES, SFTConfig, build_sft_config, train_sft
from rlvr.tasks import DEFAULT_TASK
from rlvr.training_run import problems_hash
from rlvr_assets.metadata import rounded
from rlvr_assets.metering import metered
from rlvr_assets.partitions import add_policy_version

SFTOverrides = config_from(SFTConfig, overrides=True)


class SFTRunConfig(Config):
    """An SFT run: a named profile, any of its knobs overridden, and the problems it learns from."""

    profile: str = Field(default="default", description=f"one of {sorted(PROFILES)}: 'default' takes about a minute on 2 CPU cores, 'full' is for a GPU")
    overrides: SFTOverrides = Field(default_factory=SFTOverrides, description="SFTConfig fields set on top of the profile, e.g. {'total_steps': 50}")
    split: str = Field(default="train", description="split of gsm8k_problems whose reference solutions it learns")
    limit: Optional[int] = Field(default=None, description="the first N problems of the split only")
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig,
        description="the environment GRPO will roll out in, e.g. {name: calculator}: its instructions join the prompt, and with the calculator "
        "GSM8k's <<48/2=24>> annotations are kept (keep_calculator_annotations, unless overridden). Recorded with the checkpoint",
    )

    def sft_config(self) -> tuple[SFTConfig, Any]:
        """The profile's SFTConfig with the overrides applied (with the calculator, GSM8k's annotations
        kept unless overridden), and the environment; ValueError / TypeError when they do not fit."""
        environment = build_environment(self.environment.spec(), "environment")
        overrides = {"keep_calculator_annotations": environment.name == "calculator", **self.overrides.set_fields()}
        return build_sft_config(self.profile, overrides), environment


@asset(group_name="models", kinds={"pytorch", "mlflow"}, deps=["gsm8k_problems", "base_policy"], owners=["team:rlvr-training"])
@metered
def sft_policy(
    context: AssetExecutionContext, config: SFTRunConfig, duckdb: Warehouse, model_store: ModelStore, mlflow: MLflowResource, compute: ComputeResource
) -> MaterializeResult:
    """The base policy fine-tuned on worked solutions (loss on the solution tokens only), as a
    checkpoint in the model store and an MLflow run; resumable when the Dagster run is re-executed."""
    try:
        sft_config, environment = config.sft_config()
    except (ValueError, TypeError) as err:
        raise Failure(description=f"sft_policy: bad run config: {err}") from None
    env_spec = environment_spec(environment)
    base, rows = model_store.require("base_policy"), duckdb.task_problems(DEFAULT_TASK, config.split, config.limit)
    run_id = context.run.root_run_id or context.run.run_id
    lineage = {"base_policy_version": base.version, "parent_version": base.version, "data_hash": problems_hash(rows)}
    tags = {"rlvr.kind": "sft", "dagster.run_id": context.run.run_id, "rlvr.profile": config.profile, "rlvr.environment": env_spec["name"]}
    work_dir = f"sft-runs/{run_id}"
    with mlflow.start_run(run_name("sft", None, context.run.run_id), tags | {f"rlvr.{k}": v for k, v in lineage.items()}) as run:
        run.log_params(flat_params({"sft": asdict(sft_config), "environment": env_spec}))

        def on_step(step: int, metrics: dict) -> None:
            run.log_metrics(metrics, step=step)
            context.log.info(f"SFT step {step}/{sft_config.total_steps}: loss {metrics['loss']:.4f}, {metrics['tokens_per_s']:.0f} tok/s")

        trained = train_sft(base.path, rows, sft_config, model_store.work_dir(work_dir), compute.torch_device(), on_step, environment)
        stored = model_store.put(
            "sft_policy",
            replace(trained, environment=environment).export,  # the checkpoint records the environment it was trained for
            metadata={
                **lineage,
                "data_source": rows[0]["source"],
                "sft_config": asdict(sft_config),
                "environment": env_spec,
                "steps": trained.steps,
                "final_metrics": trained.history[-1] if trained.history else {},
                "mlflow_run_id": run.run_id,
            },
        )
        run.log_policy(stored.path, {POLICY_VERSION_TAG: stored.version})
        run.set_tags({POLICY_VERSION_TAG: stored.version})
        run.rename(run_name("sft", stored.version, context.run.run_id))
    model_store.remove_work_dir(work_dir)
    add_policy_version(context.instance, "sft_policy", stored.version)
    losses = [m["loss"] for m in trained.history]
    return MaterializeResult(
        metadata={
            **({"final_loss": rounded(losses[-1])} if losses else {}),
            "loss_curve": MetadataValue.md(" → ".join(f"{loss:.3f}" for loss in losses)),
            "steps": trained.steps,
            "MLflow run": MetadataValue.url(mlflow.links().run(run.run_id)),
            "path": MetadataValue.path(str(stored.path)),
            "version": stored.version,
            "parent_base_policy": base.version,
            "sft_config": MetadataValue.json(asdict(sft_config)),
            "environment": MetadataValue.json(env_spec),
        }
    )
