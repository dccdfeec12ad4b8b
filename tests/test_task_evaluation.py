"""Evaluating a policy on any task: GSM8k as a task grades exactly as before, another task is graded by
its own rewards (pass@k from its correctness reward), and a grader that raises or hangs costs that row
its reward (0, the error recorded), never the evaluation."""

import time

import pytest

from rlvr.evaluation.runner import EvalConfig, evaluate_policy, summarize
from rlvr.policy import load_policy
from rlvr.rewards import register_reward
from rlvr.tasks import GSM8K, Task, TaskProblem, problem_record
from support.scripted_policies import GREEDY_COMPLETION, save_scripted_tiny_llama

pytestmark = pytest.mark.slow  # a grader that hangs costs the pool's 30 s timeout


@register_reward("test_expects_power")
def expects_power(completion: str, expected: str = "", **_) -> float:
    """1 when the completion holds the expected text."""
    return float(expected in completion)


@register_reward("test_grader_raises")
def grader_raises(completion: str, **_) -> float:
    raise RuntimeError("scorer bug")


@register_reward("test_grader_hangs")
def grader_hangs(completion: str, **_) -> float:
    time.sleep(3600)
    return 1.0


def problems(n: int) -> list[dict]:
    rows = [TaskProblem("powers", f"p{i}", "test", f"Write two to the power {i}.", {"expected": "2^{3}" if i % 2 else "2^{4}"}).as_row() for i in range(n)]
    return [problem_record(row) for row in rows]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return load_policy(save_scripted_tiny_llama(tmp_path_factory.mktemp("scripted")))


def test_gsm8k_as_a_task_evaluates_exactly_as_before(scripted, gsm8k_dir):
    model, tokenizer = scripted
    rows = [problem_record(p.as_row()) for p in GSM8K.load_problems({"local_dir": str(gsm8k_dir), "limit": 3}) if p.split == "test"]
    config = EvalConfig(max_new_tokens=12, batch_rows=4)
    assert evaluate_policy(model, tokenizer, rows, config, task=GSM8K) == evaluate_policy(model, tokenizer, rows, config)


def test_a_task_is_graded_by_its_own_rewards_and_a_failing_grader_costs_one_row(scripted):
    model, tokenizer = scripted
    task = Task(
        name="powers",
        load=lambda options: [],
        correctness="test_expects_power",
        rewards={"test_expects_power": 1.0, "test_grader_raises": 0.0, "test_grader_hangs": 0.0},
    )
    config = EvalConfig(max_new_tokens=12, num_samples=2, ks=[1, 2], batch_rows=4)
    started = time.monotonic()
    results = evaluate_policy(model, tokenizer, problems(2), config, task=task)
    assert time.monotonic() - started < 300  # one timeout per hung job in flight, not a stuck evaluation
    assert all(r["completion"] == GREEDY_COMPLETION for r in results)  # the scripted policy's greedy text: "#### 2^{3}"
    assert [r["correct_strict"] for r in results] == [False, True]
    assert all(r["task"] == "powers" and r["num_samples"] == 2 for r in results)
    assert all("scorer bug" in r["grading_error"] and "timed out" in r["grading_error"] for r in results)
    assert all(r["reward_test_grader_raises"] == 0.0 and r["reward_test_grader_hangs"] == 0.0 for r in results)
    metrics = summarize(results, config)
    assert metrics["pass@1_strict"] == 0.5 and metrics["mean_score"] == 0.5
    assert 0.0 <= metrics["pass@2"] <= 1.0 and "maj@2" not in metrics  # no final answer to vote on
