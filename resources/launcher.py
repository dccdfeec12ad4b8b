"""Launching GRPO training outside the orchestrator's process: torchrun through Dagster Pipes.

:class:`TrainingLauncher` runs ``rlvr_assets.grpo_worker`` under ``torchrun --nproc_per_node N``
with :class:`dagster.PipesSubprocessClient`: the worker's per-step logs reach the event log as they
happen, its per-step metrics come back as Pipes messages, its rows as Parquet files in the run's
scratch folder (:meth:`TrainingLauncher.step_rows` reads them back for the one DuckDB writer), its
checkpoint as a folder there, and each rank's final weights digest (a run whose ranks disagree
fails). Every run size takes this path, one process included.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd
from dagster import ConfigurableResource, Failure, PipesSubprocessClient
from dagster._core.errors import DagsterPipesExecutionError  # what PipesSubprocessClient raises on a failed process
from pydantic import Field

from rlvr.grpo import GRPOConfig
from rlvr.rewards import pickled_reward

WORKER_MODULE = "rlvr_assets.grpo_worker"


def process_count(nproc: str | int, cuda_devices: int) -> int:
    """Processes for a run: ``"auto"`` is one per visible GPU (1 without), an integer is itself (>= 1)."""
    if nproc == "auto":
        return max(cuda_devices, 1)
    try:
        count = int(nproc)
    except (TypeError, ValueError):
        raise ValueError(f"nproc must be 'auto' or a positive integer, got {nproc!r}") from None
    if count < 1:
        raise ValueError(f"nproc must be 'auto' or a positive integer, got {nproc!r}")
    return count


@dataclass
class TrainingJob:
    """What one launched run trains: the start checkpoint, the problem rows, the config and rewards."""

    run_id: str
    start: Path
    rows: list[dict]
    config: GRPOConfig
    rewards: Mapping[str, float]
    scratch: Path  # the run's folder: checkpoints/, steps/, errors/, digests/, export/ (kept until the run completes)
    device: str | None = None  # one process: this device; several: torchrun's (cuda:LOCAL_RANK or cpu)

    def extras(self) -> dict:
        """The worker's Pipes extras (JSON): paths, the config as a dict, the rewards pickled (a reward
        registered only in this process, e.g. in a notebook, reaches the worker too)."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        problems = self.scratch / "problems.parquet"
        pd.DataFrame(self.rows).to_parquet(problems, index=False)
        return {
            "run_id": self.run_id,
            "start": str(self.start),
            "problems": str(problems),
            "config": asdict(self.config),
            "rewards": dict(self.rewards),
            "device": self.device,
            "scratch": str(self.scratch),
            "checkpoint_dir": str(self.scratch / "checkpoints"),
            "export_dir": str(self.scratch / "export"),
            "reward_payloads": {name: base64.b64encode(pickled_reward(name)).decode() for name in self.rewards},
        }


class TrainingLauncher(ConfigurableResource):
    """Runs the GRPO worker under torchrun through Dagster Pipes on this machine."""

    python: str = Field(default=sys.executable, description="the interpreter torchrun and the worker run with")

    def processes(self, nproc: str | int) -> int:
        """:func:`process_count` for this machine's visible GPUs."""
        import torch

        return process_count(nproc, torch.cuda.device_count())

    def command(self, nproc: int) -> list[str]:
        """The torchrun command line of a run of ``nproc`` processes on this node."""
        return [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", WORKER_MODULE]

    def train(self, context: Any, job: TrainingJob, nproc: int, restart: bool = False) -> list[tuple[int, dict]]:
        """Run ``job`` on ``nproc`` processes; returns (step, metrics) of the steps run. ``restart``
        drops the run's checkpoints first (a run cannot resume on another number of processes). A
        failed run raises :class:`dagster.Failure` with each failed rank's error text."""
        clear_attempt(job.scratch, restart)
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))  # the worker imports what this process can
        try:
            invocation = PipesSubprocessClient().run(context=context, command=self.command(nproc), extras=job.extras(), env={"PYTHONPATH": path})
        except DagsterPipesExecutionError as err:
            raise training_failure(err, job.scratch, nproc) from None
        check_digests(job.scratch, nproc)
        return [(m["step"], m["metrics"]) for m in invocation.get_custom_messages() if "metrics" in m]

    @staticmethod
    def step_rows(scratch: Path, table: str) -> pd.DataFrame:
        """Every rank's rows of ``table`` (rollouts, rewards) written so far, as one frame."""
        files = sorted((scratch / "steps").glob(f"{table}-step*-rank*.parquet"))
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True) if files else pd.DataFrame()

    @staticmethod
    def exported(scratch: Path) -> Callable[[Path], None]:
        """A model-store writer copying the run's exported checkpoint into the new version's folder."""
        return lambda folder: shutil.copytree(scratch / "export", folder, dirs_exist_ok=True)


def clear_attempt(scratch: Path, restart: bool) -> None:
    """Drop an earlier attempt's errors, digests and export (and with ``restart`` its checkpoints: a run
    cannot resume on another number of processes)."""
    for folder in ("errors", "export", "digests", *(["checkpoints"] if restart else [])):
        shutil.rmtree(scratch / folder, ignore_errors=True)


def training_failure(err: Exception, scratch: Path, nproc: int) -> Failure:
    """A failed run: what the orchestrator saw, then each rank's account from the scratch folder."""
    report = rank_errors(scratch / "errors", nproc)
    hint = " (set restart: true to start it afresh)" if "cannot resume" in report else ""
    return Failure(description=f"GRPO training failed{hint} ({err}):\n{report}")


def check_digests(scratch: Path, nproc: int) -> None:
    """Every rank left the same final weights digest, or the run fails."""
    digests = {path.stem: path.read_text() for path in sorted((scratch / "digests").glob("rank-*.txt"))}
    if len(digests) != nproc or len(set(digests.values())) != 1:
        raise Failure(description=f"GRPO training: the ranks' final weights differ or are missing: {digests}")


def rank_errors(errors: Path, nproc: int) -> str:
    """Which ranks died without a word (killed by a signal, out of memory), the tracebacks of those that failed, and
    which ranks torchrun merely stopped because another one failed."""
    texts = {int(path.stem.split("-")[1]): path.read_text()[-4000:] for path in errors.glob("rank-*.txt")}
    stopped = sorted(int(path.stem.split("-")[1]) for path in errors.glob("rank-*.stopped"))
    silent = [rank for rank in range(nproc) if rank not in texts and rank not in stopped]
    lines = [f"rank(s) {silent} died without leaving an error (killed by a signal, or out of memory?)"] if silent else []
    lines += [f"--- rank {rank} ---\n{text}" for rank, text in sorted(texts.items())]
    return "\n".join(lines + ([f"rank(s) {stopped} stopped by torchrun after another rank failed"] if stopped else []))
