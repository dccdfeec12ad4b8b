"""Champion/challenger promotion: move the champion only to a policy at least as good on the same problems."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scipy.stats import binom

from rlvr.evaluation.significance import as_correctness, paired_correctness


@dataclass(frozen=True)
class PromotionDecision:
    """Whether to promote the challenger, why, and the numbers the decision used."""

    promote: bool
    reason: str
    challenger_accuracy: float
    champion_accuracy: float | None  # None: there was no champion
    delta: float | None  # challenger - champion accuracy on the shared problems
    p_value: float | None  # one-sided exact McNemar p-value of "challenger is worse"
    challenger_only: int  # problems only the challenger solved
    champion_only: int  # problems only the champion solved
    n: int
    margin: float
    alpha: float


def decide_promotion(
    champion_correct: Sequence[bool] | None,
    challenger_correct: Sequence[bool],
    margin: float = 0.0,
    alpha: float = 0.05,
    *,
    champion_id: str | None = None,
    challenger_id: str | None = None,
) -> PromotionDecision:
    """Decide whether the challenger replaces the champion, from per-problem correctness (same problems, same order).

    With b = champion-only and c = challenger-only solves, delta = (c - b) / n and p = P[X <= c],
    X ~ Binomial(b + c, 1/2): the one-sided exact McNemar test of "challenger is worse" (p = 1 when
    b + c = 0). Promote iff delta >= -margin and p >= alpha; with no champion, always. When
    ``champion_id`` and ``challenger_id`` name the same policy (a gate run again), it stays champion with
    delta 0 and p 1, whatever the arrays.
    """
    if margin < 0 or not 0 < alpha < 1:
        raise ValueError(f"need margin >= 0 and 0 < alpha < 1, got margin={margin}, alpha={alpha}")
    already_champion = champion_id is not None and champion_id == challenger_id
    if already_champion or champion_correct is None:  # nothing to test the challenger against
        challenger = as_correctness(challenger_correct)
        n = int(challenger.size)
        _require_problems(n)
        accuracy = float(challenger.mean())
        return PromotionDecision(
            promote=True,
            reason=f"already champion ({champion_id})" if already_champion else f"no champion yet: promoting challenger (accuracy {accuracy:.4f}, n={n})",
            challenger_accuracy=accuracy,
            champion_accuracy=accuracy if already_champion else None,
            delta=0.0 if already_champion else None,
            p_value=1.0 if already_champion else None,
            challenger_only=0,
            champion_only=0,
            n=n,
            margin=margin,
            alpha=alpha,
        )

    champion, challenger = paired_correctness(champion_correct, challenger_correct)
    n = int(challenger.size)
    _require_problems(n)
    b, c = int((champion & ~challenger).sum()), int((~champion & challenger).sum())
    delta = (c - b) / n
    p_value = float(binom.cdf(c, b + c, 0.5)) if b + c else 1.0
    within_margin = delta >= -margin - 1e-12
    not_worse = p_value >= alpha

    summary = f"challenger {challenger.mean():.4f} vs champion {champion.mean():.4f} on n={n} (delta {delta:+.4f}; challenger-only {c}, champion-only {b})"
    problems = []
    if not within_margin:
        problems.append(f"delta {delta:+.4f} is below -margin ({-margin:+.4f})")
    if not not_worse:
        problems.append(f"challenger significantly worse (one-sided McNemar p={p_value:.4g} < alpha={alpha})")
    if problems:
        reason = "kept champion: " + "; ".join(problems) + f". {summary}"
    else:
        reason = (
            f"promoted: delta {delta:+.4f} >= -margin ({-margin:+.4f}) and not significantly worse "
            f"(one-sided McNemar p={p_value:.4g} >= alpha={alpha}). {summary}"
        )
    return PromotionDecision(
        promote=not problems,
        reason=reason,
        challenger_accuracy=float(challenger.mean()),
        champion_accuracy=float(champion.mean()),
        delta=delta,
        p_value=p_value,
        challenger_only=c,
        champion_only=b,
        n=n,
        margin=margin,
        alpha=alpha,
    )


def _require_problems(n: int) -> None:
    if n == 0:
        raise ValueError("cannot decide a promotion on zero problems")
