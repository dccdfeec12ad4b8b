"""The evaluation runner: grading rules on hand-written completions, mechanics with a tiny model."""

import pytest

from rlvr.evaluation.report import evaluation_report, moved_accuracy, significance_verdict, stage_moves
from rlvr.evaluation.runner import EvalConfig, compare, evaluate_policy, grade_completion, grade_samples, summarize
from rlvr.policy import load_policy


def test_grade_completion_strict_vs_flexible():
    strict = grade_completion("3 + 4 = 7\n#### 7", 7)
    assert strict["correct_strict"] and strict["correct_flexible"] and strict["well_formed"]
    flexible_only = grade_completion("so the answer is 7.", 7)
    assert not flexible_only["correct_strict"] and flexible_only["correct_flexible"]
    assert not flexible_only["well_formed"] and flexible_only["extracted_strict"] is None
    wrong = grade_completion("#### 8\nThe answer is: 8", 7)
    assert not wrong["correct_strict"] and not wrong["well_formed"] and wrong["extracted_strict"] == "8"


def test_grade_samples_majority_and_maj_at_k():
    texts = ["#### 7", "#### 7.0", "#### 8", "no answer", "#### 8"]
    graded = grade_samples(texts, 7, ks=[1, 5])
    assert graded["num_correct_samples"] == 2
    assert graded["majority_answer"] == "7" and graded["vote_share"] == pytest.approx(2 / 5)  # "7.0" normalizes to "7"
    assert graded["maj_at_5"] == 1.0  # tie 2-2 between correct and 8: first seen (correct) wins
    assert graded["maj_at_1"] == pytest.approx(2 / 5)


def test_evaluate_and_summarize_with_a_tiny_model(tiny_llama_dir):
    model, tokenizer = load_policy(tiny_llama_dir)
    problems = [
        {"problem_id": f"p{i}", "question": f"What is {i} + {i}?", "answer_value": 2.0 * i, "answer_text": str(2 * i), "num_steps": 1 + i % 2} for i in range(5)
    ]
    seen = []
    config = EvalConfig(max_new_tokens=8, num_samples=3, ks=[1, 3], batch_rows=4)
    results = evaluate_policy(model, tokenizer, problems, config, progress=lambda done, total: seen.append((done, total)))
    assert [r["problem_id"] for r in results] == [p["problem_id"] for p in problems]
    assert seen[-1] == (20, 20) and len(seen) > 2  # 5 greedy + 15 sampled completions, reported in chunks
    assert all(r["completion_tokens"] <= 8 and r["num_samples"] == 3 for r in results)
    again = evaluate_policy(model, tokenizer, problems, config)
    assert [r["completion"] for r in again] == [r["completion"] for r in results]  # seeded: reproducible
    metrics = summarize(results, config)
    assert metrics["num_problems"] == 5 and 0 <= metrics["pass@1_strict"] <= metrics["pass@1_strict_ci_high"] <= 1
    assert {"pass@3", "maj@3", "mean_reward_total", "mean_reward_math_answer", "truncation_rate"} <= set(metrics)
    assert sorted(row["group"] for row in metrics["accuracy_by_steps"]) == [1, 2]
    lm_eval = [r["correct_lm_eval_flexible"] for r in results]  # lm-evaluation-harness's grading, beside ours
    assert metrics["pass@1_lm_eval_flexible"] == pytest.approx(sum(lm_eval) / 5) and "pass@1_lm_eval_strict_ci_high" in metrics
    older = summarize([{k: v for k, v in r.items() if not k.startswith("correct_lm_eval")} for r in results], config)
    assert "pass@1_lm_eval_strict" not in older and older["pass@1_strict"] == metrics["pass@1_strict"]  # rows stored before the column


def test_compare_pairs_by_problem_id():
    base = [{"problem_id": f"p{i}", "correct_strict": i < 2} for i in range(10)]
    new = [{"problem_id": f"p{i}", "correct_strict": i < 8} for i in reversed(range(10))]
    result = compare(base, new)
    assert result["shared_problems"] == 10 and result["delta"] == pytest.approx(0.6)
    assert result["new_only_correct"] == 6 and result["base_only_correct"] == 0
    assert result["mcnemar_p_value"] < 0.05
    base_flexible, new_flexible = [dict(r, correct_flexible=not r["correct_strict"]) for r in base], [dict(r, correct_flexible=True) for r in new]
    flexible = compare(base_flexible, new_flexible, column="correct_flexible")
    assert flexible["delta"] == pytest.approx(0.2) and flexible["new_only_correct"] == 2  # the column asked for, not strict
    with pytest.raises(ValueError, match="share no problems"):
        compare(base, [{"problem_id": "other", "correct_strict": True}])


def test_stage_moves_name_the_stage_that_moved_accuracy():
    def rows(correct: int, formatted: int = 100) -> list[dict]:
        return [
            {"problem_id": f"p{i}", "correct_strict": i < correct, "correct_flexible": i < correct, "well_formed": i < formatted}
            | {"truncated": False, "completion_tokens": 50, "num_steps": 2}
            for i in range(100)
        ]

    config = EvalConfig()
    moves = stage_moves([("base", rows(5, 40)), ("SFT", rows(30, 95)), ("GRPO", rows(31, 96))], config)
    assert [m["stage"] for m in moves] == ["base", "SFT", "GRPO"] and [m.get("verdict") for m in moves] == [None, "better", "not significantly different"]
    assert moves[1]["delta"] == pytest.approx(0.25) and moves[1]["format_delta"] == pytest.approx(0.55)
    assert moved_accuracy(moves).endswith("accuracy moved at SFT")
    flat = stage_moves([("base", rows(5, 40)), ("GRPO", rows(6, 90))], config)
    assert moved_accuracy(flat).endswith("no stage moved accuracy significantly; format compliance moved most at GRPO (+50.0%)")


def test_significance_verdict():
    assert significance_verdict(0.1, 0.01) == "better" and significance_verdict(-0.1, 0.01) == "worse"
    assert significance_verdict(0.3, 0.06) == "not significantly different"
    assert significance_verdict(0.3, 0.06, alpha=0.1) == "better"


def test_evaluation_report_of_two_result_sets():
    def results(correct):
        return [
            {
                "problem_id": f"p{i}",
                "num_steps": 1 + i % 3,
                "correct_strict": ok,
                "correct_flexible": ok,
                "well_formed": True,
                "truncated": False,
                "completion_tokens": 10,
                "reward_total": float(ok),
                "reward_math_answer": float(ok),
            }
            for i, ok in enumerate(correct)
        ]

    base, trained = results([i < 5 for i in range(40)]), results([i < 30 for i in range(40)])
    report = evaluation_report(base, trained, EvalConfig(), "t1", "b1", "test", {"reward_mean": [(1, 0.2), (2, 0.4)]})
    assert report.verdict == "better" and report.paired["new_only_correct"] == 25
    assert "**better**" in report.markdown and "`t1` vs base `b1`" in report.markdown and "split `test`" in report.markdown
    assert set(report.figures) == {"accuracy.png", "reward_histogram.png", "accuracy_by_steps.png", "training_curves.png"}
    assert all(png.startswith(b"\x89PNG") for png in report.figures.values())
    metrics = report.metrics()
    assert metrics["trained.pass@1_strict"] == 0.75 and metrics["base.pass@1_strict"] == 0.125
    assert metrics["paired.delta"] == pytest.approx(0.625) and "paired.mcnemar_method" not in metrics  # numbers only
    assert report.markdown_with_figures().count("](data:image/png;base64,") == 4
