"""Asset jobs: the whole pipeline, monitoring, drift-triggered retraining and the champion's evaluation."""

from dagster import AssetSelection, define_asset_job

DUCKDB_WRITER = {"rlvr/duckdb": "writer"}  # deploy/ limits runs with this tag to one at a time (single-writer DuckDB)

# sft_policy (the cold start) runs on request, or in a run that sets grpo_training's init_from to 'sft';
# policy_evaluation (one partition per stored policy) runs by declarative automation or a backfill
TRAINING_PATH = AssetSelection.groups("data", "models", "training", "evaluation", "serving") - AssetSelection.assets("sft_policy", "policy_evaluation")
RETRAINING = AssetSelection.assets("rollouts", "rewards", "grpo_checkpoint", "eval_report", "champion_policy", "bento")

pipeline_job = define_asset_job(
    "rlvr_pipeline",
    selection=TRAINING_PATH,
    tags=DUCKDB_WRITER,
    description="GSM8k tables -> base policy -> GRPO -> evaluation -> promotion gate -> Bento.",
)
monitoring_job = define_asset_job(
    "monitoring",
    selection=AssetSelection.groups("monitoring"),
    tags=DUCKDB_WRITER,
    description="Ingest the service's traffic logs and measure drift.",
)
retraining_job = define_asset_job(
    "retraining",
    selection=RETRAINING,
    tags=DUCKDB_WRITER,
    config={"ops": {"grpo_training": {"config": {"init_from": "champion"}}}},  # no tasks: the champion's own mixture (grpo_training)
    description="GRPO from the current champion on its own task mixture -> evaluation -> promotion gate -> Bento (rebuilt only when promoted).",
)
champion_evaluation_job = define_asset_job(
    "champion_evaluation",
    selection=AssetSelection.assets("eval_report", "champion_policy"),
    tags=DUCKDB_WRITER,
    description="Re-evaluate the latest trained policy and re-run the promotion gate.",
)
