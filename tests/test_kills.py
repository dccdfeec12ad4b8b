"""Training survives kills: a step killed at each of its boundaries loses no rows and no curve point,
a re-execution stops what a dead earlier attempt left running, and killing the run worker (SIGKILL) takes
its whole training along; its MLflow run ends once Dagster marks the run failed, and the re-executed run
completes with every row and step once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from dagster import DagsterInstance, ReexecutionOptions, build_sensor_context, execute_job

from resources import grpo_worker
from resources.launcher import LOCK_FILE, SCRATCH_ENV, TrainingJob, TrainingLauncher, attempt_lock, clear_attempt, step_history, stop_abandoned_training
from resources.tracking import TRAINING_RUN_TAG
from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig
from rlvr.tasks.gsm8k import dataset as gsm8k
from rlvr.training_run import start_training_process
from sensors import failed_run_mlflow_sensor
from support.pipeline import resources_for
from support.training_jobs import resumable_at, rows, training_job, two_process_config
from support.waiting import wait_for

STEPS, ROWS_PER_STEP = 3, 4  # 2 prompts x 2 completions

# Runs the worker's training of one rank in a fresh process and SIGKILLs it at one boundary of step 2.
KILL_AT = """
import json, os, signal, sys
from pathlib import Path
from rlvr.grpo import checkpoint, trainer
from resources import grpo_worker

boundary, step = sys.argv[2], 2
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if boundary == "mid-step":  # sampled and scored, killed in the update
    update = trainer.GRPOTrainer._update
    trainer.GRPOTrainer._update = lambda self, *a, **k: die() if self.step_count + 1 == step else update(self, *a, **k)
elif boundary == "between-rollouts-and-rewards":
    write = grpo_worker.write_atomically
    grpo_worker.write_atomically = lambda path, data: die() if f"rewards-step{step:06d}" in str(path) else write(path, data)
else:  # rows and metrics written: before the resume point is saved, or right after it
    save = checkpoint.save_checkpoint
    def save_checkpoint(folder, at, *a, **k):
        if at == step and boundary == "before-checkpoint":
            die()
        saved = save(folder, at, *a, **k)
        if at == step:
            die()
        return saved
    checkpoint.save_checkpoint = save_checkpoint
