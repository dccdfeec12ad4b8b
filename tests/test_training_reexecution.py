"""A re-execution of a GRPO run whose training an earlier attempt already completed trains nothing: it fails
naming that attempt's Dagster run and stored checkpoint (else it would retrain from scratch and store a
second policy version whose rows the warehouse skipped as duplicates of the first's)."""

from __future__ import annotations

import json
import uuid

from dagster import DagsterInstance, Definitions, define_asset_job, in_process_executor

from resources.launcher import TrainingLauncher
from rlvr_assets import training
from support.pipeline import resources_for


def store_checkpoint(store, **manifest) -> str:
    def write(folder):
        (folder / "weights.json").write_text(json.dumps(manifest))

    return store.put("grpo_checkpoint", write, metadata=manifest).version


def test_the_checkpoint_of_a_run_is_found_by_its_root_run(home):
    store = resources_for(home)["model_store"]
    assert training.checkpoint_of_run(store, "root-a", lambda run: None) is None  # nothing stored yet
    first = store_checkpoint(store, dagster_run_id="attempt-2", root_run_id="root-a")
    older = store_checkpoint(store, dagster_run_id="attempt-7")  # a manifest from before root_run_id was recorded
    roots = {"attempt-7": "root-c"}
    assert training.checkpoint_of_run(store, "root-a", roots.get).version == first
    assert training.checkpoint_of_run(store, "root-c", roots.get).version == older
    assert training.checkpoint_of_run(store, "root-b", roots.get) is None


class NoTraining(TrainingLauncher):
    def train(self, *args, **kwargs):
        raise AssertionError("a completed run was trained again")


def test_a_reexecution_of_a_completed_run_trains_nothing_and_names_the_checkpoint(home):
    resources = {**resources_for(home), "launcher": NoTraining()}
    root_run = str(uuid.uuid4())
    version = store_checkpoint(resources["model_store"], dagster_run_id="first-reexecution", root_run_id=root_run)
    job = Definitions(assets=[training.grpo_training], resources=resources, jobs=[define_asset_job("train", executor_def=in_process_executor)])
    with DagsterInstance.ephemeral() as instance:
        result = job.resolve_job_def("train").execute_in_process(instance=instance, run_id=root_run, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.event_specific_data.error.message + str(failure.event_specific_data.user_failure_data)
    assert "first-reexecution" in message and version in message and "trains nothing" in message
    assert [v.version for v in resources["model_store"].versions("grpo_checkpoint")] == [version]  # no second policy version
