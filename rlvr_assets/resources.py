"""The default resources, all rooted in the data directory (``$RLVR_HOME``)."""

from __future__ import annotations

from resources import BentoBuilder, ComputeResource, Evaluator, MLflowResource, ModelStore, Settings, Warehouse
from resources.k8s_launcher import K8sTrainingLauncher
from resources.launcher import TrainingLauncher


def default_resources(settings: Settings | None = None) -> dict:
    """Resources for a local install: DuckDB file, model store, MLflow store and compute under one folder."""
    settings = (settings or Settings.from_env()).ensure()
    warehouse, compute = Warehouse(database=str(settings.duckdb_path)), ComputeResource()
    return {
        "duckdb": warehouse,
        "model_store": ModelStore(root=str(settings.model_root)),
        "mlflow": MLflowResource(
            tracking_uri=settings.mlflow_tracking_uri,
            # a tracking server keeps its own artifact store; a local store keeps artifacts beside it
            artifact_location=None if settings.mlflow_tracking_uri.startswith("http") else str(settings.mlflow_artifact_root),
        ),
        "compute": compute,
        "evaluator": Evaluator(warehouse=warehouse, compute=compute),
        "bento_builder": BentoBuilder(),
        "launcher": K8sTrainingLauncher.from_env() if settings.launcher == "k8s" else TrainingLauncher(),  # deploy/k8s/rlvr-config.yaml
    }