job = json.loads(Path(sys.argv[1]).read_text())
grpo_worker._train(job, 0, Path(job["scratch"]), None)
"""
BOUNDARIES = ("mid-step", "between-rollouts-and-rewards", "before-checkpoint", "after-checkpoint")


def worker_job(scratch: Path, start: Path, gsm8k_dir: Path) -> dict:
    rows = [p.as_row() for p in gsm8k.load_local(gsm8k_dir, limit=8) if p.split == "train"]
    config = GRPOConfig(total_steps=STEPS, prompts_per_step=2, group_size=2, checkpoint_every=1, seed=0, sampling=SamplingConfig(max_new_tokens=8))
    extras = TrainingJob("r", start, rows, config, {"math_answer": 1.0}, scratch, device="cpu").extras()
    (scratch / "job.json").write_text(json.dumps(extras))
    return extras


@pytest.mark.slow  # trains in subprocesses
def test_a_step_killed_at_each_boundary_loses_no_rows_and_no_curve_point(tmp_path, gsm8k_dir, tiny_llama_dir):
    jobs = {b: worker_job(tmp_path / b, tiny_llama_dir, gsm8k_dir) for b in BOUNDARIES}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    killed = {b: subprocess.Popen([sys.executable, "-c", KILL_AT, str(tmp_path / b / "job.json"), b], env=env) for b in BOUNDARIES}
    for boundary, process in killed.items():
        assert process.wait(timeout=300) == -signal.SIGKILL, f"{boundary}: the worker was not killed there"
    for boundary, job in jobs.items():
        scratch = tmp_path / boundary
        assert resumable_at(scratch, 2) == (boundary == "after-checkpoint") and resumable_at(scratch, 1) != (boundary == "after-checkpoint")
        clear_attempt(scratch, restart=False)  # what the re-execution's launcher does first
        grpo_worker._train(job, 0, scratch, None)  # the re-execution, resuming
        rollouts, rewards = TrainingLauncher.step_rows(scratch, "rollouts"), TrainingLauncher.step_rows(scratch, "rewards")
        assert sorted(rollouts.groupby("step").size().items()) == [(s, ROWS_PER_STEP) for s in range(1, STEPS + 1)], boundary
        assert rollouts["completion_id"].is_unique and set(rewards["completion_id"]) == set(rollouts["completion_id"]), boundary
        assert [step for step, _ in step_history(scratch)] == list(range(1, STEPS + 1)), boundary


def test_a_reexecution_stops_what_an_earlier_attempt_left_running(tmp_path):
    """A run worker killed where no parent-death signal reaches (another host, a container restart): its
    torchrun goes on. The next attempt, once it holds the lock, finds its process group there and stops it;
    a group that is not this scratch folder's training (a recycled id, another run's) is left alone."""
    scratch = tmp_path / "scratch"
    (scratch / "export.tmp").mkdir(parents=True)  # a stale export of the killed attempt
    orphan = subprocess.Popen(  # launched as the launcher launches torchrun
        [sys.executable, "-c", "import time; time.sleep(600)", "torch.distributed.run"],
        start_new_session=True,
        preexec_fn=partial(start_training_process, os.getpid()),
        env={**os.environ, SCRATCH_ENV: str(scratch.resolve())},
    )
    (scratch / LOCK_FILE).write_text(json.dumps({"dagster_run_id": "killed", "pid": 1, "pgid": orphan.pid}))
    warnings: list[str] = []
    with attempt_lock(scratch, "next") as attempt:
        stop_abandoned_training(attempt.earlier, scratch, 5, warnings.append)
        assert orphan.poll() == -signal.SIGTERM  # stopped (and reaped) before the attempt goes on
        clear_attempt(scratch, restart=False)
        attempt.record(4242)
    assert f"process group {orphan.pid}" in warnings[0] and not (scratch / "export.tmp").exists()
    assert json.loads((scratch / LOCK_FILE).read_text()) == {"dagster_run_id": "next", "pid": os.getpid(), "host": socket.gethostname(), "pgid": 4242}
    other_run = subprocess.Popen(  # another scratch folder's training, and a process that is no training
        [sys.executable, "-c", "import time; time.sleep(600)", "torch.distributed.run"], start_new_session=True, env={**os.environ, SCRATCH_ENV: "/elsewhere"}
    )
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        for process in (other_run, unrelated):
            (scratch / LOCK_FILE).write_text(json.dumps({"pid": 1, "pgid": process.pid}))
            with attempt_lock(scratch, "next") as attempt:
                stop_abandoned_training(attempt.earlier, scratch, 5, warnings.append)
                assert process.poll() is None and len(warnings) == 1
    finally:
        for process in (other_run, unrelated):
            process.kill()
            process.wait()


# The run worker: the training job (support.training_jobs registers its rewards here too) in a fresh process.
RUN_WORKER = """
import json, sys
from dagster import DagsterInstance, execute_job
from support.training_jobs import training_job
with DagsterInstance.local_temp(sys.argv[1]) as instance:
    execute_job(training_job(sys.argv[3]), instance=instance, run_config=json.loads(sys.argv[2]))
"""


def marked_processes(marker: bytes) -> list[int]:
    """Processes (other than this one) whose environment holds ``marker``: the run worker's descendants."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) != os.getpid() and marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
