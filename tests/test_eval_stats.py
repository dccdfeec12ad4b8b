"""Evaluation statistics against hand-computed cases and scipy's reference implementations."""

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from rlvr.evaluation import (
    accuracy_by_group,
    bootstrap_ci,
    decide_promotion,
    maj_at_k,
    majority_vote,
    mcnemar_test,
    paired_bootstrap,
    pass_at_k,
    pass_at_k_per_problem,
    wilson_interval,
)

# pass@k ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 1 - math.comb(3, 2) / math.comb(5, 2)),  # 0.7
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 4, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (5, 5, 3, 1.0),
        (5, 1, 5, 1.0),
        (10, 3, 4, 1 - math.comb(7, 4) / math.comb(10, 4)),
    ],
)
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct():
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)


def test_pass_at_k_per_problem_matches_scalar_and_exact_combinatorics():
    cases = [(n, c, k) for n in (1, 2, 5, 16, 200) for c in range(0, n + 1, max(1, n // 7)) for k in sorted({1, 2, n // 2, n}) if 1 <= k <= n]
    for n, c, k in cases:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-10)
    ns, cs = np.array([n for n, _, _ in cases]), np.array([c for _, c, _ in cases])
    for k in (1, 2):
        keep = ns >= k
        vectorized = pass_at_k_per_problem(ns[keep], cs[keep], k)
        scalar = [pass_at_k(int(n), int(c), k) for n, c in zip(ns[keep], cs[keep])]
        np.testing.assert_allclose(vectorized, scalar, atol=1e-10)
    np.testing.assert_allclose(pass_at_k_per_problem(5, [0, 2, 4, 5], 2), [0.0, 0.7, 1.0, 1.0], atol=1e-12)


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        pass_at_k_per_problem([n], [c], k)


# majority vote and maj@k ----------------------------------------------------------------------


def test_majority_vote_counts_abstentions_in_the_share():
    assert majority_vote(["3", "4", "3", None]) == ("3", 0.5)
    assert majority_vote([None, None, None, "7"]) == ("7", 0.25)
    assert majority_vote([None, None]) == (None, 0.0)
    assert majority_vote([]) == (None, 0.0)


def test_majority_vote_ties_go_to_the_first_answer_seen():
    assert majority_vote(["4", "3", "3", "4"]) == ("4", 0.5)
    assert majority_vote(["3", "4", "4", "3"]) == ("3", 0.5)


def test_maj_at_k_hand_cases():
    assert maj_at_k(["7", "7", "3"], "7", k=3) == 1.0
    assert maj_at_k(["3", "3", "7"], "7", k=3) == 0.0
    assert maj_at_k(["7", "7", "3"], "7", k=1) == pytest.approx(2 / 3)
    # pairs: (3,7) -> 3, (3,7) -> 3, (7,7) -> 7: one in three subsets votes correctly
    assert maj_at_k(["3", "7", "7"], "7", k=2) == pytest.approx(1 / 3)
    assert maj_at_k([None, None, "7"], "7", k=2) == pytest.approx(2 / 3)


def test_maj_at_k_sampled_subsets_approximate_the_exact_mean_and_are_seeded():
    rng = np.random.default_rng(1)
    answers = [str(x) for x in rng.choice([1, 2, 3], size=12, p=[0.45, 0.35, 0.2])]
    exact = maj_at_k(answers, "1", k=6, max_subsets=1000)  # C(12, 6) = 924: all subsets
    sampled = maj_at_k(answers, "1", k=6, max_subsets=200, seed=3)
    assert sampled == maj_at_k(answers, "1", k=6, max_subsets=200, seed=3)
    assert abs(sampled - exact) < 0.1
    assert 0.0 < exact < 1.0


# intervals ------------------------------------------------------------------------------------


def test_wilson_interval_hand_values_and_scipy():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 1.959964**2 / (10 + 1.959964**2)), abs=1e-6)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    for successes, n in [(0, 7), (3, 7), (7, 7), (412, 1319)]:
        reference = binomtest(successes, n).proportion_ci(0.9, method="wilson")
        assert wilson_interval(successes, n, 0.9) == pytest.approx((reference.low, reference.high), abs=1e-9)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_bootstrap_ci_of_a_constant_has_zero_width():
    low, high = bootstrap_ci(np.full(50, 0.7), seed=0)
    assert low == high == pytest.approx(0.7)


