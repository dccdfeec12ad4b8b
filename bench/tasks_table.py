"""Print docs/benchmarks.md's "Tasks" tables from a finished ``bench/tasks.sh`` ($RLVR_HOME).

Recomputes every number from the per-problem rows in DuckDB (``eval_results``) with the core functions
the assets use (``cross_task_table``), and reads the mixture run's per-task curves and step times from
MLflow. ``--grading-per-s`` (``bench/code_grading.py``'s figure) adds the share of a step that grading
that many code completions would take beside the run's own rollouts.
"""

import argparse

import duckdb

from resources import MLflowResource, ModelStore, Settings
from rlvr.evaluation.cross_task import cross_task_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--grading-per-s", type=float, help="sandboxed code completions graded per second on this machine")
    args = parser.parse_args()
    settings = Settings.from_env()
    store = ModelStore(root=str(settings.model_root))
    base, trained = store.latest("base_policy"), store.latest("grpo_checkpoint")
    with duckdb.connect(str(settings.duckdb_path), read_only=True) as conn:
        frame = conn.execute(
            "SELECT task, policy_version, problem_id, correct_strict, score, grading_error FROM eval_results WHERE policy_version IN (?, ?)",
            [base.version, trained.version if trained else ""],
        ).df()
    evaluations = {}
    print(f"\nbase {base.version}, trained {trained.version if trained else '-'}")
    print("| task | problems | base pass@1 (95% CI) | base partial credit | grading errors |")
    print("|---|---|---|---|---|")
    for task, rows in frame[frame.policy_version == base.version].groupby("task", sort=False):
        table = cross_task_table({task: (rows.to_dict("records"), rows.to_dict("records"))})[0]
        print(
            f"| {task} | {len(rows)} | {table['base']:.1%} [{table['base_ci_low']:.1%}, {table['base_ci_high']:.1%}] | "
            f"{rows.score.mean():.3f} | {int(rows.grading_error.notna().sum())} |".replace("nan", "-")
        )
        if trained is not None:
            after = frame[(frame.policy_version == trained.version) & (frame.task == task)]
            if len(after):
                evaluations[task] = (rows.to_dict("records"), after.to_dict("records"))
    if evaluations:
        print("\n| task | base pass@1 | trained pass@1 | Δ (95% CI) | McNemar p |")
        print("|---|---|---|---|---|")
        for r in cross_task_table(evaluations):
            p = f"{r['mcnemar_p_value']:.3f}" if r["mcnemar_p_value"] is not None else f"{r['paired_bootstrap_p_value']:.3f} (bootstrap)"
            print(f"| {r['task']} | {r['base']:.1%} | {r['trained']:.1%} | {r['delta']:+.1%} [{r['delta_ci_low']:+.1%}, {r['delta_ci_high']:+.1%}] | {p} |")
    if trained is not None:
        training_curves(trained.manifest["mlflow_run_id"], settings, args.grading_per_s)


def training_curves(run_id: str, settings: Settings, grading_per_s: float | None) -> None:
    """The mixture run's per-task accuracy and reward by step, and its step-time split."""
    client = MLflowResource(tracking_uri=settings.mlflow_tracking_uri).client()
    run = client.get_run(run_id)
    tasks = sorted({key.split("/")[1] for key in run.data.metrics if key.startswith("task/")})
    mixture = {k.removeprefix("tasks."): float(v) for k, v in run.data.params.items() if k.startswith("tasks.")}
    print(f"\nmixture run {run_id}: {mixture}")
    for task in tasks:
        for metric in ("groups", "accuracy", "reward_mean"):
            history = client.get_metric_history(run_id, f"task/{task}/{metric}")
            print(f"  {task} {metric} by step: {', '.join(f'{m.step}:{m.value:.3g}' for m in sorted(history, key=lambda m: m.step))}")
    times = {name: [m.value for m in client.get_metric_history(run_id, name)] for name in ("gen_time_s", "reward_time_s", "update_time_s", "tokens_per_s")}
    steps = len(times["gen_time_s"])
    mean = {name: sum(values) / max(len(values), 1) for name, values in times.items()}
    print(
        f"  {steps} steps, mean per step: rollout {mean['gen_time_s']:.1f} s, reward {mean['reward_time_s']:.2f} s, "
        f"update {mean['update_time_s']:.1f} s; {mean['tokens_per_s']:.0f} tok/s"
    )
    if grading_per_s:
        params = run.data.params
        completions = int(params["grpo.prompts_per_step"]) * int(params["grpo.group_size"])
        grading = completions / grading_per_s
        step = mean["gen_time_s"] + mean["update_time_s"] + grading
        print(f"  grading {completions} code completions at {grading_per_s:.1f}/s: {grading:.1f} s, {grading / step:.0%} of such a step")


if __name__ == "__main__":
    main()
