"""Addresses of MLflow UI pages (runs, registry versions), for links in asset metadata.

Each opens the UI in its model-training mode (``workflowType=machine_learning``): MLflow 3.17's UI
picks GenAI or model training from a global switch (the browser's last choice, GenAI by default),
not from the experiment's ``mlflow.experimentKind`` tag, so a link must say which."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import quote

DEFAULT_UI_PORT = "5000"  # `make mlflow`'s MLFLOW_PORT
MODEL_TRAINING_MODE = "?workflowType=machine_learning"


def default_ui_url(tracking_uri: str) -> str:
    """The MLflow UI of a tracking URI: the server itself, or ``make mlflow``'s address for a local store."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', DEFAULT_UI_PORT)}"


@dataclass(frozen=True)
class MlflowLinks:
    """Pages of one experiment and registered model in the MLflow UI at ``ui``."""

    ui: str
    experiment_id: str
    registered_model: str

    def experiment(self) -> str:
        return f"{self.ui}/#/experiments/{self.experiment_id}/runs{MODEL_TRAINING_MODE}"

    def run(self, run_id: str, tab: str = "") -> str:
        """A run's page; ``tab`` e.g. ``artifacts`` or ``model-metrics``."""
        return f"{self.ui}/#/experiments/{self.experiment_id}/runs/{run_id}" + (f"/{tab}" if tab else "") + MODEL_TRAINING_MODE

    def model_version(self, version: str | int) -> str:
        return f"{self.ui}/#/models/{quote(self.registered_model)}/versions/{version}{MODEL_TRAINING_MODE}"
