"""MLflow tracking and registry: a local SQLite store by default, any tracking URI otherwise."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field


class MLflowResource(ConfigurableResource):
    """Points MLflow at a tracking server or local store and an experiment."""

    tracking_uri: str = Field(description="e.g. sqlite:///.rlvr/mlflow.db or http://mlflow:5000")
    experiment: str = Field(default="rlvr-ops", description="experiment that runs are logged under")
    artifact_location: str | None = Field(default=None, description="artifact root for a new experiment")
    registered_model: str = Field(default="rlvr-gsm8k-policy", description="registered model holding trained policies")

    def client(self):
        """An MlflowClient bound to this tracking URI (registry too)."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def registry(self) -> "PolicyRegistry":
        """The champion/challenger view of the registered model."""
        return PolicyRegistry(self.client(), self.registered_model)

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


CHAMPION, CHALLENGER = "champion", "challenger"
POLICY_VERSION_TAG = "rlvr.policy_version"  # the model-store version of the registered checkpoint


class PolicyRegistry:
    """The MLflow model registry seen as champion/challenger versions of one registered policy."""

    def __init__(self, client, name: str):
        self.client = client
        self.name = name

    def register(self, policy_version: str, source: str, run_id: str | None, tags: dict) -> str:
        """Register ``policy_version`` from an artifact ``source`` (e.g. ``runs:/<id>/checkpoint``),
        alias it ``challenger`` and return its registry version. ``tags`` carry metrics and lineage.
        Registering a policy version again returns its existing registry version."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name, description="GRPO-trained policies from rlvr-ops")
        existing = self.client.search_model_versions(f"name='{self.name}' and tags.`{POLICY_VERSION_TAG}`='{policy_version}'")
        if existing:
            version = str(existing[0].version)
        else:
            all_tags = {**{k: str(v) for k, v in tags.items()}, POLICY_VERSION_TAG: policy_version}
            version = str(self.client.create_model_version(self.name, source=source, run_id=run_id, tags=all_tags).version)
        self.client.set_registered_model_alias(self.name, CHALLENGER, version)
        return version

    def version_for(self, alias: str):
        """The ModelVersion behind ``alias``, or None when the alias is not set."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self.name, alias)
        except MlflowException:
            return None

    def record_decision(self, version: str, promote: bool, reason: str) -> None:
        """Write the promotion verdict on the version; move ``champion`` to it when promoted."""
        self.client.set_model_version_tag(self.name, version, "promotion.verdict", "promoted" if promote else "refused")
        self.client.set_model_version_tag(self.name, version, "promotion.reason", reason[:4900])
        if promote:
            self.client.set_registered_model_alias(self.name, CHAMPION, version)