def test_bootstrap_ci_is_seeded_and_brackets_the_estimate():
    values = np.random.default_rng(0).random(200)
    assert bootstrap_ci(values, seed=5) == bootstrap_ci(values, seed=5)
    low, high = bootstrap_ci(values, seed=5)
    assert low < values.mean() < high
    assert (high - low) == pytest.approx(2 * 1.96 * values.std() / np.sqrt(200), rel=0.15)
    low_median, high_median = bootstrap_ci(values, statistic=np.median, seed=5)
    assert low_median < np.median(values) < high_median


def test_bootstrap_ci_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(42)
    covered = 0
    for trial in range(60):
        sample = rng.random(300) < 0.6
        low, high = bootstrap_ci(sample, n_resamples=1000, seed=trial)
        covered += low <= 0.6 <= high
    assert 50 <= covered <= 60


def test_accuracy_by_group_counts_and_intervals():
    table = accuracy_by_group([1, 0, 1, 1, 0, 1], [2, 2, 3, 3, 3, 5])
    assert table["group"].tolist() == [2, 3, 5]
    assert table["n"].tolist() == [2, 3, 1]
    assert table["correct"].tolist() == [1, 2, 1]
    assert table["accuracy"].tolist() == pytest.approx([0.5, 2 / 3, 1.0])
    assert tuple(table.iloc[1][["ci_low", "ci_high"]]) == pytest.approx(wilson_interval(2, 3))


# paired tests ---------------------------------------------------------------------------------


def _pairs(both: int, base_only: int, new_only: int, neither: int) -> tuple[np.ndarray, np.ndarray]:
    base = [1] * both + [1] * base_only + [0] * new_only + [0] * neither
    new = [1] * both + [0] * base_only + [1] * new_only + [0] * neither
    return np.array(base, dtype=bool), np.array(new, dtype=bool)


@pytest.mark.parametrize("base_only, new_only", [(0, 5), (2, 9), (7, 3), (6, 6), (0, 1), (12, 12)])
def test_mcnemar_exact_matches_scipy_binomtest(base_only, new_only):
    base, new = _pairs(20, base_only, new_only, 10)
    result = mcnemar_test(base, new)
    assert result.method == "exact"
    assert (result.base_only, result.new_only) == (base_only, new_only)
    reference = binomtest(new_only, base_only + new_only, 0.5).pvalue
    assert result.p_value == pytest.approx(reference, rel=1e-12)


def test_mcnemar_chi_square_with_continuity_correction_by_hand():
    base, new = _pairs(100, 30, 15, 40)
    result = mcnemar_test(base, new)
    assert result.method == "chi2"
    statistic = (abs(30 - 15) - 1) ** 2 / 45  # 196 / 45
    assert result.statistic == pytest.approx(statistic)
    assert result.p_value == pytest.approx(math.erfc(math.sqrt(statistic / 2)))  # chi-square, 1 dof
    assert result.p_value == pytest.approx(0.0369, abs=1e-4)


def test_mcnemar_without_discordant_pairs_and_forced_methods():
    base, new = _pairs(10, 0, 0, 5)
    assert mcnemar_test(base, new).p_value == 1.0
    base, new = _pairs(10, 3, 9, 5)
    assert mcnemar_test(base, new, method="chi2").method == "chi2"
    assert mcnemar_test(base, new, method="exact").p_value == pytest.approx(binomtest(9, 12).pvalue)
    with pytest.raises(ValueError):
        mcnemar_test(base, new[:-1])
    with pytest.raises(ValueError):
        mcnemar_test([0.5, 1.0], [1, 0])


