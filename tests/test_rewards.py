"""Reward functions on tricky inputs, the registry's error containment, composites and the pool."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import rlvr.rewards.math
from rlvr.rewards import (
    CompositeReward,
    RewardError,
    RewardPool,
    RewardResult,
    get_reward,
    register_reward,
    reward_names,
    score,
)
from rlvr.rewards.sympy_worker import TIMEOUT_S, SymbolicCheckAborted, run_bounded
from rlvr.tasks.gsm8k import REWARDS as GSM8K_REWARDS
from support.reward_cases import GSM8K, unique_name


def test_builtin_rewards_are_registered():
    assert {"math_answer", "math_answer_flexible", "format", "exact_match", "token_f1", "classification", "regression", "code_execution"} <= set(reward_names())


# ---- math_answer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reference, strict, flexible",
    [
        ("48/2 = 24 clips in May.\n#### 72", GSM8K, 1, 1),
        ("#### 72.00", GSM8K, 1, 1),
        ("#### $72", GSM8K, 1, 1),
        ("#### 72 clips", GSM8K, 1, 1),
        ("#### 72.\nHope this helps!", GSM8K, 1, 1),  # trailing text: still correct, not well formed
        ("#### 1,080", {"answer_text": "1080", "answer_value": 1080.0}, 1, 1),
        ("#### -5", {"answer_text": "-5", "answer_value": -5.0}, 1, 1),
        ("#### \u22125", {"answer_text": "-5", "answer_value": -5.0}, 1, 1),  # unicode minus keeps the sign
        ("#### 5", {"answer_text": "-5", "answer_value": -5.0}, 0, 0),
        ("#### 0.5", {"answer_text": "0.5", "answer_value": 0.5}, 1, 1),
        ("#### 72\n#### 71", GSM8K, 0, 0),  # the last #### line wins
        ("#### 71\n#### 72", GSM8K, 1, 1),
        ("The answer is 72.", GSM8K, 0, 1),  # last number: flexible only
        ("so \\boxed{72} clips", GSM8K, 0, 1),
        ("\\boxed{72} but actually 70", GSM8K, 0, 1),  # flexible prefers \boxed over the last number
        ("#### 71", GSM8K, 0, 0),
        ("", GSM8K, 0, 0),
        ("#### ", GSM8K, 0, 0),
        ("72 " * 3 + "#### seventy-two", GSM8K, 0, 1),  # a marker without a number: flexible falls back
        ("#### 72", {"answer_value": "72"}, 1, 1),  # numeric string reference
        ("#### 72", {"answer_text": 72}, 1, 1),  # non-string reference
        ("#### 72", {"answer_value": 72}, 1, 1),
        ("#### 1" + "0" * 5000, GSM8K, 0, 0),  # too large for a float or Python's int parser
    ],
)
def test_math_answer(completion, reference, strict, flexible):
    assert score("math_answer", completion, **reference).value == strict
    assert score("math_answer_flexible", completion, **reference).value == flexible


def test_math_answer_details_report_how_the_answer_was_found():
    strict = score("math_answer", "so #### 72", **GSM8K).details
    assert strict == {"extracted": "72", "method": "hash", "mode": "strict", "strict": True, "match": "numeric"}
    boxed = score("math_answer_flexible", "\\boxed{72}", **GSM8K).details
    assert (boxed["method"], boxed["strict"], boxed["mode"]) == ("boxed", False, "flexible")
    last = score("math_answer_flexible", "it is 72 then", **GSM8K).details
    assert last["method"] == "last_number"
    missing = score("math_answer", "no idea", **GSM8K).details
    assert missing["extracted"] is None and missing["match"] is None and "error" not in missing


def test_math_answer_mode_can_come_from_the_reference():
    assert score("math_answer", "it is 72", **GSM8K, mode="flexible").value == 1.0
    assert "unknown extraction mode" in score("math_answer", "#### 72", **GSM8K, mode="loose").details["error"]


@pytest.mark.parametrize(
    "completion, mode, answer_text, answer_value",
    [
        ("#### \\frac{3}{4}", "math_answer", "3/4", 0.75),
        ("so \\boxed{\\frac{3}{4}}", "math_answer_flexible", "0.75", 0.75),
        ("#### \\dfrac{1}{2}", "math_answer", "0.5", 0.5),
        ("#### 2^{3}", "math_answer", "8", 8.0),
    ],
)
def test_math_answer_symbolic_equivalence(completion, mode, answer_text, answer_value):
    result = score(mode, completion, answer_text=answer_text, answer_value=answer_value)
    assert result.value == 1.0 and result.details["match"] == "symbolic"


def test_math_answer_symbolic_path_rejects_wrong_answers():
    assert score("math_answer", "#### \\frac{2}{3}", answer_text="3/4", answer_value=0.75).value == 0.0
    assert score("math_answer", "#### \\frac{3}{4}", answer_text="3/4", answer_value=0.75, symbolic=False).value == 0.0


@pytest.mark.parametrize(
    "right, wrong, answer_text, answer_value",
    [
        ("#### 1267650600228229401496703205376", "#### 1267650600228229401496703205377", "2^{100}", None),
        ("#### 2^{100}", "#### 2^{101}", "1267650600228229401496703205376", 2**100),
        ("#### \\binom{10}{3}", "#### \\binom{10}{4}", "120", 120),
        ("#### 120", "#### 121", "\\binom{10}{3}", None),
    ],
)
def test_math_answer_verifies_long_integers_and_binomials(right, wrong, answer_text, answer_value):
    result = score("math_answer", right, answer_text=answer_text, answer_value=answer_value)
    assert result.value == 1.0 and result.details["match"] == "symbolic", result.details
    assert score("math_answer", wrong, answer_text=answer_text, answer_value=answer_value).value == 0.0


@pytest.mark.parametrize("gold", ["9^{9^{9}}", "\\frac{" + "7" * 400 + "}{3}", "x^{2} + " * 30 + "1"])
def test_math_answer_written_as_the_reference_scores_without_sympy(monkeypatch, gold):
    monkeypatch.setattr(rlvr.rewards.math, "run_bounded", lambda *args, **kwargs: pytest.fail("sympy was asked"))
    for completion in (f"#### {gold}", f"#### $ {gold.replace(' ', '')} $."):
        result = score("math_answer", completion, answer_text=gold)
        assert result.value == 1.0 and result.details["match"] == "text", result.details


@pytest.mark.parametrize("answer, why", [("(x+y+z)^{200}", "aborted"), ("9^{9^{9}}", "refused")])
def test_math_answer_sympy_cannot_finish_scores_zero_within_the_limit(answer, why):
    assert score("math_answer", "#### 2^{3}", **GSM8K | {"answer_text": "8", "answer_value": 8}).value == 1.0  # the worker is up
    started = time.monotonic()
    result = score("math_answer", f"#### {answer}", **GSM8K)
    assert time.monotonic() - started < TIMEOUT_S + 3
    assert result.value == 0.0 and why in result.details, result.details


# ---- the sympy worker --------------------------------------------------------------------------


def test_sympy_worker_returns_values_and_raises_what_the_function_raised():
    assert run_bounded(divmod, 7, 2) == (3, 1)
    with pytest.raises(ValueError, match="invalid literal"):
        run_bounded(int, "x")


def test_sympy_worker_past_its_limit_is_killed_and_replaced():
    run_bounded(abs, -1)
    started = time.monotonic()
    with pytest.raises(SymbolicCheckAborted, match="ran past 0.5 s"):
        run_bounded(pow, 3, 10**9, timeout_s=0.5)  # a big-integer power holds the GIL: no alarm could stop it
    assert time.monotonic() - started < 2.5
    with pytest.raises(SymbolicCheckAborted, match=r"died \(exit code 3\)"):
        run_bounded(os._exit, 3)
    assert run_bounded(abs, -2) == 2


def test_sympy_worker_serves_threads_at_once():
    with ThreadPoolExecutor(8) as threads:
        assert list(threads.map(lambda i: run_bounded(abs, -i), range(40))) == list(range(40))


def test_math_answer_on_huge_completions_is_fast():
    start = time.monotonic()
    for completion in ("x " * 500_000 + "#### 72", "#### " * 100_000, "1" * 1_000_000, "12 " * 300_000):
        for name in ("math_answer", "math_answer_flexible", "format"):
            result = score(name, completion, **GSM8K)
            assert "error" not in result.details
    assert time.monotonic() - start < 10


def test_math_answer_without_reference_is_a_contained_error():
    result = score("math_answer", "#### 72", question="q", sample=7)
    assert result.value == 0.0
    assert "math_answer" in result.details["error"] and "sample 7" in result.details["error"]


# ---- format ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("reasoning\n#### 72", 1),
        ("#### 72\n", 1),
        ("#### 1,080.50.", 1),
        ("#### -$5", 1),
        ("#### \u22125", 1),
        ("#### 72\nDone.", 0),
        ("#### 72 clips", 0),
        ("The answer is 72", 0),
        ("#### ", 0),
        ("####72", 1),
        ("", 0),
    ],
)
def test_format(completion, expected):
    result = score("format", completion, **GSM8K)
    assert result.value == expected and result.details == {"well_formed": bool(expected)}


# ---- exact match, token F1, classification, regression ------------------------------------------


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("  Paris \n", {"target": "Paris"}, 1),
        ("paris", {"target": "Paris"}, 0),  # case matters by default
        ("paris", {"target": "Paris", "normalize": ["strip", "lower"]}, 1),
        ("The  Paris!", {"target": "paris", "normalize": "squad"}, 1),
        ("Lyon", {"targets": ["Paris", "Lyon"]}, 1),
        ("1,080.00", {"target": "1080", "normalize": ["strip", "number"]}, 1),
        ("Paris is the answer", {"target": "Paris"}, 0),
    ],
)
def test_exact_match(completion, reference, expected):
    assert score("exact_match", completion, **reference).value == expected


def test_exact_match_errors_are_contained_and_clear():
    assert "unknown normalization 'shout'" in score("exact_match", "x", target="x", normalize="shout").details["error"]
    assert "needs a reference 'target'" in score("exact_match", "x").details["error"]


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("the cat sat", {"target": "The cat sat."}, 1.0),
        ("cat", {"target": "the cat sat"}, pytest.approx(2 * 1.0 * 0.5 / 1.5)),  # P=1, R=1/2
        ("dog", {"target": "cat"}, 0.0),
        ("", {"target": ""}, 1.0),
        ("", {"target": "cat"}, 0.0),
        ("the", {"target": "a"}, 1.0),  # both only articles: empty token lists
        ("cat dog", {"targets": ["dog", "cat dog"]}, 1.0),  # best target
        ("cat cat cat", {"target": "cat"}, pytest.approx(2 * (1 / 3) * 1.0 / (1 / 3 + 1.0))),  # multiset counts
    ],
)
def test_token_f1(completion, reference, expected):
    assert score("token_f1", completion, **reference).value == expected


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("Positive", {"label": "positive", "labels": ["positive", "negative"]}, 1),
        ("The sentiment is positive.", {"label": "positive", "labels": ["positive", "negative"]}, 1),
        ("positive or negative", {"label": "positive", "labels": ["positive", "negative"]}, 0),  # hedge
        ("not spam", {"label": "not spam", "labels": ["spam", "not spam"]}, 1),  # longest label wins
        ("not spam", {"label": "spam", "labels": ["spam", "not spam"]}, 0),
        ("positively", {"label": "positive", "labels": ["positive", "negative"]}, 0),  # whole words only
        ("negative", {"label": "positive"}, 0),
        (" POSITIVE! ", {"label": "positive"}, 1),
    ],
)
def test_classification(completion, reference, expected):
    assert score("classification", completion, **reference).value == expected


def test_classification_label_outside_the_label_set_is_an_error():
    result = score("classification", "cat", label="cat", labels=["dog", "bird"])
    assert result.value == 0.0 and "not in the label set" in result.details["error"]


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("#### 100", {"target": 100}, 1.0),
        ("#### 90", {"target": 100}, pytest.approx(0.9)),
        ("#### 110", {"target": "100"}, pytest.approx(0.9)),
        ("#### 300", {"target": 100}, 0.0),  # bounded below by 0
        ("#### 95", {"target": 100, "max_rel_error": 0.1}, pytest.approx(0.5)),
        ("#### -100", {"target": -100}, 1.0),
        ("about 0.1", {"target": 0, "min_scale": 1.0}, pytest.approx(0.9)),
        ("no number", {"target": 100}, 0.0),
    ],
)
def test_regression(completion, reference, expected):
    assert score("regression", completion, **reference).value == expected


def test_regression_needs_a_numeric_target():
    assert "finite number" in score("regression", "#### 1", target="many").details["error"]


# ---- code execution ----------------------------------------------------------------------------

CODE_TESTS = [{"input": "1 2", "output": "3"}, {"input": "5 5", "output": "10"}]


def test_code_execution_scores_the_fraction_of_tests_passed():
    good = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    partial = "```python\na, b = map(int, input().split())\nprint(a + 2)\n```"  # right only for b == 2
    assert score("code_execution", good, tests=CODE_TESTS).value == 1.0
    result = score("code_execution", partial, tests=CODE_TESTS)
    assert result.value == 0.5 and result.details["outcomes"] == ["passed", "wrong output"]
    assert score("code_execution", "print(3)", tests=CODE_TESTS).value == 0.5  # unfenced code runs as is


def test_code_execution_hostile_program_scores_zero_and_returns():
    hostile = "import os\nos.system('reboot')\nwhile True:\n    pass"
    result = score("code_execution", hostile, tests=CODE_TESTS, limits={"cpu_time_s": 1, "wall_time_s": 2})
    assert result.value == 0.0 and "error" not in result.details


def test_code_execution_bad_tests_are_a_contained_error():
    assert "tests" in score("code_execution", "print(1)", tests="print(1)").details["error"]


# ---- custom rewards and error containment -------------------------------------------------------


def test_register_custom_reward_with_and_without_kwargs():
    name = unique_name("length")

    @register_reward(name)
    def short_is_good(completion, max_chars=10):  # no **kwargs: extra reference keys are dropped
        return min(1.0, max_chars / max(len(completion), 1))

    assert score(name, "x" * 20, max_chars=10, question="ignored").value == 0.5
    assert get_reward(name).fn.__wrapped__ is short_is_good

    @register_reward
    def custom_reward_by_function_name(completion, **_):
        return RewardResult(1.0, {"why": "always"})

    assert score("custom_reward_by_function_name", "").details == {"why": "always"}


@pytest.mark.parametrize("output", [1.5, -0.1, float("nan"), "1.0", None, [1.0]])
def test_bad_reward_output_names_the_function(output):
    name = unique_name("bad")

    @register_reward(name)
    def returns_garbage(completion, **_):
        return output

    result = score(name, "text")
    assert result.value == 0.0
    assert f"reward {name!r}" in result.details["error"] and "returns_garbage" in result.details["error"]
    with pytest.raises(RewardError, match="returns_garbage"):
        get_reward(name)("text")


def test_exception_inside_a_reward_names_function_and_sample():
    name = unique_name("crash")

    @register_reward(name)
    def divides_by_zero(completion, **_):
        return 1 / 0

    result = score(name, "text", sample=3, **GSM8K)
    assert result.value == 0.0
    assert "divides_by_zero" in result.details["error"] and "sample 3" in result.details["error"]
    assert "ZeroDivisionError" in result.details["error"]
    assert "sample p-1" in score(name, "text", **GSM8K).details["error"]  # else the problem_id


def test_registration_errors():
    name = unique_name("dup")
    register_reward(name)(lambda completion, **_: 1.0)
    with pytest.raises(RewardError, match="already registered"):
        register_reward(name)(lambda completion, **_: 0.0)
    register_reward(name, replace=True)(lambda completion, **_: 0.0)
    assert score(name, "x").value == 0.0
    with pytest.raises(RewardError, match="reserved"):
        register_reward("total")(lambda completion, **_: 1.0)
    with pytest.raises(RewardError, match="non-empty"):
        register_reward("")(lambda completion, **_: 1.0)
    with pytest.raises(RewardError, match="positional"):
        register_reward(unique_name("nopos"))(lambda **kwargs: 1.0)
    with pytest.raises(RewardError, match="unknown reward 'no_such_reward'.*math_answer"):
        score("no_such_reward", "x")


def test_reward_result_validates_its_value():
    assert RewardResult(1).value == 1.0
    for bad in (1.01, -1e-9, float("nan"), True, "0.5"):
        with pytest.raises((ValueError, TypeError)):
            RewardResult(bad)


# ---- composite ---------------------------------------------------------------------------------


def test_default_gsm8k_reward_weighs_correctness_over_format():
    reward = CompositeReward(GSM8K_REWARDS)
    both = reward("#### 72", **GSM8K)
    assert both.value == 1.0 and both.details == {"math_answer": 1.0, "format": 1.0}
    format_only = reward("#### 71", **GSM8K).value
    correct_only = reward("#### 72 clips, done", **GSM8K).value
    assert format_only == pytest.approx(0.2 / 1.2) and correct_only == pytest.approx(1.0 / 1.2)
    assert correct_only > format_only > reward("no answer", **GSM8K).value == 0.0


def test_composite_zero_weight_components_are_reported_only():
    reward = CompositeReward({"math_answer": 1.0, "math_answer_flexible": 0.0})
    result = reward("it is 72", **GSM8K)
    assert result.value == 0.0 and result.details == {"math_answer": 0.0, "math_answer_flexible": 1.0}


def test_composite_component_errors_are_contained():
    name = unique_name("crash")
    register_reward(name)(lambda completion, **_: 1 / 0)
    result = CompositeReward({"format": 1.0, name: 1.0})("#### 72", **GSM8K)
    assert result.value == 0.5 and name in result.details["errors"]


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"math_answer": 1.0, "nope": 1.0}, "unknown reward 'nope'"),
        ({"math_answer": -1.0}, "must be a finite number >= 0"),
        ({"math_answer": float("inf")}, "finite"),
        ({"math_answer": "1"}, "finite number"),
        ({"math_answer": 0.0, "format": 0}, "all zero"),
        ({}, "non-empty"),
    ],
)
def test_composite_validation(weights, message):
    with pytest.raises(RewardError, match=message):
        CompositeReward(weights)


# ---- pool --------------------------------------------------------------------------------------


def test_pool_keeps_input_order():
    name = unique_name("echo")

    @register_reward(name)
    def echo_after_delay(completion, delay_s=0.0, **_):
        time.sleep(delay_s)
        return float(completion)

    completions = [str(v / 10) for v in range(10)]
    references = [{"delay_s": 0.05 * ((7 * i) % 4)} for i in range(10)]  # finish out of order
    with RewardPool(workers=4, timeout_s=5) as pool:
        batch = pool.score_batch({name: 1.0}, completions, references)
    assert [row[name].value for row in batch] == [v / 10 for v in range(10)]
    assert [row["total"].value for row in batch] == [v / 10 for v in range(10)]


def test_pool_slow_reward_times_out_without_stalling_the_batch():
    name = unique_name("slow")

    @register_reward(name)
    def hangs_on_request(completion, **_):
        if completion == "hang":
            time.sleep(30)
        return 1.0

    completions = ["#### 72", "hang", "#### 72", "#### 71"]
    start = time.monotonic()
    with RewardPool(workers=2, timeout_s=0.5) as pool:
        batch = pool.score_batch({**GSM8K_REWARDS, name: 1.0}, completions, [GSM8K] * 4)
        assert pool.killed == 1
    assert time.monotonic() - start < 3
    assert "timed out" in batch[1][name].details["error"]
    assert batch[1][name].value == 0.0 and batch[1]["format"].value == 0.0
    assert batch[0]["total"].value == 1.0 and batch[3]["math_answer"].value == 0.0
    assert batch[1]["total"].details["errors"][name].startswith(f"reward {name!r} timed out")


def test_pool_runs_symbolic_math_and_code_off_the_main_thread():
    references = [{"answer_text": "3/4", "answer_value": 0.75}, {"tests": CODE_TESTS}]
    with RewardPool(workers=2, timeout_s=20) as pool:
        math_row, code_row = (
            pool.score_batch({"math_answer": 1.0}, ["#### \\frac{3}{4}"], references[:1])[0],
            pool.score_batch({"code_execution": 1.0}, ["a, b = map(int, input().split())\nprint(a + b)"], references[1:])[0],
        )
    assert math_row["math_answer"].value == 1.0 and math_row["math_answer"].details["match"] == "symbolic"
    assert code_row["code_execution"].value == 1.0


def test_pool_validates_its_inputs():
    with RewardPool() as pool:
        with pytest.raises(ValueError, match="2 completions but 1 references"):
            pool.score_batch(GSM8K_REWARDS, ["a", "b"], [GSM8K])
        with pytest.raises(RewardError, match="unknown reward"):
            pool.score_batch({"nope": 1.0}, ["a"], [GSM8K])
        assert pool.score_batch(GSM8K_REWARDS, [], []) == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_batch(GSM8K_REWARDS, ["a"], [GSM8K])


def test_pool_reward_fn_matches_the_trainer_callback():
    with RewardPool(workers=2) as pool:
        reward_fn = pool.reward_fn({"math_answer": 1.0, "format": 0.25})
        totals, per = reward_fn(["#### 7", "seven\n#### 8", "7"], [{"answer_value": 7.0}] * 3)
    assert per == {"math_answer": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}
    assert totals == pytest.approx([1.0, 0.2, 0.0])
    with pytest.raises(RewardError, match="unknown reward"):
        RewardPool().reward_fn({"nope": 1.0})
