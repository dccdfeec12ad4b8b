"""Print the result tables of docs/results.md from a finished pipeline run ($RLVR_HOME).

Recomputes every number from the per-problem rows in DuckDB (``eval_results``) with the same core
functions the ``eval_report`` asset uses, and reads the training run's budget from MLflow. When
the run started from an SFT policy whose ``policy_evaluation`` used the same protocol, the table
has three columns (base, SFT, SFT+GRPO) and the paired tests compare each stage with the one before.

``--against DIR`` adds the trained policy of another experiment's data directory (e.g. the same
budget without tools) on the same problems, first, and pairs this run's trained policy with it.
"""

import argparse
from collections import Counter
from pathlib import Path

import duckdb
from dagster import AssetKey, DagsterInstance

from resources import MLflowResource, ModelStore, Settings
from rlvr.answers import answers_match, parse_number
from rlvr.environments.calculator import annotation_results
from rlvr.evaluation.runner import EvalConfig, compare, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--against", type=Path, help="another experiment's data directory ($RLVR_HOME): its trained policy, paired with this one's")
    args = parser.parse_args()
    settings = Settings.from_env()
    meta = DagsterInstance.get().get_latest_materialization_event(AssetKey("eval_report")).asset_materialization.metadata
    with duckdb.connect(str(settings.duckdb_path), read_only=True) as conn:
        gold = dict(conn.execute("SELECT problem_id, answer_value FROM gsm8k_problems").fetchall())
        base, trained = evaluation_rows(conn, meta["base_eval_id"].value), evaluation_rows(conn, meta["trained_eval_id"].value)
        sft = sft_rows(conn, trained, settings)
        whole = widest_shared_evaluation(conn, [r[0]["policy_version"] for r in (base, sft, trained) if r], len(trained))
        against = paired_against(conn, trained[0]["policy_version"], args.against, [r["problem_id"] for r in trained]) if args.against else []
        source = conn.execute("SELECT any_value(source), count(*) FILTER (split = 'train') FROM gsm8k_problems").fetchone()
        curve = conn.execute(  # the training run's mean reward per reward function, per block of 10 steps
            "SELECT reward_name, list(round(value, 3) ORDER BY block) FROM (SELECT reward_name, (step - 1) // 10 AS block, "
            "avg(value) AS value FROM rewards WHERE run_id = (SELECT max_by(run_id, step) FROM rollouts) GROUP BY ALL) GROUP BY 1"
        ).fetchall()
    config = EvalConfig(**{k: v for k, v in meta["protocol"].value.items() if k in ("max_new_tokens", "seed", "num_samples", "ks")})
    stages = [("base", base)] + ([("SFT", sft)] if sft else []) + [("SFT+GRPO" if sft else "trained", trained)]
    client = MLflowResource(tracking_uri=settings.mlflow_tracking_uri).client()
    experiments = [e.experiment_id for e in client.search_experiments()]
    run = client.search_runs(experiments, "tags.`rlvr.kind` = 'training'", order_by=["attributes.start_time DESC"])[0]
    steps = client.get_metric_history(run.info.run_id, "step_time_s")
    params = run.data.params
    print(f"\nsource {source[0]} ({source[1]} train problems); policy {meta['policy_version'].value}")
    rewards = [k.removeprefix("rewards.") for k in params if k.startswith("rewards.")]
    print(
        f"training: {len(steps)} GRPO steps x {params['grpo.prompts_per_step']} prompts x {params['grpo.group_size']} "
        f"completions, max {params['grpo.sampling.max_new_tokens']} new tokens, lr {params['grpo.lr']}, rewards "
        f"{ {name: float(params['rewards.' + name]) for name in rewards} }: {sum(m.value for m in steps) / 60:.1f} min of steps"
    )
    costs = {k: v.value for k, v in meta.items() if k.startswith("training") and ("cost" in k or "per point" in k)}  # the ledger's (docs/costs.md)
    print("  cost: " + ("; ".join(f"{k} {v}" for k, v in costs.items()) or "not recorded (a run from before the cost ledger)"))
    for metric in [f"reward_{name}_mean" for name in sorted(rewards)] + ["frac_groups_kept"]:
        print(f"  GRPO {metric} per step: {metric_curve(client, run.info.run_id, metric)}")
    if sft:
        sft_run = client.search_runs(experiments, "tags.`rlvr.kind` = 'sft'", order_by=["attributes.start_time DESC"])[0]
        losses = metric_curve(client, sft_run.info.run_id, "loss")
        p = sft_run.data.params
        print(
            f"SFT: {len(losses)} steps x {p['sft.batch_size']} solutions, lr {p['sft.lr']}, max {p['sft.max_completion_tokens']} target tokens; "
            f"{(sft_run.info.end_time - sft_run.info.start_time) / 60000:.1f} min; loss per step {losses}"
        )
    print(f"\nevaluation on {len(trained)} held-out problems, greedy, max {config.max_new_tokens} new tokens\n")
    print_table(stages, config)
    print_calculator_use(stages, gold)
    for other, mine in against:
        print(f"\nthis run's trained policy against {args.against}'s, on the same {len(mine)} problems\n")
        print_table([(f"{args.against.name} trained", other), (f"{settings.home.name} trained", mine)], config)
        print_calculator_use([(f"{settings.home.name} trained", mine)], gold)
    if whole:
        print(f"\nthe same policies on {len(whole[0])} problems of the {whole[0][0]['split']} split (their policy_evaluation partitions)\n")
        print_table([(label, rows_) for (label, _), rows_ in zip(stages, whole)], config)
    print("\ntraining reward per block of 10 steps: " + "; ".join(f"{name} {values}" for name, values in sorted(curve)))


