"""Group ``costs``: what the work cost, from the ledger (``costs``: every materialization, training step and
evaluation) and the service's traffic (per API key), as tables and plots. Money appears only where prices are set
(``RLVR_PRICES``; docs/costs.md)."""

import pandas as pd
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from resources import Warehouse
from resources.costs import daily, ledger, summed, traffic_usage
from rlvr import plots
from rlvr.costs import configured_prices
from rlvr_assets.metadata import amount, markdown_table
from rlvr_assets.metering import metered

COLUMNS = {
    "wall_s": "wall (s)",
    "cpu_core_s": "CPU core-s",
    "gpu_s": "GPU-s",
    "energy_kwh": "energy (Wh)",
    "prompt_tokens": "prompt tokens",
    "completion_tokens": "completion tokens",
    "trained_tokens": "trained tokens",
    "peak_rss_mb": "peak RSS (MiB)",
    "peak_gpu_mem_mb": "peak GPU memory (MiB)",
    "cost_usd": "cost (USD)",
    "generated_tokens": "generated tokens",
    "compute_s": "compute (s)",
    "api_key_id": "API key",
}


@asset(group_name="costs", kinds={"duckdb"}, owners=["team:rlvr-training"], deps=["serving_traffic"])
@metered
def cost_report(context: AssetExecutionContext, duckdb: Warehouse) -> MaterializeResult:
    """What rlvr-ops cost: compute, memory, energy and tokens per day and per run, by asset (each materialization),
    by task (training steps and evaluations) and by API key (served requests), as tables and plots; USD where
    prices are set."""
    prices = configured_prices()
    rows = ledger(duckdb)
    assets, work = rows[rows["scope"] == "asset"], rows[rows["scope"].isin(["step", "evaluation"])]
    per_day, by_asset = daily(assets, prices), summed(assets, ["asset"], prices)
    by_task, keys = summed(work, ["task", "scope"], prices), traffic_usage(duckdb)
    per_key = keys.groupby("api_key_id", as_index=False)[["requests", "prompt_tokens", "generated_tokens", "compute_s"]].sum()
    measure, unit = ("cost_usd", "USD") if prices.is_set else ("cpu_core_s", "CPU core-s")
    figures = {
        "cost over time": plots.daily_figure(list(per_day["day"]), {"materializations": list(per_day[measure])}, f"cost per day ({unit})", unit),
        "cost by asset": plots.bars_figure(list(by_asset["asset"]), list(by_asset[measure]), f"cost by asset ({unit})", unit),
        "cost by task": plots.bars_figure(
            [f"{t} ({s})" for t, s in zip(by_task["task"], by_task["scope"])], list(by_task[measure]), f"cost by task ({unit})", unit
        ),
        "usage by API key": plots.bars_figure(list(per_key["api_key_id"]), list(per_key["compute_s"]), "serving compute by API key (s)", "compute (s)"),
    }
    total = summed(assets.assign(all=""), ["all"], prices)
    return MaterializeResult(
        metadata={
            "materializations": len(assets),
            "total CPU core-s": round(float(total["cpu_core_s"].sum()), 2),
            "total GPU-s": round(float(total["gpu_s"].sum()), 2),
            **({"total cost (USD)": round(float(total["cost_usd"].sum()), 4)} if "cost_usd" in total else {}),
            "requests": int(per_key["requests"].sum()),
            "per day": table(per_day),
            "per run": table(summed(assets, ["run_id"], prices)),
            "by asset": table(by_asset),
            "by task": table(by_task),
            "by API key": table(per_key),
            "by API key and day": table(keys),
            **{name: MetadataValue.md(plots.figure_markdown(fig, name)) for name, fig in figures.items()},
        }
    )


def table(frame: pd.DataFrame) -> MetadataValue:
    """A cost table as Markdown (its columns named as people read them, energy in Wh, small amounts to four
    decimals); a line saying so when it is empty."""
    if frame.empty:
        return MetadataValue.md("_nothing recorded yet_")
    shown = frame.copy()
    for column, scale in (("energy_kwh", 1000.0), ("cost_usd", 1.0)):
        if column in shown:
            shown[column] = [amount(value * scale) for value in shown[column]]
    return markdown_table(shown.to_dict(orient="records"), COLUMNS)
