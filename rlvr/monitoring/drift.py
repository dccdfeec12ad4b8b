"""Drift between the training reference and recent serving traffic: PSI, KS, embedding MMD, thresholds.

:func:`traffic_drift` is the one definition of every drift metric the monitoring reports: inputs
(:func:`input_drift`) and outputs (:func:`output_drift`), checked against :class:`DriftThresholds`.

Metric names are flat strings so they can go to MLflow and asset metadata as they are; a
per-feature family is named ``<family>/<feature>`` (``psi/num_words``) and thresholded by family.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import pandas as pd
from scipy.stats import ks_2samp

from rlvr.monitoring.prompt_features import prompt_features

PSI_EPSILON = 1e-4


def population_stability_index(reference: Sequence | np.ndarray, current: Sequence | np.ndarray, bins: int = 10, epsilon: float = PSI_EPSILON) -> float:
    """PSI = sum_i (p_cur,i - p_ref,i) · ln(p_cur,i / p_ref,i) over bins fixed on the reference.

    Numeric features with more than ``bins`` distinct values get the reference's quantile bins (open-ended
    outer bins); others get one bin per reference value plus one for unseen values; NaN/None is a bin of
    its own; empty bins get ``epsilon``. Usual reading (Siddiqi 2006): < 0.1 stable, 0.1-0.25 moderate,
    > 0.25 major shift. With no drift at all PSI is about (bins - 1)(1/n_ref + 1/n_cur), so those
    thresholds assume hundreds of rows on each side.
    """
    reference, current = pd.Series(reference).reset_index(drop=True), pd.Series(current).reset_index(drop=True)
    if reference.empty or current.empty:
        raise ValueError("PSI needs non-empty reference and current samples")
    ref_bins, cur_bins = _bin_labels(reference, current, bins)
    labels = np.union1d(ref_bins, cur_bins)
    p_ref = np.maximum(_proportions(ref_bins, labels), epsilon)
    p_cur = np.maximum(_proportions(cur_bins, labels), epsilon)
    return float(np.sum((p_cur - p_ref) * np.log(p_cur / p_ref)))


def ks_statistic(reference: Sequence[float] | np.ndarray, current: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov (statistic, p-value) via ``scipy.stats.ks_2samp``, NaN dropped.

    The statistic is sup_x |F_ref(x) - F_cur(x)|; with thousands of prompts the p-value flags
    differences too small to matter, so thresholds apply to the statistic.
    """
    reference = np.asarray(reference, dtype=np.float64)
    current = np.asarray(current, dtype=np.float64)
    reference, current = reference[~np.isnan(reference)], current[~np.isnan(current)]
    if reference.size == 0 or current.size == 0:
        return float("nan"), float("nan")
    result = ks_2samp(reference, current)
    return float(result.statistic), float(result.pvalue)


def feature_drift(reference: pd.DataFrame, current: pd.DataFrame, bins: int = 10) -> dict[str, float]:
    """``psi/<column>`` and ``ks/<column>`` (KS statistic) for every column of ``reference``."""
    metrics = {}
    for column in reference.columns:
        metrics[f"psi/{column}"] = population_stability_index(reference[column], current[column], bins)
        metrics[f"ks/{column}"] = ks_statistic(reference[column], current[column])[0]
    return metrics