def test_paired_bootstrap_sign_and_significance():
    base, new = _pairs(150, 5, 40, 105)
    better = paired_bootstrap(base, new, n_resamples=4000, seed=0)
    assert better.delta == pytest.approx(35 / 300)
    assert 0 < better.ci_low < better.delta < better.ci_high
    assert better.p_value < 0.01
    worse = paired_bootstrap(new, base, n_resamples=4000, seed=0)
    assert worse.delta == pytest.approx(-35 / 300)
    assert worse.ci_high < 0 and worse.p_value < 0.01
    noise = paired_bootstrap(*_pairs(150, 20, 22, 108), n_resamples=4000, seed=0)
    assert noise.ci_low < 0 < noise.ci_high and noise.p_value > 0.5
    same = paired_bootstrap(base, base, n_resamples=500)
    assert same.delta == 0 and same.p_value == 1.0


# promotion ------------------------------------------------------------------------------------


def test_no_champion_promotes():
    decision = decide_promotion(None, [1, 0, 1, 1])
    assert decision.promote and "no champion" in decision.reason
    assert decision.challenger_accuracy == 0.75 and decision.delta is None


def test_better_challenger_is_promoted():
    champion, challenger = _pairs(100, 5, 25, 70)
    decision = decide_promotion(champion, challenger)
    assert decision.promote and decision.reason.startswith("promoted")
    assert decision.delta == pytest.approx(20 / 200)
    assert (decision.challenger_only, decision.champion_only) == (25, 5)


def test_equal_challenger_is_promoted_at_zero_margin():
    champion, challenger = _pairs(100, 10, 10, 80)
    assert decide_promotion(champion, challenger).promote


def test_clearly_worse_challenger_is_refused_with_reasons():
    champion, challenger = _pairs(100, 30, 5, 65)
    decision = decide_promotion(champion, challenger, margin=0.01)
    assert not decision.promote
    assert decision.reason.startswith("kept champion")
    assert "below -margin" in decision.reason and "significantly worse" in decision.reason
    assert decision.p_value == pytest.approx(binomtest(5, 35, alternative="less").pvalue)


def test_slightly_worse_challenger_within_margin_is_promoted():
    champion, challenger = _pairs(100, 12, 10, 78)  # delta = -0.01
    assert not decide_promotion(champion, challenger, margin=0.0).promote
    decision = decide_promotion(champion, challenger, margin=0.01)
    assert decision.promote and decision.delta == pytest.approx(-0.01)


def test_within_margin_but_significantly_worse_is_refused():
    champion, challenger = _pairs(5000, 100, 40, 4860)  # delta = -0.006, p ~ 1e-7
    decision = decide_promotion(champion, challenger, margin=0.02)
    assert not decision.promote
    assert "significantly worse" in decision.reason and "below -margin" not in decision.reason


def test_a_challenger_that_already_is_the_champion_stays_without_a_test():
    champion, challenger = _pairs(100, 30, 5, 65)  # would be refused if these were two policies
    decision = decide_promotion(champion, challenger, champion_id="registry version 3", challenger_id="registry version 3")
    assert decision.promote and decision.reason == "already champion (registry version 3)"
    assert (decision.delta, decision.p_value) == (0.0, 1.0) and decision.challenger_accuracy == decision.champion_accuracy
    assert decide_promotion(None, [1, 0], champion_id="v1", challenger_id="v1").reason.startswith("already champion")
    assert not decide_promotion(champion, challenger, champion_id="v1", challenger_id="v2").promote  # two policies: tested


def test_promotion_rejects_unpaired_inputs():
    with pytest.raises(ValueError):
        decide_promotion([1, 0, 1], [1, 0])
    with pytest.raises(ValueError):
        decide_promotion(None, [])
    with pytest.raises(ValueError):
        decide_promotion([1], [1], margin=-0.1)
