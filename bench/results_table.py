"""Print the result tables of docs/results.md from a finished pipeline run ($RLVR_HOME).

Recomputes every number from the per-problem rows in DuckDB (``eval_results``) with the same core
functions the ``eval_report`` asset uses, and reads the training run's budget from MLflow.
"""

from collections import Counter

import duckdb
from dagster import AssetKey, DagsterInstance

from resources import MLflowResource, Settings
from rlvr.evaluation.runner import EvalConfig, compare, summarize


def main() -> None:
    settings = Settings.from_env()
    meta = DagsterInstance.get().get_latest_materialization_event(AssetKey("eval_report")).asset_materialization.metadata
    with duckdb.connect(str(settings.duckdb_path), read_only=True) as conn:

        def rows(eval_id):
            return conn.execute("SELECT * FROM eval_results WHERE eval_id = ? ORDER BY problem_id", [eval_id]).df().to_dict("records")

        base, trained = rows(meta["base_eval_id"].value), rows(meta["trained_eval_id"].value)
        source = conn.execute("SELECT any_value(source), count(*) FILTER (split = 'train') FROM gsm8k_problems").fetchone()
        curve = conn.execute(  # the training run's mean reward per reward function, per block of 10 steps
            "SELECT reward_name, list(round(value, 3) ORDER BY block) FROM (SELECT reward_name, (step - 1) // 10 AS block, "
            "avg(value) AS value FROM rewards WHERE run_id = (SELECT max_by(run_id, step) FROM rollouts) GROUP BY ALL) GROUP BY 1"
        ).fetchall()
    config = EvalConfig(**{k: v for k, v in meta["protocol"].value.items() if k in ("max_new_tokens", "seed", "num_samples", "ks")})
    b, t, paired = summarize(base, config), summarize(trained, config), compare(base, trained)
    client = MLflowResource(tracking_uri=settings.mlflow_tracking_uri).client()
    experiments = [e.experiment_id for e in client.search_experiments()]
    run = client.search_runs(experiments, "tags.`rlvr.kind` = 'training'", order_by=["attributes.start_time DESC"])[0]
    steps = client.get_metric_history(run.info.run_id, "step_time_s")
    params = run.data.params
    print(f"\nsource {source[0]} ({source[1]} train problems); policy {meta['policy_version'].value}")
    print(
        f"training: {len(steps)} GRPO steps x {params['grpo.prompts_per_step']} prompts x {params['grpo.group_size']} "
        f"completions, max {params['grpo.sampling.max_new_tokens']} new tokens, lr {params['grpo.lr']}, rewards "
        f"{ {k.removeprefix('rewards.'): float(v) for k, v in params.items() if k.startswith('rewards.')} }: "
        f"{sum(m.value for m in steps) / 60:.1f} min of steps"
    )
    print(f"\nevaluation on {paired['shared_problems']} held-out problems, greedy, max {config.max_new_tokens} new tokens\n")
    print("| metric | base | trained |\n|---|---|---|")
    for name in ("pass@1_strict", "pass@1_flexible"):
        print(
            f"| {name} (95% CI) | {b[name]:.1%} [{b[name + '_ci_low']:.1%}, {b[name + '_ci_high']:.1%}] "
            f"| {t[name]:.1%} [{t[name + '_ci_low']:.1%}, {t[name + '_ci_high']:.1%}] |"
        )
    for name in ("format_compliance", "truncation_rate"):
        print(f"| {name} | {b[name]:.1%} | {t[name]:.1%} |")
    print(f"| mean completion tokens | {b['mean_completion_tokens']:.1f} | {t['mean_completion_tokens']:.1f} |")
    for name in sorted(k for k in t if k.startswith(("pass@", "maj@")) and "_" not in k):
        print(f"| {name} (n={config.num_samples}, strict) | {b[name]:.1%} | {t[name]:.1%} |")
    print(
        f"\nstrict pass@1 difference {paired['delta']:+.1%} (95% CI {paired['delta_ci_low']:+.1%} to {paired['delta_ci_high']:+.1%}); "
        f"McNemar p = {paired['mcnemar_p_value']:.3g} ({paired['mcnemar_method']}); paired bootstrap p = "
        f"{paired['paired_bootstrap_p_value']:.3g}; solved only by trained {paired['new_only_correct']}, only by base {paired['base_only_correct']}"
    )
    flexible = compare([dict(r, correct_strict=r["correct_flexible"]) for r in base], [dict(r, correct_strict=r["correct_flexible"]) for r in trained])
    print(
        f"flexible pass@1 difference {flexible['delta']:+.1%} (95% CI {flexible['delta_ci_low']:+.1%} to "
        f"{flexible['delta_ci_high']:+.1%}); McNemar p = {flexible['mcnemar_p_value']:.3g}"
    )
    for role, rows_ in (("base", base), ("trained", trained)):
        answers = Counter(r["extracted_flexible"] for r in rows_)
        top, count = answers.most_common(1)[0]
        print(f"{role}: {len(answers)} distinct answers (flexible); most common {top!r} on {count / len(rows_):.1%} of problems")
    print("\ntraining reward per block of 10 steps: " + "; ".join(f"{name} {values}" for name, values in sorted(curve)))


if __name__ == "__main__":
    main()
