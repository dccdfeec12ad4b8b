"""Tasks by name (registry, a user's module, an entry point), GSM8k as a task, the mixture's schedule,
the task-routed reward, per-task step metrics and the cross-task table."""

import math
from pathlib import Path

import numpy as np
import pytest

from rlvr.evaluation.cross_task import MACRO, cross_task_table
from rlvr.grpo.trainer import per_task_metrics
from rlvr.rewards import RewardPool
from rlvr.tasks import GSM8K, Task, TaskError, TaskMixture, TaskProblem, get_task, problem_record, register_task, task_names
from rlvr.tasks.checks import validate_task_problems
from rlvr.tasks.mixture import training_records
from support.tiny_models import embedded_tokenizer

USER_TASK = """
from rlvr.tasks import Task, TaskProblem

def load(options):
    words = ["alpha", "beta", "gamma", "delta"]
    return [TaskProblem("echo", f"echo-{i}", "train" if i % 2 else "test", f"Repeat the word {w}.", {"target": w}) for i, w in enumerate(words)]

TASK = Task(name="echo", load=load, correctness="exact_match", rewards={"exact_match": 1.0}, system_prompt="Answer with one word.")
"""


def test_an_unknown_task_is_refused_naming_the_registered_ones():
    with pytest.raises(TaskError) as err:
        get_task("gsm9k")
    for name in ("gsm8k", "humaneval", "math", "reasoning_gym:<name>"):
        assert name in str(err.value)
    with pytest.raises(TaskError, match="needs a name after the colon"):
        get_task("reasoning_gym:")
    with pytest.raises(TaskError, match="cannot load 'NOPE'"):
        get_task("rlvr.tasks.gsm8k:NOPE")
    assert {"gsm8k", "humaneval", "math"} <= set(task_names())


def test_a_users_task_loads_by_dotted_path_and_by_entry_point(tmp_path, monkeypatch):
    (tmp_path / "user_tasks.py").write_text(USER_TASK)
    dist = tmp_path / "user_tasks-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: user-tasks\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlvr.tasks]\necho = user_tasks:TASK\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    by_path = get_task("user_tasks:TASK")
    assert by_path.name == "user_tasks:TASK" and by_path.correctness == "exact_match"
    by_entry_point = get_task("echo")
    assert by_entry_point.name == "echo"
    problems = by_entry_point.load_problems()
    assert [p.split for p in problems] == ["test", "train", "test", "train"]
    record = problem_record(problems[1].as_row())
    assert record["target"] == "beta" and record["task"] == "echo"


def test_a_task_is_checked_when_defined_and_when_loaded():
    with pytest.raises(TaskError, match="correctness reward 'math_answer' must be one of its rewards"):
        Task(name="x", load=lambda o: [], correctness="math_answer", rewards={"format": 1.0})
    twice = [TaskProblem("t", "a", "train", "q1", {"k": 1}), TaskProblem("t", "a", "test", "q2", {"k": 1})]
    task = Task(name="t", load=lambda o: twice, correctness="format", rewards={"format": 1.0})
    with pytest.raises(TaskError, match="problem id a appears twice"):
        task.load_problems()
    renamed = Task(name="t", load=lambda o: [TaskProblem("other", "a", "train", "q", {})], correctness="format", rewards={"format": 1.0})
    assert [p.task for p in renamed.load_problems()] == ["t"]  # a task reached by path or entry point names its rows as asked
    with pytest.raises(TaskError, match="already registered"):
        register_task(Task(name="gsm8k", load=lambda o: twice, correctness="format", rewards={"format": 1.0}))


def test_gsm8k_as_a_task_keeps_its_problems_prompt_and_grade(gsm8k_dir):
    from rlvr.rewards import score
    from rlvr.tasks.gsm8k import dataset as gsm8k
    from rlvr.tasks.gsm8k.prompt import render_prompt

    problems = GSM8K.load_problems({"local_dir": str(gsm8k_dir), "limit": 3})
    originals = gsm8k.load_local(gsm8k_dir, limit=3)
    assert [p.problem_id for p in problems] == [p.problem_id for p in originals]
    tokenizer = embedded_tokenizer()
    first = problem_record(problems[0].as_row())
    assert GSM8K.render_prompt(tokenizer, first) == render_prompt(tokenizer, originals[0].question)
    right = f"so #### {originals[0].answer_text}"
    assert score(GSM8K.correctness, right, **first).value == 1.0
    assert score(GSM8K.correctness, "#### -1", **first).value == 0.0
    with pytest.raises(TaskError, match="unexpected keyword argument 'nope'"):
        GSM8K.load_problems({"nope": 1})


