"""The function-test harness on its own: the plain-value codec, the verdict record, calls across the two sandboxes."""

from __future__ import annotations

import collections
import enum
import json
import math

import pytest

from rlvr.function_tests import read_verdict, run_function_tests
from rlvr.function_tests_child import decode, encode
from rlvr.sandbox import SandboxLimits, SandboxResult

FAST = SandboxLimits(cpu_time_s=1, wall_time_s=3)


def roundtrip(value, plain_only=True):
    return decode(json.loads(json.dumps(encode(value, plain_only))))


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -(10**40), 1.5, "é\n", b"\x00\xff", 2 - 3j, [1, [2.0]], (1, (2,)), (), {1: "a", (2, 3): [None]}, {1, "x"}, frozenset({(1, 2)})],
)
def test_plain_values_cross_unchanged_in_type_and_value(value):
    back = roundtrip(value)
    assert back == value and type(back) is type(value)
    if isinstance(value, (list, tuple)) and value:
        assert type(back[-1]) is type(value[-1])


def test_nan_and_infinities_cross():
    nan, inf = roundtrip([math.nan, math.inf])
    assert math.isnan(nan) and inf == math.inf


def test_subclasses_are_refused_strictly_and_reduced_to_their_honest_value():
    class Always(int):
        __eq__ = lambda self, other: True  # noqa: E731
        __hash__ = int.__hash__

    class Color(enum.IntEnum):
        RED = 3

    with pytest.raises(TypeError):
        encode(Always(5))
    assert roundtrip(Always(5), plain_only=False) == 5 and type(roundtrip(Always(5), plain_only=False)) is int
    assert roundtrip(collections.Counter("aab"), plain_only=False) == {"a": 2, "b": 1}
    assert roundtrip(collections.namedtuple("P", "x y")(1, 2), plain_only=False) == (1, 2)
    assert roundtrip([Color.RED], plain_only=False) == [3]
    with pytest.raises(TypeError, match="unsupported type object"):
        encode(object(), plain_only=False)


@pytest.mark.parametrize("data", [{"tuple": 1}, {"list": []}, {"a": 1, "b": 2}, {"dict": [[1]]}, {"complex": ["1", 2]}, {"set": [[1]]}])
def test_decode_refuses_what_encode_never_writes(data):
    with pytest.raises((ValueError, TypeError)):
        decode(data)


def result(returncode=0, timed_out=False) -> SandboxResult:
    return SandboxResult(stdout="", stderr="", returncode=returncode, timed_out=timed_out, wall_time_s=0.1, isolation=("uid",))


def test_only_the_exact_passing_record_passes():
    good = json.dumps({"nonce": "n1", "verdict": "passed", "reason": "all tests passed", "calls": 3}).encode()
    assert read_verdict(good, "n1", result(), result()) == (True, "all tests passed", 3)
    assert not read_verdict(good, "n2", result(), result())[0]  # another nonce
    assert not read_verdict(good + good, "n1", result(), result())[0]  # a second record
    assert not read_verdict(b"passed", "n1", result(), result())[0]
    assert not read_verdict(b"", "n1", result(), result())[0]
    assert not read_verdict(good, "n1", result(returncode=-9), result())[0]  # the tests process did not end well
    assert read_verdict(b"", "n1", result(timed_out=True), result())[1] == "timed out"


TEST = "def check(candidate):\n    assert candidate(2, scale=3) == (6, [2.0])\n    assert candidate(0, scale=1) == (0, [0.0])\n"


def test_calls_cross_with_keywords_and_tuples():
    report = run_function_tests("def f(x, scale):\n    return x * scale, [float(x)]", TEST, "f", limits=FAST)
    assert report.passed and report.calls == 2 and report.reason == "all tests passed"
    wrong = run_function_tests("def f(x, scale):\n    return [x * scale, [float(x)]]", TEST, "f", limits=FAST)  # a list is not a tuple
    assert not wrong.passed and wrong.reason == "assertion failed"


def test_program_without_the_function_or_hanging_at_import_fails():
    assert run_function_tests("def g(x, scale):\n    return 0", TEST, "f", limits=FAST).reason.startswith("at import: raised NameError")
    assert run_function_tests("while True:\n    pass\ndef f(x, scale):\n    return 0", TEST, "f", limits=FAST).reason.startswith("timed out")


def test_candidate_answering_out_of_turn_fails():
    program = (
        "import os\nfor fd in range(3, 4096):\n    try:\n        os.write(fd, b'{\"value\": [6, [2.0]]}\\n' * 5)\n"
        "    except OSError:\n        pass\ndef f(x, scale):\n    return 0"
    )
    report = run_function_tests(program, TEST, "f", limits=FAST)
    assert not report.passed and report.reason == "sent an unreadable answer"  # its first line stood where "ready" was due
