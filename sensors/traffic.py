"""Start the monitoring job for each UTC day whose traffic logs have grown."""

import hashlib
import json
from pathlib import Path

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from resources import Settings
from rlvr.monitoring.traffic import FILE_PREFIX, FILE_SUFFIX, file_day
from rlvr_assets.partitions import traffic_days


def traffic_file_sizes(folder: Path) -> dict[str, int]:
    """Size of every traffic log file in ``folder``: what the sensor compares between ticks. A file deleted
    (retention) since the listing is left out, as the next tick's listing leaves it out."""
    if not folder.is_dir():
        return {}
    state = {}
    for path in sorted(folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}")):
        try:
            state[path.name] = path.stat().st_size
        except FileNotFoundError:
            continue
    return state


@sensor(
    job_name="monitoring",
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Ingests new traffic (serving_traffic, drift_report) of every day whose log files grew: one run per day.",
)
def traffic_sensor(context: SensorEvaluationContext):
    state = traffic_file_sizes(Settings.from_env().traffic_dir)
    before = json.loads(context.cursor) if context.cursor else {}
    grown: dict[str, dict[str, int]] = {}
    for name, size in state.items():
        if size > before.get(name, 0):
            grown.setdefault(file_day(name) or "", {})[name] = size
    if not grown:
        return SkipReason("no new traffic")
    known = set(traffic_days.get_partition_keys())
    requests = [
        RunRequest(
            partition_key=day,
            run_key=f"traffic-{day}-{hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]}",
            tags={"rlvr/trigger": "traffic", "rlvr/grown_files": str(len(files))},
        )
        for day, files in sorted(grown.items())
        if day in known
    ]
    outside = sorted(day or "unnamed" for day in grown if day not in known)
    if outside:
        context.log.warning(f"traffic logs outside the partitions ({traffic_days.start:%Y-%m-%d} to today) are not ingested: days {outside}")
    skip = None if requests else SkipReason(f"new traffic only on days outside the partitions: {outside}")
    return SensorResult(run_requests=requests, cursor=json.dumps(state), skip_reason=skip)
