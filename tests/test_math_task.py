"""math: MATH-style rows from a file or a datasets folder, graded by math-verify (gold first) in any thread and in the pool."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import pytest

import rlvr.rewards.symbolic
from rlvr.rewards import RewardPool, score
from rlvr.rewards.sympy_worker import TIMEOUT_S
from rlvr.tasks import MATH, TaskError, get_task, problem_record

ROWS = [
    {"problem": "Write 0.5 as a fraction.", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Prealgebra"},
    {"problem": "What is $\\sin 45^\\circ$?", "solution": "So $\\boxed{\\frac{\\sqrt{2}}{2}}$."},
    {"problem": "Solve $0 < x \\le 1$ as an interval.", "solution": "$\\boxed{(0, 1]}$", "type": "Algebra"},
    {"problem": "How many sides has a triangle?", "solution": "A misprint: \\boxed{7}", "answer": "3"},
    {"problem": "Expand $(x+1)^2$.", "solution": "$\\boxed{x^2+2x+1}$", "split": "train"},
]
# (row, completion, verdict of math_verify)
GRADED = [
    (0, "Half is \\boxed{0.5}", 1.0),
    (0, "\\boxed{0.4}", 0.0),
    (0, "The final answer is $\\frac{1}{2}$.", 1.0),  # no \boxed{}: math-verify reads the last line
    (1, "\\boxed{\\sqrt{2}/2}", 1.0),
    (1, "First \\boxed{1}, corrected: \\boxed{\\frac{\\sqrt2}{2}}", 1.0),  # the last \boxed{} is the answer
    (2, "\\boxed{(0,1]}", 1.0),
    (2, "\\boxed{[0, 1]}", 0.0),
    (3, "\\boxed{3}", 1.0),
    (3, "\\boxed{7}", 0.0),
    (4, "\\boxed{(x+1)^2}", 1.0),
    (4, "I am not sure.", 0.0),
    (4, "\\boxed{9^{9^{9}}}", 0.0),  # refused before sympy sees it
]
ROTATION = r"\begin{pmatrix} \frac{\sqrt{2}}{2} & -\frac{\sqrt{2}}{2} & 0 \\ \frac{\sqrt{2}}{2} & \frac{\sqrt{2}}{2} & 0 \\ 0 & 0 & 1 \end{pmatrix}"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def problems(tmp_path):
    return MATH.load_problems({"path": str(write_jsonl(tmp_path / "math.jsonl", ROWS))})


def test_rows_become_problems_with_gold_level_and_type(problems):
    assert [p.split for p in problems] == ["test", "test", "test", "test", "train"]
    assert [p.reference["gold"] for p in problems] == ["\\frac{1}{2}", "\\frac{\\sqrt{2}}{2}", "(0, 1]", "3", "x^2+2x+1"]
    assert problems[0].reference == {"gold": "\\frac{1}{2}", "level": "Level 1", "type": "Prealgebra"}
    assert problems[2].reference == {"gold": "(0, 1]", "type": "Algebra"}
    assert get_task("math") is MATH and MATH.correctness == "math_verify" and MATH.format_reward == "boxed"
    assert "\\boxed{}" in MATH.messages(problems[0])[0]["content"]


def test_math_verify_grades_equivalent_answers_and_boxed_checks_the_format(problems):
    records = [problem_record(p.as_row()) for p in problems]
    for row, completion, verdict in GRADED:
        result = score("math_verify", completion, **records[row])
        assert result.value == verdict, (completion, result.details)
        assert score("boxed", completion).value == float("\\boxed{" in completion)
    refused = score("math_verify", "\\boxed{9^{9^{9}}}", **records[4])
    assert refused.details["refused"] == "answer: a power of over 100,000,000 digits"


def test_math_verify_outside_the_main_thread_runs_without_its_alarms(problems):
    verdicts = []
    worker = threading.Thread(target=lambda: verdicts.extend(score("math_verify", c, **problems[r].reference).value for r, c, _ in GRADED))
    worker.start()
    worker.join(timeout=60)
    assert verdicts == [v for _, _, v in GRADED]


def test_math_verify_in_reward_pool_workers(problems):
    records = [problem_record(problems[row].as_row()) for row, _, _ in GRADED]
    with RewardPool(workers=1, timeout_s=30) as pool:
        batch = pool.score_batch({"math_verify": 1.0, "boxed": 0.1}, [c for _, c, _ in GRADED], records)
    assert [b["math_verify"].value for b in batch] == [v for _, _, v in GRADED]
    assert not any("error" in b["math_verify"].details for b in batch)


@pytest.fixture
def sympy_forbidden(monkeypatch):
    """The worker process is never asked: an answer written as the gold scores without sympy."""

    def forbidden(*args, **kwargs):
        raise AssertionError("sympy was asked")

    monkeypatch.setattr(rlvr.rewards.symbolic, "run_bounded", forbidden)


@pytest.mark.parametrize("gold", [ROTATION, "9^{9^{9}}", "\\frac{" + "7" * 400 + "}{3}"])
def test_a_gold_scores_against_itself_however_long_or_explosive(sympy_forbidden, gold):
    assert len(ROTATION) > 120
    for completion in (f"\\boxed{{{gold}}}", f"So $\\boxed{{ {gold.replace('frac', 'dfrac')} }}$."):
        result = score("math_verify", completion, gold=gold)
        assert result.value == 1.0 and result.details["match"] == "text", result.details


def test_a_long_matrix_gold_scores_an_equivalent_form_and_not_a_wrong_one():
    equivalent = r"\begin{bmatrix} \frac{1}{\sqrt{2}} & -\frac{1}{\sqrt{2}} & 0 \\ \frac{\sqrt2}{2} & \frac{2}{2\sqrt{2}} & 0 \\ 0 & 0 & 1 \end{bmatrix}"
    right = score("math_verify", f"\\boxed{{{equivalent}}}", gold=ROTATION)
    assert right.value == 1.0 and "match" not in right.details and right.details["parsed"][0].startswith("Matrix(")
    assert score("math_verify", f"\\boxed{{{ROTATION.replace('-', '')}}}", gold=ROTATION).value == 0.0


@pytest.mark.parametrize(
    "answer, gold, verdict",
    [
        ("2^{100}", "1267650600228229401496703205376", 1.0),
        ("1267650600228229401496703205376", "2^{100}", 1.0),
        ("1267650600228229401496703205377", "2^{100}", 0.0),
        ("\\binom{10}{3}", "120", 1.0),
        ("120", "\\binom{10}{3}", 1.0),
        ("\\binom{10}{4}", "120", 0.0),
    ],
)
def test_long_integers_and_binomials_are_verified_both_ways(answer, gold, verdict):
    result = score("math_verify", f"\\boxed{{{answer}}}", gold=gold)
    assert result.value == verdict and not {"refused", "aborted", "error"} & set(result.details), result.details


@pytest.mark.parametrize("answer, why", [("(x+y+z)^{200}", "aborted"), ("9^{9^{9}}", "refused")])
def test_an_answer_sympy_cannot_finish_scores_zero_within_the_limit_in_a_thread(answer, why):
    assert score("math_verify", "\\boxed{2}", gold="2").value == 1.0  # the worker is up: its start is not timed
    results = []
    worker = threading.Thread(target=lambda: results.append(score("math_verify", f"\\boxed{{{answer}}}", gold="x^2+2x+1")))
    started = time.monotonic()
    worker.start()
    worker.join(timeout=TIMEOUT_S + 30)
    assert time.monotonic() - started < TIMEOUT_S + 3
    assert results[0].value == 0.0 and why in results[0].details, results[0].details
    assert score("math_verify", "\\boxed{(x+1)^2}", gold="x^2+2x+1").value == 1.0  # a fresh worker took over


def test_an_endless_answer_in_a_reward_pool_worker_is_cut_at_the_symbolic_limit():
    completions = ["\\boxed{(x+y+z)^{200}}", "\\boxed{(x+1)^2}"]
    with RewardPool(workers=1, timeout_s=30) as pool:
        batch = pool.score_batch({"math_verify": 1.0}, completions, [{"gold": "x^2+2x+1"}] * 2)
    endless, right = (row["math_verify"] for row in batch)
    assert endless.value == 0.0 and f"ran past {TIMEOUT_S:g} s" in endless.details["aborted"]  # not the pool's 30 s
    assert right.value == 1.0


def test_json_and_parquet_files_and_limit(tmp_path, problems):
    (tmp_path / "math.json").write_text(json.dumps(ROWS))
    import pyarrow
    import pyarrow.parquet as parquet  # datasets' own dependency

    columns = [{**row, "answer": row.get("answer"), "split": row.get("split")} for row in ROWS]
    parquet.write_table(pyarrow.Table.from_pylist(columns), tmp_path / "math.parquet")
    for name in ("math.json", "math.parquet"):
        assert MATH.load_problems({"path": str(tmp_path / name)}) == [replace(p, source=name) for p in problems]
    limited = MATH.load_problems({"path": str(tmp_path / "math.json"), "limit": 2})
    assert [(p.split, p.question) for p in limited] == [("test", ROWS[0]["problem"]), ("test", ROWS[1]["problem"]), ("train", ROWS[4]["problem"])]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"problem": "No solution here."}, r"math.jsonl line 2: field 'solution' is missing or empty"),
        ({"solution": "\\boxed{1}"}, r"math.jsonl line 2: field 'problem' is missing or empty"),
        ({"problem": "p", "solution": "the answer is 4"}, r"math.jsonl line 2: field 'solution' has no \\boxed\{\} answer and there is no 'answer' field"),
        ({"problem": "p", "solution": "\\boxed{1}", "split": "validation"}, r"math.jsonl line 2: field 'split' must be 'train' or 'test'"),
    ],
)
def test_a_bad_row_is_named_with_its_field_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "math.jsonl", [ROWS[0], row])
    with pytest.raises(TaskError, match=message):
        MATH.load_problems({"path": str(path)})


def test_bad_options_are_refused(tmp_path):
    path = str(write_jsonl(tmp_path / "math.jsonl", ROWS))
    for options, message in [
        ({}, "exactly one of 'path'"),
        ({"path": path, "dataset": "x"}, "exactly one of 'path'"),
        ({"path": path, "shuffle": True}, r"unknown options \['shuffle'\]"),
        ({"path": path, "test_split": "test"}, "apply to 'dataset'"),
        ({"path": path, "limit": 0}, "'limit' must be a positive integer"),
        ({"path": str(tmp_path / "math.csv")}, "is not a .jsonl, .json, .parquet file"),
        ({"path": str(tmp_path / "absent.jsonl")}, "no file at"),
    ]:
        with pytest.raises(TaskError, match=message):
            MATH.load_problems(options)


def test_a_datasets_folder_loads_both_splits_and_a_load_failure_names_its_cause(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "local_math"
    folder.mkdir()
    uniform = [{"answer": None, "level": "Level 2", "type": "Algebra", **{k: v for k, v in row.items() if k != "split"}} for row in ROWS]  # one schema
    write_jsonl(folder / "train.jsonl", [uniform[4], uniform[3]])
    write_jsonl(folder / "test.jsonl", uniform[:3])
    loaded = MATH.load_problems({"dataset": str(folder), "limit": 2})
    assert [(p.problem_id, p.reference["gold"]) for p in loaded] == [
        ("math-train-00000", "x^2+2x+1"),
        ("math-train-00001", "3"),
        ("math-test-00000", "\\frac{1}{2}"),
        ("math-test-00001", "\\frac{\\sqrt{2}}{2}"),
    ]
    assert [p.split for p in MATH.load_problems({"dataset": str(folder), "train_split": None})] == ["test"] * 3
    with pytest.raises(TaskError, match=r"split 'validation'.*Unknown split"):
        MATH.load_problems({"dataset": str(folder), "test_split": "validation"})

    def offline(*args, **kwargs):
        raise ConnectionError("the hub cannot be reached")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(TaskError, match=r"cannot load dataset 'someone/MATH'.*ConnectionError: the hub cannot be reached"):
        MATH.load_problems({"dataset": "someone/MATH"})
