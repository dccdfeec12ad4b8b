"""Two attempts at one training run, as an operator makes them: launched at once, one trains and the other
is refused, naming it, while nothing of the live one (its training, its MLflow run) is touched; a dead
attempt's training is stopped only by the attempt that holds the run. A data directory copied elsewhere
logs into its own MLflow artifacts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import DagsterInstance, Failure, execute_job

from resources import MLflowResource
from resources.launcher import LOCK_FILE, SCRATCH_ENV, attempt_lock, stop_abandoned_training
from resources.tracking import DAGSTER_RUN_TAG, TRAINING_RUN_TAG
from rlvr.training_run import start_training_process
from support.training_jobs import HOLD_REWARDS, rows, training_job, two_process_config
from support.waiting import wait_for

pytestmark = pytest.mark.slow  # starts run workers, training and MLflow stores


def python_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def fake_training(scratch: Path) -> subprocess.Popen:
    """A process as the launcher starts torchrun: its command line names torch.distributed.run, its environment the scratch folder,
    and it starts as a training process (SIGTERM's default action, whatever this process's)."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "torch.distributed.run"],
        start_new_session=True,
        env={**os.environ, SCRATCH_ENV: str(scratch.resolve())},
        preexec_fn=start_training_process,
    )


# A run worker holding the run: takes the lock, names its training there, and keeps it until it is killed.
HOLDER = """
import sys
from pathlib import Path
from resources.launcher import attempt_lock
with attempt_lock(Path(sys.argv[1]), sys.argv[2]) as attempt:
    attempt.record(int(sys.argv[3]))
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_live_attempt_is_refused_and_only_the_holder_stops_a_dead_ones_training(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    training = fake_training(scratch)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(scratch), "run-a", str(training.pid)], env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(Failure) as refused:
            with attempt_lock(scratch, "run-b", wait_s=60):
                pass
        assert "Dagster run run-a" in refused.value.description and "is training there now" in refused.value.description  # at once, not after 60 s
        assert training.poll() is None  # the refused attempt stopped nothing
        holder.kill()  # its run worker dies where no parent-death signal reaches its training
        holder.wait()
        warnings: list[str] = []
        with attempt_lock(scratch, "run-b", wait_s=60) as attempt:
            assert attempt.earlier["dagster_run_id"] == "run-a" and training.poll() is None  # taking the lock stops nothing either
            stop_abandoned_training(attempt.earlier, scratch, 5, warnings.append)
            assert training.poll() == -signal.SIGTERM
        assert "Dagster run run-a" in warnings[0] and f"process group {training.pid}" in warnings[0]
        assert json.loads((scratch / LOCK_FILE).read_text())["dagster_run_id"] == "run-b"
    finally:
        for process in (holder, training):
            process.kill()
            process.wait()


# A re-execution of the failed run in a fresh process (support.training_jobs registers the held reward there too).
REEXECUTE = """
import json, sys
from dagster import DagsterInstance, ReexecutionOptions, execute_job
from support.training_jobs import training_job
with DagsterInstance.local_temp(sys.argv[1]) as instance:
    options = ReexecutionOptions.from_failure(sys.argv[2], instance)
    execute_job(training_job(sys.argv[3]), instance=instance, run_config=json.loads(sys.argv[4]), reexecution_options=options)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="training processes are found in /proc")
