"""The one Definitions object of rlvr-ops, loaded by ``dagster dev`` through workspace.yaml."""

from dagster import Definitions, define_asset_job, in_process_executor

from rlvr_assets import data, models
from rlvr_assets.resources import default_resources

pipeline_job = define_asset_job(
    "rlvr_pipeline", selection="*", description="Every asset, data to served policy.", tags={"rlvr/duckdb": "writer"}
)

defs = Definitions(
    assets=[data.gsm8k_problems, models.base_policy],
    jobs=[pipeline_job],
    resources=default_resources(),
    executor=in_process_executor,
)
