"""MLflow tracking and registry: a local SQLite store by default, any tracking URI otherwise."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field


class MLflowResource(ConfigurableResource):
    """Points MLflow at a tracking server or local store and an experiment."""

    tracking_uri: str = Field(description="e.g. sqlite:///.rlvr/mlflow.db or http://mlflow:5000")
    experiment: str = Field(default="rlvr-ops", description="experiment that runs are logged under")
    artifact_location: str | None = Field(default=None, description="artifact root for a new experiment")

    def client(self):
        """An MlflowClient bound to this tracking URI (registry too)."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def experiment_id(self) -> str:
        client = self.client()
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            return experiment.experiment_id
        location = None
        if self.artifact_location:
            from pathlib import Path

            location = Path(self.artifact_location).resolve().as_uri()
        return client.create_experiment(self.experiment, artifact_location=location)

    def activate(self) -> str:
        """Make this store and experiment the active ones for the ``mlflow`` module; returns the experiment id."""
        import mlflow

        mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.set_registry_uri(self.tracking_uri)
        experiment_id = self.experiment_id()
        mlflow.set_experiment(experiment_id=experiment_id)
        return experiment_id
