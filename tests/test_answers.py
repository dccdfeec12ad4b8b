import pytest

from rlvr.answers import (
    answers_match,
    count_reasoning_steps,
    extract_final_answer,
    format_number,
    is_well_formed,
    normalize_answer,
    parse_number,
    split_gsm8k_answer,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("72", "72"),
        ("1,080", "1080"),
        ("109,200,000", "109200000"),
        ("$18", "18"),
        ("$18.00", "18"),
        ("-47", "-47"),
        ("-$5", "-5"),
        ("18.0", "18"),
        ("0.50", "0.5"),
        ("-0.25", "-0.25"),
        ("6/8", "0.75"),
        ("10/2", "5"),
        ("1/3", "1/3"),
        ("50%", "50"),
        ("12 dollars", "12"),
        ("7.", "7"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1,08", "3/0", "12 apples and 3", "--5", "1.2.3"])
def test_normalize_answer_rejects_non_numbers(text):
    assert normalize_answer(text) is None
    assert parse_number(text) is None


def test_parse_number_values():
    assert parse_number("1,234.5") == 1234.5
    assert parse_number("-$3") == -3
    assert parse_number("3/4") == 0.75


def test_format_number():
    assert format_number(3.0) == "3"
    assert format_number(-0.125) == "-0.125"
    assert format_number(10) == "10"
    with pytest.raises(ValueError):
        format_number(float("nan"))


def test_split_gsm8k_answer_and_steps():
    reasoning, final = split_gsm8k_answer("She has 3+4=<<3+4=7>>7.\nThen 7*2=<<7*2=14>>14.\n#### 14")
    assert final == "14"
    assert count_reasoning_steps(reasoning) == 2
    with pytest.raises(ValueError, match="no '#### <answer>' line"):
        split_gsm8k_answer("just text")
    with pytest.raises(ValueError, match="empty"):
        split_gsm8k_answer("text\n####   ")


def test_strict_extraction_takes_last_hash_answer():
    found = extract_final_answer("#### 3\nwait, recompute\n#### 1,200\nThe answer is: 1200")
    assert found is not None and found.text == "1200" and found.method == "hash"
    assert extract_final_answer("The answer is 42.") is None
    assert extract_final_answer("#### forty") is None


def test_flexible_extraction_falls_back_to_boxed_then_last_number():
    boxed = extract_final_answer("so \\boxed{-7} is it, 3 left", mode="flexible")
    assert boxed is not None and boxed.value == -7 and boxed.method == "boxed"
    last = extract_final_answer("3 apples plus 4 apples is 7 apples.", mode="flexible")
    assert last is not None and last.text == "7" and last.method == "last_number"
    assert extract_final_answer("no numbers here", mode="flexible") is None
    with pytest.raises(ValueError, match="unknown extraction mode"):
        extract_final_answer("1", mode="loose")


def test_well_formed_requires_hash_line_at_the_end():
    assert is_well_formed("3+4=7\n#### 7")
    assert is_well_formed("3+4=7\n#### $1,000.\n")
    assert not is_well_formed("#### 7\nThe answer is: 7")
    assert not is_well_formed("The answer is 7")


def test_answers_match_tolerance():
    assert answers_match(0.1 + 0.2, 0.3)
    assert not answers_match(7.0, 7.01)


def test_huge_numbers_are_no_answer():
    assert extract_final_answer("#### " + "9" * 5000) is None
    assert parse_number("1" * 400) is None
