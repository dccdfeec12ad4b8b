"""Blocking data-quality checks: the core's check outcomes as Dagster check results, and a failed one stops the write."""

from typing import Generator, Sequence

from dagster import AssetCheckResult, AssetCheckSeverity, Failure

from rlvr.tasks.gsm8k.dataset import CheckOutcome


def blocking_checks(outcomes: Sequence[CheckOutcome], what: str) -> Generator[AssetCheckResult, None, list[AssetCheckResult]]:
    """Use as ``results = yield from blocking_checks(outcomes, what)``: with a failed check, yields every
    result and raises a Failure saying the previous table was kept; else returns the results unyielded
    (for the materialization, which carries them)."""
    results = [
        AssetCheckResult(check_name=o.name, passed=o.passed, severity=AssetCheckSeverity.ERROR, description=o.description, metadata=o.metadata)
        for o in outcomes
    ]
    failed = [o for o in outcomes if not o.passed]
    if failed:
        yield from results
        raise Failure(description=f"{what} failed its checks, the previous table was kept: " + "; ".join(f"{o.name}: {o.description}" for o in failed))
    return results
