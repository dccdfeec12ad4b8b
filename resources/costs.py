"""The cost ledger: :class:`~rlvr.costs.Usage` records as rows of the warehouse's ``costs`` table.

One row per (run, asset, partition, step, task): ``scope`` ``asset`` (a whole materialization: step and
task empty), ``step`` (a training step's share for one task, by the task's share of the step's tokens) or
``evaluation`` (an evaluation's work on one task). Prices are applied when the ledger is read
(:func:`with_money`), so a changed price table reprices every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import pandas as pd

from resources.part_keys import NO_PARTITION, partition_sql
from rlvr.costs import PriceTable, Usage, total

COSTS = "costs"
SCOPES = ("asset", "step", "evaluation")
USAGE_COLUMNS = tuple(Usage.__dataclass_fields__)


def cost_id(run_id: str, asset: str, partition: str | None, step: int | None, task: str | None) -> str:
    """A row's key: run, asset, partition, step and task."""
    return "|".join((run_id, asset, partition or "", "" if step is None else str(step), task or ""))


def cost_row(
    usage: Usage,
    *,
    run_id: str,
    asset: str,
    scope: str,
    machine: str,
    partition: str | None = None,
    step: int | None = None,
    task: str | None = None,
    root_run_id: str | None = None,
    policy_version: str | None = None,
    recorded_at: datetime | None = None,
) -> dict:
    """One ``costs`` row of ``usage``; ValueError for an unknown scope."""
    if scope not in SCOPES:
        raise ValueError(f"cost scope must be one of {SCOPES}, got {scope!r}")
    return {
        "cost_id": cost_id(run_id, asset, partition, step, task),
        "recorded_at": recorded_at or datetime.now(timezone.utc),
        "run_id": run_id,
        "root_run_id": root_run_id or run_id,
        "asset": asset,
        "partition": partition or "",
        "step": step,
        "task": task or "",
        "scope": scope,
        "machine": machine,
        "policy_version": policy_version,
        **usage.as_dict(),
    }


def cost_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as the frame :class:`~resources.warehouse.Upsert` writes (keyed by ``cost_id``)."""
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["step"] = frame["step"].astype("Int64")
    return frame


def usage_of(row: dict | pd.Series) -> Usage:
    """The :class:`Usage` a ledger row records."""
    return Usage(**{name: row[name] for name in USAGE_COLUMNS})


def with_money(frame: pd.DataFrame, prices: PriceTable) -> pd.DataFrame:
    """``frame`` (ledger rows, or sums of them with a ``machine`` column) with a ``cost_usd`` column when a price
    is set; unchanged when none is (no money shown without prices)."""
    if not prices.is_set or frame.empty:
        return frame
    money = [prices.money(usage_of(row), row["machine"]) for _, row in frame.iterrows()]
    return frame.assign(cost_usd=money)


# --- reading the ledger -----------------------------------------------------------------------------

SUMMED = ("wall_s", "cpu_core_s", "gpu_s", "energy_kwh", "prompt_tokens", "completion_tokens", "trained_tokens")
PEAKS = ("peak_rss_mb", "peak_gpu_mem_mb")
LEDGER_COLUMNS = ("cost_id", "recorded_at", "run_id", "root_run_id", "asset", "partition", "step", "task", "scope", "machine", "policy_version", *USAGE_COLUMNS)
TRAFFIC_USAGE = ("requests", "prompt_tokens", "generated_tokens", "compute_s")


def ledger(warehouse, scope: str | None = None, root_run_id: str | None = None) -> pd.DataFrame:
    """The ``costs`` rows (of ``scope`` / training run ``root_run_id`` when given), oldest first; numbers NULL in
    older rows read as 0. Empty, with the ledger's columns, before any row was written."""
    if not warehouse.table_exists(COSTS):
        return pd.DataFrame(columns=list(LEDGER_COLUMNS))
    frame = warehouse.query(
        "SELECT * FROM costs WHERE (CAST(? AS VARCHAR) IS NULL OR scope = ?) AND (CAST(? AS VARCHAR) IS NULL OR root_run_id = ?) ORDER BY recorded_at, cost_id",
        [scope, scope, root_run_id, root_run_id],
    )
    numbers = [*SUMMED, *PEAKS]
    frame[numbers] = frame[numbers].fillna(0)
    return frame.assign(energy_source=frame["energy_source"].fillna("estimate"), machine=frame["machine"].fillna("default"))


