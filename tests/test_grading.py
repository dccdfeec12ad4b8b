"""Grading beside the harnesses: lm-evaluation-harness' gsm8k scoring, quirks included, in the
evaluation runner's columns; and the guard that keeps explosive answers from sympy."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import rlvr.evaluation.runner as runner
import rlvr.rewards.math
from rlvr.answers import LM_EVAL_INVALID, extract_final_answer, lm_eval_gsm8k_answers, lm_eval_gsm8k_match
from rlvr.rewards.math import explosive_reason, math_answer, math_answer_flexible
from rlvr.tasks import Task

# ---- lm-evaluation-harness gsm8k (lm-eval 0.4.13, gsm8k.yaml v3.0) ------------------------------


@pytest.mark.parametrize(
    "completion, strict, flexible",
    [
        ("48/2 = 24\n#### 72", "72", "72"),
        ("#### 3\n#### 5", "3", "5"),  # strict takes the FIRST "#### ", ours the last
        ("####5", LM_EVAL_INVALID, "5"),  # exactly one space after the marker
        ("####  5", LM_EVAL_INVALID, "5"),
        ("#### $5", LM_EVAL_INVALID, "$5"),  # "$" is outside the strict class
        ("#### -5", "-5", "-5"),
        ("#### \u22125", LM_EVAL_INVALID, "5"),  # a unicode minus is no sign: flexible loses it
        ("#### 1,234.50", "1,234.50", "1,234.50"),
        ("#### 72.", "72.", "72."),
        ("The answer is 72.", LM_EVAL_INVALID, "72."),
        ("It is 72...", LM_EVAL_INVALID, "72..."),
        ("It is 72. Done..", LM_EVAL_INVALID, ".."),  # a lone ".." is a flexible answer
        ("#### 72\nCheck: 8*9", "72", "9"),  # flexible ignores "####"
        ("x = -5", LM_EVAL_INVALID, "-5"),
        ("5-3", LM_EVAL_INVALID, "-3"),
        ("no numbers", LM_EVAL_INVALID, LM_EVAL_INVALID),
        ("", LM_EVAL_INVALID, LM_EVAL_INVALID),
        ("#### 72\n\nQuestion: what is 3 + 4?\nAnswer: #### 7", "72", "72"),  # cut at the stop string
    ],
)
def test_lm_eval_extraction_reproduces_the_harness(completion, strict, flexible):
    assert lm_eval_gsm8k_answers(completion) == (strict, flexible)


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        ("72", "72", True),
        ("72.", "72", True),  # one trailing period goes
        ("72..", "72", False),  # only one
        ("1,234", "1234", True),  # commas go on both sides
        ("$5", "5", True),
        ("72.00", "72", False),  # string comparison: 72.00 is not 72
        ("5.0", "5", False),
        ("-5", "5", False),
        ("72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", True),  # a whole reference solution
        ("24", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", False),
        (LM_EVAL_INVALID, "72", False),
    ],
)
def test_lm_eval_match_reproduces_the_harness_cleanup(prediction, reference, expected):
    assert lm_eval_gsm8k_match(prediction, reference) is expected


def test_lm_eval_match_needs_strings():
    with pytest.raises(TypeError, match="compares strings"):
        lm_eval_gsm8k_match("72", 72)


def test_our_strict_and_the_harness_strict_differ_where_documented():
    completion = "#### 3\n#### $1,234.50"
    assert lm_eval_gsm8k_answers(completion)[0] == "3"
    assert extract_final_answer(completion, "strict").text == "1234.5"


@pytest.mark.parametrize(
    "completion, strict, flexible",
    [
        ("#### 72", True, True),
        ("#### 72.00", False, False),
        ("#### $72", False, True),
        ("The answer is 72.", False, True),
        ("#### 71\nso 72", False, True),
        ("#### 72\nCheck: 8*9", True, False),
    ],
)
def test_grade_lm_eval_columns(completion, strict, flexible):
    assert runner.grade_lm_eval(completion, "72") == {"correct_lm_eval_strict": strict, "correct_lm_eval_flexible": flexible}


@dataclass
class _Chunk:
    texts: list[str]
    finish_reasons: list[str]
    completion_lengths: torch.Tensor
    tool_calls: list = None

    def __post_init__(self) -> None:
        self.tool_calls = self.tool_calls or [[] for _ in self.texts]

    def __len__(self) -> int:
        return len(self.texts)


class _NoRewards:
    def __init__(self, **_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None

    def score_batch(self, weights, completions, references):
        return [{} for _ in completions]


def test_evaluate_policy_reports_lm_eval_columns(monkeypatch):
    texts = ["#### 1,080", "The answer is 5.", "#### 72.00"]
    problems = [
        {"problem_id": "a", "question": "q", "answer_value": 1080.0, "answer_text": "1080"},
        {"problem_id": "b", "question": "q", "answer_value": 5.0, "answer_text": "5"},
        {"problem_id": "c", "question": "q", "answer_value": 72.0},  # no answer_text: from the value
    ]
    monkeypatch.setattr(Task, "render_prompt", lambda task, tokenizer, problem, environment=None: problem["question"])
    monkeypatch.setattr(runner, "RewardPool", _NoRewards)
    chunks = SimpleNamespace(stream=lambda *args, **kwargs: iter([_Chunk(texts, ["eos"] * 3, torch.tensor([4, 5, 4]))]))
    monkeypatch.setattr(runner, "make_generator", lambda *args, **kwargs: chunks)
    results = runner.evaluate_policy(None, None, problems, runner.EvalConfig())
    assert [(r["correct_strict"], r["correct_lm_eval_strict"], r["correct_lm_eval_flexible"]) for r in results] == [
        (True, True, True),
        (False, False, True),
        (True, False, False),  # we read 72.00 as 72; the harness compares strings
    ]


# ---- explosive expressions never reach sympy -----------------------------------------------------


@pytest.fixture
def sympy_forbidden(monkeypatch):
    """The sympy worker process is never asked: a refused answer is refused before any parsing."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the sympy worker was asked")

    monkeypatch.setattr(rlvr.rewards.math, "run_bounded", forbidden)


