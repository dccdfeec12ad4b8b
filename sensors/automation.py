"""Declarative automation: the sensor that evaluates the assets' automation conditions (today,
``policy_evaluation``'s "evaluate a stored policy while its evaluation is missing", which also covers
the policies stored before the daemon started)."""

from dagster import AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus

from rlvr_assets.jobs import DUCKDB_WRITER

evaluation_automation = AutomationConditionSensorDefinition(
    "evaluation_automation",
    target=AssetSelection.assets("policy_evaluation"),
    run_tags=DUCKDB_WRITER,  # its runs write eval_results: one DuckDB writer at a time, like every job
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=60,
    description="Evaluates every stored policy (a policy_versions partition) that has no evaluation yet, once.",
)
