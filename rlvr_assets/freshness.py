"""How stale an asset may get before the UI flags it (Dagster freshness policies, evaluated by the daemon).

The champion is retrained weekly (``weekly_retraining``) and re-evaluated daily; traffic and drift
are ingested as traffic arrives.
"""

from datetime import timedelta

from dagster import FreshnessPolicy

WEEKLY = FreshnessPolicy.time_window(warn_window=timedelta(days=7), fail_window=timedelta(days=8))
DAILY = FreshnessPolicy.time_window(warn_window=timedelta(days=1), fail_window=timedelta(days=2))
