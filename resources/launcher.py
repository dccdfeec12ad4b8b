"""Launching GRPO training outside the orchestrator's process: torchrun through Dagster Pipes.

:class:`TrainingLauncher` runs :mod:`resources.grpo_worker` under ``torchrun --nproc_per_node N`` (one
process: the worker alone) in a Pipes session: logs reach the event log as they happen, per-step metrics stream
from the run's scratch folder (:class:`StepMetrics`), rows come back as Parquet files there
(:meth:`TrainingLauncher.step_rows`; each step's costs: :func:`step_costs`), and every rank's final
weights digest must agree. Training dies with its run (own process group, parent-death signal); one
attempt at a time holds the scratch folder (:func:`attempt_lock`), and stops what a dead earlier attempt
left running (:func:`stop_abandoned_training`).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from subprocess import Popen, TimeoutExpired
from typing import IO, Any, Callable, Iterator, Mapping

import pandas as pd
from dagster import ConfigurableResource, Failure, PipesTempFileContextInjector, PipesTempFileMessageReader, PreviewWarning, open_pipes_session
from pydantic import Field

from resources import grpo_worker
from rlvr.costs import Usage, total
from rlvr.costs.budget import Budget
from rlvr.grpo import GRPOConfig
from rlvr.grpo.checkpoint import latest_checkpoint
from rlvr.rewards import pickled_reward
from rlvr.training_run import start_training_process

WORKER_MODULE = grpo_worker.__name__  # what torchrun runs with -m: resources.grpo_worker
LOCK_FILE = "attempt.lock"  # in the scratch folder: the holder's {"dagster_run_id", "pid", "host", "pgid": its training's process group}
SCRATCH_ENV = "RLVR_TRAINING_SCRATCH"  # in every training process's environment: the scratch folder it trains in
TRAINING_MARKERS = (b"torch.distributed.run", b"torchrun", WORKER_MODULE.encode())  # what a training process's command line holds
ONE_PROCESS_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}  # a run of one process, as torchrun names it
OnStep = Callable[[int, dict], None]

# Dagster's own Pipes session reads this preview property of every message reader it is given (ours
# included), warning on each training run about code that is not ours.
warnings.filterwarnings("ignore", message=r"Function `PipesMessageReader\.expected_writer_count`", category=PreviewWarning)


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
    environment: dict | None = None  # the rollouts' environment spec ({"name", "options"}); None: single-turn
    tasks: dict | None = None  # a task mixture (task name -> weight; rows name their task); None: GSM8k rows and ``rewards``
    attempt_id: str | None = None  # the Dagster run of this attempt (each step's costs name it); None: run_id
    budget: Budget | None = None  # the run's spend limits: it stops at the step that reaches one (resumable)

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
            "environment": self.environment,
            "tasks": self.tasks,
            "attempt_id": self.attempt_id,
            "budget": self.budget.as_dict() if self.budget is not None else None,
            "scratch": str(self.scratch),
            "checkpoint_dir": str(self.scratch / "checkpoints"),
            "export_dir": str(self.scratch / "export"),
            "reward_payloads": {name: base64.b64encode(pickled_reward(name)).decode() for name in self.rewards},
        }


class TrainingLauncher(ConfigurableResource):
    """Runs the GRPO worker under torchrun through Dagster Pipes on this machine."""

    python: str = Field(default=sys.executable, description="the interpreter torchrun and the worker run with")
    stop_grace_s: float = Field(default=10.0, description="how long a stopped training gets to end after SIGTERM before SIGKILL")
    lock_wait_s: float = Field(default=30.0, description="how long an attempt waits for another that holds the run but is not training (starting, or ending)")

    def processes(self, nproc: str | int) -> int:
        """:func:`process_count` for this machine's visible GPUs."""
        import torch

        return process_count(nproc, torch.cuda.device_count())

    def command(self, nproc: int) -> list[str]:
        """The command line of a run of ``nproc`` processes on this node: torchrun's; for one process the worker
        itself (torchrun's agent would add only its start-up, about 2 s), with the environment torchrun would give it
        (:data:`ONE_PROCESS_ENV`)."""
        if nproc == 1:
            return [self.python, "-m", WORKER_MODULE]
        return [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", WORKER_MODULE]

    def train(self, context: Any, job: TrainingJob, nproc: int, restart: bool = False, on_step: OnStep | None = None) -> list[tuple[int, dict]]:
        """Run ``job`` on ``nproc`` processes; returns (step, metrics) of every step of the run, earlier
        attempts' included, and hands each to ``on_step`` as it ends (those of earlier attempts first).
        ``restart`` drops the run's checkpoints first (a run cannot resume on another number of
        processes). A failed run raises :class:`dagster.Failure` with each rank's account."""
        with attempt_lock(job.scratch, context.run.run_id, self.lock_wait_s) as attempt:
            stop_abandoned_training(attempt.earlier, job.scratch, self.stop_grace_s, context.log.warning)
            clear_attempt(job.scratch, restart)
            metrics = StepMetrics(job.scratch, on_step)
            try:
                returncode = self._run(context, job, nproc, attempt.record, metrics)
            finally:
                metrics.poll()
        if returncode != 0:
            raise training_failure(f"{'the training' if nproc == 1 else 'torchrun'} exited with code {returncode}", job.scratch, nproc)
        check_digests(job.scratch, nproc)
        return step_history(job.scratch)

    def _run(self, context: Any, job: TrainingJob, nproc: int, record: Callable[[int], None], metrics: "StepMetrics") -> int:
        """torchrun in a Pipes session, in its own process group, dying with this process; stopped if
        this step is interrupted (a cancelled run). Returns torchrun's exit code."""
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))  # the worker imports what this process can
        with open_pipes_session(context, PipesTempFileContextInjector(), PipesTempFileMessageReader(), extras=job.extras()) as session:
            env = {**os.environ, "PYTHONPATH": path, SCRATCH_ENV: str(job.scratch.resolve()), **session.get_bootstrap_env_vars()}
            env |= ONE_PROCESS_ENV if nproc == 1 else {}
            process = Popen(self.command(nproc), env=env, start_new_session=True, preexec_fn=partial(start_training_process, os.getpid()))
            try:
                record(process.pid)  # its process group: what a later attempt stops if this one is killed
                while process.poll() is None:  # each step's metrics as it ends
                    metrics.poll()
                    with contextlib.suppress(TimeoutExpired):
                        process.wait(timeout=0.5)
            finally:
                if process.poll() is None:
                    context.log.warning(f"stopping the training (process group {process.pid}): the step ended before it")
                    stop_group(process.pid, job.scratch, self.stop_grace_s, process)
            return process.returncode

    @staticmethod
    def step_rows(scratch: Path, table: str) -> pd.DataFrame:
        """Every rank's rows of ``table`` (rollouts, rewards, tool_calls) written so far, as one frame."""
        files = sorted((scratch / "steps").glob(f"{table}-step*-rank*.parquet"))
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True) if files else pd.DataFrame()

    @staticmethod
    def exported(scratch: Path) -> Callable[[Path], None]:
        """A model-store writer copying the run's exported checkpoint into the new version's folder."""
        return lambda folder: shutil.copytree(scratch / "export", folder, dirs_exist_ok=True)