def test_two_reexecutions_of_one_failed_run_launched_at_once_train_it_once(home, gsm8k_dir, tiny_llama_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("RLVR_TEST_HOME", str(home))
    config = two_process_config(gsm8k_dir, tiny_llama_dir, steps=2)
    config["ops"]["grpo_training"]["config"] |= {"nproc": "1", "rewards": {"test_held_length": 1.0}}
    broken = json.loads(json.dumps(config))
    broken["ops"]["grpo_training"]["config"]["nproc"] = "0"  # the failed run: fixed, then re-executed twice at once
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        failed = execute_job(training_job(home), instance=instance, run_config=broken)
    assert not failed.success
    (home / HOLD_REWARDS).touch()
    args = [str(tmp_path / "dagster"), failed.run_id, str(home), json.dumps(config)]
    attempts = [subprocess.Popen([sys.executable, "-c", REEXECUTE, *args], env=python_env()) for _ in range(2)]
    try:
        (refused_process,) = wait_for(lambda: [p for p in attempts if p.poll() is not None], 600, "one re-execution to end")
        client = MLflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_location=str(home / "mlartifacts")).client()
        experiment = client.get_experiment_by_name("rlvr-ops").experiment_id
        (live,) = client.search_runs([experiment], f"tags.`{TRAINING_RUN_TAG}` = '{failed.run_id}' AND attributes.status = 'RUNNING'")
        (home / HOLD_REWARDS).unlink()
        (trainer,) = [p for p in attempts if p is not refused_process]
        assert trainer.wait(timeout=600) == 0
    finally:
        (home / HOLD_REWARDS).unlink(missing_ok=True)
        for process in attempts:
            process.kill()
            process.wait()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        runs = {run.status.value: run for run in instance.get_runs() if run.parent_run_id == failed.run_id}
        assert sorted(runs) == ["FAILURE", "SUCCESS"]
        trained, refused = runs["SUCCESS"].run_id, runs["FAILURE"].run_id
        refusal = next(e for e in instance.all_logs(refused) if e.dagster_event and e.dagster_event.event_type_value == "STEP_FAILURE")
        message = refusal.dagster_event.event_specific_data.error.message
        assert f"Dagster run {trained}" in message and "refuses to train the same run twice" in message
        assert not any("stopped the training" in (e.message or "") for e in instance.all_logs(refused))
    assert live.data.tags[DAGSTER_RUN_TAG] == trained  # the live attempt's MLflow run stayed RUNNING while the other was refused
    attempts_in_mlflow = client.search_runs([experiment], f"tags.`{TRAINING_RUN_TAG}` = '{failed.run_id}'")
    assert {r.data.tags[DAGSTER_RUN_TAG]: r.info.status for r in attempts_in_mlflow} == {trained: "FINISHED", refused: "FAILED"}
    keys = rows(home, "SELECT step, group_index, sample_index, count(*) FROM rollouts GROUP BY ALL")
    assert len(keys) == 2 * 2 * 2 and all(k[3] == 1 for k in keys)  # trained once: every row once


def test_a_copied_data_directory_logs_into_its_own_artifacts(tmp_path):
    def tracking(home: Path, artifacts: Path | None = None) -> MLflowResource:
        return MLflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_location=str(artifacts or home / "mlartifacts"))

    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    with tracking(original).start_run("before-the-copy") as before:
        before.log_files({"note.txt": "original"})
    client = tracking(original).client()
    tracking(original).registry().register("v1", client.get_run(before.run_id).info.artifact_uri, before.run_id, {})
    subprocess.run(["cp", "-a", str(original), str(copy)], check=True)

    with tracking(copy).start_run("after-the-copy") as after:
        after.log_files({"note.txt": "copy"})
    client = tracking(copy).client()
    for run_id in (before.run_id, after.run_id):  # the copy's runs, old and new, keep their artifacts in the copy
        assert client.get_run(run_id).info.artifact_uri.startswith((copy / "mlartifacts").as_uri() + "/")
    assert tracking(copy).registry().version_for("challenger").source.startswith((copy / "mlartifacts").as_uri() + "/")
    assert not list((original / "mlartifacts").rglob(after.run_id))  # nothing landed in the original
    shutil.rmtree(original)
    assert Path(client.download_artifacts(before.run_id, "note.txt", str(tmp_path))).read_text() == "original"  # the copy alone suffices

    elsewhere = tracking(copy, tmp_path / "elsewhere" / "mlartifacts")  # the copy's store, another folder's artifacts: refused
    with pytest.raises(ValueError, match=r"keeps its artifacts at .*copy/mlartifacts, not at this resource's artifact_location"):
        elsewhere.experiment_id()
