"""Group ``monitoring``: serving traffic in DuckDB, and drift of each day's traffic (overall and per task) from the training reference.

Both are partitioned by UTC day (``partitions.traffic_days``): a run of a day ingests that day's
log files and reports that day's drift; the traffic sensor requests the days whose logs grew, and a
backfill re-ingests or re-reports any day within retention (``TrafficConfig.retention_days``)."""

from datetime import datetime, timezone

import numpy as np
from dagster import AllPartitionMapping, AssetDep, AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from resources import WRITER_POOL, ModelStore, Settings, Warehouse, config_from
from rlvr import plots
from rlvr.monitoring.drift import DriftThresholds, drift_by_task, history_curves
from rlvr.monitoring.embeddings import embed_texts
from rlvr.monitoring.traffic import TrafficBatch, delete_expired_files, first_kept_day, read_traffic, retention_days_from_env
from rlvr.tasks import DEFAULT_TASK
from rlvr_assets.freshness import DAILY
from rlvr_assets.metering import metered
from rlvr_assets.partitions import traffic_days


class TrafficConfig(Config):
    folder: str = Field(default_factory=lambda: str(Settings.from_env().traffic_dir), description="the service's traffic log folder ($RLVR_TRAFFIC_DIR)")
    reread: bool = Field(default=False, description="read the day's files from their first byte again, replacing the rows already stored")
    retention_days: int = Field(
        default_factory=retention_days_from_env,
        description="days of traffic kept before today ($RLVR_TRAFFIC_RETENTION_DAYS, default 30); older log files and their rows are deleted, "
        "and an older day is not ingested",
    )


def apply_retention(context: AssetExecutionContext, folder: str, retention_days: int, duckdb: Warehouse) -> tuple[str, dict]:
    """Delete the log files of the days past retention, then their rows; returns the first day kept and the metadata
    of what was deleted. A file that could not be deleted is reported and tried again by the next run."""
    first_kept = first_kept_day(datetime.now(timezone.utc).date(), retention_days)
    deleted, failed = delete_expired_files(folder, first_kept)
    rows = duckdb.delete_traffic_before(first_kept)
    if failed:
        context.log.error(f"{len(failed)} traffic log files past retention could not be deleted, e.g. {failed[:3]}")
    return first_kept, {
        "retention_days": retention_days,
        "expired_files_deleted": len(deleted),
        "expired_rows_deleted": rows,
        "expired_files_not_deleted": MetadataValue.json(failed[:20]),
    }


@asset(
    group_name="monitoring",
    kinds={"duckdb"},
    owners=["team:rlvr-serving"],
    deps=["bento"],
    freshness_policy=DAILY,
    partitions_def=traffic_days,
    pool=WRITER_POOL,
)
@metered
def serving_traffic(context: AssetExecutionContext, config: TrafficConfig, duckdb: Warehouse) -> MaterializeResult:
    """Requests to the served champion, one partition per UTC day, ingested from the Bento's JSONL
    traffic logs in ``$RLVR_TRAFFIC_DIR`` (``$RLVR_HOME/traffic``). Each file is read from a byte cursor
    stored with its rows in one transaction, so re-runs never duplicate rows (``reread`` starts over);
    the days past ``retention_days`` (never today's or yesterday's) are deleted first."""
    day = context.partition_key
    first_kept, retention = apply_retention(context, config.folder, config.retention_days, duckdb)
    if day < first_kept:
        context.log.warning(f"{day} is past retention (traffic is kept from {first_kept}): nothing ingested")
        batch, new_rows = TrafficBatch(), 0
    else:
        batch = read_traffic(config.folder, {} if config.reread else duckdb.traffic_cursor(), day=day)
        new_rows = duckdb.ingest_traffic(batch, replace=config.reread)
    if batch.malformed:
        context.log.warning(f"{len(batch.malformed)} malformed traffic lines skipped, e.g. {batch.malformed[:3]}")
    return MaterializeResult(
        metadata={
            "new_rows": new_rows,
            "dagster/row_count": duckdb.traffic_rows(day),
            "malformed_lines": len(batch.malformed),
            "malformed_examples": MetadataValue.json(batch.malformed[:20]),
            "files": len(batch.cursor),
            "table": f"{duckdb.database}:serving_traffic",
            **retention,
        }
    )


