"""Group ``monitoring``: serving traffic in DuckDB, and drift of recent traffic from the training reference."""

from datetime import datetime, timezone

import numpy as np
import pandas as pd
from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from dagster_duckdb import DuckDBResource
from pydantic import Field

from resources import Settings
from rlvr.drift import DriftThresholds, embedding_drift, evaluate_drift, feature_drift
from rlvr.embeddings import embed_texts
from rlvr.prompt_features import prompt_features
from rlvr.traffic import TRAFFIC_COLUMNS, read_traffic, traffic_row
from rlvr_assets import plots
from rlvr_assets.freshness import DAILY

TRAFFIC_SCHEMA = """
CREATE TABLE IF NOT EXISTS serving_traffic (
  record_id VARCHAR PRIMARY KEY, "timestamp" TIMESTAMPTZ, request_id VARCHAR, endpoint VARCHAR, model_version VARCHAR,
  status INTEGER, latency_s DOUBLE, prompt VARCHAR, answer VARCHAR, vote_share DOUBLE, num_completions INTEGER,
  well_formed DOUBLE, completion_chars DOUBLE, completion_tokens DOUBLE, truncated DOUBLE, ground_truth VARCHAR,
  mean_reward DOUBLE, best_reward DOUBLE, source_file VARCHAR, source_offset BIGINT);
CREATE TABLE IF NOT EXISTS serving_traffic_cursor (file VARCHAR PRIMARY KEY, "offset" BIGINT);
"""


class TrafficConfig(Config):
    folder: str = Field(default_factory=lambda: str(Settings.from_env().traffic_dir), description="the service's traffic log folder ($RLVR_TRAFFIC_DIR)")


@asset(group_name="monitoring", kinds={"duckdb"}, owners=["team:rlvr-serving"], freshness_policy=DAILY)
def serving_traffic(context: AssetExecutionContext, config: TrafficConfig, duckdb: DuckDBResource) -> MaterializeResult:
    """The Bento's JSONL traffic logs, ingested incrementally: each file is read from a per-file
    byte cursor stored with the rows in one transaction, so re-runs never duplicate rows; a
    partly written last line waits for the next pass; malformed lines are counted and reported."""
    with duckdb.get_connection() as conn:
        conn.execute(TRAFFIC_SCHEMA)
        cursor = dict(conn.execute('SELECT file, "offset" FROM serving_traffic_cursor').fetchall())
        batch = read_traffic(config.folder, cursor)
        frame = pd.DataFrame([traffic_row(r) for r in batch.records], columns=list(TRAFFIC_COLUMNS))
        frame["timestamp"] = pd.to_datetime(frame["timestamp"], utc=True, errors="coerce")
        cursor_frame = pd.DataFrame({"file": list(batch.cursor), "offset": list(batch.cursor.values())})
        conn.register("incoming", frame)
        conn.register("incoming_cursor", cursor_frame)
        conn.execute("BEGIN TRANSACTION")
        try:
            conn.execute("INSERT INTO serving_traffic BY NAME SELECT * FROM incoming "
                         "WHERE record_id NOT IN (SELECT record_id FROM serving_traffic)")
            conn.execute('INSERT OR REPLACE INTO serving_traffic_cursor SELECT file, "offset" FROM incoming_cursor')
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        total = conn.execute("SELECT count(*) FROM serving_traffic").fetchone()[0]
    if batch.malformed:
        context.log.warning(f"{len(batch.malformed)} malformed traffic lines skipped, e.g. {batch.malformed[:3]}")
    return MaterializeResult(metadata={
        "new_rows": len(frame),
        "dagster/row_count": int(total),
        "malformed_lines": len(batch.malformed),
        "malformed_examples": MetadataValue.json(batch.malformed[:20]),
        "files": len(batch.cursor),
        "table": f"{duckdb.database}:serving_traffic",
    })


class DriftConfig(Config):
    """The window compared with the reference, and the thresholds that flag drift."""

    window: int = Field(default=200, description="the most recent N successful requests")
    min_requests: int = Field(default=20, description="below this, no drift verdict is given")
    reference_size: int = Field(default=1000, description="train questions sampled as the input reference")
    use_embeddings: bool = Field(default=True, description="also measure embedding drift (all-MiniLM-L6-v2)")
    psi: float = Field(default=DriftThresholds.psi)
    ks: float = Field(default=DriftThresholds.ks)
    mean_cosine_distance: float = Field(default=DriftThresholds.mean_cosine_distance)
    mmd: float = Field(default=DriftThresholds.mmd)
    format_compliance_drop: float = Field(default=DriftThresholds.format_compliance_drop)
    vote_share_drop: float = Field(default=DriftThresholds.vote_share_drop)
    verified_reward_drop: float = Field(default=DriftThresholds.verified_reward_drop)

    def thresholds(self) -> DriftThresholds:
        return DriftThresholds(**{k: getattr(self, k) for k in DriftThresholds.__dataclass_fields__})


@asset(group_name="monitoring", kinds={"duckdb"}, owners=["team:rlvr-serving"], deps=["serving_traffic", "gsm8k_problems"],
       freshness_policy=DAILY)