class StepMetrics:
    """Each step's metrics as rank 0 leaves them in ``<scratch>/steps``, handed to ``on_step`` once each
    as they appear (:meth:`poll`): the run's curve, live, and whole on a resumed run."""

    def __init__(self, scratch: Path, on_step: OnStep | None):
        self.scratch, self.on_step, self.seen = scratch, on_step, set()

    def poll(self) -> None:
        for step, metrics in step_history(self.scratch):
            if step not in self.seen and self.on_step is not None:
                self.on_step(step, metrics)
            self.seen.add(step)


def step_history(scratch: Path) -> list[tuple[int, dict]]:
    """(step, metrics) of every step whose metrics are in ``<scratch>/steps``, in step order."""
    files = sorted((scratch / "steps").glob("metrics-step*.json"))
    return [(int(f.stem.removeprefix("metrics-step")), json.loads(f.read_text())) for f in files]


def clear_attempt(scratch: Path, restart: bool) -> None:
    """Drop an earlier attempt's errors, digests, (stale) export and budget stop, and the metrics of steps past the
    resume point (they run again); with ``restart`` its checkpoints and steps too (a run cannot resume on
    another number of processes)."""
    for folder in ("errors", "export", "export.tmp", "digests", *(["checkpoints", "steps"] if restart else [])):
        shutil.rmtree(scratch / folder, ignore_errors=True)
    (scratch / grpo_worker.STOPPED_FILE).unlink(missing_ok=True)
    resume = latest_checkpoint(scratch / "checkpoints")
    done = int(resume.name.removeprefix("step-")) if resume is not None else 0
    for step, _ in step_history(scratch):
        if step > done:
            (scratch / "steps" / f"metrics-step{step:06d}.json").unlink()