def rows_of(task: str, n: int) -> list[dict]:
    return [{"task": task, "problem_id": f"{task}-{i}", "question": f"{task} {i}"} for i in range(n)]


def test_each_group_of_a_mixture_comes_from_one_task_drawn_by_weight():
    mixture = TaskMixture(rows_of("a", 5) + rows_of("b", 7), {"a": 3.0, "b": 1.0})
    steps = [mixture.step_problems(step, 8, seed=1) for step in range(200)]
    tasks = [p["task"] for step in steps for p in step]
    assert abs(tasks.count("a") / len(tasks) - 0.75) < 0.03
    # a pure function of (step, seed): a resumed run sees the same problems, another seed others
    assert mixture.step_problems(137, 8, seed=1) == steps[137]
    assert [mixture.step_problems(s, 8, seed=2) for s in range(5)] != steps[:5]
    # each task walks through its own problems: every 'b' problem once before any repeats
    b_order = [p["problem_id"] for p in (p for step in steps for p in step) if p["task"] == "b"]
    assert sorted(b_order[:7]) == sorted(r["problem_id"] for r in rows_of("b", 7))


def test_a_mixture_refuses_bad_weights_and_tasks_without_problems():
    with pytest.raises(TaskError, match="weight must be a finite number > 0"):
        TaskMixture(rows_of("a", 2), {"a": 0.0})
    with pytest.raises(TaskError, match=r"no problems to train on for task\(s\) \['b'\]"):
        TaskMixture(rows_of("a", 2), {"a": 1.0, "b": 1.0})
    with pytest.raises(TaskError, match="have no weight"):
        TaskMixture(rows_of("a", 2) + rows_of("c", 1), {"a": 1.0})


def test_training_records_render_each_tasks_prompt_and_name_its_correctness(gsm8k_dir):
    gsm8k_row = GSM8K.load_problems({"local_dir": str(gsm8k_dir), "limit": 1})[0].as_row()
    math_row = TaskProblem("math", "m-1", "train", "What is $1+1$?", {"gold": "2"}).as_row()
    records = training_records([gsm8k_row, math_row], embedded_tokenizer())
    assert records[0]["correctness"] == "math_answer" and records[1]["correctness"] == get_task("math").correctness
    assert "####" in records[0]["prompt"] and "boxed" in records[1]["prompt"]
    assert records[1]["gold"] == "2"
    assert records[0]["stop"] == GSM8K.stop_rule and records[0]["stop"].answer_line is not None
    assert records[1]["stop"] == get_task("math").stop_rule


def test_completions_are_scored_by_their_own_tasks_rewards():
    problems = [
        {"task": "arith", "answer_value": 4.0, "answer_text": "4"},
        {"task": "words", "target": "blue"},
        {"task": "arith", "answer_value": 5.0, "answer_text": "5"},
    ]
    with RewardPool(workers=1) as pool:
        reward_fn = pool.reward_fn_by_task({"arith": {"math_answer": 1.0, "format": 1.0}, "words": {"exact_match": 1.0}})
        totals, per_reward = reward_fn(["#### 4", "blue", "#### 4"], problems)
        with pytest.raises(ValueError, match=r"task\(s\) \['poems'\] have no reward weights"):
            reward_fn(["x"], [{"task": "poems"}])
    assert totals == [1.0, 1.0, 0.5]
    assert per_reward["math_answer"][:1] == [1.0] and math.isnan(per_reward["math_answer"][1])
    assert per_reward["exact_match"][1] == 1.0 and math.isnan(per_reward["exact_match"][0])


def test_per_task_step_metrics():
    rank = {
        "group_tasks": ["a", "b", "a"],
        "rewards": [1.0, 0.0, 0.5, 0.5, 0.2, 0.4],
        "row_correct": [1.0, 0.0, 1.0, 1.0, float("nan"), float("nan")],
        "lengths": [10, 20, 30, 30, 5, 7],
        "zero_variance": [False, True, False],
    }
    metrics = per_task_metrics([rank], group_size=2)
    assert metrics["task/a/groups"] == 2 and metrics["task/b/groups"] == 1
    assert metrics["task/a/reward_mean"] == pytest.approx((1.0 + 0.0 + 0.2 + 0.4) / 4)
    assert metrics["task/a/accuracy"] == pytest.approx(0.5)  # NaN rows (no correctness) left out
    assert metrics["task/b/frac_zero_variance_groups"] == 1.0 and metrics["task/a/frac_zero_variance_groups"] == 0.0
    assert metrics["task/a/completion_len_mean"] == pytest.approx((10 + 20 + 5 + 7) / 4)
    assert per_task_metrics([{**rank, "group_tasks": [None] * 3}], 2) == {}


