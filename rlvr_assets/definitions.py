"""The one Definitions object of rlvr-ops: the dg project's code location (``dg launch``, ``dg dev``,
``dg check defs``; pyproject.toml's ``[tool.dg]``), also named by workspace.yaml."""

from dagster import Definitions, in_process_executor

from rlvr_assets import costs, data, evaluation, models, monitoring, registry, serving, sft, tasks, training
from rlvr_assets.jobs import champion_evaluation_job, monitoring_job, pipeline_job, retraining_job
from rlvr_assets.resources import default_resources
from sensors import champion_evaluation_schedule, drift_sensor, evaluation_automation, failed_run_mlflow_sensor, retraining_schedule, traffic_sensor

defs = Definitions(
    assets=[
        data.gsm8k_problems,
        models.base_policy,
        sft.sft_policy,
        training.grpo_training,
        evaluation.baseline_eval,
        evaluation.eval_report,
        evaluation.policy_evaluation,
        registry.champion_policy,
        serving.bento,
        monitoring.serving_traffic,
        monitoring.drift_report,
        tasks.task_problems,
        tasks.task_evaluation,
        tasks.cross_task_report,
        costs.cost_report,
    ],
    jobs=[pipeline_job, monitoring_job, retraining_job, champion_evaluation_job],
    sensors=[traffic_sensor, drift_sensor, evaluation_automation, failed_run_mlflow_sensor],
    schedules=[retraining_schedule, champion_evaluation_schedule],
    resources=default_resources(),
    executor=in_process_executor,
)
