"""Where rlvr-ops keeps its state: one data directory (``$RLVR_HOME``, default ``./.rlvr``).

The one resolver of every path: resources, sensors, the Bento build and the service all call
:meth:`Settings.from_env`. Paths are absolute, so a served Bento (which runs in its own folder)
writes where the monitoring assets read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GSM8K_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"  # the official files, shipped in the package
LAUNCHERS = ("local", "k8s")
DEFAULT_TASKS = ("gsm8k", "humaneval", "math", "reasoning_gym:basic_arithmetic", "reasoning_gym:spell_backward")  # the first: the pipeline's task


@dataclass(frozen=True)
class Settings:
    """Paths of the shared state; every one lives under ``home`` unless overridden by its variable."""

    home: Path

    @classmethod
    def from_env(cls, require_absolute: bool = False) -> "Settings":
        """The settings of this process's environment.

        ``require_absolute`` (the service, which runs inside its Bento's folder): a relative
        ``RLVR_HOME`` / ``RLVR_TRAFFIC_DIR``, or no location for the traffic logs at all, is a ValueError
        instead of a folder resolved against the working directory.
        """
        if require_absolute:
            for name in ("RLVR_HOME", "RLVR_TRAFFIC_DIR"):
                value = os.environ.get(name)
                if value and not Path(value).expanduser().is_absolute():
                    raise ValueError(f"{name} must be an absolute path, got {value!r}")
            if not (os.environ.get("RLVR_HOME") or os.environ.get("RLVR_TRAFFIC_DIR")):
                raise ValueError("set RLVR_HOME (or RLVR_TRAFFIC_DIR) to an absolute path: where the traffic logs go")
        return cls(Path(os.environ.get("RLVR_HOME", ".rlvr")).expanduser().resolve())

    @property
    def tasks(self) -> list[str]:
        """The tasks the UI offers as partitions (``RLVR_TASKS``, comma-separated; the pipeline's, ``DEFAULT_TASKS[0]``, always first)."""
        named = [name.strip() for name in os.environ.get("RLVR_TASKS", ",".join(DEFAULT_TASKS)).split(",") if name.strip()]
        return [DEFAULT_TASKS[0], *dict.fromkeys(name for name in named if name != DEFAULT_TASKS[0])]  # the pipeline's task always offered

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
        """The service's traffic logs, which monitoring reads: ``$RLVR_TRAFFIC_DIR``, else ``home/traffic``."""
        folder = os.environ.get("RLVR_TRAFFIC_DIR")
        return Path(folder).expanduser().resolve() if folder else self.home / "traffic"

    @property
    def bentoml_home(self) -> Path:
        """BentoML's model store and Bentos: ``$BENTOML_HOME``, else ``home/bentoml``."""
        folder = os.environ.get("BENTOML_HOME")
        return Path(folder).expanduser().resolve() if folder else self.home / "bentoml"

    @property
    def launcher(self) -> str:
        """Where GRPO training runs: ``local`` (torchrun beside the run, the default) or ``k8s`` (pods of its
        own, ``resources.k8s_launcher``): ``$RLVR_LAUNCHER``."""
        launcher = os.environ.get("RLVR_LAUNCHER", "local")
        if launcher not in LAUNCHERS:
            raise ValueError(f"RLVR_LAUNCHER must be one of {LAUNCHERS}, got {launcher!r}")
        return launcher

    @property
    def gsm8k_dir(self) -> Path:
        """The ``local`` source's folder: ``$RLVR_GSM8K_DIR``, else the GSM8k copy shipped in ``rlvr/data/gsm8k``."""
        return Path(os.environ.get("RLVR_GSM8K_DIR", DEFAULT_GSM8K_DIR)).expanduser().resolve()

    def ensure(self) -> "Settings":
        for path in (self.home, self.dagster_home, self.model_root, self.mlflow_artifact_root, self.traffic_dir):
            path.mkdir(parents=True, exist_ok=True)
        return self