def paired_against(conn, version: str, home: Path, problem_ids: list[str]) -> list[tuple[list[dict], list[dict]]]:
    """(the rows of the latest ``grpo_checkpoint`` of the experiment in ``home``, this run's ``version``'s
    rows) on ``problem_ids`` (the eval_report's), then on the widest problem set both policies were
    evaluated on (e.g. both ``policy_evaluation`` partitions on the whole test split) when it is wider."""
    other = ModelStore(root=str(home / "models")).latest("grpo_checkpoint").version
    mine = evaluations(conn, version)
    with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as other_conn:
        theirs = evaluations(other_conn, other)
        sets = [tuple(sorted(problem_ids))]
        widest = max(set(mine) & set(theirs), key=len, default=())
        if len(widest) > len(sets[0]):
            sets.append(widest)
        if sets[0] not in theirs:
            raise SystemExit(f"{home}: grpo_checkpoint {other} has no evaluation on these {len(problem_ids)} problems")
        return [(evaluation_rows(other_conn, theirs[ids]), evaluation_rows(conn, mine[ids])) for ids in sets]


def evaluation_rows(conn, eval_id: str) -> list[dict]:
    """One evaluation's per-problem rows, by problem id."""
    return conn.execute("SELECT * FROM eval_results WHERE eval_id = ? ORDER BY problem_id", [eval_id]).df().to_dict("records")


def evaluations(conn, version: str) -> dict[tuple[str, ...], str]:
    """A policy version's evaluations: the problem ids each covered -> its newest eval_id."""
    found = conn.execute(
        "SELECT eval_id, list(problem_id ORDER BY problem_id) FROM eval_results WHERE policy_version = ? GROUP BY eval_id ORDER BY max(evaluated_at)",
        [version],
    ).fetchall()
    return {tuple(ids): eval_id for eval_id, ids in found}  # newest last: it wins a problem set evaluated twice


def metric_curve(client, run_id: str, metric: str) -> list[float]:
    """An MLflow run's metric by step."""
    return [round(m.value, 3) for m in sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)]


def sft_rows(conn, trained: list[dict], settings: Settings) -> list[dict]:
    """The rows of the SFT policy GRPO started from, on the same problems (its policy_evaluation), or none."""
    store = ModelStore(root=str(settings.model_root))
    parent = store.latest("grpo_checkpoint").manifest["parent_version"]
    if store.get("sft_policy", parent) is None:
        return []
    eval_id = evaluations(conn, parent).get(tuple(sorted(r["problem_id"] for r in trained)))
    return evaluation_rows(conn, eval_id) if eval_id else []


def widest_shared_evaluation(conn, versions: list[str], evaluated: int) -> list[list[dict]]:
    """Each policy version's rows on the widest problem set every one of them was evaluated on, when it
    is wider than the report's ``evaluated`` problems (e.g. the whole test split), or none."""
    by_version = [evaluations(conn, version) for version in versions]
    widest = max(set.intersection(*(set(found) for found in by_version)), key=len, default=())
    if len(widest) <= evaluated:
        return []
    return [evaluation_rows(conn, found[widest]) for found in by_version]


