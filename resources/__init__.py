"""Dagster resources of rlvr-ops: the DuckDB warehouse, model store, MLflow tracking, compute, evaluations
and the Bento builder; ``config_from`` exposes a core dataclass config as Dagster run config."""

from resources.bento import BentoBuilder
from resources.compute import ComputeResource
from resources.evaluations import EvalProtocol, Evaluation, Evaluator
from resources.model_store import ModelStore, StoredModel
from resources.run_config import CoreConfig, EnvironmentConfig, build_environment, config_from
from resources.tracking import CHAMPION, MLflowResource
from resources.warehouse import WRITER_POOL, Append, Replace, Upsert, Warehouse
from rlvr.settings import Settings

__all__ = [
    "Append",
    "BentoBuilder",
    "CHAMPION",
    "ComputeResource",
    "CoreConfig",
    "EvalProtocol",
    "EnvironmentConfig",
    "Evaluation",
    "Evaluator",
    "MLflowResource",
    "ModelStore",
    "Replace",
    "Settings",
    "StoredModel",
    "Upsert",
    "WRITER_POOL",
    "Warehouse",
    "build_environment",
    "config_from",
]
