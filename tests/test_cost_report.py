"""``cost_report`` materialized on a real DuckDB file holding ledger and traffic rows."""

import json
from datetime import datetime, timezone

import pandas as pd
import pytest
from dagster import DagsterInstance, materialize

from resources import Append, Upsert, Warehouse
from resources.costs import COSTS, cost_frame, cost_row, ledger, traffic_usage
from rlvr.costs import Usage
from rlvr.monitoring.traffic import TRAFFIC_COLUMNS
from rlvr_assets.costs import cost_report

DAY1, DAY2 = datetime(2026, 11, 20, 9, tzinfo=timezone.utc), datetime(2026, 11, 21, 9, tzinfo=timezone.utc)


def traffic(key, when, prompt, generated, compute, index):
    stamp = when.strftime("%Y%m%dT%H%M%S")
    row = dict.fromkeys(TRAFFIC_COLUMNS)
    return row | {
        "record_id": f"traffic-{stamp}.jsonl@{index}",
        "timestamp": when,
        "status": 200,
        "source_file": f"traffic-{stamp}.jsonl",
        "source_offset": index,
        "api_key_id": key,
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "compute_s": compute,
    }


@pytest.fixture
def warehouse(tmp_path):
    db = Warehouse(database=str(tmp_path / "rlvr.duckdb"))
    rows = [
        cost_row(Usage(wall_s=10, cpu_core_s=36.0, peak_rss_mb=100), run_id="r1", asset="gsm8k_problems", scope="asset", machine="cpu", recorded_at=DAY1),
        cost_row(Usage(wall_s=20, cpu_core_s=72.0, peak_rss_mb=300), run_id="r2", asset="grpo_training", scope="asset", machine="cpu", recorded_at=DAY2),
        cost_row(Usage(cpu_core_s=50.0).with_tokens(100, 300, 300), run_id="r2", asset="grpo_training", scope="step", step=1, task="gsm8k", machine="cpu"),
        cost_row(Usage(cpu_core_s=22.0).with_tokens(50, 50, 50), run_id="r2", asset="grpo_training", scope="step", step=1, task="math", machine="cpu"),
    ]
    frame = pd.DataFrame(
        [
            traffic("key-a", DAY1, 10, 20, 0.5, 0),
            traffic("key-a", DAY2, 30, 40, 1.5, 1),
            traffic("key-b", DAY2, 5, None, None, 2),  # an older row: no generated tokens or compute recorded
        ]
    )
    db.write(Upsert(COSTS, cost_frame(rows), "cost_id"), Append("serving_traffic", frame, key="record_id"))
    return db


def report(warehouse):
    with DagsterInstance.ephemeral() as instance:
        result = materialize([cost_report], resources={"duckdb": warehouse}, instance=instance)
    assert result.success
    return {name: value.value for name, value in result.asset_materializations_for_node("cost_report")[0].metadata.items()}


def test_per_key_usage_sums_nulls_as_zero(warehouse):
    per_key = traffic_usage(warehouse).groupby("api_key_id")[["requests", "prompt_tokens", "generated_tokens", "compute_s"]].sum()
    assert per_key.loc["key-a"].tolist() == [2, 40, 60, 2.0]
    assert per_key.loc["key-b"].tolist() == [1, 5, 0, 0.0]


def test_report_without_prices_has_tables_and_plots_and_no_money(warehouse, monkeypatch):
    monkeypatch.setenv("RLVR_PRICES", "none")
    meta = report(warehouse)
    assert meta["materializations"] == 2 and meta["total CPU core-s"] == 108.0 and meta["requests"] == 3
    assert "| 2026-11-20 |" in meta["per day"] and "| 2026-11-21 |" in meta["per day"]
    assert "| grpo_training |" in meta["by asset"] and "| math | step |" in meta["by task"]
    assert "| key-a | 2 | 40 | 60 | 2 |" in meta["by API key"]
    for name in ("cost over time", "cost by asset", "cost by task", "usage by API key"):
        assert meta[name].startswith("![")
    assert not any("USD" in name or "USD" in str(value) for name, value in meta.items() if not str(value).startswith("!["))
    assert not any("cost (USD)" in name for name in meta)  # the report's own cost is metered too, without money


def test_report_with_a_price_file_shows_money(warehouse, tmp_path, monkeypatch):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"cpu": {"core_hour": 3.6}}))  # 0.001 USD per core-second
    monkeypatch.setenv("RLVR_PRICES", str(prices))
    meta = report(warehouse)
    assert meta["total cost (USD)"] == pytest.approx(0.108)
    assert "cost (USD)" in meta["by asset"] and "cost (USD)" in meta
    # the report's own materialization is in the ledger now
    assert "cost_report" in set(ledger(warehouse, scope="asset")["asset"])


def test_report_on_an_empty_warehouse(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVR_PRICES", "none")
    meta = report(Warehouse(database=str(tmp_path / "empty.duckdb")))
    assert meta["materializations"] == 0 and meta["requests"] == 0
    assert meta["by API key"] == "_nothing recorded yet_" and meta["cost by asset"].startswith("![")


def test_policy_cost_splits_by_token_share_and_prices_per_point(warehouse, tmp_path):
    from resources.costs import policy_cost
    from rlvr.costs import Prices, PriceTable
    from rlvr_assets.metadata import policy_cost_metadata, task_cost_rows

    priced = PriceTable({"cpu": Prices(core_hour=3.6)})
    cost = policy_cost(warehouse, "r2", priced)
    assert cost.total.cpu_core_s == pytest.approx(72.0) and cost.money == pytest.approx(0.072)
    gsm8k, _ = cost.per_task["gsm8k"]  # 400 of the 500 tokens
    assert gsm8k.cpu_core_s == pytest.approx(72.0 * 0.8)
    meta = policy_cost_metadata(cost, 8.0)
    assert meta["training CPU core-s per point gained"] == 9.0 and meta["training USD per point gained"] == pytest.approx(0.009)
    assert policy_cost_metadata(cost, -1.0)["training CPU core-s per point gained"] == "no gain"
    rows = task_cost_rows(cost, {"gsm8k": 4.0, "math": 0.0})
    assert rows[0]["core-s per point"] == pytest.approx(14.4) and rows[1]["core-s per point"] == "no gain"
    assert "USD" not in task_cost_rows(policy_cost(warehouse, "r2", PriceTable({})), {"gsm8k": 4.0})[0]
    assert policy_cost(warehouse, "no-such-run", priced) is None
    assert policy_cost_metadata(None, 5.0) == {"training cost": "no step costs recorded for the trained policy's run"}
