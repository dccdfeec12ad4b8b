"""GRPO through the torchrun/Pipes launcher against the in-process run it replaced, and 1 vs 2 processes.

    python bench/training_launcher.py .rlvr/models/base_policy/<version> [--steps 4] [--gsm8k <folder of train.jsonl/test.jsonl>]

One invocation, same problems and config (the ``default`` profile: the embedded default run of
``make run``): (a) ``train_grpo`` called in this process, as the asset did before the launcher
(imports already paid, as in a Dagster step process); (b) ``TrainingLauncher.train`` inside a
materialized asset with ``nproc`` 1, then 2 (torchrun start, worker imports, model load, Pipes and
the per-step Parquet files included). Prints wall time of the training call and mean completion
tokens/s of steps 2.. for each.
"""

import argparse
import tempfile
import time
from pathlib import Path

from dagster import AssetExecutionContext, DagsterInstance, MaterializeResult, asset, materialize

from resources.launcher import TrainingJob, TrainingLauncher
from rlvr.grpo.profiles import build_config
from rlvr.settings import Settings
from rlvr.tasks.gsm8k import REWARDS as GSM8K_REWARDS
from rlvr.tasks.gsm8k.dataset import load_local
from rlvr.training_run import train_grpo


def through_launcher(checkpoint: Path, rows: list[dict], config, nproc: int, scratch: Path) -> tuple[float, list[dict]]:
    timing: dict = {}

    @asset
    def bench_training(context: AssetExecutionContext) -> MaterializeResult:
        job = TrainingJob("bench", checkpoint, rows, config, GSM8K_REWARDS, scratch, "cpu" if nproc == 1 else None)
        started = time.perf_counter()
        timing["history"] = TrainingLauncher().train(context, job, nproc)
        timing["wall"] = time.perf_counter() - started
        return MaterializeResult()

    with DagsterInstance.ephemeral() as instance:
        assert materialize([bench_training], instance=instance).success
    return timing["wall"], [metrics for _, metrics in timing["history"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gsm8k", type=Path, default=Settings.from_env().gsm8k_dir)
    args = parser.parse_args()
    rows = [p.as_row() for p in load_local(args.gsm8k) if p.split == "train"][:200]
    config = build_config("default", {"total_steps": args.steps, "checkpoint_every": 0})
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        trained = train_grpo(args.checkpoint, rows, config, GSM8K_REWARDS, Path(tmp) / "in-process", "cpu")
        results.append(("in process (before the launcher)", time.perf_counter() - started, trained.history))
        for nproc in (1, 2):
            wall, history = through_launcher(args.checkpoint, rows, config, nproc, Path(tmp) / f"launcher-{nproc}")
            results.append((f"launcher, nproc {nproc}", wall, history))
    print(
        f"\n{args.steps} steps of the default profile ({config.prompts_per_step} prompts x {config.group_size} x "
        f"{config.sampling.max_new_tokens} tokens), {args.checkpoint}\n"
    )
    print("| run | wall s | completion tokens/s, steps 2.. | step s, steps 2.. |")
    print("|---|---|---|---|")
    for name, wall, history in results:
        later = history[1:] or history
        tokens = sum(m["tokens_per_s"] for m in later) / len(later)
        step = sum(m["step_time_s"] for m in later) / len(later)
        print(f"| {name} | {wall:.1f} | {tokens:.1f} | {step:.2f} |")


if __name__ == "__main__":
    main()
