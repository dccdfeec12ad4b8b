"""Group ``evaluation``: the base policy's baseline and the trained policy's report.

Per-problem results land in the DuckDB table ``eval_results`` keyed by ``eval_id`` (policy version
x protocol x problem set), so an evaluation that already ran is reused, never recomputed, and
every number in a report can be re-derived with SQL.
"""

import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import pandas as pd
from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, MetadataValue, asset
from dagster_duckdb import DuckDBResource
from pydantic import Field

from resources import ComputeResource, MLflowResource, ModelStore, replace_rows
from rlvr import gsm8k
from rlvr.evaluation.runner import EvalConfig, compare, evaluate_policy, summarize
from rlvr.policy import load_policy
from rlvr.rewards import DEFAULT_GSM8K_REWARD
from rlvr_assets import plots


class EvalProtocol(Config):
    """The evaluation protocol: the same for the baseline and the trained policy, so they pair."""

    split: str = Field(default="test", description="held-out split of gsm8k_problems")
    limit: Optional[int] = Field(default=50, description="first N problems of the split (None: all)")
    max_new_tokens: int = Field(default=256, description="token budget per completion")
    num_samples: int = Field(default=0, description="sampled completions per problem for pass@k / maj@k (0: greedy only)")
    ks: list[int] = Field(default=[1], description="k values of pass@k and maj@k (each <= num_samples)")
    sample_temperature: float = Field(default=0.7, description="temperature of the sampled completions")
    batch_rows: int = Field(default=32, description="completions decoded together")
    reward_weights: dict[str, float] = Field(default=dict(DEFAULT_GSM8K_REWARD), description="rewards reported per completion")
    seed: int = Field(default=0)

    def runner_config(self) -> EvalConfig:
        return EvalConfig(
            max_new_tokens=self.max_new_tokens, num_samples=self.num_samples, ks=list(self.ks),
            sample_temperature=self.sample_temperature, batch_rows=self.batch_rows, seed=self.seed,
            reward_weights=dict(self.reward_weights),
        )


def load_eval_problems(duckdb: DuckDBResource, protocol: EvalProtocol) -> tuple[list[dict], str]:
    """The protocol's problems from ``gsm8k_problems`` (ordered by id) and the table's source."""
    limit = f"LIMIT {int(protocol.limit)}" if protocol.limit else ""
    with duckdb.get_connection() as conn:
        frame = conn.execute(
            f"SELECT * FROM gsm8k_problems WHERE split = ? ORDER BY problem_id {limit}", [protocol.split]
        ).df()
    if frame.empty:
        raise Failure(description=f"gsm8k_problems has no rows in split {protocol.split!r}")
    return frame.to_dict(orient="records"), str(frame["source"].iloc[0])


def eval_id(policy_version: str, protocol: EvalProtocol, problems: list[dict]) -> str:
    """Identity of one evaluation: what was evaluated, how, on which problems."""
    key = json.dumps(
        {"policy": policy_version, "protocol": protocol.model_dump(), "problems": [p["content_hash"] for p in problems]},
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def evaluate_or_reuse(
    context: AssetExecutionContext,
    duckdb: DuckDBResource,
    compute: ComputeResource,
    role: str,
    policy_version: str,
    policy_path: Path,
    protocol: EvalProtocol,
    problems: list[dict],
) -> tuple[list[dict], str, bool]:
    """Per-problem results of ``policy_version`` under ``protocol``: from ``eval_results`` when they
    exist, else computed now and stored. Returns (results, eval_id, reused)."""
    key = eval_id(policy_version, protocol, problems)
    with duckdb.get_connection() as conn:
        exists = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'eval_results'"
        ).fetchone()[0]
        stored = conn.execute("SELECT * FROM eval_results WHERE eval_id = ? ORDER BY problem_id", [key]).df() if exists else None
    if stored is not None and len(stored) == len(problems):
        context.log.info(f"{role}: reusing stored evaluation {key} of {policy_version}")
        return stored.to_dict(orient="records"), key, True

    model, tokenizer = load_policy(policy_path, compute.torch_device(), compute.torch_dtype())
    model.requires_grad_(False)  # frozen: rollout chunks reuse one packed copy of its weights
    started, last = time.perf_counter(), [0.0]

    def progress(done: int, total: int) -> None:
        if done == total or time.perf_counter() - last[0] > 30:
            last[0] = time.perf_counter()
            context.log.info(f"{role}: {done}/{total} completions ({time.perf_counter() - started:.0f} s)")

    results = evaluate_policy(model, tokenizer, problems, protocol.runner_config(), progress)
    frame = pd.DataFrame(results).assign(
        eval_id=key, policy_role=role, policy_version=policy_version, split=protocol.split,
        evaluated_at=pd.Timestamp.now(tz="UTC"),
    )
    replace_rows(duckdb, "eval_results", frame, key="eval_id")
    return frame.to_dict(orient="records"), key, False


