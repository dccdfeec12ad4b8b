"""Partitions where the data is partitioned: serving traffic by UTC day, evaluations by policy version, tasks by name."""

from datetime import date, datetime, timedelta, timezone
from pathlib import Path

from dagster import DailyPartitionsDefinition, DynamicPartitionsDefinition, MultiPartitionsDefinition, StaticPartitionsDefinition

from resources import Settings
from rlvr.monitoring.traffic import FILE_PREFIX, FILE_SUFFIX, file_day

TRAFFIC_LOOKBACK_DAYS = 7  # without older traffic, the partitions cover this many days before today


def traffic_start(folder: Path, today: date, lookback_days: int = TRAFFIC_LOOKBACK_DAYS) -> str:
    """The first traffic partition: the day of the oldest log file in ``folder`` (the service names
    each file by its UTC day), or ``lookback_days`` before ``today`` when that is earlier or there is
    no traffic yet; so the UI offers the days the traffic covers, not months of empty ones."""
    days = [day for p in folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}") if (day := file_day(p.name))] if folder.is_dir() else []
    return min([*days, (today - timedelta(days=lookback_days)).isoformat()])


# The service's log files each hold one UTC day (rlvr.monitoring.traffic); today's partition exists while the day is
# still filling (end_offset=1). Logs older than the first day are not ingested. The start is computed
# when the code location loads.
traffic_days = DailyPartitionsDefinition(
    start_date=traffic_start(Settings.from_env().traffic_dir, datetime.now(timezone.utc).date()), end_offset=1, timezone="UTC"
)

# One partition per policy version (base_policy, sft_policy or grpo_checkpoint version), added when
# the version is stored: each has its own evaluation, which a backfill can recompute.
policy_versions = DynamicPartitionsDefinition(name="policy_versions")
POLICY_STORES = ("base_policy", "sft_policy", "grpo_checkpoint")


def policy_key(name: str, version: str) -> str:
    """The ``policy_versions`` partition of a stored policy: ``<model store name>/<version>``."""
    return f"{name}/{version}"


def parse_policy_key(key: str) -> tuple[str, str]:
    """(model store name, version) of a ``policy_versions`` partition; a ValueError names a malformed key."""
    name, _, version = key.partition("/")
    if name not in POLICY_STORES or not version:
        raise ValueError(f"policy version {key!r} is not '<{'|'.join(POLICY_STORES)}>/<version>'")
    return name, version


def add_policy_version(instance, name: str, version: str) -> None:
    """Give a newly stored policy its ``policy_versions`` partition (its evaluation can then run)."""
    instance.add_dynamic_partitions(policy_versions.name, [policy_key(name, version)])  # a known key is left as it is


# One partition per task the UI offers (``RLVR_TASKS``; rlvr.settings): each task's problems, and its
# evaluations of each stored policy (task x policy version: the base-vs-trained matrix).
TASKS = Settings.from_env().tasks
task_names = StaticPartitionsDefinition(TASKS)
task_policy_versions = MultiPartitionsDefinition({"task": task_names, "policy": policy_versions})
