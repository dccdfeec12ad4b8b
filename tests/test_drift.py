"""Drift statistics: PSI, KS, prompt features, thresholds, and embedding drift with the real model."""

import numpy as np
import pandas as pd
import pytest

from rlvr.monitoring.drift import (
    DriftThresholds,
    drift_by_task,
    embedding_drift,
    evaluate_drift,
    feature_drift,
    history_curves,
    ks_statistic,
    memoized,
    output_drift,
    population_stability_index,
    traffic_drift,
)
from rlvr.monitoring.prompt_features import PROMPT_FEATURES, prompt_features

# PSI and KS -----------------------------------------------------------------------------------


def test_psi_is_zero_for_identical_samples():
    values = np.random.default_rng(0).normal(size=500)
    assert population_stability_index(values, values) == 0.0
    assert population_stability_index([1, 2, 2, 3], [3, 2, 1, 2]) == 0.0


def test_psi_is_small_for_the_same_distribution_and_large_for_a_shift():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=5000)
    assert population_stability_index(reference, rng.normal(size=5000)) < 0.02
    shifted = population_stability_index(reference, rng.normal(loc=1.0, size=5000))
    assert shifted > 0.25
    assert population_stability_index(reference, rng.normal(loc=0.3, size=5000)) < shifted


def test_psi_is_roughly_symmetric():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=4000), rng.normal(loc=0.5, scale=1.2, size=4000)
    forward, backward = population_stability_index(a, b), population_stability_index(b, a)
    assert 0.5 < forward / backward < 2.0


def test_psi_hand_computed_for_a_discrete_feature():
    # bins {0, 1}: p_ref = (0.5, 0.5), p_cur = (0.25, 0.75)
    expected = (0.25 - 0.5) * np.log(0.25 / 0.5) + (0.75 - 0.5) * np.log(0.75 / 0.5)
    assert population_stability_index([0, 1, 0, 1], [0, 1, 1, 1]) == pytest.approx(expected)


def test_psi_counts_unseen_categories_out_of_range_values_and_nan():
    assert population_stability_index(["a", "b"] * 50, ["a", "b", "c", "c"] * 25) > 0.25
    reference = np.arange(100, dtype=float)
    assert population_stability_index(reference, reference + 1000) > 1.0  # all in the top bin
    with_nan = np.where(np.arange(100) % 2 == 0, np.nan, reference)
    assert population_stability_index(reference, with_nan) > 1.0
    assert population_stability_index(with_nan, with_nan) == 0.0


def test_ks_detects_a_shift_and_ignores_nan():
    rng = np.random.default_rng(2)
    reference = rng.normal(size=400)
    same_statistic, same_p = ks_statistic(reference, rng.normal(size=400))
    shift_statistic, shift_p = ks_statistic(reference, np.append(rng.normal(loc=0.8, size=400), np.nan))
    assert same_p > 0.01 and shift_p < 1e-6
    assert shift_statistic > 0.25 > same_statistic
    assert np.isnan(ks_statistic([np.nan], [1.0])[0])


# prompt features ------------------------------------------------------------------------------


def test_prompt_features_of_a_known_question():
    question = "Tom buys 3 apples at $1,250.50 each. He sells 2. How many are left?"
    row = prompt_features([question]).iloc[0]
    assert row["num_chars"] == len(question)
    assert row["num_words"] == 14
    assert row["num_numbers"] == 3
    assert row["max_log10_number"] == pytest.approx(np.log10(1251.5))
    assert row["mean_log10_number"] == pytest.approx((np.log10(4) + np.log10(1251.5) + np.log10(3)) / 3)
    assert row["num_sentences"] == 3


def test_prompt_features_without_numbers_or_final_punctuation():
    frame = prompt_features(["no numbers here", ""])
    assert list(frame.columns) == list(PROMPT_FEATURES)
    assert frame.loc[0, ["num_numbers", "max_log10_number", "num_sentences"]].tolist() == [0, 0.0, 1]
    assert frame.loc[1, ["num_chars", "num_words", "num_sentences"]].tolist() == [0, 0, 0]


