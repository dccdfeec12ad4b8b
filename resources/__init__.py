"""Dagster resources of rlvr-ops: the DuckDB warehouse, model store, MLflow tracking, compute, evaluations
and the Bento builder; ``config_from`` exposes a core dataclass config as Dagster run config.

Names are imported when first used (PEP 562), so a process that needs one module of the package (the
training worker: ``resources.grpo_worker``) does not pay for MLflow, BentoML and DuckDB at start.
"""

from importlib import import_module

_WHERE = {
    "BentoBuilder": "resources.bento",
    "ComputeResource": "resources.compute",
    "EvalProtocol": "resources.evaluations",
    "Evaluation": "resources.evaluations",
    "Evaluator": "resources.evaluations",
    "ModelStore": "resources.model_store",
    "StoredModel": "resources.model_store",
    "CoreConfig": "resources.run_config",
    "EnvironmentConfig": "resources.run_config",
    "build_environment": "resources.run_config",
    "config_from": "resources.run_config",
    "CHAMPION": "resources.tracking",
    "MLflowResource": "resources.tracking",
    "WRITER_POOL": "resources.warehouse",
    "Append": "resources.warehouse",
    "Replace": "resources.warehouse",
    "Upsert": "resources.warehouse",
    "Warehouse": "resources.warehouse",
    "Settings": "rlvr.settings",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'resources' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