@asset(group_name="evaluation", kinds={"duckdb", "pytorch"}, owners=["team:rlvr-eval"], deps=["gsm8k_problems", "base_policy"])
def baseline_eval(
    context: AssetExecutionContext, config: EvalProtocol, duckdb: DuckDBResource, model_store: ModelStore, compute: ComputeResource
) -> MaterializeResult:
    """The base policy evaluated under the protocol, computed once per base-policy version and
    reused while only the trained policy changes. Rows in ``eval_results`` (role ``base``)."""
    base = _require(model_store.latest("base_policy"), "base_policy")
    problems, _ = load_eval_problems(duckdb, config)
    results, key, reused = evaluate_or_reuse(context, duckdb, compute, "base", base.version, base.path, config, problems)
    metrics = summarize(results, config.runner_config())
    return MaterializeResult(
        metadata={
            "eval_id": key,
            "policy_version": base.version,
            "reused": reused,
            **_headline(metrics),
            "accuracy_by_steps": MetadataValue.md(pd.DataFrame(metrics["accuracy_by_steps"]).to_markdown(index=False)),
        }
    )


@asset(group_name="evaluation", kinds={"duckdb", "mlflow"}, owners=["team:rlvr-eval"], deps=["grpo_checkpoint", "baseline_eval"])
def eval_report(
    context: AssetExecutionContext,
    config: EvalProtocol,
    duckdb: DuckDBResource,
    model_store: ModelStore,
    compute: ComputeResource,
    mlflow: MLflowResource,
) -> MaterializeResult:
    """The trained policy against the base policy on the same held-out problems: pass@1 (strict
    and flexible) with 95% bootstrap CIs, a paired McNemar test and bootstrap of the difference,
    rewards, format compliance, lengths, accuracy by difficulty, and plots. Shown here and logged
    to MLflow with the report as artifacts."""
    import mlflow as mlflow_api

    trained = _require(model_store.latest("grpo_checkpoint"), "grpo_checkpoint")
    base = _require(model_store.get("base_policy", trained.manifest["base_policy_version"]), "base_policy of the checkpoint")
    problems, eval_source = load_eval_problems(duckdb, config)
    try:
        gsm8k.check_no_contamination(trained.manifest.get("data_source", ""), eval_source, config.split)
    except gsm8k.DataSourceError as err:
        raise Failure(description=f"eval_report: {err}") from None
    runner_config = config.runner_config()
    base_results, base_id, _ = evaluate_or_reuse(context, duckdb, compute, "base", base.version, base.path, config, problems)
    new_results, new_id, _ = evaluate_or_reuse(context, duckdb, compute, "trained", trained.version, trained.path, config, problems)
    base_metrics, new_metrics = summarize(base_results, runner_config), summarize(new_results, runner_config)
    paired = compare(base_results, new_results, seed=config.seed)
    curves = _training_curves(mlflow, trained.manifest.get("mlflow_run_id"))
    figures = {
        "accuracy.png": plots.accuracy_figure([
            ("base", base_metrics["pass@1_strict"], base_metrics["pass@1_strict_ci_low"], base_metrics["pass@1_strict_ci_high"]),
            ("trained", new_metrics["pass@1_strict"], new_metrics["pass@1_strict_ci_low"], new_metrics["pass@1_strict_ci_high"]),
        ]),
        "reward_histogram.png": plots.overlaid_histograms_figure(
            {"base": [r["reward_total"] for r in base_results], "trained": [r["reward_total"] for r in new_results]},
            "total reward of greedy completions",
        ),
        "accuracy_by_steps.png": plots.grouped_accuracy_figure(
            {"base": base_metrics["accuracy_by_steps"], "trained": new_metrics["accuracy_by_steps"]}
        ),
        "training_curves.png": plots.curves_figure(curves),
    }
    pngs = {name: plots.figure_png(fig) for name, fig in figures.items()}
    report = render_report(base_metrics, new_metrics, paired, trained.version, base.version, config)

    mlflow.activate()
    with mlflow_api.start_run(run_name=f"eval-{trained.version}") as run, tempfile.TemporaryDirectory() as tmp:
        mlflow_api.set_tags({"rlvr.kind": "evaluation", "rlvr.policy_version": trained.version,
                             "rlvr.training_run_id": trained.manifest.get("mlflow_run_id", ""), "dagster.run_id": context.run.run_id})
        mlflow_api.log_params({f"eval.{k}": v for k, v in config.model_dump().items()})
        mlflow_api.log_metrics({**_numeric(new_metrics, "trained."), **_numeric(base_metrics, "base."), **_numeric(paired, "paired.")})
        for name, png in pngs.items():
            (Path(tmp) / name).write_bytes(png)
        (Path(tmp) / "report.md").write_text(report)
        pd.DataFrame(new_results).to_csv(Path(tmp) / "eval_results.csv", index=False)
        mlflow_api.log_artifacts(tmp, artifact_path="report")
        eval_run_id = run.info.run_id

    images = "\n\n".join(plots.png_markdown(png, name) for name, png in pngs.items())
    return MaterializeResult(
        metadata={
            "report": MetadataValue.md(report + "\n\n" + images),
            "trained_eval_id": new_id,
            "base_eval_id": base_id,
            "policy_version": trained.version,
            "protocol": MetadataValue.json(config.model_dump()),
            "mlflow_eval_run_id": eval_run_id,
            **_headline(new_metrics),
            "delta_pass@1_strict": paired["delta"],
            "mcnemar_p_value": paired["mcnemar_p_value"],
        }
    )