def drift_report(context: AssetExecutionContext, config: DriftConfig, duckdb: DuckDBResource) -> MaterializeResult:
    """Drift of the recent traffic window from the training reference. Inputs: PSI and KS of prompt
    features against train questions, and embedding distance (MMD, mean cosine). Outputs against
    the served policy's last evaluation: format compliance, completion length, verified reward
    (traffic with ground truth); vote share against the previous window. ``drifted`` in the
    metadata drives the drift sensor; every run appends to ``drift_history``."""
    with duckdb.get_connection() as conn:
        window = conn.execute(
            'SELECT * FROM serving_traffic WHERE status = 200 ORDER BY "timestamp" DESC, record_id DESC LIMIT ?',
            [config.window * 2],
        ).df()
        current, previous = window.head(config.window), window.iloc[config.window:]
        reference = conn.execute(
            "SELECT question FROM gsm8k_problems WHERE split = 'train' ORDER BY hash(problem_id) LIMIT ?", [config.reference_size]
        ).df()["question"].tolist()
        served = current["model_version"].mode().iloc[0] if len(current) else None
        evaluation = _latest_eval(conn, served)
    if len(current) < config.min_requests:
        return MaterializeResult(metadata={"drifted": False, "requests": len(current),
                                           "status": f"insufficient traffic: {len(current)} < {config.min_requests} requests"})

    metrics = feature_drift(prompt_features(reference), prompt_features(current["prompt"].tolist()))
    if config.use_embeddings:
        drift = embedding_drift(embed_texts(reference), embed_texts(current["prompt"].tolist()))
        metrics |= {k: drift[k] for k in ("mean_cosine_distance", "mmd")}
    if evaluation is not None:
        metrics["format_compliance_drop"] = float(evaluation["well_formed"].mean() - current["well_formed"].mean())
        metrics["psi/completion_chars"] = feature_drift(
            evaluation[["completion_chars"]], current[["completion_chars"]])["psi/completion_chars"]
        verified = current.dropna(subset=["ground_truth", "mean_reward"])
        if len(verified):
            metrics["verified_reward_mean"] = float(verified["mean_reward"].mean())
            metrics["verified_reward_drop"] = float(evaluation["reward_total"].mean() - verified["mean_reward"].mean())
    shares, previous_shares = current["vote_share"].dropna(), previous["vote_share"].dropna()
    if len(shares) and len(previous_shares) >= config.min_requests:
        metrics["vote_share_drop"] = float(previous_shares.mean() - shares.mean())
    checks = evaluate_drift(metrics, config.thresholds())
    drifted = [c for c in checks if c.drifted]
    history = _append_history(duckdb, context.run.run_id, checks)
    table = "| metric | value | threshold | drifted |\n|---|---|---|---|\n" + "\n".join(
        f"| {c.name} | {c.value:.4f} | {'' if c.threshold is None else c.threshold} | {'**yes**' if c.drifted else ''} |" for c in checks)
    watched = [c.name for c in checks if c.threshold is not None]
    curves = {name: list(zip(range(len(group)), group["value"])) for name, group in history[history.metric.isin(watched)].groupby("metric")}
    return MaterializeResult(metadata={
        "drifted": bool(drifted),
        "drift_reasons": MetadataValue.json([f"{c.name}={c.value:.3f} > {c.threshold}" for c in drifted]),
        "requests": len(current),
        "served_model_version": served or "",
        "window_start": str(current["timestamp"].min()),
        "window_end": str(current["timestamp"].max()),
        "metrics": MetadataValue.md(table),
        "drift_over_time": MetadataValue.md(plots.figure_markdown(plots.curves_figure(curves, "drift metrics by report"), "drift over time")),
        **{name.replace("/", "_"): float(value) for name, value in metrics.items() if np.isfinite(value)},
    })


def _latest_eval(conn, policy_version):
    """Per-problem results of the most recent evaluation of ``policy_version``, or None."""
    if policy_version is None or not conn.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'eval_results'").fetchone()[0]:
        return None
    frame = conn.execute(
        "SELECT *, length(completion) AS completion_chars, well_formed::DOUBLE AS well_formed FROM eval_results "
        "WHERE policy_version = ? AND eval_id = "
        "(SELECT eval_id FROM eval_results WHERE policy_version = ? ORDER BY evaluated_at DESC LIMIT 1)",
        [policy_version, policy_version],
    ).df()
    return frame if len(frame) else None


def _append_history(duckdb: DuckDBResource, run_id: str, checks) -> pd.DataFrame:
    """Append this report's metrics to ``drift_history`` and return the whole history in order."""
    now = datetime.now(timezone.utc)
    rows = pd.DataFrame([{"reported_at": now, "run_id": run_id, "metric": c.name, "value": c.value,
                          "threshold": c.threshold, "drifted": c.drifted} for c in checks])
    with duckdb.get_connection() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS drift_history (reported_at TIMESTAMPTZ, run_id VARCHAR, metric VARCHAR, "
                     "value DOUBLE, threshold DOUBLE, drifted BOOLEAN)")
        conn.register("incoming", rows)
        conn.execute("INSERT INTO drift_history BY NAME SELECT * FROM incoming")
        return conn.execute("SELECT * FROM drift_history ORDER BY reported_at").df()
