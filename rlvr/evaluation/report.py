"""The evaluation report: a trained policy against its base on the same problems, in Markdown with figures.

Headline metrics with confidence intervals (``summarize``), the paired comparison (``compare``:
McNemar and paired bootstrap), the significance verdict, and the plots shown in the Dagster UI
and logged to MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from rlvr import plots
from rlvr.evaluation.runner import EvalConfig, compare, summarize

TRAINING_CURVES = ("reward_mean", "format_mean", "loss")  # training-run metrics plotted in the report


@dataclass(frozen=True)
class EvalReport:
    """Summaries of both policies, their paired comparison, the verdict, Markdown and PNG figures."""

    base: dict
    trained: dict
    paired: dict
    verdict: str
    markdown: str
    figures: dict[str, bytes] = field(default_factory=dict)  # file name -> PNG
    stages: list[dict] = field(default_factory=list)  # stage_moves of base -> (start policy ->) trained

    def metrics(self) -> dict[str, float]:
        """Every numeric value, prefixed ``trained.``, ``base.`` and ``paired.``."""
        return {**headline(self.trained, "trained."), **headline(self.base, "base."), **headline(self.paired, "paired.")}

    def markdown_with_figures(self) -> str:
        """The Markdown with each figure inlined after it (the Dagster UI shows it as is)."""
        return self.markdown + "\n\n" + "\n\n".join(plots.png_markdown(png, name) for name, png in self.figures.items())


def headline(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numeric, non-boolean values of a metrics dict as floats."""
    return {prefix + k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def significance_verdict(delta: float, p_value: float, alpha: float = 0.05) -> str:
    """'better' / 'worse' when the difference is significant at ``alpha``, else 'not significantly different'."""
    if p_value < alpha and delta > 0:
        return "better"
    if p_value < alpha and delta < 0:
        return "worse"
    return "not significantly different"


def stage_moves(stages: list[tuple[str, list[dict]]], config: EvalConfig, alpha: float = 0.05) -> list[dict]:
    """Each stage of a pipeline (e.g. base, SFT, GRPO) against the one before it on the same problems:
    strict pass@1 and its paired difference (McNemar), format compliance, and the verdict."""
    moves, previous = [], None
    for label, results in stages:
        metrics = summarize(results, config)
        move = {"stage": label, "pass@1_strict": metrics["pass@1_strict"], "format_compliance": metrics["format_compliance"]}
        if previous is not None:
            paired = compare(previous[1], results, seed=config.seed)
            delta, p_value = paired["delta"], paired["mcnemar_p_value"]
            move.update(delta=delta, p_value=p_value, verdict=significance_verdict(delta, p_value, alpha))
            move["format_delta"] = metrics["format_compliance"] - previous[0]["format_compliance"]
        moves.append(move)
        previous = (metrics, results)
    return moves


def moved_accuracy(moves: list[dict]) -> str:
    """One line naming the stage(s) that moved strict accuracy significantly, or saying none did
    (and where the format moved most)."""
    better = [m for m in moves[1:] if m["verdict"] == "better"]
    chain = " -> ".join(f"{m['stage']} {m['pass@1_strict']:.1%}" + (f" ({m['delta']:+.1%}, p = {m['p_value']:.2g})" if "delta" in m else "") for m in moves)
    if better:
        return f"{chain}: accuracy moved at {', '.join(m['stage'] for m in better)}"
    worse = [m["stage"] for m in moves[1:] if m["verdict"] == "worse"]
    fmt = max(moves[1:], key=lambda m: m["format_delta"], default=None)
    what = f"; format compliance moved most at {fmt['stage']} ({fmt['format_delta']:+.1%})" if fmt else ""
    return f"{chain}: no stage moved accuracy significantly" + (f" (worse at {', '.join(worse)})" if worse else "") + what


def evaluation_report(
    base_results: list[dict],
    trained_results: list[dict],
    config: EvalConfig,
    trained_version: str,
    base_version: str,
    split: str,
    training_curves: dict[str, list[tuple[int, float]]] | None = None,
    start: tuple[str, list[dict]] | None = None,
) -> EvalReport:
    """The report of per-problem results of the base and trained policies on the same problems;
    ``start`` (label, results): the policy training started from when it is not the base (an SFT
    policy, the champion), so the report says which stage moved accuracy."""
    base, trained = summarize(base_results, config), summarize(trained_results, config)
    stages = stage_moves([("base", base_results)] + ([start] if start else []) + [("GRPO", trained_results)], config)
    paired = compare(base_results, trained_results, seed=config.seed)
    verdict = significance_verdict(paired["delta"], paired["mcnemar_p_value"])
    figures = {
        "accuracy.png": plots.accuracy_figure(
            [
                ("base", base["pass@1_strict"], base["pass@1_strict_ci_low"], base["pass@1_strict_ci_high"]),
                ("trained", trained["pass@1_strict"], trained["pass@1_strict_ci_low"], trained["pass@1_strict_ci_high"]),
            ]
        ),
        "reward_histogram.png": plots.overlaid_histograms_figure(
            {"base": [r["reward_total"] for r in base_results], "trained": [r["reward_total"] for r in trained_results]},
            "total reward of greedy completions",
        ),
        "accuracy_by_steps.png": plots.grouped_accuracy_figure({"base": base["accuracy_by_steps"], "trained": trained["accuracy_by_steps"]}),
        "training_curves.png": plots.curves_figure(training_curves or {}),
    }
    markdown = render_report(base, trained, paired, verdict, trained_version, base_version, split) + f"\n**Stages**: {moved_accuracy(stages)}.\n"
    return EvalReport(base, trained, paired, verdict, markdown, {name: plots.figure_png(fig) for name, fig in figures.items()}, stages)


def render_report(base: dict, new: dict, paired: dict, verdict: str, new_version: str, base_version: str, split: str) -> str:
    """The Markdown report: headline, significance, the metric table and accuracy by difficulty."""

    def pct(m: dict, name: str) -> str:
        return f"{m[name]:.1%} [{m[name + '_ci_low']:.1%}, {m[name + '_ci_high']:.1%}]"

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
    steps = steps.astype({"group": str, "n": int})  # whole numbers print whole beside the 3-decimal rates
    return (
        f"## Trained policy `{new_version}` vs base `{base_version}`\n\n"
        f"On {paired['shared_problems']} problems of split `{split}` (zero-shot, greedy, strict `####`): "
        f"**{new['pass@1_strict']:.1%}** vs **{base['pass@1_strict']:.1%}**, "
        f"difference {paired['delta']:+.1%} (95% CI {paired['delta_ci_low']:+.1%} to {paired['delta_ci_high']:+.1%}); "
        f"McNemar p = {paired['mcnemar_p_value']:.3g} ({paired['new_only_correct']} solved only by the trained policy, "
        f"{paired['base_only_correct']} only by the base): **{verdict}**.\n\n"
        f"{table}\n\n### Accuracy by reference reasoning steps\n\n"
        f"{steps[['group', 'n', 'base_accuracy', 'trained_accuracy', 'ci_low', 'ci_high']].to_markdown(index=False, floatfmt='.3f')}\n"
    )
