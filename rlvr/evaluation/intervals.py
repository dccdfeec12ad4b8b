"""Confidence intervals for evaluation scores: Wilson for proportions, percentile bootstrap otherwise."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pandas as pd
from scipy.stats import norm


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927; Brown, Cai & DasGupta 2001).

    With p = successes/n and z the two-sided normal quantile:
    (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n). Unlike the Wald interval it stays in
    [0, 1] and keeps its coverage for small n and p near 0 or 1. n = 0 gives (0, 1).
    """
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}, {n}")
    if n == 0:
        return 0.0, 1.0
    z = norm.ppf(0.5 + confidence / 2)
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half_width = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return float(max(0.0, center - half_width)), float(min(1.0, center + half_width))


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[..., np.ndarray] = np.mean,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic(values)`` (Efron & Tibshirani 1993, ch. 13).

    Draws ``n_resamples`` resamples of the problems with replacement and returns the
    (1-confidence)/2 and (1+confidence)/2 quantiles of the statistic over them. ``statistic``
    must accept an ``axis`` keyword, like ``np.mean`` and ``np.median``.
    """
    estimates = bootstrap_distribution(values, statistic, n_resamples, seed)
    low, high = np.quantile(estimates, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def bootstrap_distribution(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[..., np.ndarray] = np.mean,
    n_resamples: int = 2000,
    seed: int = 0,
) -> np.ndarray:
    """``statistic`` over ``n_resamples`` resamples of ``values`` with replacement (in memory-bounded chunks)."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("values must be a non-empty 1-d array")
    rng = np.random.default_rng(seed)
    chunk = max(1, 2_000_000 // values.size)
    estimates = []
    for start in range(0, n_resamples, chunk):
        rows = min(chunk, n_resamples - start)
        estimates.append(statistic(values[rng.integers(0, values.size, size=(rows, values.size))], axis=1))
    return np.concatenate(estimates)


def accuracy_by_group(correct: Sequence[bool] | np.ndarray, groups: Sequence | np.ndarray, confidence: float = 0.95) -> pd.DataFrame:
    """Accuracy per group (e.g. by number of reasoning steps) with its Wilson interval.

    Returns one row per group, sorted by group: group, n, correct, accuracy, ci_low, ci_high.
    """
    frame = pd.DataFrame({"group": np.asarray(groups), "correct": np.asarray(correct, dtype=bool)})
    if frame.empty:
        return pd.DataFrame(columns=["group", "n", "correct", "accuracy", "ci_low", "ci_high"])
    table = frame.groupby("group", sort=True)["correct"].agg(n="size", correct="sum").reset_index()
    table["accuracy"] = table["correct"] / table["n"]
    bounds = [wilson_interval(int(s), int(n), confidence) for s, n in zip(table["correct"], table["n"])]
    table["ci_low"] = [low for low, _ in bounds]
    table["ci_high"] = [high for _, high in bounds]
    return table