def print_calculator_use(stages: list[tuple[str, list[dict]]], gold: dict) -> None:
    """For stages that called the calculator: whether the final answers come from its results, and
    whether the reference answer is among them (the policy set up the right computation)."""
    for label, rows_ in stages:
        called = [(r, [parse_number(v) for v in annotation_results(r["completion"])]) for r in rows_ if r.get("tool_calls")]
        if not called:
            continue
        same = lambda a, b: a is not None and b is not None and answers_match(a, b)  # noqa: E731
        ends_on_result = sum(bool(results) and same(results[-1], parse_number(str(r["extracted_flexible"]))) for r, results in called)
        gold_among = sum(any(same(value, gold[r["problem_id"]]) for value in results) for r, results in called)
        print(
            f"{label}: {len(called)} of {len(rows_)} completions called the calculator; {ends_on_result} of them answer with its last "
            f"result; the reference answer is among its results in {gold_among}"
        )


def print_table(stages: list[tuple[str, list[dict]]], config: EvalConfig) -> None:
    """The metrics of each stage side by side, then each stage against the one before (paired, strict and flexible)."""
    metrics = [(label, summarize(rows, config)) for label, rows in stages]
    print("| metric | " + " | ".join(label for label, _ in metrics) + " |\n|" + "---|" * (len(metrics) + 1))
    for name in ("pass@1_strict", "pass@1_flexible", "pass@1_lm_eval_strict", "pass@1_lm_eval_flexible"):
        if all(name in m for _, m in metrics):
            cells = [f"{m[name]:.1%} [{m[name + '_ci_low']:.1%}, {m[name + '_ci_high']:.1%}]" for _, m in metrics]
            print(f"| {name} (95% CI) | " + " | ".join(cells) + " |")
    for name in ("format_compliance", "truncation_rate"):
        print(f"| {name} | " + " | ".join(f"{m[name]:.1%}" for _, m in metrics) + " |")
    print("| mean completion tokens | " + " | ".join(f"{m['mean_completion_tokens']:.1f}" for _, m in metrics) + " |")
    if any(m.get("mean_tool_calls") for _, m in metrics):
        print("| completions calling a tool | " + " | ".join(f"{m.get('tool_use_rate', 0):.1%}" for _, m in metrics) + " |")
        print("| tool calls per completion | " + " | ".join(f"{m.get('mean_tool_calls', 0):.2f}" for _, m in metrics) + " |")
        print("| tool calls that errored | " + " | ".join(f"{m.get('tool_error_rate', 0):.1%}" for _, m in metrics) + " |")
    for label, rows_ in stages:
        graded = [r for r in rows_ if isinstance(r.get("correct_lm_eval_strict"), bool)]  # rows stored before the column have none
        if graded:
            differ = {kind: sum(r[f"correct_{kind}"] != r[f"correct_lm_eval_{kind}"] for r in graded) for kind in ("strict", "flexible")}
            print(f"{label}: ours and lm-evaluation-harness's grading differ on {differ['strict']} (strict), {differ['flexible']} (flexible) of {len(graded)}")
    for (before, rows_before), (after, rows_after) in zip(stages, stages[1:]):
        for column in ("correct_strict", "correct_flexible"):
            paired = compare(rows_before, rows_after, column=column)
            print(
                f"\n{after} vs {before}, {column.removeprefix('correct_')} pass@1: {paired['delta']:+.1%} (95% CI {paired['delta_ci_low']:+.1%} to "
                f"{paired['delta_ci_high']:+.1%}); McNemar p = {paired['mcnemar_p_value']:.3g} ({paired['mcnemar_method']}); paired bootstrap "
                f"p = {paired['paired_bootstrap_p_value']:.3g}; only {after} {paired['new_only_correct']}, only {before} {paired['base_only_correct']}"
            )
    for label, rows_ in stages:
        answers = Counter(r["extracted_flexible"] for r in rows_)
        top, count = answers.most_common(1)[0]
        print(f"{label}: {len(answers)} distinct answers (flexible); most common {top!r} on {count / len(rows_):.1%} of problems")


if __name__ == "__main__":
    main()
