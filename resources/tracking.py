"""MLflow tracking and registry: a local SQLite store by default, any tracking URI otherwise.

Everything goes through an ``MlflowClient`` bound to this resource's URI, so no asset touches the
``mlflow`` module's global state: runs (a context manager), params, metrics, artifacts and tables,
the evaluation record the promotion gate reads, registry aliases and checkpoint downloads. A local
store keeps its artifacts in its own data directory, also once that directory is copied or moved.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pandas as pd
from dagster import ConfigurableResource
from pydantic import Field

from resources.mlflow_links import MlflowLinks, default_ui_url
from resources.mlflow_policy import checkpoint_in, log_policy_model
from resources.model_store import StoredModel

CHAMPION, CHALLENGER = "champion", "challenger"
POLICY_VERSION_TAG = "rlvr.policy_version"  # the model-store version of the registered checkpoint
EVAL_PROTOCOL_TAG = "rlvr.eval_protocol"  # the evaluation protocol of an evaluation run, as JSON
TRAINING_RUN_TAG = "rlvr.training_run"  # the Dagster root run id of a training run: every attempt's MLflow run carries it
DAGSTER_RUN_TAG = "dagster.run_id"  # the Dagster run that owns an MLflow run: every asset's runs carry it
PARAMS_PER_BATCH, METRICS_PER_BATCH = 100, 1000  # per log_batch call (MLflow's limits)
# The tag the MLflow UI reads to open an experiment in its model-training mode (runs, charts, registry)
# rather than the GenAI one (traces); its values are the UI's ExperimentKind.
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
DEFAULT_EXPERIMENT_ID = "0"
# Where a SQL store keeps artifact URIs: what a data directory copied or moved elsewhere rewrites (:func:`relocate_artifacts`).
ARTIFACT_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)


class MLflowResource(ConfigurableResource):
    """Points MLflow at a tracking server or local store and an experiment."""

    tracking_uri: str = Field(description="e.g. sqlite:///.rlvr/mlflow.db or http://mlflow:5000")
    experiment: str = Field(default="rlvr-ops", description="experiment that runs are logged under")
    artifact_location: str | None = Field(default=None, description="artifact root for a new experiment")
    registered_model: str = Field(default="rlvr-gsm8k-policy", description="registered model holding trained policies")
    ui_url: str | None = Field(default=None, description="the MLflow UI that metadata links point at; default: a tracking server itself, else `make mlflow`'s")
    system_metrics_interval_s: float = Field(default=10.0, description="how often a run with system metrics (training) samples the machine's use")

    def client(self):
        """An MlflowClient bound to this tracking URI (registry too)."""
        from mlflow.tracking import MlflowClient

        ready_store(self.tracking_uri)
        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def registry(self) -> "PolicyRegistry":
        """The champion/challenger view of the registered model."""
        return PolicyRegistry(self.client(), self.registered_model)

    def experiment_id(self) -> str:
        """The experiment, created as a model-training experiment; an existing one without the kind
        gets it, and the store's empty ``Default`` experiment is removed, once."""
        client = self.client()
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            self.own_artifacts(experiment.artifact_location)
        if experiment is not None and experiment.tags.get(EXPERIMENT_KIND_TAG):
            return experiment.experiment_id
        if experiment is None:
            location = Path(self.artifact_location).resolve().as_uri() if self.artifact_location else None
            experiment_id = client.create_experiment(self.experiment, artifact_location=location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
        else:
            experiment_id = experiment.experiment_id
            client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        remove_empty_default_experiment(client)
        return experiment_id

    def own_artifacts(self, location: str) -> None:
        """Keep the experiment's artifacts at ``artifact_location``. MLflow records absolute artifact URIs, so a
        data directory copied (``cp -a``) or moved still points at the original's: when the store (a SQLite file)
        lies beside ``artifact_location``, every URI under the old location is rewritten to it; otherwise a
        ValueError names both. No check without ``artifact_location`` (a tracking server keeps its own)."""
        if not self.artifact_location:
            return
        root = Path(self.artifact_location).resolve()
        if location == root.as_uri():
            return
        store = sqlite_store(self.tracking_uri)
        if store is None or store.parent != root.parent or not location.startswith("file:"):
            raise ValueError(
                f"MLflow experiment {self.experiment!r} of {self.tracking_uri} keeps its artifacts at {location}, not at this "
                f"resource's artifact_location {root}: point tracking_uri at this data directory's own store, or artifact_location at {location}"
            )
        relocate_artifacts(self.tracking_uri, location, root.as_uri())
        logging.getLogger(__name__).warning(f"MLflow store {store}: artifacts now under {root}, not {location} (a copied or moved data directory)")

    def links(self) -> MlflowLinks:
        """Addresses of this experiment's runs and the registered model's versions in the MLflow UI."""
        return MlflowLinks(self.ui_url or default_ui_url(self.tracking_uri), self.experiment_id(), self.registered_model)

    def activate(self) -> str:
        """Make this store and experiment the active ones for the ``mlflow`` module (notebooks, tests);
        returns the experiment id. The resource's own methods never need it."""
        import mlflow

        mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.set_registry_uri(self.tracking_uri)
        experiment_id = self.experiment_id()
        mlflow.set_experiment(experiment_id=experiment_id)
        return experiment_id

    @contextmanager
    def start_run(
        self, run_name: str, tags: Mapping[str, Any] | None = None, started_at: float | None = None, system_metrics: bool = False
    ) -> Iterator["TrackedRun"]:
        """A run of this experiment, ended FINISHED when the block ends and FAILED when it raises;
        ``started_at`` (``time.time()``) dates its start back to when its work began; ``system_metrics``: MLflow's
        monitor logs the machine's CPU, memory, disk, network and GPU use meanwhile (``system/...``, every
        ``system_metrics_interval_s``)."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        from mlflow.tracking.context.registry import resolve_tags  # the user/source tags mlflow.start_run adds

        client, experiment_id = self.client(), self.experiment_id()
        start_time = int(started_at * 1000) if started_at is not None else None
        run = client.create_run(experiment_id, start_time=start_time, run_name=run_name, tags=resolve_tags({k: str(v) for k, v in (tags or {}).items()}))
        monitor = SystemMetricsMonitor(run.info.run_id, self.system_metrics_interval_s, tracking_uri=self.tracking_uri) if system_metrics else None
        if monitor is not None:
            monitor.start()
        try:
            yield TrackedRun(client, run.info.run_id, experiment_id)
        except BaseException:
            client.set_terminated(run.info.run_id, "FAILED")
            raise
        finally:
            if monitor is not None:
                monitor.finish()
        client.set_terminated(run.info.run_id, "FINISHED")

    def end_runs_of(self, dagster_run_id: str, status: str = "KILLED") -> list[str]:
        """End as ``status`` the runs of the Dagster run ``dagster_run_id`` (tag ``dagster.run_id``) still RUNNING:
        those its run worker, killed, could not end (call once Dagster marked it failed); returns their ids."""
        client = self.client()
        runs = client.search_runs([self.experiment_id()], f"tags.`{DAGSTER_RUN_TAG}` = '{dagster_run_id}' AND attributes.status = 'RUNNING'")
        for run in runs:
            client.set_terminated(run.info.run_id, status)
        return [run.info.run_id for run in runs]

    def end_abandoned_runs(self, tag: str, value: str, owner_gone: Callable[[str], bool]) -> list[str]:
        """End as KILLED the runs tagged ``tag = value`` still RUNNING whose owner is provably gone:
        ``owner_gone(dagster_run_id)`` of their ``dagster.run_id`` tag (its Dagster run has ended); a live
        attempt's run, or one naming no Dagster run, is left alone. Returns their ids."""
        client = self.client()
        runs = client.search_runs([self.experiment_id()], f"tags.`{tag}` = '{value}' AND attributes.status = 'RUNNING'")
        abandoned = [run.info.run_id for run in runs if DAGSTER_RUN_TAG in run.data.tags and owner_gone(run.data.tags[DAGSTER_RUN_TAG])]
        for run_id in abandoned:
            client.set_terminated(run_id, "KILLED")
        return abandoned

    def metric_history(self, run_id: str | None, names: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
        """(step, value) of each named metric of a run; empty when there is no run."""
        if not run_id:
            return {}
        client = self.client()
        return {name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)] for name in names}

    def latest_evaluation(self, policy_version: str) -> "EvaluationRun | None":
        """The most recent finished evaluation run of ``policy_version``: its protocol and metrics."""
        runs = self.client().search_runs(
            [self.experiment_id()],
            f"tags.`rlvr.kind` = 'evaluation' AND tags.`{POLICY_VERSION_TAG}` = '{policy_version}' AND attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not runs or EVAL_PROTOCOL_TAG not in runs[0].data.tags:
            return None
        run = runs[0]
        return EvaluationRun(run.info.run_id, json.loads(run.data.tags[EVAL_PROTOCOL_TAG]), dict(run.data.metrics))

    def download_checkpoint(self, source: str) -> Path:
        """Fetch a registered checkpoint's artifacts (e.g. ``runs:/<id>/checkpoint``) into a new temporary folder."""
        from mlflow.artifacts import download_artifacts

        folder = tempfile.mkdtemp(prefix="checkpoint-")
        return checkpoint_in(download_artifacts(artifact_uri=source, dst_path=folder, tracking_uri=self.tracking_uri))


def sqlite_store(tracking_uri: str) -> Path | None:
    """The file of a SQLite tracking URI (``sqlite:///relative.db``, ``sqlite:////absolute.db``); None for any other."""
    return Path(tracking_uri.removeprefix("sqlite:///")).resolve() if tracking_uri.startswith("sqlite:///") else None


@functools.cache
def ready_store(tracking_uri: str) -> None:
    """Create a SQLite store's schema, once per process, under an ``flock`` beside it: processes opening a new
    store at once otherwise race on its migrations (alembic: "Online migration expected to match one row")."""
    from mlflow.tracking import MlflowClient

    store = sqlite_store(tracking_uri)
    if store is None:
        return
    store.parent.mkdir(parents=True, exist_ok=True)
    with open(store.with_name(store.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        client.search_experiments(max_results=1)  # the tracking tables
        client.search_registered_models(max_results=1)  # the registry's


def relocate_artifacts(tracking_uri: str, old: str, new: str) -> None:
    """Rewrite every artifact URI of the SQL store at ``tracking_uri`` that is ``old`` or under it to the same
    place under ``new`` (experiments, runs, logged models, model versions), in one transaction."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(tracking_uri)
    try:
        with engine.begin() as conn:
            for table, column in ARTIFACT_COLUMNS:
                conn.execute(
                    sqlalchemy.text(f"UPDATE {table} SET {column} = :new || substr({column}, :tail) WHERE {column} = :old OR substr({column}, 1, :n) = :under"),
                    {"new": new, "old": old, "tail": len(old) + 1, "under": old + "/", "n": len(old) + 1},
                )
    finally:
        engine.dispose()


def remove_empty_default_experiment(client) -> None:
    """Delete the ``Default`` experiment a new store starts with while it holds no run: an empty
    experiment beside ours in the UI."""
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    try:
        default = client.get_experiment(DEFAULT_EXPERIMENT_ID)
        if default.lifecycle_stage == "active" and not client.search_runs([DEFAULT_EXPERIMENT_ID], run_view_type=ViewType.ALL, max_results=1):
            client.delete_experiment(DEFAULT_EXPERIMENT_ID)
    except MlflowException:  # no Default experiment (a tracking server may have none), or one it keeps
        pass


@dataclass(frozen=True)
class EvaluationRun:
    """An evaluation as MLflow holds it: the run, the protocol it ran under, its metrics."""

    run_id: str
    protocol: dict
    metrics: dict[str, float]


class TrackedRun:
    """One MLflow run: what an asset logs into it."""

    def __init__(self, client, run_id: str, experiment_id: str):
        self.client, self.run_id, self.experiment_id = client, run_id, experiment_id

    def rename(self, name: str) -> None:
        self.client.update_run(self.run_id, name=name)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params, each value as its ``str`` (:func:`flat_params` names nested ones one by one)."""
        from mlflow.entities import Param

        flat = [Param(key, str(value)) for key, value in params.items()]
        for start in range(0, len(flat), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=flat[start : start + PARAMS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """The numeric values of ``metrics`` (booleans and others skipped; ``step`` is the x axis, not a
        metric); ``@`` in a name becomes ``_at_``."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(key.replace("@", "_at_"), float(value), now, step or 0)
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
        ]
        for start in range(0, len(rows), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[start : start + METRICS_PER_BATCH])

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)

    def log_files(self, files: Mapping[str, bytes | str], artifact_path: str | None = None) -> None:
        """Files from memory: name -> bytes or text."""
        with tempfile.TemporaryDirectory() as tmp:
            for name, content in files.items():
                path = Path(tmp) / name
                path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
            self.log_artifacts(tmp, artifact_path)

    def log_table(self, frame: pd.DataFrame, artifact_file: str) -> None:
        self.client.log_table(self.run_id, frame, artifact_file)

    def log_policy(self, checkpoint: str | Path, tags: Mapping[str, Any] | None = None) -> str:
        """Log a policy checkpoint as this run's MLflow model (``resources.mlflow_policy``); returns its model id."""
        model = log_policy_model(self.client, self.experiment_id, self.run_id, checkpoint, {k: str(v) for k, v in (tags or {}).items()})
        return model.model_id


class PolicyRegistry:
    """The MLflow model registry seen as champion/challenger versions of one registered policy."""

    def __init__(self, client, name: str):
        self.client = client
        self.name = name

    def register(self, policy_version: str, source: str, run_id: str | None, tags: dict, model_id: str | None = None) -> str:
        """Register ``policy_version`` from an artifact ``source`` (a logged model's artifact location, or
        e.g. ``runs:/<id>/checkpoint``), alias it ``challenger`` and return its registry version. ``tags``
        carry metrics and lineage. Registering a policy version again returns its existing registry version."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name, description="GRPO-trained policies from rlvr-ops")
        existing = self.client.search_model_versions(f"name='{self.name}' and tags.`{POLICY_VERSION_TAG}`='{policy_version}'")
        if existing:
            version = str(existing[0].version)
        else:
            all_tags = {**{k: tag_value(v) for k, v in tags.items()}, POLICY_VERSION_TAG: policy_version}
            version = str(self.client.create_model_version(self.name, source=source, run_id=run_id, tags=all_tags, model_id=model_id).version)
        self.client.set_registered_model_alias(self.name, CHALLENGER, version)
        return version

    def register_trained(self, trained: StoredModel, evaluation: EvaluationRun) -> str:
        """Register a trained checkpoint from the MLflow model its training run logged (a checkpoint
        from before that: the run's ``checkpoint`` artifact), tagged with its lineage (model-store
        manifest) and the headline numbers of its evaluation."""
        run_id = trained.manifest.get("mlflow_run_id")
        metrics = evaluation.metrics
        lineage = {
            **{key: trained.manifest.get(key) for key in ("data_hash", "data_source", "base_policy_version", "training_config", "dagster_run_id")},
            **{f"eval.{name}": metrics.get(f"trained.{name}") for name in ("pass_at_1_strict", "pass_at_1_flexible", "format_compliance", "num_problems")},
            "eval.mlflow_run_id": evaluation.run_id,
        }
        outputs = self.client.get_run(run_id).outputs if run_id else None
        if outputs and outputs.model_outputs:  # the policy model the training run logged
            model = self.client.get_logged_model(outputs.model_outputs[-1].model_id)
            return self.register(trained.version, model.artifact_location, run_id, lineage, model.model_id)
        return self.register(trained.version, f"runs:/{run_id}/checkpoint", run_id, lineage)

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


def run_name(kind: str, policy_version: str | None, dagster_run_id: str) -> str:
    """Every run's name: ``<kind>-<policy version>-run-<Dagster run id, 8 chars>`` (e.g.
    ``eval-37fa7f300ff73716-run-0a3a63cd``), so a run maps to its policy and its Dagster run at a glance."""
    return f"{kind}-{policy_version or 'pending'}-run-{dagster_run_id[:8]}"


def tag_value(value: Any) -> str:
    """A tag's text: JSON for a mapping or list (a config reads as JSON), ``str`` otherwise."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (Mapping, list, tuple)) else str(value)


def flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted names: ``{"grpo": {"sampling": {"max_new_tokens": 8}}}`` -> ``grpo.sampling.max_new_tokens``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