def embedding_drift(
    reference_emb: np.ndarray,
    current_emb: np.ndarray,
    max_samples: int = 1000,
    n_permutations: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """Distance between two sets of sentence embeddings: ``mean_cosine_distance`` (biased upward for small
    sets), ``mmd2`` (the unbiased squared MMD, Gretton et al. 2012, JMLR, eq. 3, RBF kernel with the median
    heuristic; it may be slightly negative), ``mmd`` = sqrt(max(mmd2, 0)) and, when ``n_permutations`` > 0,
    ``mmd_p_value`` = (1 + #permutations with MMD² >= observed) / (1 + n_permutations).

    Each set (at least 2 rows) is subsampled to ``max_samples`` rows, seeded: MMD costs O(n²).
    docs/architecture.md ("Drift") has the formulas.
    """
    rng = np.random.default_rng(seed)
    x = _subsample(np.asarray(reference_emb, dtype=np.float64), max_samples, rng)
    y = _subsample(np.asarray(current_emb, dtype=np.float64), max_samples, rng)
    if len(x) < 2 or len(y) < 2:
        raise ValueError("embedding drift needs at least 2 reference and 2 current embeddings")
    mean_x, mean_y = x.mean(axis=0), y.mean(axis=0)
    cosine = mean_x @ mean_y / max(np.linalg.norm(mean_x) * np.linalg.norm(mean_y), 1e-12)

    pooled = np.concatenate([x, y])
    squared_norms = np.sum(pooled**2, axis=1)
    squared_distances = np.maximum(squared_norms[:, None] + squared_norms[None, :] - 2 * pooled @ pooled.T, 0.0)
    off_diagonal = squared_distances[np.triu_indices(len(pooled), k=1)]
    bandwidth = float(np.sqrt(np.median(off_diagonal))) if off_diagonal.size else 0.0
    bandwidth = bandwidth if bandwidth > 0 else 1.0
    kernel = np.exp(-squared_distances / (2 * bandwidth**2))
    is_x = np.arange(len(pooled)) < len(x)
    mmd2 = _mmd2(kernel, is_x)

    metrics = {
        "mean_cosine_distance": float(1 - cosine),
        "mmd": float(np.sqrt(max(mmd2, 0.0))),
        "mmd2": float(mmd2),
        "rbf_bandwidth": bandwidth,
        "n_reference": int(len(x)),
        "n_current": int(len(y)),
    }
    if n_permutations > 0:
        exceed = sum(_mmd2(kernel, rng.permutation(is_x)) >= mmd2 - 1e-12 for _ in range(n_permutations))
        metrics["mmd_p_value"] = (1 + exceed) / (1 + n_permutations)
    return metrics


def input_drift(reference_questions: Sequence[str], prompts: Sequence[str], embed: Callable[[list[str]], np.ndarray] | None = None) -> dict[str, float]:
    """Drift of served prompts from the training questions: ``psi/<feature>`` and ``ks/<feature>`` of
    the prompt features (:func:`rlvr.monitoring.prompt_features.prompt_features`) and, given ``embed`` (e.g.
    :func:`rlvr.monitoring.embeddings.embed_texts`), ``mean_cosine_distance`` and ``mmd`` of the embeddings."""
    metrics = feature_drift(prompt_features(reference_questions), prompt_features(prompts))
    if embed is not None:
        distances = embedding_drift(embed(list(reference_questions)), embed(list(prompts)))
        metrics |= {name: distances[name] for name in ("mean_cosine_distance", "mmd")}
    return metrics


def output_drift(
    current: pd.DataFrame,
    evaluation: pd.DataFrame | None = None,
    previous: pd.DataFrame | None = None,
    min_previous: int = 1,
    bins: int = 10,
) -> dict[str, float]:
    """Drift of the served policy's outputs; drops are positive when worse now.

    ``current`` and ``previous`` (the window before) hold one row per served request (``well_formed``,
    ``completion_chars``, ``vote_share``, ``ground_truth``, ``mean_reward``); ``evaluation`` the served
    policy's last evaluation, one row per problem (``well_formed``, ``completion_chars``, ``reward_total``).
    Returns ``format_compliance_drop``, ``psi/completion_chars`` and ``verified_reward_mean`` / ``_drop``
    against the evaluation, ``vote_share_drop`` against ``previous`` when it has ``min_previous`` vote
    shares; metrics without a reference are left out (docs/architecture.md, "Drift").
    """
    metrics = {}
    if evaluation is not None and len(evaluation):
        metrics["format_compliance_drop"] = float(evaluation["well_formed"].mean() - current["well_formed"].mean())
        metrics["psi/completion_chars"] = population_stability_index(evaluation["completion_chars"], current["completion_chars"], bins)
        verified = current.dropna(subset=["ground_truth", "mean_reward"])
        if len(verified):
            metrics["verified_reward_mean"] = float(verified["mean_reward"].mean())
            metrics["verified_reward_drop"] = float(evaluation["reward_total"].mean() - verified["mean_reward"].mean())
    shares = current["vote_share"].dropna()
    previous_shares = previous["vote_share"].dropna() if previous is not None else pd.Series(dtype=float)
    if len(shares) and len(previous_shares) >= max(min_previous, 1):
        metrics["vote_share_drop"] = float(previous_shares.mean() - shares.mean())
    return metrics


@dataclass(frozen=True)
class DriftThresholds:
    """Alert levels: a metric drifts when its value is above the threshold named by it or its family."""

    psi: float = 0.25  # major shift (Siddiqi 2006)
    ks: float = 0.2  # KS statistic
    # Calibrated on gsm_symbolic questions with all-MiniLM-L6-v2 (150 current vs 300 reference):
    # same distribution ~0.01 / ~0.0, 10% off-topic prompts ~0.03 / ~0.07, 20% ~0.06 / ~0.13.
    mean_cosine_distance: float = 0.05  # biased upward for small sets: ~0.06 at 30 vs 30, no drift
    mmd: float = 0.1  # square root of the unbiased MMD² of the embeddings
    format_compliance_drop: float = 0.05  # absolute drop in the rate of well-formed completions
    vote_share_drop: float = 0.1  # absolute drop in the mean majority vote share
    verified_reward_drop: float = 0.1  # drop of the mean reward on traffic with ground truth vs the evaluation


class DriftCheck(NamedTuple):
    """One metric against its threshold; threshold None means no threshold applies to it. ``task``: the
    task whose requests it measures (None: the whole window)."""

    name: str
    value: float
    threshold: float | None
    drifted: bool
    task: str | None = None

    @property
    def label(self) -> str:
        return check_label(self.task, self.name)


def check_label(task: str | None, metric: str) -> str:
    """How a report names a metric: as it is for the whole window, ``[task] metric`` for one task's requests."""
    return metric if task is None else f"[{task}] {metric}"


def evaluate_drift(metrics: Mapping[str, float], thresholds: DriftThresholds = DriftThresholds(), task: str | None = None) -> list[DriftCheck]:
    """Compare each metric with the threshold field named like it (``psi/num_words`` -> ``psi``).

    drifted = value > threshold. Metrics without a threshold (counts, p-values, bandwidths) are
    listed with threshold None and never drift; a NaN value (no data) does not drift either.
    """
    limits = {field.name: getattr(thresholds, field.name) for field in fields(thresholds)}
    checks = []
    for name, value in metrics.items():
        threshold = limits.get(name.split("/", 1)[0])
        drifted = threshold is not None and not np.isnan(value) and value > threshold
        checks.append(DriftCheck(name, float(value), threshold, bool(drifted), task))
    return checks


@dataclass(frozen=True)
class DriftReport:
    """A window of traffic against its references: every metric, each checked against its threshold.
    ``metrics`` are the whole window's; ``task_metrics`` each task's; ``notes`` say what a task's checks left out."""

    metrics: dict[str, float]
    checks: list[DriftCheck]
    task_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def drifted(self) -> list[DriftCheck]:
        return [c for c in self.checks if c.drifted]

    def reasons(self) -> list[str]:
        return [f"{c.label}={c.value:.3f} > {c.threshold}" for c in self.drifted]

    def table(self) -> str:
        """The checks as a Markdown table (task ``all``: the whole window)."""
        return "| task | metric | value | threshold | drifted |\n|---|---|---|---|---|\n" + "\n".join(
            f"| {c.task or 'all'} | {c.name} | {c.value:.4f} | {'' if c.threshold is None else c.threshold} | {'**yes**' if c.drifted else ''} |"
            for c in self.checks
        )

    def history_rows(self, run_id: str, reported_at, day: str | None = None) -> pd.DataFrame:
        """One row per check, as the drift history keeps them (``day``: the traffic day reported on; ``task``
        None: the whole window)."""
        return pd.DataFrame(
            [
                {
                    "reported_at": reported_at,
                    "run_id": run_id,
                    "metric": c.name,
                    "value": c.value,
                    "threshold": c.threshold,
                    "drifted": c.drifted,
                    "day": day,
                    "task": c.task,
                }
                for c in self.checks
            ]
        )


def traffic_drift(
    reference_questions: Sequence[str],
    current: pd.DataFrame,
    previous: pd.DataFrame | None = None,
    evaluation: pd.DataFrame | None = None,
    thresholds: DriftThresholds = DriftThresholds(),
    embed: Callable[[list[str]], np.ndarray] | None = None,
    min_previous: int = 1,
    task: str | None = None,
) -> DriftReport:
    """:func:`input_drift` of the window's prompts and :func:`output_drift` of its outputs, checked
    against ``thresholds`` (:func:`evaluate_drift`); ``task``: the task all of the window's requests are of."""
    metrics = input_drift(reference_questions, current["prompt"].tolist(), embed)
    metrics |= output_drift(current, evaluation, previous, min_previous)
    return DriftReport(metrics, evaluate_drift(metrics, thresholds, task))


def drift_by_task(
    reference_questions: Sequence[str],
    task_references: Mapping[str, Sequence[str]],
    current: pd.DataFrame,
    previous: pd.DataFrame | None = None,
    evaluations: Mapping[str, pd.DataFrame | None] | None = None,
    thresholds: DriftThresholds = DriftThresholds(),
    embed: Callable[[list[str]], np.ndarray] | None = None,
    min_requests: int = 1,
) -> DriftReport:
    """Drift of a window of requests of several tasks (column ``task``; None: no task, e.g. the OpenAI routes).

    The whole window: :func:`input_drift` of every prompt against ``reference_questions`` (the served
    policy's training mixture). Each task with ``min_requests`` requests: :func:`traffic_drift` of them against
    that task's own train questions (``task_references``), its requests of ``previous`` and its evaluation
    (``evaluations``), so its outputs are held to its own format rate. Requests without a task count in the
    whole window only; what a task's checks left out is in ``notes``.
    """
    embed = memoized(embed) if embed is not None else None
    metrics = input_drift(reference_questions, _prompts(current), embed) if len(reference_questions) >= 2 else {}
    report = DriftReport(metrics, evaluate_drift(metrics, thresholds))
    for task, requests in current.dropna(subset=["task"]).groupby("task", sort=True):
        if len(requests) < min_requests:
            report.notes[task] = f"not checked: {len(requests)} requests < {min_requests}"
            continue
        reference = list(task_references.get(task) or [])
        evaluation = (evaluations or {}).get(task)
        earlier = previous[previous["task"] == task] if previous is not None and "task" in previous else None
        task_metrics = input_drift(reference, _prompts(requests), embed) if len(reference) >= 2 else {}
        task_metrics |= output_drift(requests, evaluation, earlier, min_requests)
        report.task_metrics[task] = task_metrics
        report.checks.extend(evaluate_drift(task_metrics, thresholds, task))
        unchecked = ["inputs (no train questions)"] if len(reference) < 2 else []
        unchecked += ["format and reward (no evaluation)"] if evaluation is None else []
        if unchecked:
            report.notes[task] = "unchecked: " + ", ".join(unchecked)
    return report


def memoized(embed: Callable[[list[str]], np.ndarray]) -> Callable[[list[str]], np.ndarray]:
    """``embed`` embedding each distinct text once: the whole window and its tasks share prompts and references."""
    cache: dict[str, np.ndarray] = {}

    def embed_once(texts: list[str]) -> np.ndarray:
        new = [t for t in dict.fromkeys(texts) if t not in cache]
        if new:
            cache.update(zip(new, embed(new)))
        return np.stack([cache[t] for t in texts]) if texts else embed([])

    return embed_once


def _prompts(requests: pd.DataFrame) -> list[str]:
    return [p for p in requests["prompt"] if isinstance(p, str)]


def history_curves(history: pd.DataFrame, labels: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """(report index, value) of each of ``labels`` (:attr:`DriftCheck.label`) over a drift history (oldest first)."""
    tasks = history["task"] if "task" in history else pd.Series(None, index=history.index, dtype=object)
    named = history.assign(label=[check_label(t if isinstance(t, str) else None, m) for t, m in zip(tasks, history["metric"])])
    watched = named[named["label"].isin(list(labels))]
    return {name: list(zip(range(len(group)), group["value"])) for name, group in watched.groupby("label")}


def _bin_labels(reference: pd.Series, current: pd.Series, bins: int) -> tuple[np.ndarray, np.ndarray]:
    numeric = pd.api.types.is_numeric_dtype(reference) and pd.api.types.is_numeric_dtype(current)
    distinct = reference.dropna().unique()
    if numeric and len(distinct) > bins:
        ref_values = reference.to_numpy(dtype=np.float64)
        edges = np.unique(np.nanquantile(ref_values, np.linspace(0, 1, bins + 1)[1:-1]))

        def labels(series: pd.Series) -> np.ndarray:
            values = series.to_numpy(dtype=np.float64)
            return np.where(np.isnan(values), -1, np.searchsorted(edges, values, side="right"))

        return labels(reference), labels(current)
    categories = {value: index for index, value in enumerate(distinct)}

    def category_labels(series: pd.Series) -> np.ndarray:
        return np.array([-1 if pd.isna(v) else categories.get(v, len(categories)) for v in series], dtype=np.int64)

    return category_labels(reference), category_labels(current)


def _proportions(labels: np.ndarray, all_labels: np.ndarray) -> np.ndarray:
    values, counts = np.unique(labels, return_counts=True)
    proportions = np.zeros(len(all_labels))
    proportions[np.searchsorted(all_labels, values)] = counts / len(labels)
    return proportions


def _subsample(values: np.ndarray, max_samples: int, rng: np.random.Generator) -> np.ndarray:
    if len(values) <= max_samples:
        return values
    return values[rng.choice(len(values), size=max_samples, replace=False)]


def _mmd2(kernel: np.ndarray, is_x: np.ndarray) -> float:
    x = is_x.astype(np.float64)
    y = 1.0 - x
    n_x, n_y = x.sum(), y.sum()
    diagonal = np.diag(kernel)
    within_x = (x @ kernel @ x - diagonal @ x) / (n_x * (n_x - 1))
    within_y = (y @ kernel @ y - diagonal @ y) / (n_y * (n_y - 1))
    return float(within_x + within_y - 2 * (x @ kernel @ y) / (n_x * n_y))
