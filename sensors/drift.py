"""Request the retraining job when a drift report crosses a threshold: one run per drift episode, and
none while the registry has no champion to retrain from (the tick says so). A run retrains the champion
on its own task mixture (its manifest's ``tasks``), named in its run config and tags."""

import functools
import json

from dagster import AssetKey, DefaultSensorStatus, RunRequest, SensorEvaluationContext, SkipReason, sensor

from resources import CHAMPION, MLflowResource, ModelStore
from resources.tracking import POLICY_VERSION_TAG
from rlvr.tasks import DEFAULT_TASK

DRIFT_REPORT = AssetKey("drift_report")


@sensor(
    job_name="retraining",
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Retrains when drift_report flags drift; consecutive drifted reports are one episode, one run.",
)
def drift_sensor(context: SensorEvaluationContext, mlflow: MLflowResource, model_store: ModelStore):
    """Walks new ``drift_report`` materializations in order. A drifted report opens an episode (and
    requests one run, keyed by the episode); further drifted reports belong to it; a clean report
    closes it. Reports of a day older than the newest day seen (a backfill) are history, not a
    reason to retrain. An episode that opens while the registry has no champion is skipped (retraining
    starts from the champion), with the reason in the tick. A run trains the champion's mixture
    (:func:`retraining_run_config`). The cursor holds the last storage id read, the newest day and the open episode."""
    state = json.loads(context.cursor) if context.cursor else {"after_cursor": None, "episode": None}
    records = context.instance.fetch_materializations(DRIFT_REPORT, limit=100, cursor=state.get("after_cursor"), ascending=True)
    requests, skipped = [], []
    champion = functools.cache(lambda: mlflow.registry().version_for(CHAMPION))  # asked once, when an episode opens
    for record in records.records:
        day = record.asset_materialization.partition if record.asset_materialization else None
        if day is not None and day < state.get("day", ""):
            continue
        state["day"] = day or state.get("day", "")
        metadata = record.asset_materialization.metadata if record.asset_materialization else {}
        drifted = bool(metadata["drifted"].value) if "drifted" in metadata else False
        if drifted and state["episode"] is None:
            state["episode"] = record.storage_id
            reasons = metadata["drift_reasons"].value if "drift_reasons" in metadata else []
            if champion() is None:
                skipped.append(f"drift episode {record.storage_id} ({'; '.join(reasons)[:300]}): the registry has no champion to retrain from")
                continue
            tasks = champion_tasks(model_store, champion().tags.get(POLICY_VERSION_TAG))
            requests.append(
                RunRequest(
                    run_key=f"drift-episode-{record.storage_id}",
                    run_config=retraining_run_config(tasks),
                    tags={
                        "rlvr/trigger": "drift",
                        "rlvr/tasks": json.dumps(tasks, sort_keys=True),
                        "rlvr/drift_episode": str(record.storage_id),
                        "rlvr/drift_reasons": "; ".join(reasons)[:1000],
                        "rlvr/drift_report_run": record.run_id,
                    },
                )
            )
        elif not drifted and "drifted" in metadata:
            state["episode"] = None
    state["after_cursor"] = records.cursor if records.records else state.get("after_cursor")
    context.update_cursor(json.dumps(state))
    return requests or SkipReason("; ".join(skipped) if skipped else "no new drift episode")


def champion_tasks(model_store: ModelStore, policy_version: str | None) -> dict[str, float]:
    """The task mixture the champion was trained on: its ``grpo_checkpoint`` manifest's ``tasks``; ``DEFAULT_TASK``
    alone when it records none (or is not in the store, where the run then fails naming it)."""
    stored = model_store.get("grpo_checkpoint", policy_version) if policy_version else None
    return dict((stored.manifest.get("tasks") if stored else None) or {DEFAULT_TASK: 1.0})


def retraining_run_config(tasks: dict[str, float]) -> dict:
    """The retraining job's run config: GRPO from the champion on ``tasks`` (name -> weight)."""
    return {"ops": {"grpo_training": {"config": {"init_from": "champion", "tasks": tasks}}}}
