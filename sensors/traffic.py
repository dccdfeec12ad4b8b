"""Start the monitoring job when the service's traffic folder has grown."""

import hashlib
import json
from pathlib import Path

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SkipReason, sensor

from resources import Settings
from rlvr.traffic import FILE_PREFIX, FILE_SUFFIX


def traffic_state(folder: Path) -> dict[str, int]:
    """Size of every traffic log file in ``folder``: what the sensor compares between ticks."""
    if not folder.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in sorted(folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))}


@sensor(
    job_name="monitoring",
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Ingests new traffic (serving_traffic, drift_report) when the traffic log folder grows.",
)
def traffic_sensor(context: SensorEvaluationContext):
    state = traffic_state(Settings.from_env().traffic_dir)
    before = json.loads(context.cursor) if context.cursor else {}
    grown = {name: size for name, size in state.items() if size > before.get(name, 0)}
    if not grown:
        return SkipReason("no new traffic")
    context.update_cursor(json.dumps(state))
    key = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
    return RunRequest(run_key=f"traffic-{key}", tags={"rlvr/trigger": "traffic", "rlvr/grown_files": str(len(grown))})