def results(correct: list[int]) -> list[dict]:
    return [{"problem_id": f"p{i}", "correct_strict": bool(c)} for i, c in enumerate(correct)]


def test_the_cross_task_table_pairs_each_task_and_averages_tasks_equally():
    rows = cross_task_table({"a": (results([1, 0, 0, 1]), results([1, 1, 0, 1])), "b": (results([0] * 10), results([1] * 5 + [0] * 5))}, n_resamples=4000)
    a, b, macro = rows
    assert (a["base"], a["trained"], a["delta"]) == (0.5, 0.75, 0.25)
    assert b["delta"] == 0.5 and b["mcnemar_p_value"] == pytest.approx(2 * 0.5**5)  # exact binomial, 5 discordant pairs
    assert macro["task"] == MACRO and macro["base"] == pytest.approx(0.25) and macro["trained"] == pytest.approx(0.625)
    assert macro["delta"] == pytest.approx(0.375) and macro["delta_ci_low"] < 0.375 < macro["delta_ci_high"]
    assert macro["problems"] == 14 and macro["paired_bootstrap_p_value"] < 0.05
    with pytest.raises(ValueError, match="share no problems"):
        cross_task_table({"a": (results([1]), [{"problem_id": "other", "correct_strict": True}])})


def test_task_problem_checks():
    task = Task(name="t", load=lambda o: [], correctness="format", rewards={"format": 1.0}, eval_only=True)
    problems = [TaskProblem("t", "1", "train", "Same  Question", {"k": 1}), TaskProblem("t", "2", "test", "same question", {})]
    outcomes = {o.name: o for o in validate_task_problems(task, problems)}
    assert not outcomes["no_split_overlap"].passed and outcomes["no_split_overlap"].metadata["overlap"] == 1
    assert not outcomes["no_empty_fields"].passed and "reference" in outcomes["no_empty_fields"].description
    assert not outcomes["held_out_only"].passed
    assert np.all([o.passed for o in validate_task_problems(task, [TaskProblem("t", "1", "test", "q", {"k": 1})])])


def test_the_documented_task_of_your_own_works_as_written(tmp_path, monkeypatch):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tasks.md").read_text()
    code = doc.split("## A task of your own")[1].split("```python\n")[1].split("```")[0]
    assert len(code.splitlines()) <= 40
    (tmp_path / "my_tasks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = get_task("my_tasks:UNITS")
    problems = task.load_problems({"size": 30})
    assert {p.task for p in problems} == {"my_tasks:UNITS"} and sum(p.split == "test" for p in problems) == 3
    assert all(o.passed for o in validate_task_problems(task, problems))
    record = problem_record(problems[4].as_row())
    assert "km" in task.render_prompt(embedded_tokenizer(), record)
    from rlvr.rewards import score

    assert score(task.correctness, "5 km is 5,000 meters.\n5000", **record).value == 1.0
    assert score(task.correctness, "500", **record).value == 0.0


@pytest.mark.parametrize(
    "name, completion, answer, well_formed",
    [
        ("gsm8k", "6 * 7 = 42\n#### 42", "42", True),
        ("gsm8k", "The answer is 42.", None, False),
        ("reasoning_gym:basic_arithmetic", "think <answer> 7 </answer>", "7", True),
        ("reasoning_gym:basic_arithmetic", "<answer>7</answer> and <answer>8</answer>", "8", False),
        ("math", "so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
        ("math", "#### 1/2", None, False),
        ("humaneval", "def f():\n    return 1\n```", "def f():\n    return 1\n", True),  # after the prompt's opening fence
    ],
)
def test_a_task_reads_a_completion_with_its_parser(name, completion, answer, well_formed):
    task = get_task(name)
    assert task.parse(completion) == answer
    assert task.well_formed(completion) is well_formed


def test_each_task_has_its_own_stop_rule():
    assert GSM8K.stop_rule.answer_line("#### 42") and not GSM8K.stop_rule.answer_line("42") and GSM8K.stop_rule.strings == ()
    assert get_task("reasoning_gym:basic_arithmetic").stop_rule.strings == ("</answer>",)
    assert get_task("humaneval").stop_rule.strings == ("\n```",) and get_task("humaneval").stop_rule.answer_line is None
    extra = Task(name="extra", load=lambda options: [], correctness="format", rewards={"format": 1.0}, parser=GSM8K.parser, stop_strings=("END",))
    assert extra.stop_rule.strings == ("END",) and extra.stop_rule.answer_line is GSM8K.parser.answer_line
