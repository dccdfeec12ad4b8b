"""The cross-task report: per task, base against trained pass@1 with 95% CIs and a paired test, and
their macro average (each task weighing the same), as a table and a plot.

Per task: bootstrap CIs of each policy's pass@1, the paired bootstrap of the difference and McNemar's
exact test (``runner.compare``). The macro average's CIs come from a stratified bootstrap: each
resample draws every task's problems within that task, so a task's CI width carries into the average.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from rlvr.evaluation.intervals import bootstrap_ci
from rlvr.evaluation.runner import compare

MACRO = "macro average"


def cross_task_table(evaluations: Mapping[str, tuple[list[dict], list[dict]]], confidence: float = 0.95, seed: int = 0, n_resamples: int = 2000) -> list[dict]:
    """One row per task of ``evaluations`` (task -> (base rows, trained rows), per-problem results with
    ``problem_id`` and ``correct_strict``), then the macro-average row."""
    if not evaluations:
        raise ValueError("no task evaluations to report")
    rows, paired = [], {}
    for task, (base, trained) in evaluations.items():
        by_id = {r["problem_id"]: bool(r["correct_strict"]) for r in base}
        shared = [r for r in trained if r["problem_id"] in by_id]
        if not shared:
            raise ValueError(f"task {task!r}: the base and trained evaluations share no problems")
        b = np.array([by_id[r["problem_id"]] for r in shared], dtype=float)
        t = np.array([bool(r["correct_strict"]) for r in shared], dtype=float)
        paired[task] = (b, t)
        test = compare(base, trained, confidence, seed)
        rows.append(
            {
                "task": task,
                "problems": len(shared),
                "base": float(b.mean()),
                **_interval("base", b, confidence, seed),
                "trained": float(t.mean()),
                **_interval("trained", t, confidence, seed),
                "delta": test["delta"],
                "delta_ci_low": test["delta_ci_low"],
                "delta_ci_high": test["delta_ci_high"],
                "mcnemar_p_value": test["mcnemar_p_value"],
                "paired_bootstrap_p_value": test["paired_bootstrap_p_value"],
            }
        )
    rows.append(macro_average(paired, confidence, seed, n_resamples))
    return rows


def macro_average(paired: Mapping[str, tuple[np.ndarray, np.ndarray]], confidence: float, seed: int, n_resamples: int) -> dict:
    """The unweighted mean over tasks of base, trained and their difference, with stratified-bootstrap
    CIs and the share of resamples on the other side of zero (two-sided) as the difference's p-value."""
    rng = np.random.default_rng(seed)
    draws = np.zeros((n_resamples, 2))
    for b, t in paired.values():
        index = rng.integers(0, len(b), size=(n_resamples, len(b)))
        draws[:, 0] += b[index].mean(axis=1)
        draws[:, 1] += t[index].mean(axis=1)
    draws /= len(paired)
    delta = draws[:, 1] - draws[:, 0]
    alpha = (1 - confidence) / 2
    base, trained = (float(np.mean([pair[i].mean() for pair in paired.values()])) for i in (0, 1))
    low, high = np.quantile(draws, [alpha, 1 - alpha], axis=0)
    delta_low, delta_high = np.quantile(delta, [alpha, 1 - alpha])
    p_value = min(1.0, 2 * min(float((delta <= 0).mean()), float((delta >= 0).mean())))
    return {
        "task": MACRO,
        "problems": int(sum(len(b) for b, _ in paired.values())),
        "base": base,
        "base_ci_low": float(low[0]),
        "base_ci_high": float(high[0]),
        "trained": trained,
        "trained_ci_low": float(low[1]),
        "trained_ci_high": float(high[1]),
        "delta": trained - base,
        "delta_ci_low": float(delta_low),
        "delta_ci_high": float(delta_high),
        "mcnemar_p_value": None,
        "paired_bootstrap_p_value": p_value,
    }


def _interval(name: str, values: np.ndarray, confidence: float, seed: int) -> dict:
    low, high = bootstrap_ci(values, confidence=confidence, seed=seed)
    return {f"{name}_ci_low": float(low), f"{name}_ci_high": float(high)}
