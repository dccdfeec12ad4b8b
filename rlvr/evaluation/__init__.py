"""Evaluation statistics: pass@k and maj@k, confidence intervals, paired tests, promotion decisions."""

from rlvr.evaluation.estimators import maj_at_k, majority_vote, pass_at_k, pass_at_k_per_problem
from rlvr.evaluation.intervals import accuracy_by_group, bootstrap_ci, bootstrap_distribution, wilson_interval
from rlvr.evaluation.promotion import PromotionDecision, decide_promotion
from rlvr.evaluation.significance import (
    McNemarResult,
    PairedBootstrapResult,
    as_correctness,
    discordant_counts,
    mcnemar_test,
    paired_bootstrap,
    paired_correctness,
)

__all__ = [
    "McNemarResult",
    "PairedBootstrapResult",
    "PromotionDecision",
    "accuracy_by_group",
    "as_correctness",
    "bootstrap_ci",
    "bootstrap_distribution",
    "decide_promotion",
    "discordant_counts",
    "maj_at_k",
    "majority_vote",
    "mcnemar_test",
    "paired_bootstrap",
    "paired_correctness",
    "pass_at_k",
    "pass_at_k_per_problem",
    "wilson_interval",
]