def test_feature_drift_names_metrics_by_family_and_feature():
    reference = prompt_features(["A has 3 pens. B has 4. How many?"] * 20)
    metrics = feature_drift(reference, reference)
    assert set(metrics) == {f"{family}/{name}" for family in ("psi", "ks") for name in PROMPT_FEATURES}
    assert all(value == 0.0 for value in metrics.values())


# thresholds -----------------------------------------------------------------------------------


def test_evaluate_drift_thresholds_by_family_and_skips_unthresholded_metrics():
    metrics = {
        "psi/num_words": 0.3,
        "psi/num_numbers": 0.05,
        "ks/num_chars": 0.1,
        "mean_cosine_distance": 0.2,
        "mmd_p_value": 0.001,
        "format_compliance_drop": float("nan"),
    }
    checks = {check.name: check for check in evaluate_drift(metrics, DriftThresholds(psi=0.25, ks=0.2))}
    assert checks["psi/num_words"] == ("psi/num_words", 0.3, 0.25, True, None)  # None: the whole window, no task
    assert not checks["psi/num_numbers"].drifted and not checks["ks/num_chars"].drifted
    assert checks["mean_cosine_distance"].drifted
    assert checks["mmd_p_value"].threshold is None and not checks["mmd_p_value"].drifted
    assert not checks["format_compliance_drop"].drifted


def test_output_drift_against_the_evaluation_and_the_previous_window():
    lengths = list(range(10))
    evaluation = pd.DataFrame({"well_formed": [1.0] * 9 + [0.0], "completion_chars": lengths, "reward_total": [0.8] * 10})
    current = pd.DataFrame(
        {
            "well_formed": [1.0] * 6 + [0.0] * 4,
            "completion_chars": lengths,
            "vote_share": [0.5] * 10,
            "ground_truth": ["7"] * 4 + [None] * 6,
            "mean_reward": [0.5] * 4 + [0.1] * 6,
        }
    )
    previous = pd.DataFrame({"vote_share": [1.0] * 10})
    metrics = output_drift(current, evaluation, previous)
    assert metrics["format_compliance_drop"] == pytest.approx(0.3)
    assert metrics["psi/completion_chars"] == 0.0
    assert metrics["verified_reward_mean"] == pytest.approx(0.5)  # requests with a ground truth only
    assert metrics["verified_reward_drop"] == pytest.approx(0.3)
    assert metrics["vote_share_drop"] == pytest.approx(0.5)
    drifted = {check.name for check in evaluate_drift(metrics) if check.drifted}
    assert drifted == {"format_compliance_drop", "verified_reward_drop", "vote_share_drop"}
    # a missing reference leaves its metrics out
    assert output_drift(current) == {}
    assert "vote_share_drop" not in output_drift(current, evaluation, previous.head(3), min_previous=5)


def test_traffic_drift_reports_every_check_and_its_history():
    questions = [f"Tom has {i} apples and buys {i + 3} more. How many apples does he have now?" for i in range(60)]
    off_topic = [f"Write a poem about the sea at night, verse {i}, in the style of a sailor's song." for i in range(60)]
    window = pd.DataFrame({"prompt": off_topic, "well_formed": 1.0, "completion_chars": 40.0, "vote_share": 1.0, "ground_truth": None, "mean_reward": None})
    same = traffic_drift(questions, window.assign(prompt=questions))
    assert not same.drifted and same.metrics["psi/num_words"] == 0.0
    report = traffic_drift(questions, window, thresholds=DriftThresholds(psi=0.25))
    assert report.drifted and all(reason.split("=")[0] in report.metrics for reason in report.reasons())
    assert "**yes**" in report.table() and report.table().count("\n") == len(report.checks) + 1
    rows = report.history_rows("run-1", pd.Timestamp("2026-01-01", tz="UTC"), day="2026-01-01")
    assert list(rows.columns) == ["reported_at", "run_id", "metric", "value", "threshold", "drifted", "day", "task"] and set(rows["day"]) == {"2026-01-01"}
    history = pd.concat([same.history_rows("run-0", pd.Timestamp("2025-12-31", tz="UTC")), rows])
    curves = history_curves(history, ["psi/num_words"])
    assert curves == {"psi/num_words": [(0, 0.0), (1, report.metrics["psi/num_words"])]}