@dataclass(frozen=True)
class StepCost:
    """A step's usage on one task, every rank's summed, as the Dagster run (attempt) that ran it measured it."""

    run_id: str
    step: int
    task: str
    usage: Usage


def step_costs(scratch: Path) -> list[StepCost]:
    """Each step's costs per task in ``<scratch>/steps`` (every attempt's that left them), summed over ranks."""
    found: dict[tuple[str, int, str], list[Usage]] = {}
    for entry in grpo_worker.step_costs(scratch / "steps"):
        for task, usage in entry["tasks"].items():
            found.setdefault((entry["run_id"], entry["step"], task), []).append(usage)
    return [StepCost(run_id, step, task, total(usages)) for (run_id, step, task), usages in sorted(found.items(), key=lambda kv: kv[0][1:])]


def budget_stopped(scratch: Path) -> dict | None:
    """``{"step", "reason"}`` when this attempt's training stopped early on its budget, else None."""
    path = scratch / grpo_worker.STOPPED_FILE
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class Attempt:
    """One attempt's hold on a scratch folder: what the attempt before it recorded there (``earlier``), and
    ``record(pgid)``, which names this attempt's training's process group in the lock."""

    earlier: dict
    record: Callable[[int | None], None]


@contextmanager
def attempt_lock(scratch: Path, dagster_run_id: str, wait_s: float = 30.0) -> Iterator[Attempt]:
    """Hold the scratch folder for one attempt: an ``flock`` on ``attempt.lock``, which names the holder
    (Dagster run, PID, host, training's process group). A second attempt refuses rather than wait for a live
    one (:class:`dagster.Failure` naming its Dagster run): at once when the holder's training runs on this
    host, after ``wait_s`` otherwise (a holder starting, or ending). Nothing is stopped before the lock is
    held: the holder then stops what a dead earlier attempt left (:func:`stop_abandoned_training`)."""
    scratch.mkdir(parents=True, exist_ok=True)
    with open(scratch / LOCK_FILE, "a+") as handle:
        take_lock(handle, scratch, wait_s)
        earlier = lock_record(handle)
        owner = {"dagster_run_id": dagster_run_id, "pid": os.getpid(), "host": socket.gethostname()}

        def record(pgid: int | None) -> None:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({**owner, "pgid": pgid}))
            handle.flush()

        record(earlier.get("pgid") if on_this_host(earlier) else None)  # an earlier training stays named until it is stopped
        yield Attempt(earlier, record)