class DriftConfig(config_from(DriftThresholds)):
    """The window compared with the reference, and the thresholds that flag drift."""

    window: int = Field(default=200, description="the day's most recent N successful requests (its drift window)")
    min_requests: int = Field(default=20, description="below this, no drift verdict is given")
    reference_size: int = Field(default=1000, description="train questions sampled as the input reference")
    use_embeddings: bool = Field(default=True, description="also measure embedding drift (all-MiniLM-L6-v2)")


@asset(
    group_name="monitoring",
    kinds={"duckdb"},
    owners=["team:rlvr-serving"],
    deps=["serving_traffic", "gsm8k_problems", AssetDep("task_problems", partition_mapping=AllPartitionMapping())],
    freshness_policy=DAILY,
    partitions_def=traffic_days,
    pool=WRITER_POOL,
)
@metered
def drift_report(context: AssetExecutionContext, config: DriftConfig, duckdb: Warehouse, model_store: ModelStore) -> MaterializeResult:
    """Drift of the day's last ``window`` requests, overall and per task (the task each request was rendered
    with). Inputs: PSI and KS of prompt features and embedding distance (MMD, mean cosine), overall against the
    served policy's training mixture, per task against that task's train questions. Outputs, per task, against
    the served policy's last evaluation of that task: format compliance (the task's own format), completion
    length, verified reward; vote share against the previous window. ``drifted`` in the metadata drives the
    drift sensor; every run appends to ``drift_history`` (its plot: each day's latest report, by day)."""
    current, previous = duckdb.traffic_window(context.partition_key, config.window)
    if len(current) < config.min_requests:
        return MaterializeResult(
            metadata={"drifted": False, "requests": len(current), "status": f"insufficient traffic: {len(current)} < {config.min_requests} requests"}
        )
    served = next(iter(current["model_version"].mode()), None)  # the policy most of the window was served by
    trained = model_store.get("grpo_checkpoint", served) if served else None
    mixture = (trained.manifest.get("tasks") if trained else None) or {DEFAULT_TASK: 1.0}  # its training mixture: the overall reference
    tasks = sorted(current["task"].dropna().unique())
    report = drift_by_task(
        duckdb.reference_questions(config.reference_size, mixture),
        {task: duckdb.task_reference_questions(task, config.reference_size) for task in tasks},
        current,
        previous,
        {task: duckdb.latest_evaluation(served, task) for task in tasks},
        config.to_core(),
        embed_texts if config.use_embeddings else None,
        min_requests=config.min_requests,
    )
    for task, note in report.notes.items():
        context.log.warning(f"drift of {task}: {note}")
    history = duckdb.append_drift_history(report.history_rows(context.run.run_id, datetime.now(timezone.utc), context.partition_key))
    curves = history_curves(history, [c.label for c in report.checks if c.threshold is not None])
    return MaterializeResult(
        metadata={
            "drifted": bool(report.drifted),
            "drift_reasons": MetadataValue.json(report.reasons()),
            "requests": len(current),
            "requests_by_task": MetadataValue.json({str(k): int(v) for k, v in current["task"].fillna("(none)").value_counts().sort_index().items()}),
            "served_model_version": served or "",
            "served_tasks": MetadataValue.json(mixture),
            "task_notes": MetadataValue.json(report.notes),
            "window_start": str(current["timestamp"].min()),
            "window_end": str(current["timestamp"].max()),
            "metrics": MetadataValue.md(report.table()),
            "drift_over_time": MetadataValue.md(plots.figure_markdown(plots.curves_figure(curves, "drift metrics by report"), "drift over time")),
            **{c.label.replace("/", "_"): c.value for c in report.checks if np.isfinite(c.value)},
        }
    )
