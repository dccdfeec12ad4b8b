"""Per-problem accuracy estimators over n sampled completions: pass@k and maj@k."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Sequence

import numpy as np
from scipy.special import gammaln


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples of which c are correct (Chen et al. 2021, §2.1).

    pass@k = 1 - C(n-c, k) / C(n, k), computed as the stable product
    1 - prod_{i=n-c+1}^{n} (1 - k/i) of the paper's reference code; 1 when n - c < k.
    """
    _check_counts(n, c, k)
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_per_problem(n: Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """Vectorized :func:`pass_at_k` over problems; the benchmark score is the mean of the result.

    Uses C(n-c, k) / C(n, k) = exp(lgamma(n-c+1) + lgamma(n-k+1) - lgamma(n-c-k+1) - lgamma(n+1)).
    ``n`` may be a scalar (the same number of samples for every problem).
    """
    c = np.asarray(c, dtype=np.int64)
    n = np.broadcast_to(np.asarray(n, dtype=np.int64), c.shape)
    if k < 1 or np.any(n < k) or np.any(c < 0) or np.any(c > n):
        raise ValueError("need 1 <= k <= n and 0 <= c <= n for every problem")
    estimate = np.ones(c.shape, dtype=np.float64)
    some_wrong = n - c >= k
    nw, cw = n[some_wrong], c[some_wrong]
    log_ratio = gammaln(nw - cw + 1) + gammaln(nw - k + 1) - gammaln(nw - cw - k + 1) - gammaln(nw + 1)
    estimate[some_wrong] = -np.expm1(log_ratio)
    return estimate


def majority_vote(answers: Sequence[str | None]) -> tuple[str | None, float]:
    """Most frequent answer and its vote share, as in self-consistency (Wang et al. 2022).

    ``None`` (no answer extracted) is an abstention: it never wins, but it counts in the
    denominator, so vote_share = votes(winner) / len(answers). All None (or empty) -> (None, 0.0).
    Ties go to the answer that appears first in ``answers``; samples are i.i.d., so this is a
    uniformly random tie-break in expectation, and it is deterministic for a given order.
    """
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None, 0.0
    winner, count = votes.most_common(1)[0]  # Counter keeps first-seen order among equal counts
    return winner, count / len(answers)


def maj_at_k(answers: Sequence[str | None], reference: str, k: int, max_subsets: int = 256, seed: int = 0) -> float:
    """maj@k of one problem: probability that the majority vote of k of its n samples is correct.

    Answers and reference must be normalized texts (:func:`rlvr.answers.normalize_answer`); a
    correct vote is string equality. For k = n this is 0 or 1. For k < n it is the mean over all
    C(n, k) subsets of size k when there are at most ``max_subsets`` of them (exact), otherwise
    over ``max_subsets`` subsets drawn uniformly without replacement with ``seed`` (each subset
    keeps sample order, so ties follow :func:`majority_vote`).
    """
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if math.comb(n, k) <= max_subsets:
        subsets = itertools.combinations(range(n), k)
    else:
        rng = np.random.default_rng(seed)
        subsets = (np.sort(rng.choice(n, size=k, replace=False)) for _ in range(max_subsets))
    hits = [majority_vote([answers[i] for i in subset])[0] == reference for subset in subsets]
    return float(np.mean(hits))


def _check_counts(n: int, c: int, k: int) -> None:
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
