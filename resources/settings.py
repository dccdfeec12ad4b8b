"""Where rlvr-ops keeps its state: one data directory (``$RLVR_HOME``, default ``./.rlvr``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GSM8K_DIR = "../shared/data/gsm8k"


@dataclass(frozen=True)
class Settings:
    """Paths of the shared state; every one lives under ``home`` unless overridden by its variable."""

    home: Path

    @classmethod
    def from_env(cls) -> "Settings":
        return cls(Path(os.environ.get("RLVR_HOME", ".rlvr")).expanduser().resolve())

    @property
    def dagster_home(self) -> Path:
        return Path(os.environ.get("DAGSTER_HOME", self.home / "dagster"))

    @property
    def duckdb_path(self) -> Path:
        return self.home / "rlvr.duckdb"

    @property
    def model_root(self) -> Path:
        return self.home / "models"

    @property
    def mlflow_tracking_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{self.home / 'mlflow.db'}")

    @property
    def mlflow_artifact_root(self) -> Path:
        return self.home / "mlartifacts"

    @property
    def traffic_dir(self) -> Path:
        return self.home / "traffic"

    @property
    def gsm8k_dir(self) -> Path:
        return Path(os.environ.get("RLVR_GSM8K_DIR", DEFAULT_GSM8K_DIR)).expanduser().resolve()

    def ensure(self) -> "Settings":
        for path in (self.home, self.dagster_home, self.model_root, self.mlflow_artifact_root, self.traffic_dir):
            path.mkdir(parents=True, exist_ok=True)
        return self
