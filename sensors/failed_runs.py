"""End the MLflow runs a failed Dagster run left RUNNING: its run worker was killed before it could end them."""

from dagster import DefaultSensorStatus, RunFailureSensorContext, run_failure_sensor

from resources import MLflowResource


@run_failure_sensor(
    default_status=DefaultSensorStatus.RUNNING,
    description="Ends as KILLED the MLflow runs (tag dagster.run_id) that a failed run left RUNNING, once Dagster marks it failed.",
)
def failed_run_mlflow_sensor(context: RunFailureSensorContext, mlflow: MLflowResource):
    """A run whose step raised ended its MLflow run FAILED itself; one whose run worker died (the run monitor
    marks it failed) could not, so its runs end KILLED here rather than at the next re-execution."""
    ended = mlflow.end_runs_of(context.dagster_run.run_id, "KILLED")
    if ended:
        context.log.warning(f"Dagster run {context.dagster_run.run_id} failed with MLflow runs {ended} still RUNNING: marked KILLED")