_RNG = np.random.default_rng(0)
ARITHMETIC = [f"Calculate {a} + {b} * {c}." for a, b, c in _RNG.integers(1, 1000, size=(400, 3))]  # a reasoning-gym-like task's questions
WORD_PROBLEMS = [f"Tom has {a} apples and buys {b} more at the market. How many apples does he have now?" for a, b in _RNG.integers(1, 100, size=(400, 2))]


def requests(prompts, task, well_formed=1.0, vote_share=1.0):
    return pd.DataFrame(
        {
            "prompt": prompts,
            "task": task,
            "well_formed": well_formed,
            "completion_chars": 40.0,
            "vote_share": vote_share,
            "ground_truth": None,
            "mean_reward": None,
        }
    )


def test_drift_by_task_holds_each_task_to_its_own_questions_and_format():
    references = {"arith": ARITHMETIC[::2], "gsm8k": WORD_PROBLEMS[::2]}  # each task's train questions; the traffic: the others
    evaluations = {"arith": pd.DataFrame({"well_formed": [1.0] * 10, "completion_chars": [40.0] * 10, "reward_total": [1.0] * 10})}
    no_task = requests(WORD_PROBLEMS[1:10:2], None, well_formed=None)  # e.g. the OpenAI routes: the whole window only
    window = pd.concat([requests(ARITHMETIC[1::2], "arith"), requests(WORD_PROBLEMS[1::2], "gsm8k"), no_task])
    mixture = ARITHMETIC[::4] + WORD_PROBLEMS[::4]
    report = drift_by_task(mixture, references, window, evaluations=evaluations, min_requests=10)
    assert not report.drifted, report.reasons()
    assert set(report.task_metrics) == {"arith", "gsm8k"} and {c.task for c in report.checks} == {None, "arith", "gsm8k"}
    assert report.task_metrics["arith"]["format_compliance_drop"] == 0.0  # against its own evaluation's rate
    assert "format_compliance_drop" not in report.task_metrics["gsm8k"] and "no evaluation" in report.notes["gsm8k"]
    # word problems sent to the arithmetic task drift from its questions; GSM8k's requests do not move
    swapped = pd.concat([requests(WORD_PROBLEMS[1::2], "arith"), requests(WORD_PROBLEMS[1::2], "gsm8k")])
    drifted = drift_by_task(mixture, references, swapped, min_requests=10)
    assert {c.task for c in drifted.drifted} >= {"arith"} and "gsm8k" not in {c.task for c in drifted.drifted}
    assert any(reason.startswith("[arith] psi/") for reason in drifted.reasons())
    # its completions out of its own format drop its format compliance
    unformatted = drift_by_task(ARITHMETIC[::2], references, requests(ARITHMETIC[1::2], "arith", well_formed=0.0), evaluations=evaluations, min_requests=10)
    assert [c.label for c in unformatted.drifted] == ["[arith] format_compliance_drop"]


def test_drift_by_task_leaves_out_tasks_with_too_few_requests_and_compares_vote_share_within_a_task():
    references = {"arith": ARITHMETIC[::2]}
    window = pd.concat([requests(ARITHMETIC[1::2], "arith", vote_share=0.5), requests(ARITHMETIC[1:6:2], "other")])
    previous = pd.concat([requests(ARITHMETIC[1::2], "arith", vote_share=1.0), requests(ARITHMETIC[1::2], "other", vote_share=0.0)])
    report = drift_by_task(ARITHMETIC[::2], references, window, previous, min_requests=10)
    assert "other" not in report.task_metrics and report.notes["other"] == "not checked: 3 requests < 10"
    assert report.task_metrics["arith"]["vote_share_drop"] == pytest.approx(0.5)  # its own earlier requests, not the other task's
    assert [c.label for c in report.drifted] == ["[arith] vote_share_drop"]


def test_memoized_embeds_each_distinct_text_once():
    seen = []

    def embed(texts):
        seen.extend(texts)
        return np.array([[len(t), 1.0] for t in texts])

    once = memoized(embed)
    np.testing.assert_array_equal(once(["ab", "c", "ab"]), [[2, 1], [1, 1], [2, 1]])
    np.testing.assert_array_equal(once(["c", "def"]), [[1, 1], [3, 1]])
    assert seen == ["ab", "c", "def"]


