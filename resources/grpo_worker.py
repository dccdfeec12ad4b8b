"""The GRPO training job :class:`resources.launcher.TrainingLauncher` starts through Dagster Pipes.

``torchrun --nproc_per_node N -m resources.grpo_worker``: every rank trains (``train_grpo``) and writes
its rows of each step as Parquet files in the run's scratch folder; rank 0 streams logs to the Dagster
event log, keeps each step's metrics as ``steps/metrics-step<n>.json`` and exports the checkpoint. Every
rank measures its steps (:class:`StepCosts`). A step's rows, metrics and costs are on disk before its
resume point. A budget stop (:func:`budget_stop`) keeps the step's checkpoint, exports nothing and leaves
its reason in ``stopped.json``. A failed rank leaves its traceback in ``errors/rank-<r>.txt``
(``.stopped`` when stopped by SIGTERM), a finished one its weights digest.
Every rank dies with torchrun. The job comes as the Pipes extras (``TrainingJob.extras``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import traceback
from pathlib import Path

from dagster_pipes import PipesContext, PipesDefaultContextLoader, PipesEnvVarParamsLoader, open_dagster_pipes

from rlvr.costs import Prices, Usage, UsageMeter
from rlvr.costs.budget import Budget, Spend, spend_of
from rlvr.environments import make_environment
from rlvr.files import write_atomically
from rlvr.grpo import GRPOConfig
from rlvr.rewards import load_pickled_reward
from rlvr.training_run import start_training_process, task_usages, train_grpo, training_tables

STOPPED_FILE = "stopped.json"  # in the scratch folder: {"step", "reason"} of a run its stop hook (budget) ended early


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    start_training_process()  # torchrun killed (its run worker killed): this rank goes too, no orphan trains on
    signal.signal(signal.SIGTERM, _stopped)  # torchrun stops every rank when one fails: say so, not die silently
    if rank == 0:
        with open_dagster_pipes() as pipes:
            stop = _run_unless_stopped(dict(pipes.extras), rank, pipes)
        if stop is not None:  # raised once the Pipes session closed: a stopped rank is reported as stopped, not as an error
            raise stop
    else:  # other ranks read the same job, and report nothing (one voice in the event log)
        with PipesDefaultContextLoader().load_context(PipesEnvVarParamsLoader().load_context_params()) as data:
            extras = dict(data["extras"])
        _run(extras, rank, None)


def _run_unless_stopped(job: dict, rank: int, pipes: PipesContext) -> Stopped | None:
    """:func:`_run`; its :class:`Stopped`, if it was stopped, returned rather than raised."""
    try:
        _run(job, rank, pipes)
    except Stopped as stop:
        return stop
    return None


def _run(job: dict, rank: int, pipes: PipesContext | None) -> None:
    scratch = Path(job["scratch"])
    try:
        _train(job, rank, scratch, pipes)
    except BaseException as error:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's stop must not cut the report short
        errors = scratch / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        stopped = isinstance(error, Stopped)  # ended because another rank failed, or the run was stopped: not to blame
        write_atomically(errors / f"rank-{rank}.{'stopped' if stopped else 'txt'}", traceback.format_exc())
        if pipes is not None and stopped:
            pipes.log.warning(f"rank {rank} stopped: {error}")
        elif pipes is not None:
            pipes.log.error(f"rank {rank} failed:\n{traceback.format_exc()}")
        raise


def _train(job: dict, rank: int, scratch: Path, pipes: PipesContext | None) -> None:
    import pandas as pd

    for payload in job["reward_payloads"].values():
        load_pickled_reward(base64.b64decode(payload), register=True)
    config = GRPOConfig(**job["config"])
    rows = pd.read_parquet(job["problems"]).to_dict(orient="records")
    steps = scratch / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    costs = StepCosts(steps, rank, job.get("attempt_id") or job["run_id"], gpus=_gpus(job.get("device")))

    def on_step(step: int, metrics: dict, records: list[dict]) -> None:
        costs.record(step, records)
        rollouts, rewards, tool_calls = training_tables(records, job["run_id"], job["rewards"])
        for name, frame in (("rollouts", rollouts), ("rewards", rewards), ("tool_calls", tool_calls)):
            write_atomically(steps / f"{name}-step{step:06d}-rank{rank:03d}.parquet", frame.to_parquet(None, index=False))
        if rank == 0:  # the run's curve: the launcher streams it to MLflow, whole on a resumed run
            numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            write_atomically(steps / f"metrics-step{step:06d}.json", json.dumps(numbers))
        if pipes is not None:
            pipes.log.info(
                f"step {step}/{config.total_steps}: reward {metrics['reward_mean']:.3f}, loss {metrics['loss']:.4f}, "
                f"zero-variance groups {metrics['frac_zero_variance_groups']:.0%}, {metrics['tokens_per_s']:.0f} tok/s{task_summary(metrics)}"
            )

    spec = job.get("environment") or {"name": "single_turn", "options": {}}
    environment = make_environment(spec["name"], **spec["options"])
    trained = train_grpo(
        Path(job["start"]),
        rows,
        config,
        job["rewards"],
        Path(job["checkpoint_dir"]),
        job.get("device"),
        on_step,
        records_per_rank=True,
        environment=environment,
        tasks=job.get("tasks"),
        should_stop=budget_stop(Budget.from_dict(job["budget"]), steps, rank) if job.get("budget") else None,
    )
    costs.close()
    digests = scratch / "digests"
    digests.mkdir(parents=True, exist_ok=True)
    write_atomically(digests / f"rank-{rank}.txt", weights_digest(trained.policy))
    if rank == 0 and trained.stopped is not None:
        write_atomically(scratch / STOPPED_FILE, json.dumps({"step": trained.steps, "reason": trained.stopped}))
    elif rank == 0:
        export = Path(job["export_dir"])
        tmp = export.with_name(export.name + ".tmp")
        for stale in (tmp, export):  # an earlier attempt's, left by a kill
            shutil.rmtree(stale, ignore_errors=True)
        trained.export(tmp)
        os.replace(tmp, export)


class StepCosts:
    """What each step used on this rank (its process tree: the reward workers too), from the end of the step
    before (the start of training for the first), split over the step's tasks (:func:`task_usages`) and written
    as ``costs-step<n>-rank<r>.json`` with the Dagster run (``attempt_id``) that ran it."""

    def __init__(self, steps: Path, rank: int, attempt_id: str, gpus: int):
        self.steps, self.rank, self.attempt_id, self.gpus = steps, rank, attempt_id, gpus
        self.meter = UsageMeter(gpus).__enter__()

    def record(self, step: int, records: list[dict]) -> None:
        self.close()
        tasks = {task: usage.as_dict() for task, usage in task_usages(self.meter.usage, records).items()}
        self.meter = UsageMeter(self.gpus).__enter__()
        body = {"run_id": self.attempt_id, "step": step, "rank": self.rank, "tasks": tasks}
        write_atomically(self.steps / f"costs-step{step:06d}-rank{self.rank:03d}.json", json.dumps(body))

    def close(self) -> None:
        self.meter.__exit__(None, None, None)


def step_costs(steps: Path, rank: int | None = None) -> list[dict]:
    """The cost files in ``steps`` (one rank's, or all), in step order; each task's usage as a :class:`Usage`."""
    files = sorted(steps.glob(f"costs-step*-rank{'*' if rank is None else f'{rank:03d}'}.json"))
    entries = [json.loads(path.read_text()) for path in files]
    return [{**entry, "tasks": {task: Usage(**usage) for task, usage in entry["tasks"].items()}} for entry in entries]


def run_spend(steps: Path, prices: Prices, rank: int | None = None) -> Spend:
    """The spend of the cost files in ``steps`` (one rank's, or all) at ``prices``."""
    return spend_of((usage for entry in step_costs(steps, rank) for usage in entry["tasks"].values()), prices)


def budget_stop(budget: Budget, steps: Path, rank: int):
    """The stop hook of a run with ``budget``: after a step, the run's spend (every rank's cost files, earlier
    attempts' included; each rank's summed by an all-reduce, so every rank answers the same) against it."""
    import torch

    from rlvr.grpo.distributed import all_reduce_sum, init_distributed

    def should_stop(step: int) -> str | None:
        own = torch.tensor(run_spend(steps, budget.prices, rank).as_tuple(), dtype=torch.float64)
        return budget.reached(Spend(*all_reduce_sum(own, init_distributed()).tolist()))

    return should_stop


def _gpus(device: str | None) -> int:
    """GPUs a rank holds: one when it trains on CUDA (its own device under torchrun), else none."""
    import torch

    return int(torch.cuda.is_available() and (device is None or str(device).startswith("cuda")))


def task_summary(metrics: dict) -> str:
    """A mixture step's per-task results for the event log ('' for a single task): groups, reward, accuracy."""
    tasks = sorted({key.split("/")[1] for key in metrics if key.startswith("task/")})
    if len(tasks) < 2:
        return ""
    parts = []
    for task in tasks:
        accuracy = metrics.get(f"task/{task}/accuracy")
        found = f"{task}: {metrics[f'task/{task}/groups']} groups, reward {metrics[f'task/{task}/reward_mean']:.3f}"
        parts.append(found + (f", accuracy {accuracy:.0%}" if accuracy is not None else ""))
    return "; " + "; ".join(parts)


def weights_digest(model) -> str:
    """SHA-256 of every parameter's bytes, in order: equal on every rank of a healthy DDP run."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


class Stopped(SystemExit):
    """SIGTERM: torchrun ends every rank once one of them fails; the launcher ends a cancelled run."""


def _stopped(signum: int, frame) -> None:
    raise Stopped(f"stopped by signal {signum} (torchrun after another rank failed, or the launcher)")


if __name__ == "__main__":
    main()
