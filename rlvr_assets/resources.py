"""The default resources, all rooted in the data directory (``$RLVR_HOME``)."""

from __future__ import annotations

from dagster_duckdb import DuckDBResource

from resources import ComputeResource, MLflowResource, ModelStore, Settings


def default_resources(settings: Settings | None = None) -> dict:
    """Resources for a local install: DuckDB file, model store, MLflow store and compute under one folder."""
    settings = (settings or Settings.from_env()).ensure()
    return {
        "duckdb": DuckDBResource(database=str(settings.duckdb_path)),
        "model_store": ModelStore(root=str(settings.model_root)),
        "mlflow": MLflowResource(
            tracking_uri=settings.mlflow_tracking_uri,
            # a tracking server keeps its own artifact store; a local store keeps artifacts beside it
            artifact_location=None if settings.mlflow_tracking_uri.startswith("http") else str(settings.mlflow_artifact_root),
        ),
        "compute": ComputeResource(),
    }