def test_history_curves_follow_each_tasks_metric_apart():
    history = pd.DataFrame(
        {"metric": ["psi/num_words"] * 4, "value": [0.1, 0.2, 0.3, 0.4], "task": [None, "arith", None, "arith"]},
    )
    assert history_curves(history, ["psi/num_words", "[arith] psi/num_words"]) == {
        "psi/num_words": [(0, 0.1), (1, 0.3)],
        "[arith] psi/num_words": [(0, 0.2), (1, 0.4)],
    }


# embedding drift ------------------------------------------------------------------------------


def test_embedding_drift_on_synthetic_vectors():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(200, 16))
    same = embedding_drift(reference, reference)
    assert same["mmd"] == 0.0 and same["mean_cosine_distance"] == pytest.approx(0.0, abs=1e-9)
    shifted = embedding_drift(reference, rng.normal(loc=0.5, size=(200, 16)), n_permutations=50)
    assert shifted["mmd"] > 0.2 and shifted["mmd_p_value"] < 0.05
    fresh = embedding_drift(reference, rng.normal(size=(200, 16)), n_permutations=50)
    assert fresh["mmd"] < 0.05 and fresh["mmd_p_value"] > 0.05
    assert embedding_drift(reference, reference[:5], max_samples=3)["n_current"] == 3
    with pytest.raises(ValueError):
        embedding_drift(reference, reference[:1])


GSM8K_LIKE = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of babysitting. How much did she earn?",
    "Betty needs $100 for a new wallet. She has half of the money, her parents give her $15 and her "
    "grandparents twice as much. How much more money does she need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Mark has a garden with 10 yellow flowers and 80% more purple ones. How many flowers does Mark have?",
    "Albert buys 2 large pizzas with 16 slices each and 2 small pizzas with 8 slices each. How many slices does he eat if he eats them all?",
    "A bakery sells 120 muffins a day at $2 each. How much money does it make in a week?",
]
UNRELATED = [
    "Whisk the eggs with sugar until pale, fold in the flour and bake at 180C for 25 minutes.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Sauté the onions in olive oil, add garlic and crushed tomatoes, then simmer the sauce.",
    "SELECT name, count(*) FROM users GROUP BY name HAVING count(*) > 1;",
    "The quarterly board meeting is moved to Thursday; please update your calendars.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\nprint(x.mean())",
    "Season the salmon with salt and dill and roast it skin-side down until flaky.",
    "Our hiking trail climbs through pine forest to a lake with a view of the glacier.",
]


@pytest.fixture(scope="module")
def embeddings():
    from rlvr.monitoring.embeddings import embed_texts

    return embed_texts(GSM8K_LIKE, batch_size=3), embed_texts(UNRELATED, batch_size=8)


@pytest.mark.slow
def test_embed_texts_is_normalized_and_independent_of_batching(embeddings):
    from rlvr.monitoring.embeddings import embed_texts

    gsm, _ = embeddings
    assert gsm.shape == (len(GSM8K_LIKE), 384) and gsm.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(gsm, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(embed_texts(GSM8K_LIKE[:4], batch_size=4), gsm[:4], atol=1e-5)
    assert embed_texts([]).shape == (0, 384)


@pytest.mark.slow
def test_embedding_drift_separates_math_questions_from_unrelated_text(embeddings):
    gsm, unrelated = embeddings
    same = embedding_drift(gsm, gsm)
    assert same["mmd"] == 0.0 and same["mean_cosine_distance"] < 1e-6
    within = embedding_drift(gsm[:4], gsm[4:], n_permutations=200)
    across_small = embedding_drift(gsm[:4], unrelated[:4], n_permutations=200)
    assert across_small["mean_cosine_distance"] > within["mean_cosine_distance"] + 0.3
    assert across_small["mmd"] > 2 * within["mmd"] and within["mmd_p_value"] > 0.1
    across = embedding_drift(gsm, unrelated, n_permutations=200)
    assert across["mean_cosine_distance"] > 0.5 and across["mmd"] > 0.2 and across["mmd_p_value"] < 0.05
    checks = {c.name: c.drifted for c in evaluate_drift(across)}
    assert checks["mean_cosine_distance"] and checks["mmd"]
