"""Sensors and schedules: traffic ingestion, drift-triggered retraining, periodic retraining and evaluation."""

from sensors.drift import drift_sensor
from sensors.schedules import champion_evaluation_schedule, retraining_schedule
from sensors.traffic import traffic_sensor

__all__ = ["champion_evaluation_schedule", "drift_sensor", "retraining_schedule", "traffic_sensor"]
