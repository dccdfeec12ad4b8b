"""Sensors and schedules: traffic ingestion, drift-triggered retraining, periodic retraining and evaluation,
the declarative automation of policy evaluations, and the MLflow runs of failed runs ended."""

from sensors.automation import evaluation_automation
from sensors.drift import drift_sensor
from sensors.failed_runs import failed_run_mlflow_sensor
from sensors.schedules import champion_evaluation_schedule, retraining_schedule
from sensors.traffic import traffic_sensor

__all__ = ["champion_evaluation_schedule", "evaluation_automation", "drift_sensor", "failed_run_mlflow_sensor", "retraining_schedule", "traffic_sensor"]
