"""Partitions where the data is partitioned: serving traffic by UTC day, evaluations by policy version."""

from dagster import DailyPartitionsDefinition, DynamicPartitionsDefinition

# The service's log files each hold one UTC day (rlvr.traffic); today's partition exists while the day is
# still filling (end_offset=1). Logs older than the first day are not ingested.
TRAFFIC_START = "2026-01-01"
traffic_days = DailyPartitionsDefinition(start_date=TRAFFIC_START, end_offset=1, timezone="UTC")

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
