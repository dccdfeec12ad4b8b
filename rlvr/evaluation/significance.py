"""Paired tests of two policies graded on the same problems: McNemar and the paired bootstrap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.stats import binom, chi2

from rlvr.evaluation.intervals import bootstrap_distribution

MCNEMAR_METHODS = ("auto", "exact", "chi2")
EXACT_BELOW_DISCORDANT = 25  # b + c under this: exact binomial test (chi-square is poor there)


@dataclass(frozen=True)
class McNemarResult:
    """Discordant counts and the two-sided test of 'both policies solve the same share'."""

    base_only: int  # b: problems base solved and new did not
    new_only: int  # c: problems new solved and base did not
    statistic: float  # min(b, c) for the exact test, the corrected chi-square otherwise
    p_value: float
    method: str  # "exact" or "chi2"


@dataclass(frozen=True)
class PairedBootstrapResult:
    """Mean paired difference new - base, its percentile interval and a two-sided p-value."""

    delta: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int


def discordant_counts(base_correct: Sequence[bool], new_correct: Sequence[bool]) -> tuple[int, int]:
    """(b, c): problems only ``base`` solved and problems only ``new`` solved."""
    base, new = paired_correctness(base_correct, new_correct)
    return int(np.sum(base & ~new)), int(np.sum(~base & new))


def mcnemar_test(base_correct: Sequence[bool], new_correct: Sequence[bool], method: str = "auto") -> McNemarResult:
    """McNemar's test on paired correctness (McNemar 1947), two-sided.

    Only discordant problems carry information: under H0, c ~ Binomial(b + c, 1/2).
    ``exact``: p = min(1, 2·P[X <= min(b, c)]) for X ~ Binomial(b + c, 1/2).
    ``chi2``: (|b - c| - 1)² / (b + c) against chi-square with 1 dof (Edwards' continuity correction).
    ``auto`` picks exact when b + c < 25, the usual rule of thumb, and chi2 otherwise.
    No discordant pairs gives p = 1.
    """
    if method not in MCNEMAR_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {MCNEMAR_METHODS}")
    b, c = discordant_counts(base_correct, new_correct)
    if method == "auto":
        method = "exact" if b + c < EXACT_BELOW_DISCORDANT else "chi2"
    if b + c == 0:
        return McNemarResult(b, c, 0.0, 1.0, method)
    if method == "exact":
        statistic = float(min(b, c))
        p_value = min(1.0, 2.0 * binom.cdf(min(b, c), b + c, 0.5))
    else:
        statistic = (abs(b - c) - 1) ** 2 / (b + c)
        p_value = chi2.sf(statistic, df=1)
    return McNemarResult(b, c, statistic, float(p_value), method)


def paired_bootstrap(
    base: Sequence[float],
    new: Sequence[float],
    confidence: float = 0.95,
    n_resamples: int = 10_000,
    seed: int = 0,
) -> PairedBootstrapResult:
    """Paired bootstrap of the mean difference d_i = new_i - base_i (Efron & Tibshirani 1993, §16.4).

    Problems are resampled with replacement, keeping each problem's pair together. The interval is
    the percentile interval of mean(d*). The two-sided p-value shifts the bootstrap distribution to
    the null (mean 0): p = (1 + #{|mean(d*) - delta| >= |delta|}) / (1 + n_resamples).
    Works for 0/1 correctness and for per-problem scores such as pass@k or maj@k.
    """
    base = np.asarray(base, dtype=np.float64)
    new = np.asarray(new, dtype=np.float64)
    if base.shape != new.shape or base.ndim != 1 or base.size == 0:
        raise ValueError("base and new must be non-empty 1-d arrays over the same problems")
    differences = new - base
    delta = float(differences.mean())
    estimates = bootstrap_distribution(differences, np.mean, n_resamples, seed)
    low, high = np.quantile(estimates, [(1 - confidence) / 2, (1 + confidence) / 2])
    extreme = np.sum(np.abs(estimates - delta) >= abs(delta) - 1e-12)
    p_value = (1 + extreme) / (1 + n_resamples)
    return PairedBootstrapResult(delta, float(low), float(high), float(min(1.0, p_value)), int(base.size))


def as_correctness(values: Sequence[bool]) -> np.ndarray:
    """Per-problem correctness as a 1-d bool array; raises ValueError unless every value is 0/1 or bool."""
    array = np.asarray(values)
    if array.ndim != 1 or not np.isin(array, (0, 1)).all():
        raise ValueError("correctness must be a 1-d array of booleans or 0/1")
    return array.astype(bool)


def paired_correctness(base_correct: Sequence[bool], new_correct: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Both correctness arrays as bool, checked to cover the same number of problems."""
    base, new = as_correctness(base_correct), as_correctness(new_correct)
    if base.shape != new.shape:
        raise ValueError(f"paired arrays differ in length: {base.size} vs {new.size} problems")
    return base, new
