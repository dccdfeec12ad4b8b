"""Dagster runs of the pipeline on a temporary data directory: its resources and a small run config."""

from __future__ import annotations

from pathlib import Path

from resources import BentoBuilder, ComputeResource, Evaluator, MLflowResource, ModelStore, Warehouse
from resources.launcher import TrainingLauncher
from rlvr_assets import data, evaluation, models, registry, training

TRAINING = [data.gsm8k_problems, models.base_policy, training.grpo_training, evaluation.baseline_eval, evaluation.eval_report, registry.champion_policy]
PROTOCOL = {"limit": 4, "max_new_tokens": 8, "batch_rows": 8}


def resources_for(home: Path) -> dict:
    """Every resource the assets use, on local stores under the data directory ``home``."""
    warehouse, compute = Warehouse(database=str(home / "rlvr.duckdb")), ComputeResource(device="cpu")
    return {
        "duckdb": warehouse,
        "model_store": ModelStore(root=str(home / "models")),
        "mlflow": MLflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_location=str(home / "mlartifacts")),
        "compute": compute,
        "evaluator": Evaluator(warehouse=warehouse, compute=compute),
        "bento_builder": BentoBuilder(),
        "launcher": TrainingLauncher(),
    }


def run_config(gsm8k_dir, model_dir, steps=2, init_from="base", seed=0) -> dict:
    """A run config of 12 problems, ``steps`` GRPO steps of 2 prompts x 2 completions, and a 4-problem evaluation."""
    return {
        "ops": {
            "gsm8k_problems": {"config": {"local_dir": str(gsm8k_dir), "limit": 12}},
            "base_policy": {"config": {"model": str(model_dir)}},
            "grpo_training": {
                "config": {
                    "init_from": init_from,
                    "overrides": {
                        "total_steps": steps,
                        "prompts_per_step": 2,
                        "group_size": 2,
                        "seed": seed,
                        "checkpoint_every": 1,
                        "sampling": {"max_new_tokens": 8},
                    },
                }
            },
            "baseline_eval": {"config": PROTOCOL},
            "eval_report": {"config": PROTOCOL},
        }
    }


def register_champion(mlflow: MLflowResource, folder: Path, policy_version: str) -> None:
    """``policy_version`` as the registry's champion: a logged checkpoint (under ``folder``), registered and promoted."""
    from resources.tracking import CHAMPION

    (folder / "checkpoint").mkdir()
    (folder / "checkpoint" / "config.json").write_text("{}")
    client = mlflow.client()
    run = client.create_run(mlflow.experiment_id())
    client.log_artifacts(run.info.run_id, str(folder / "checkpoint"), "checkpoint")
    registry = mlflow.registry()
    registry.record_decision(registry.register(policy_version, f"runs:/{run.info.run_id}/checkpoint", run.info.run_id, {}), True, "the first policy")
    assert registry.version_for(CHAMPION) is not None