def take_lock(handle: IO[str], scratch: Path, wait_s: float) -> None:
    """``flock`` the lock file, or raise :class:`dagster.Failure` naming the live attempt holding it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = lock_record(handle)
            training = bool(holder.get("pgid")) and on_this_host(holder) and bool(training_tree(holder["pgid"], scratch))
            if training or time.monotonic() > deadline:
                doing = "is training there now" if training else f"has held it for over {wait_s:.0f} s"
                raise Failure(
                    description=f"GRPO training: Dagster run {holder.get('dagster_run_id')} (run worker PID {holder.get('pid')} on "
                    f"{holder.get('host')}) holds {scratch} and {doing}; this attempt refuses to train the same run twice. "
                    "Wait for that run to end (re-execute it if it fails) or terminate it."
                ) from None
            time.sleep(0.2)


def lock_record(handle: IO[str]) -> dict:
    """What the lock file names (empty while a holder rewrites it, or before any did)."""
    handle.seek(0)
    try:
        return json.loads(handle.read() or "{}")
    except ValueError:
        return {}


def on_this_host(record: dict) -> bool:
    """The record's process ids are this host's (a record without a host is an older local launcher's)."""
    return record.get("host", socket.gethostname()) == socket.gethostname()


def stop_abandoned_training(earlier: dict, scratch: Path, grace_s: float, warn: Callable[[str], None]) -> None:
    """Stop the training a dead earlier attempt left running on ``scratch`` (its run worker killed where its
    parent-death signal did not reach torchrun), named in the lock. Only the lock's holder calls it, so that
    attempt is gone; a process group that is not this scratch folder's training is left alone."""
    if earlier.get("pgid") and on_this_host(earlier) and stop_group(earlier["pgid"], scratch, grace_s):
        warn(
            f"stopped the training an earlier attempt left running on {scratch} (Dagster run {earlier.get('dagster_run_id')}, "
            f"run worker PID {earlier.get('pid')}, process group {earlier['pgid']})"
        )


def stop_group(pgid: int, scratch: Path, grace_s: float, process: Popen | None = None) -> bool:
    """Stop the training of process group ``pgid`` (torchrun's) on ``scratch`` and every process under it (its
    ranks, which torchrun puts in groups of their own): SIGTERM, then SIGKILL after ``grace_s``; returns once
    they are gone, False when there was no such training (a recycled group id is left alone).
    ``process``: torchrun when it is this process's child (reaped here)."""
    pids = training_tree(pgid, scratch)
    if not pids:
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if process is not None:
                process.poll()
            if not any(_alive(pid) for pid in pids):
                return True
            time.sleep(0.1)
    raise Failure(description=f"GRPO training: could not stop processes {[pid for pid in pids if _alive(pid)]} of process group {pgid}")


def training_tree(pgid: int, scratch: Path) -> list[int]:
    """Live processes of group ``pgid`` and all their descendants; empty unless one of them is torchrun or a
    training rank on ``scratch`` (its command line, and :data:`SCRATCH_ENV` in its environment): a recycled
    id, or another run's training, is not ours. Linux ``/proc``; empty elsewhere."""
    table: dict[int, tuple[int, int]] = {}  # pid -> (parent, group) of live processes
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
            state, parent, group = stat[stat.rindex(")") + 2 :].split()[:3] if stat else ("Z", 0, 0)
        except (OSError, ValueError):
            continue
        if state != "Z":
            table[int(entry)] = (int(parent), int(group))
    tree = {pid for pid, (_, group) in table.items() if group == pgid}
    while grown := {pid for pid, (parent, _) in table.items() if parent in tree} - tree:
        tree |= grown
    marker = f"{SCRATCH_ENV}={scratch.resolve()}".encode()
    return sorted(tree) if any(_is_training(pid, marker) for pid in tree) else []


def _is_training(pid: int, marker: bytes) -> bool:
    try:
        proc = Path(f"/proc/{pid}")
        return any(m in (proc / "cmdline").read_bytes() for m in TRAINING_MARKERS) and marker in (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def training_failure(err: object, scratch: Path, nproc: int) -> Failure:
    """A failed run: what the orchestrator saw, then each rank's account from the scratch folder."""
    report = rank_errors(scratch, nproc)
    hint = " (set restart: true to start it afresh)" if "cannot resume" in report else ""
    return Failure(description=f"GRPO training failed{hint} ({err}):\n{report}")


def check_digests(scratch: Path, nproc: int) -> None:
    """Every rank left the same final weights digest, or the run fails."""
    digests = {path.stem: path.read_text() for path in sorted((scratch / "digests").glob("rank-*.txt"))}
    if len(digests) != nproc or len(set(digests.values())) != 1:
        raise Failure(description=f"GRPO training: the ranks' final weights differ or are missing: {digests}")


def rank_errors(scratch: Path, nproc: int) -> str:
    """Each rank's account: those that died without a word (killed by a signal, out of memory), the
    tracebacks of those that failed, those stopped (SIGTERM) after another failed, those that finished."""

    def ranks(folder: str, pattern: str) -> dict[int, Path]:
        return {int(path.name.split("-")[1].split(".")[0]): path for path in (scratch / folder).glob(pattern)}

    texts = {rank: path.read_text()[-4000:] for rank, path in ranks("errors", "rank-*.txt").items()}
    stopped, finished = sorted(ranks("errors", "rank-*.stopped")), sorted(ranks("digests", "rank-*.txt"))
    silent = [rank for rank in range(nproc) if rank not in texts and rank not in stopped and rank not in finished]
    lines = [f"rank(s) {silent} died without leaving an error (killed by a signal, or out of memory?)"] if silent else []
    lines += [f"--- rank {rank} ---\n{text}" for rank, text in sorted(texts.items())]
    lines += [f"rank(s) {stopped} stopped (SIGTERM, after another rank failed or the run was stopped)"] if stopped else []
    return "\n".join(lines + ([f"rank(s) {finished} finished"] if finished else []))
