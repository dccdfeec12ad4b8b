"""GRPO launched from Dagster as a torchrun job through Pipes: two CPU processes (gloo) from a real
materialization, a rank killed mid-run, and the re-executed run resuming from its checkpoint."""

import os
import threading
from pathlib import Path

import pytest
from dagster import DagsterInstance, ReexecutionOptions, execute_job, materialize

from resources.launcher import TrainingLauncher, process_count, rank_errors
from rlvr_assets import data, models, training
from support.pipeline import resources_for
from support.training_jobs import HOLD_AFTER_STEP_1, resumable_at, rows, training_job, two_process_config
from support.waiting import wait_for


def test_process_counts():
    assert process_count("auto", 0) == 1 and process_count("auto", 8) == 8 and process_count("3", 0) == 3
    for bad in ("0", "-1", "two", None):
        with pytest.raises(ValueError, match="nproc must be 'auto' or a positive integer"):
            process_count(bad, 0)
    launcher = TrainingLauncher(python="/py")
    assert launcher.command(2) == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "resources.grpo_worker"]


def test_rank_errors_blame_only_the_ranks_that_died(tmp_path):
    (tmp_path / "errors").mkdir()
    (tmp_path / "digests").mkdir()
    (tmp_path / "errors" / "rank-0.stopped").write_text("SystemExit: stopped by signal 15")
    (tmp_path / "errors" / "rank-2.txt").write_text("RuntimeError: gloo connection closed by peer")
    (tmp_path / "digests" / "rank-4.txt").write_text("abc")  # finished normally: not a suspect
    report = rank_errors(tmp_path, 5)
    assert report.splitlines()[0] == "rank(s) [1, 3] died without leaving an error (killed by a signal, or out of memory?)"
    assert "--- rank 2 ---\nRuntimeError: gloo" in report and "--- rank 0" not in report
    assert "rank(s) [0] stopped (SIGTERM, after another rank failed or the run was stopped)" in report
    assert report.splitlines()[-1] == "rank(s) [4] finished"


@pytest.mark.slow  # materializes torchrun training
def test_two_processes_from_a_materialization(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            [data.gsm8k_problems, models.base_policy, training.grpo_training],
            resources=res,
            run_config=two_process_config(gsm8k_dir, tiny_llama_dir),
            instance=instance,
        )
        assert result.success
        logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    # prompts_per_step 2 on 2 ranks: rank 0 samples group 0, rank 1 group 1; each row once
    keys = rows(home, "SELECT step, group_index, sample_index, count(*) FROM rollouts GROUP BY ALL ORDER BY ALL")
    assert [k[:3] for k in keys] == [(s, g, i) for s in (1, 2) for g in (0, 1) for i in (0, 1)]
    assert all(k[3] == 1 for k in keys)
    assert rows(home, "SELECT count(*) FROM rewards WHERE reward_name = 'total'")[0][0] == 8
    assert any("step 1/2: reward" in m for m in logs) and any("step 2/2: reward" in m for m in logs)  # from the worker
    stored = res["model_store"].latest("grpo_checkpoint")
    assert stored.manifest["nproc"] == 2 and stored.manifest["final_metrics"]["step"] == 2.0
    metadata = {m.asset_key.to_user_string(): m.metadata for m in result.asset_materializations_for_node("grpo_training")}
    assert metadata["grpo_checkpoint"]["nproc"].value == 2


def kill_rank_when_step_written(scratch_root: Path, rank: int, step: int, stop: threading.Event) -> None:
    """Kill the worker process of ``rank`` once ``step`` is a resume point (a crash mid-run). Until then the
    paced reward holds the next step (``HOLD_AFTER_STEP_1`` in ``$RLVR_TEST_HOME``), so the kill lands before it ends."""
    hold = Path(os.environ["RLVR_TEST_HOME"]) / HOLD_AFTER_STEP_1
    hold.touch()
    try:
        _kill_rank_at(scratch_root, rank, step, stop)
    finally:
        hold.unlink(missing_ok=True)


def _kill_rank_at(scratch_root: Path, rank: int, step: int, stop: threading.Event) -> None:
    pid = wait_for(lambda: stop.is_set() or (resumable_at(scratch_root, step) and _rank_pid(rank)), 600, f"step {step}'s resume point")
    if not stop.is_set():
        os.kill(pid, 9)


def _rank_pid(rank: int) -> int | None:
    """The process of this test's worker ``rank``, if it runs."""
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = f"RLVR_TEST_HOME={os.environ['RLVR_TEST_HOME']}".encode() in environ  # not another test's (or person's) run
        if ours and b"resources.grpo_worker" in cmdline and f"RANK={rank}".encode() in environ and b"torch.distributed.run" not in cmdline:
            return pid
    return None


@pytest.mark.slow  # materializes torchrun training
def test_a_killed_rank_fails_the_run_and_the_reexecution_resumes(home, gsm8k_dir, tiny_llama_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("RLVR_TEST_HOME", str(home))
    config = two_process_config(gsm8k_dir, tiny_llama_dir, steps=3)
    config["ops"]["grpo_training"]["config"]["rewards"] = {"test_paced_length": 1.0}
    stop = threading.Event()
    killer = threading.Thread(target=kill_rank_when_step_written, args=(home / "models" / ".work", 1, 1, stop), daemon=True)
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        killer.start()
        failed = execute_job(training_job(home), instance=instance, run_config=config)
        stop.set()
        assert not failed.success
        failure = next(e for e in failed.all_events if e.event_type_value == "STEP_FAILURE")
        assert "GRPO training failed" in failure.event_specific_data.error.message
        assert "rank(s) [1] died without leaving an error" in failure.event_specific_data.error.message  # SIGKILL
        report, failed_logs = failure.event_specific_data.error.message, [e.message for e in instance.all_logs(failed.run_id) if e.message]
        assert "rank(s) [0] stopped" in report and "--- rank 0" not in report  # rank 0 was stopped by torchrun: not blamed
        assert any(m.startswith("rank 0 stopped: stopped by signal 15") for m in failed_logs)
        assert not any("rank 0 failed" in m or "closed with exception" in m for m in failed_logs)
        done = rows(home, "SELECT DISTINCT step FROM rollouts ORDER BY 1")
        assert [s for (s,) in done][:1] == [1]  # the finished step's rows were kept

        resumed = execute_job(
            training_job(home), instance=instance, run_config=config, reexecution_options=ReexecutionOptions.from_failure(failed.run_id, instance)
        )
        assert resumed.success
        logs = [e.message for e in instance.all_logs(resumed.run_id) if e.message]
    assert not any("step 1/3" in m for m in logs) and any("step 2/3" in m for m in logs) and any("step 3/3" in m for m in logs)  # resumed past step 1
    keys = rows(home, "SELECT step, group_index, sample_index, count(*) FROM rollouts GROUP BY ALL")
    assert len(keys) == 3 * 2 * 2 and all(k[3] == 1 for k in keys)  # every row once, resumed steps included