HOPELESS = "a power of over 100,000,000 digits"


@pytest.mark.parametrize(
    "answer", ["9^{9^{9}}", "9^9^9", "9**9**9", "9 ^ { 9 ^ { 9 } }", "2^{10^{9}}", "2^{" + "9" * 30 + "}", "1^{9^{9^{9}}}", "x + 2^{3^{30}}"]
)
def test_hopeless_powers_are_refused_before_parsing(sympy_forbidden, answer):
    assert explosive_reason(answer) == HOPELESS
    for grade in (math_answer, math_answer_flexible):
        result = grade(f"#### {answer}", answer_value=72.0, answer_text="72")
        assert result.value == 0.0 and result.details["refused"] == f"answer: {HOPELESS}"
    boxed = math_answer_flexible(f"so \\boxed{{{answer}}}", answer_value=72.0, answer_text="72")
    assert boxed.value == 0.0 and boxed.details["refused"] == f"answer: {HOPELESS}"


def test_a_hopeless_reference_is_refused_but_scores_against_itself(sympy_forbidden):
    result = math_answer("#### 2^3", answer_text="9^{9^{9}}")
    assert result.value == 0.0 and result.details["refused"] == f"reference: {HOPELESS}"
    assert math_answer("#### 9^{9^{9}}", answer_text="9^{9^{9}}").details["match"] == "text"


def test_an_answer_without_latex_or_operators_never_reaches_sympy(sympy_forbidden):
    result = math_answer("#### pow(9, pow(9, 9))", answer_text="72", answer_value=72.0)
    assert result.value == 0.0 and result.details["extracted"] is None and "refused" not in result.details


def test_a_plain_number_is_never_refused_nor_parsed(sympy_forbidden):
    assert math_answer("#### 72", answer_text="72", answer_value=72).details["match"] == "numeric"
    wrong = math_answer("#### 71", answer_text="72", answer_value=72)  # no LaTeX: no symbolic path
    assert wrong.value == 0.0 and "refused" not in wrong.details


@pytest.mark.parametrize(
    "answer",
    [
        *["2^3", "2^{10}", "e^{1000}", "\\frac{3}{4}", "\\sqrt{16}", "5!", "x^2+y^2", "(a+b)^2", "2^{3} \\cdot 3^{2}", "1.5 \\times 10^{6}", "e^{i\\pi}"],
        *["2^{2^{2}}", "(9^9)^{9}", "10^{100000}", "\\binom{10}{3}", "\\sum_{n=1}^{10} n", "100000!", "1" * 10_000, "\\frac{x}{" + "y" * 200 + "}"],
    ],
)
def test_legitimate_expressions_pass_the_guard(answer):
    assert explosive_reason(answer) is None


@pytest.mark.parametrize(
    "completion, answer_text, answer_value",
    [
        ("#### \\frac{3}{4}", "0.75", 0.75),
        ("#### 2^3", "8", 8.0),
        ("#### \\sqrt{16}", "4", 4.0),
        ("#### 2^{3} \\cdot 3^{2}", "72", 72.0),
        ("#### 5!", "120", 120.0),
        ("#### \\binom{10}{3}", "120", 120.0),
        ("#### 2^{2^{2}}", "16", 16.0),
        ("#### (9^9)^{9}", str(9**81), float(9**81)),
    ],
)
def test_legitimate_symbolic_answers_still_match(completion, answer_text, answer_value):
    result = math_answer(completion, answer_text=answer_text, answer_value=answer_value)
    assert result.value == 1.0 and result.details["match"] == "symbolic" and "refused" not in result.details


def test_an_expression_on_the_hash_line_is_not_its_first_number():
    result = math_answer("#### 2+3", answer_text="2", answer_value=2.0)  # the old reading: 2
    assert result.value == 0.0 and result.details["extracted"] is None
    assert math_answer_flexible("#### 2+3", answer_text="3", answer_value=3.0).value == 0.0  # nor its last