def render_report(base: dict, new: dict, paired: dict, new_version: str, base_version: str, protocol: EvalProtocol) -> str:
    """The Markdown report: headline, significance, the metric table and accuracy by difficulty."""
    def pct(m: dict, name: str) -> str:
        return f"{m[name]:.1%} [{m[name + '_ci_low']:.1%}, {m[name + '_ci_high']:.1%}]"

    verdict = "better" if paired["delta"] > 0 and paired["mcnemar_p_value"] < 0.05 else (
        "worse" if paired["delta"] < 0 and paired["mcnemar_p_value"] < 0.05 else "not significantly different")
    rows = [
        ("pass@1 strict (95% CI)", pct(base, "pass@1_strict"), pct(new, "pass@1_strict")),
        ("pass@1 flexible (95% CI)", pct(base, "pass@1_flexible"), pct(new, "pass@1_flexible")),
        ("format compliance", f"{base['format_compliance']:.1%}", f"{new['format_compliance']:.1%}"),
        ("truncation rate", f"{base['truncation_rate']:.1%}", f"{new['truncation_rate']:.1%}"),
        ("mean completion tokens", f"{base['mean_completion_tokens']:.1f}", f"{new['mean_completion_tokens']:.1f}"),
    ]
    rows += [(name.removeprefix("mean_"), f"{base[name]:.3f}", f"{new[name]:.3f}") for name in sorted(new) if name.startswith("mean_reward_")]
    rows += [(name, f"{base[name]:.1%}", f"{new[name]:.1%}") for name in sorted(new) if name.startswith(("pass@", "maj@")) and "_" not in name]
    table = "| metric | base | trained |\n|---|---|---|\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
    steps = pd.DataFrame(new["accuracy_by_steps"]).rename(columns={"accuracy": "trained_accuracy"})
    steps = steps.merge(pd.DataFrame(base["accuracy_by_steps"])[["group", "accuracy"]].rename(columns={"accuracy": "base_accuracy"}), on="group", how="left")
    return (
        f"## Trained policy `{new_version}` vs base `{base_version}`\n\n"
        f"On {paired['shared_problems']} problems of split `{protocol.split}` (zero-shot, greedy, strict `####`): "
        f"**{new['pass@1_strict']:.1%}** vs **{base['pass@1_strict']:.1%}**, "
        f"difference {paired['delta']:+.1%} (95% CI {paired['delta_ci_low']:+.1%} to {paired['delta_ci_high']:+.1%}); "
        f"McNemar p = {paired['mcnemar_p_value']:.3g} ({paired['new_only_correct']} solved only by the trained policy, "
        f"{paired['base_only_correct']} only by the base): **{verdict}**.\n\n"
        f"{table}\n\n### Accuracy by reference reasoning steps\n\n"
        f"{steps[['group', 'n', 'base_accuracy', 'trained_accuracy', 'ci_low', 'ci_high']].to_markdown(index=False, floatfmt='.3f')}\n"
    )


def _headline(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _numeric(metrics: dict, prefix: str) -> dict:
    return {prefix + k.replace("@", "_at_"): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _training_curves(mlflow: MLflowResource, run_id: Optional[str]) -> dict[str, list[tuple[int, float]]]:
    if not run_id:
        return {}
    client = mlflow.client()
    return {name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)] for name in ("reward_mean", "format_mean", "loss")}


def _require(stored, what: str):
    if stored is None:
        raise Failure(description=f"{what} is not in the model store: materialize it first")
    return stored
