"""The platform's own overhead: the same GRPO steps through Dagster against the bare trainer loop.

    python bench/framework_overhead.py [--home .rlvr] [--steps 4] [--repeats 2]

``--home``: a data directory holding a ``base_policy`` (after ``make run``). In a fresh data directory of
its own, one invocation alternates (a) the bare loop: ``train_grpo`` in this process on the train split,
then the export, and (b) the ``grpo_training`` asset materialized on a Dagster instance with its real
resources (Pipes launch of torchrun, the per-step rows, the cost ledger, DuckDB writes, MLflow logging,
the checkpoint stored as a model version). Same profile, problems and seed. Prints wall seconds per
phase, each arm's median, and the overhead as a share of the bare loop's time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, also as `python bench/x.py`


@contextmanager
def timed_methods(timings: dict, targets: dict):
    """Time every call of ``targets`` ({label: (class, method name)}) into ``timings[label]`` while inside."""
    originals = {label: getattr(cls, name) for label, (cls, name) in targets.items()}

    def timer(label, original):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timings[label] = timings.get(label, 0.0) + time.perf_counter() - started

        return wrapper

    for label, (cls, name) in targets.items():
        setattr(cls, name, timer(label, originals[label]))
    try:
        yield
    finally:
        for label, (cls, name) in targets.items():
            setattr(cls, name, originals[label])


def bare_loop(base: Path, rows: list[dict], config, rewards: dict, work: Path) -> dict:
    """``train_grpo`` and the export, timed: the loop a user would write around the trainer."""
    from rlvr.training_run import train_grpo

    started = time.perf_counter()
    trained = train_grpo(base, rows, config, rewards, work / "checkpoints", "cpu")
    trained_at = time.perf_counter()
    trained.export(work / "export")
    ended = time.perf_counter()
    steps = sum(m["step_time_s"] for m in trained.history)
    return {"total": ended - started, "steps": steps, "load + checkpoints": trained_at - started - steps, "export": ended - trained_at}


def through_dagster(instance, resources: dict, run_config: dict) -> dict:
    """The ``grpo_training`` asset materialized, its phases timed: the launcher's call (of which the steps),
    the warehouse writes, the model store, and the rest (Dagster, MLflow, the ledger, the asset's own reads)."""
    from dagster import materialize

    from resources import ModelStore, Warehouse
    from resources.launcher import TrainingLauncher
    from rlvr_assets.training import grpo_training

    timings: dict = {}
    history: list = []
    original_train = TrainingLauncher.train

    def train(self, *args, **kwargs):
        found = original_train(self, *args, **kwargs)
        history.extend(found)
        return found

    targets = {"launcher": (TrainingLauncher, "train"), "duckdb writes": (Warehouse, "write"), "model store": (ModelStore, "put")}
    TrainingLauncher.train = train
    try:
        with timed_methods(timings, targets):
            started = time.perf_counter()
            result = materialize([grpo_training], resources=resources, run_config=run_config, instance=instance, raise_on_error=True)
            total = time.perf_counter() - started
    finally:
        TrainingLauncher.train = original_train
    assert result.success
    steps = sum(metrics["step_time_s"] for _, metrics in history)
    return {
        "total": total,
        "steps": steps,
        "launch + load + checkpoints + export": timings["launcher"] - steps,
        "duckdb writes": timings.get("duckdb writes", 0.0),
        "model store": timings.get("model store", 0.0),
        "dagster + mlflow + ledger": total - timings["launcher"] - timings.get("duckdb writes", 0.0) - timings.get("model store", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path(".rlvr"), help="a data directory with a base_policy (after make run)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    source = (args.home / "models" / "base_policy").resolve()
    if not source.is_dir():
        sys.exit(f"{source}: no base_policy; run `make run` first or pass --home")
    print(f"load average before: {os.getloadavg()[0]:.2f}")

    work = Path(tempfile.mkdtemp(prefix="framework-overhead-"))
    os.environ["RLVR_HOME"] = str(work / "home")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    from dagster import DagsterInstance, materialize

    from rlvr.grpo.profiles import build_config
    from rlvr.settings import Settings
    from rlvr.tasks import DEFAULT_TASK, get_task
    from rlvr_assets.data import gsm8k_problems
    from rlvr_assets.resources import default_resources

    settings = Settings.from_env().ensure()
    (settings.model_root).mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, settings.model_root / "base_policy", symlinks=True)
    resources = default_resources(settings)
    (work / "dagster").mkdir()
    with DagsterInstance.local_temp(str(work / "dagster")) as instance:
        assert materialize([gsm8k_problems], resources=resources, instance=instance).success
        rows = resources["duckdb"].task_problems(DEFAULT_TASK, "train")
        base = resources["model_store"].require("base_policy").path
        overrides = {"total_steps": args.steps}
        config = build_config("default", overrides)
        run_config = {"ops": {"grpo_training": {"config": {"overrides": overrides}}}}
        results: dict[str, list[dict]] = {"bare loop": [], "dagster": []}
        for repeat in range(args.repeats):
            results["bare loop"].append(bare_loop(base, rows, config, dict(get_task(DEFAULT_TASK).rewards), work / f"bare-{repeat}"))
            results["dagster"].append(through_dagster(instance, resources, run_config))
            print(f"repeat {repeat}: bare {results['bare loop'][-1]['total']:.1f} s, dagster {results['dagster'][-1]['total']:.1f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)

    shape = f"{config.prompts_per_step} prompts x {config.group_size} x {config.sampling.max_new_tokens} tokens"
    print(f"\n{args.steps} steps of the default profile ({shape}), median of {args.repeats}\n")
    print("| arm | phase | wall s |\n|---|---|---|")
    medians = {}
    for arm, runs in results.items():
        for phase in runs[0]:
            medians[(arm, phase)] = statistics.median(run[phase] for run in runs)
            print(f"| {arm} | {phase} | {medians[(arm, phase)]:.1f} |")
    bare, dagster = medians[("bare loop", "total")], medians[("dagster", "total")]
    outside = {arm: medians[(arm, "total")] - medians[(arm, "steps")] for arm in results}
    added = outside["dagster"] - outside["bare loop"]
    print(f"\noverhead, all of it: {dagster - bare:+.1f} s = {(dagster - bare) / bare:+.1%} of the bare loop's time (step times vary run to run)")
    print(f"outside the steps: bare {outside['bare loop']:.1f} s, Dagster {outside['dagster']:.1f} s", end=": ")
    print(f"{added:+.1f} s per run = {added / bare:.1%} of the bare loop's time")
    ratios = [d["steps"] / b["steps"] for b, d in zip(results["bare loop"], results["dagster"])]
    print(f"steps, Dagster / bare per repeat: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
