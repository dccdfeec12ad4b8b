"""Dagster resources of rlvr-ops: the DuckDB warehouse, model store, MLflow tracking and compute."""

from resources.compute import ComputeResource
from resources.model_store import ModelStore
from rlvr.settings import Settings
from resources.tracking import MLflowResource
from resources.warehouse import replace_rows, replace_tables

__all__ = ["ComputeResource", "MLflowResource", "ModelStore", "Settings", "replace_rows", "replace_tables"]
