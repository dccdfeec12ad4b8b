"""Training launched through Dagster as a torchrun job: its run config, a reconstructable job (for
re-execution, also from a subprocess), what it wrote, and rewards that hold its steps while a test acts.

Importing this module registers the rewards; the launched ranks find them here by module path.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import duckdb
from dagster import build_reconstructable_job

from rlvr.rewards import register_reward
from rlvr_assets import data, models, training
from support.pipeline import resources_for, run_config
from support.waiting import wait_for

HOLD_AFTER_STEP_1 = "hold-after-step-1"  # while this file is in $RLVR_TEST_HOME, test_paced_length waits once step 1 is a resume point
HOLD_REWARDS = "hold-rewards"  # while this file is in $RLVR_TEST_HOME, test_held_length waits (at most 300 s)


def two_process_config(gsm8k_dir, model_dir, steps=2) -> dict:
    """``run_config`` of the three training assets only, trained by two processes."""
    config = run_config(gsm8k_dir, model_dir, steps=steps)
    config["ops"]["grpo_training"]["config"]["nproc"] = "2"
    return {"ops": {k: v for k, v in config["ops"].items() if k in ("gsm8k_problems", "base_policy", "grpo_training")}}


def rows(home: Path, sql: str) -> list[tuple]:
    """The rows ``sql`` returns from the warehouse under ``home`` (read-only)."""
    with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
        return conn.execute(sql).fetchall()


def launch_job(home: str):
    """The three training assets as a job on the data directory ``home``."""
    from dagster import Definitions, define_asset_job, in_process_executor

    return Definitions(
        assets=[data.gsm8k_problems, models.base_policy, training.grpo_training],
        resources=resources_for(Path(home)),
        jobs=[define_asset_job("train", selection="*", executor_def=in_process_executor)],
    ).resolve_job_def("train")


def training_job(home: Path):
    """``launch_job(home)`` for execute_job (re-execution needs a reconstructable job). The home is part of
    the job's identity: Dagster keeps the last job it reconstructed, so a job found by module and name
    alone would reuse an earlier test's resources (its data directory)."""
    return build_reconstructable_job(__name__, launch_job.__name__, reconstructable_kwargs={"home": str(home)})


def resumable_at(scratch_root: Path, step: int) -> bool:
    """The run's resume point is ``step`` (its checkpoint complete and ``latest`` naming it)."""
    return any(p.read_text().strip() == f"step-{step:06d}" for p in scratch_root.rglob("checkpoints/latest"))


def _held(hold: Path, timeout_s: float, also=lambda: True) -> None:
    """Wait while ``hold`` exists (and ``also()`` holds), ``timeout_s`` at most; then go on either way."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not (hold.exists() and also()), timeout_s, f"{hold} to go")


@register_reward("test_paced_length", replace=True)
def paced_length(completion: str, **_) -> float:
    """A reward that takes 0.5 s (the tiny model's steps last long enough for a killer to land between two
    resume points) and, while a killer holds ``HOLD_AFTER_STEP_1``, waits (at most 10 s) once step 1 is a resume point."""
    home = Path(os.environ.get("RLVR_TEST_HOME", "/nonexistent"))
    _held(home / HOLD_AFTER_STEP_1, 10, lambda: resumable_at(home / "models" / ".work", 1))
    time.sleep(0.5)  # scripted pace of the reward under test, not a wait for anything
    return min(1.0, len(completion) / 400)


@register_reward("test_held_length", replace=True)
def held_length(completion: str, **_) -> float:
    """A reward that waits while the test holds ``HOLD_REWARDS``: the training stays live until the test lets it go."""
    _held(Path(os.environ.get("RLVR_TEST_HOME", "/nonexistent")) / HOLD_REWARDS, 300)
    return min(1.0, len(completion) / 400)
