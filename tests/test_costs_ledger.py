"""``@metered``: real materializations write one ``costs`` row each and carry its totals in their metadata."""

import inspect
import json

import pytest
from dagster import AssetExecutionContext, Config, DagsterInstance, MaterializeResult, asset, materialize

from resources import Evaluation, Warehouse
from resources.costs import ledger, summed
from rlvr.costs import configured_prices
from rlvr_assets.data import gsm8k_problems
from rlvr_assets.metering import count_evaluation, metered
from rlvr_assets.tasks import task_problems

pytestmark = pytest.mark.slow  # materializes Dagster assets


class SpinConfig(Config):
    loops: int = 2_000_000  # ~0.1 s of CPU: several of the kernel's 10 ms accounting ticks, never none


@asset
@metered
def returned(context: AssetExecutionContext, config: SpinConfig, duckdb: Warehouse) -> MaterializeResult:
    """A returning asset doing a little CPU work and one counted evaluation."""
    count_evaluation("gsm8k", Evaluation("e1", [{"prompt_tokens": 7, "completion_tokens": 5}, {"completion_tokens": 3}], reused=False))
    count_evaluation("gsm8k", Evaluation("e2", [{"prompt_tokens": 100, "completion_tokens": 100}], reused=True))  # no work: not counted
    return MaterializeResult(metadata={"total": sum(i * i for i in range(config.loops))})


@asset
@metered
def yielded(context: AssetExecutionContext, duckdb: Warehouse):
    """A generator asset."""
    yield MaterializeResult(metadata={"rows": 3})


@asset
@metered
def failing(context: AssetExecutionContext, duckdb: Warehouse) -> MaterializeResult:
    """An asset that fails after spending its work."""
    raise RuntimeError("boom")


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def metadata(result, node: str) -> dict:
    return {name: value.value for name, value in result.asset_materializations_for_node(node)[0].metadata.items()}


def test_the_decorator_keeps_what_dagster_reads():
    assert inspect.isgeneratorfunction(yielded.op.compute_fn.decorated_fn) and not inspect.isgeneratorfunction(returned.op.compute_fn.decorated_fn)
    assert "duckdb" in returned.required_resource_keys and returned.op.config_schema is not None
    assert "duckdb" in gsm8k_problems.required_resource_keys and len(gsm8k_problems.check_specs_by_output_name) == 4


def test_a_job_of_data_assets_writes_one_row_per_materialization(tmp_path, gsm8k_dir, instance, monkeypatch):
    monkeypatch.setenv("RLVR_PRICES", "none")
    db = Warehouse(database=str(tmp_path / "rlvr.duckdb"))
    config = {"ops": {"gsm8k_problems": {"config": {"source": "local", "local_dir": str(gsm8k_dir), "limit": 20}}}}
    first = materialize([gsm8k_problems, returned, yielded], resources={"duckdb": db}, run_config=config, instance=instance)
    assert first.success
    task = materialize(
        [task_problems],
        resources={"duckdb": db},
        partition_key="gsm8k",
        instance=instance,
        run_config={"ops": {"task_problems": {"config": {"options": {"source": "local", "local_dir": str(gsm8k_dir), "limit": 5}}}}},
    )
    assert task.success

    rows = ledger(db, scope="asset")
    assert sorted(zip(rows["run_id"], rows["asset"], rows["partition"])) == sorted(
        [(first.run_id, "gsm8k_problems", ""), (first.run_id, "returned", ""), (first.run_id, "yielded", ""), (task.run_id, "task_problems", "gsm8k")]
    )
    assert set(rows["root_run_id"]) == {first.run_id, task.run_id} and set(rows["machine"]) == {"cpu"}
    assert (
        (rows["wall_s"] > 0).all() and (rows["peak_rss_mb"] > 0).all() and (rows.set_index("asset")["cpu_core_s"].loc[["gsm8k_problems", "returned"]] > 0).all()
    )

    per_run = summed(rows, ["run_id"], configured_prices()).set_index("run_id")
    assert "cost_usd" not in per_run
    assert per_run.loc[first.run_id, "cpu_core_s"] == pytest.approx(rows[rows["run_id"] == first.run_id]["cpu_core_s"].sum())
    shown = sum(metadata(first, node)["cost: CPU core-s"] for node in ("gsm8k_problems", "returned", "yielded"))
    assert shown == pytest.approx(per_run.loc[first.run_id, "cpu_core_s"], abs=0.02)  # the metadata show each row's total, rounded

    meta = metadata(first, "returned")
    assert meta["total"] == sum(i * i for i in range(SpinConfig().loops))  # the asset's own metadata kept
    assert meta["cost: wall (s)"] > 0 and meta["cost: prompt tokens"] == 7 and meta["cost: completion tokens"] == 8
    assert "cost: energy (Wh) (estimated)" in meta or "cost: energy (Wh)" in meta
    assert not any("USD" in name for name in meta)
    assert metadata(first, "yielded")["rows"] == 3
    assert {e.check_name: e.passed for e in first.get_asset_check_evaluations()} == dict.fromkeys(
        ("row_counts", "answers_parse", "no_split_overlap", "no_nulls"), True
    )

    evaluations = ledger(db, scope="evaluation")
    assert evaluations[["asset", "task", "prompt_tokens", "completion_tokens"]].values.tolist() == [["returned", "gsm8k", 7, 8]]
    asset_row = rows[rows["asset"] == "returned"].iloc[0]
    assert evaluations["cpu_core_s"].iloc[0] == pytest.approx(asset_row["cpu_core_s"])  # the only task: the whole work


def test_money_only_with_prices_and_a_failed_materialization_is_recorded(tmp_path, instance, monkeypatch):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"default": {"core_hour": 3600.0}, "cpu": {"core_hour": 3600.0}}))  # USD 1 a core-second
    monkeypatch.setenv("RLVR_PRICES", str(prices))
    db = Warehouse(database=str(tmp_path / "rlvr.duckdb"))
    result = materialize([returned], resources={"duckdb": db}, instance=instance)
    meta = metadata(result, "returned")
    assert meta["cost (USD)"] == pytest.approx(meta["cost: CPU core-s"], rel=0.05, abs=0.011)  # both shown rounded

    failed = materialize([failing], resources={"duckdb": db}, instance=instance, raise_on_error=False)
    assert not failed.success
    assert ledger(db, scope="asset").set_index("asset").loc["failing", "run_id"] == failed.run_id


def test_a_metered_asset_without_a_warehouse_is_refused_naming_it():
    with pytest.raises(TypeError, match="metered asset lonely takes no Warehouse resource"):

        @metered
        def lonely(context: AssetExecutionContext) -> MaterializeResult:
            return MaterializeResult()
