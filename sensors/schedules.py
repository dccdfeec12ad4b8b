"""Periodic retraining and evaluation; off unless ``RLVR_SCHEDULES=on`` (or turned on in the UI)."""

import os

from dagster import DefaultScheduleStatus, ScheduleDefinition

STATUS = DefaultScheduleStatus.RUNNING if os.environ.get("RLVR_SCHEDULES") == "on" else DefaultScheduleStatus.STOPPED

retraining_schedule = ScheduleDefinition(
    name="weekly_retraining",
    job_name="retraining",
    cron_schedule=os.environ.get("RLVR_RETRAIN_CRON", "0 3 * * 1"),
    default_status=STATUS,
    tags={"rlvr/trigger": "schedule"},
    description="GRPO from the champion, gated, every week.",
)
champion_evaluation_schedule = ScheduleDefinition(
    name="daily_champion_evaluation",
    job_name="champion_evaluation",
    cron_schedule=os.environ.get("RLVR_EVAL_CRON", "0 5 * * *"),
    default_status=STATUS,
    tags={"rlvr/trigger": "schedule"},
    description="Evaluation and promotion gate, every day.",
)