def summed(frame: pd.DataFrame, by: list[str], prices: PriceTable) -> pd.DataFrame:
    """Ledger rows summed per ``by``: times, energy and tokens added, peaks the largest, and ``cost_usd`` (each row
    priced by its machine) when a price is set. Biggest CPU cost first."""
    priced, money = with_money(frame, prices), ["cost_usd"] if prices.is_set else []
    if priced.empty:
        return pd.DataFrame(columns=[*by, *SUMMED, *PEAKS, *money])
    aggregations = {name: "sum" for name in (*SUMMED, *money)} | {name: "max" for name in PEAKS}
    return priced.groupby(by, dropna=False).agg(aggregations).reset_index().sort_values("cpu_core_s", ascending=False, ignore_index=True)


def daily(frame: pd.DataFrame, prices: PriceTable) -> pd.DataFrame:
    """Ledger rows summed per UTC day (``day``: ``YYYY-MM-DD``), oldest first."""
    days = pd.to_datetime(frame["recorded_at"], utc=True).dt.strftime("%Y-%m-%d") if not frame.empty else frame["recorded_at"]
    return summed(frame.assign(day=days), ["day"], prices).sort_values("day", ignore_index=True)


@dataclass(frozen=True)
class PolicyCost:
    """What training one policy cost (its ``step`` rows), in all and per task by the task's share of the tokens."""

    total: Usage
    money: float | None
    per_task: dict[str, tuple[Usage, float | None]]  # task -> (usage share, USD share)


def policy_cost(warehouse, root_run_id: str | None, prices: PriceTable) -> PolicyCost | None:
    """The cost of the training run ``root_run_id`` from its ``step`` rows; None without any (or without a run id)."""
    rows = ledger(warehouse, scope="step", root_run_id=root_run_id) if root_run_id else pd.DataFrame()
    if rows.empty:
        return None
    usages = [(usage_of(row), row["machine"], row["task"]) for _, row in rows.iterrows()]
    money = [prices.money(usage, machine) for usage, machine, _ in usages]
    total_money = sum(m for m in money if m is not None) if prices.is_set else None
    whole = total(usage for usage, _, _ in usages)
    tokens = {}
    for usage, _, task in usages:
        tokens[task] = tokens.get(task, 0) + usage.prompt_tokens + usage.completion_tokens
    all_tokens = sum(tokens.values())
    per_task = {}
    for task, count in tokens.items():
        share = count / all_tokens if all_tokens else 1 / len(tokens)
        per_task[task] = (whole.share(share), total_money * share if total_money is not None else None)
    return PolicyCost(whole, total_money, per_task)


def traffic_usage(warehouse) -> pd.DataFrame:
    """Serving traffic per API key and UTC day: requests, prompt and generated tokens, compute seconds (NULL in older
    rows counts as 0; requests without a key are ``(none)``)."""
    if not warehouse.table_exists("serving_traffic"):
        return pd.DataFrame(columns=["api_key_id", "day", *TRAFFIC_USAGE])
    usage = warehouse.query(
        f"""SELECT coalesce(api_key_id, '(none)') AS api_key_id, {partition_sql("serving_traffic", {"source_file"})} AS day,
        count(*) AS requests, coalesce(sum(prompt_tokens), 0) AS prompt_tokens, coalesce(sum(generated_tokens), 0) AS generated_tokens,
        coalesce(sum(compute_s), 0.0) AS compute_s FROM serving_traffic GROUP BY ALL ORDER BY day, api_key_id"""
    )  # the traffic day as the table's partitions name it (its log file's UTC day)
    return usage.assign(day=[f"{d[:4]}-{d[4:6]}-{d[6:]}" if d != NO_PARTITION else d for d in usage["day"]])
