"""Print where the pipeline's outputs are: ``python -m rlvr_assets.summary`` (the end of ``make run``)."""

from dagster import AssetKey, DagsterInstance

from resources import Settings
from resources.costs import ledger, summed
from rlvr.costs import configured_prices
from rlvr_assets.definitions import defs
from rlvr_assets.resources import default_resources


def lineage_path() -> str:
    """The global lineage with every group open (the UI's ``expanded`` parameter), not as collapsed boxes."""
    groups = sorted({defs.resolve_asset_graph().get(key).group_name for key in defs.resolve_asset_graph().get_all_asset_keys()})
    return "/asset-groups?expanded=" + ",".join(f"global@global:{group}" for group in groups)


def main() -> None:
    settings = Settings.from_env()
    instance = DagsterInstance.get()
    print(f"\nrlvr-ops data directory: {settings.home}")
    print(f"  DuckDB file:      {settings.duckdb_path}")
    print(f"  model store:      {settings.model_root}")
    print(f"  MLflow tracking:  {settings.mlflow_tracking_uri}")
    print(f"  MLflow UI:        {default_resources(settings)['mlflow'].links().experiment()}  (after `make mlflow`)")
    print(f"  Dagster instance: {settings.dagster_home}  (browse with `make ui`: http://127.0.0.1:3000{lineage_path()})")
    print("latest materializations:")
    for key in sorted(defs.resolve_asset_graph().get_all_asset_keys(), key=lambda k: k.to_user_string()):
        event = instance.get_latest_materialization_event(AssetKey(key.path))
        if event is None or event.asset_materialization is None:
            print(f"  {key.to_user_string():<18} not materialized")
            continue
        metadata = event.asset_materialization.metadata
        where = metadata.get("path") or metadata.get("table")
        detail = f"  -> {where.value}" if where is not None else ""
        print(f"  {key.to_user_string():<18} run {event.run_id[:8]}{detail}")
    report = instance.get_latest_materialization_event(AssetKey("eval_report"))
    if report is not None and report.asset_materialization is not None and "pass@1 strict (%)" in report.asset_materialization.metadata:
        meta = report.asset_materialization.metadata
        print(
            f"evaluation: pass@1 (strict) {meta['pass@1 strict (%)'].value:.1f}% on {meta['problems'].value} problems, "
            f"{meta['Δ pass@1 strict vs base (points)'].value:+.1f} points vs the base policy (McNemar p = {meta['McNemar p'].value:.3g}); "
            f"in MLflow: {meta['MLflow evaluation run'].value}"
        )
        if "moved_accuracy" in meta:  # which stage (SFT, GRPO) moved strict accuracy, if any
            print(f"stages: {meta['moved_accuracy'].value}")
    if report is not None:
        print(run_cost(default_resources(settings)["duckdb"], report.run_id))
    bento = instance.get_latest_materialization_event(AssetKey("bento"))
    if bento is not None and bento.asset_materialization is not None:
        command = bento.asset_materialization.metadata["serve_command"].value.strip("`\n ")
        print(f"serve the champion:\n  {command}")


def run_cost(duckdb, run_id: str) -> str:
    """One line: what the Dagster run ``run_id`` cost, from its assets' ledger rows (``costs``), in USD where priced."""
    rows = ledger(duckdb, scope="asset")
    rows, steps = rows[rows["run_id"] == run_id], ledger(duckdb, scope="step")
    if rows.empty:
        return f"cost: no ledger rows for run {run_id[:8]}"
    prices = configured_prices()
    total = summed(rows.assign(run=run_id), ["run"], prices).iloc[0]
    tokens = steps[steps["run_id"] == run_id][["prompt_tokens", "completion_tokens", "trained_tokens"]].sum()
    money = f", ${total['cost_usd']:.4f} at the configured prices" if "cost_usd" in total else ""
    return (
        f"cost of run {run_id[:8]}: {total['cpu_core_s']:.0f} CPU core-s over {total['wall_s']:.0f} s of materializations{money}; "
        f"training {int(tokens['prompt_tokens'])} prompt + {int(tokens['completion_tokens'])} completion tokens ({int(tokens['trained_tokens'])} trained) "
        f"(`cost_report` in the UI)"
    )


if __name__ == "__main__":
    main()