@pytest.mark.slow  # trains in subprocesses
def test_killing_the_run_worker_takes_its_training_along_and_the_reexecution_completes(home, gsm8k_dir, tiny_llama_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("RLVR_TEST_HOME", str(home))
    config = two_process_config(gsm8k_dir, tiny_llama_dir, steps=STEPS)
    config["ops"]["grpo_training"]["config"]["rewards"] = {"test_paced_length": 1.0}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    (tmp_path / "dagster").mkdir()
    worker = subprocess.Popen([sys.executable, "-c", RUN_WORKER, str(tmp_path / "dagster"), json.dumps(config), str(home)], env=env)
    try:
        wait_for(lambda: resumable_at(home / "models" / ".work", 1) or worker.poll() is not None, 300, "step 1's resume point")
        assert worker.poll() is None, "the run ended before it could be killed"
        assert len(marked_processes(f"RLVR_TEST_HOME={home}".encode())) >= 4  # run worker, torchrun, two ranks (and reward workers)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        wait_for(lambda: not marked_processes(f"RLVR_TEST_HOME={home}".encode()), 30, "every training process to die with the run worker")
    finally:
        worker.kill()
    client = resources_for(home)["mlflow"].client()
    experiment = client.get_experiment_by_name("rlvr-ops").experiment_id
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        (killed,) = instance.get_runs()

        def statuses() -> list[str]:
            return sorted(r.info.status for r in client.search_runs([experiment], f"tags.`{TRAINING_RUN_TAG}` = '{killed.run_id}'"))

        def sensor_tick(cursor: str | None) -> str | None:  # one tick of the daemon's failed-run sensor
            context = build_sensor_context(instance=instance, cursor=cursor, resources={"mlflow": resources_for(home)["mlflow"]})
            return failed_run_mlflow_sensor.evaluate_tick(context).cursor

        cursor = sensor_tick(None)  # its first tick: runs failing from now on
        assert statuses() == ["RUNNING"]  # the killed run worker could not end its MLflow run
        instance.report_run_failed(killed)  # what the run monitor does for a run whose worker died
        sensor_tick(cursor)
        assert statuses() == ["KILLED"]  # ended when Dagster marked the run failed, not at the next re-execution
        resumed = execute_job(
            training_job(home), instance=instance, run_config=config, reexecution_options=ReexecutionOptions.from_failure(killed.run_id, instance)
        )
        assert resumed.success
        checkpoint = {m.asset_key.to_user_string(): m.metadata for m in resumed.asset_materializations_for_node("grpo_training")}["grpo_checkpoint"]
    keys = rows(home, "SELECT step, group_index, sample_index, count(*) FROM rollouts GROUP BY ALL")
    assert len(keys) == STEPS * ROWS_PER_STEP and all(k[3] == 1 for k in keys)  # every row once
    assert len(checkpoint["reward_curve"].value.split(" → ")) == STEPS  # the curve of every step, resumed ones included
    assert resources_for(home)["model_store"].latest("grpo_checkpoint").manifest["final_metrics"]["step"] == STEPS
    assert statuses() == ["FINISHED", "KILLED"]
    (finished,) = client.search_runs([experiment], f"tags.`{TRAINING_RUN_TAG}` = '{killed.run_id}' AND attributes.status = 'FINISHED'")
    assert [m.step for m in client.get_metric_history(finished.info.run_id, "reward_mean")] == list(range(1, STEPS + 1))


# A stand-in for torchrun (its command line names torch.distributed.run): starts a "rank" in a session of
# its own, as torchrun does, records both PIDs, leaves step 1's metrics, and trains "forever".
FAKE_TORCHRUN = """
import json, subprocess, sys, time
from pathlib import Path
steps = Path(sys.argv[1]) / "steps"
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
(steps.parent / "pids.json").write_text(json.dumps([rank.pid]))
steps.mkdir(exist_ok=True)
(steps / "metrics-step000001.json").write_text(json.dumps({"reward_mean": 0.5}))
time.sleep(600)
"""


class FakeTorchrun(TrainingLauncher):
    def command(self, nproc: int) -> list[str]:
        return [sys.executable, "-c", FAKE_TORCHRUN, os.environ["RLVR_TEST_SCRATCH"], "torch.distributed.run"]


def test_a_step_that_fails_while_training_runs_stops_the_training(tmp_path, monkeypatch):
    """The step ends under the training (here its metrics callback raises; a cancelled run raises the
    same way): the launcher stops torchrun and every process under it before the step fails."""
    from dagster import MaterializeResult, asset, materialize

    scratch = tmp_path / "scratch"
    monkeypatch.setenv("RLVR_TEST_SCRATCH", str(scratch))
    job = TrainingJob("r", tmp_path, [{"question": "1 + 1?"}], GRPOConfig(), {"math_answer": 1.0}, scratch, device="cpu")

    def broken_tracking(step: int, metrics: dict) -> None:
        raise RuntimeError(f"tracking server gone at step {step}")

    @asset
    def grpo_training(context):
        FakeTorchrun(stop_grace_s=5).train(context, job, 1, on_step=broken_tracking)
        return MaterializeResult()

    result = materialize([grpo_training], raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "tracking server gone at step 1" in failure.event_specific_data.error.cause.message
    torchrun_pgid = json.loads((scratch / LOCK_FILE).read_text())["pgid"]
    (rank,) = json.loads((scratch / "pids.json").read_text())
    for pid in (torchrun_pgid, rank):  # gone (a zombie at most, until its reaper waits)
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z", pid
