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


# ---- strict extraction: what a careful grader reads on the "####" line ---------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("#### $-5", "-5"),  # sign after the currency
        ("#### -$5", "-5"),
        ("#### $ -5", "-5"),
        ("#### \u22125", "-5"),  # unicode minus keeps the sign
        ("#### \u2212$5", "-5"),
        ("#### $1,234.50", "1234.5"),
        ("#### 5%", "5"),
        ("#### 50 percent", "50"),
        ("#### 72.", "72"),  # a trailing period ends the sentence
        ("#### 72.00.", "72"),
        ("####5", "5"),  # no space after the marker
        ("#####  5", "5"),
        ("so the total is #### 72", "72"),  # the marker may end a line of prose
        ("#### 1,234,567", "1234567"),
        ("#### 5.0", "5"),
        ("#### .5", "0.5"),
        ("#### 3/4", "0.75"),
        ("#### 2/6", "1/3"),
        ("#### 1.5e6", "1500000"),
        ("#### 2.5E-2", "0.025"),
        ("#### -0", "0"),  # negative zero is zero
        ("#### -0.0", "0"),
        ("#### 72 clips", "72"),  # a unit after the number
        ("#### 72 (clips)", "72"),
        ("#### 72 sq-ft", "72"),
        ("#### 2 million", "2000000"),  # a scale word multiplies
        ("#### 1.5 billion dollars", "1500000000"),
        ("#### 3 dozen", "36"),
        ("#### **72**", "72"),  # markdown emphasis
        ("#### $72$", "72"),  # LaTeX inline math
        ("#### \\$18 \\text{ dollars}", "18"),  # LaTeX text markup
        ("#### 50\\%", "50"),
        ("#### 3\n#### 5", "5"),  # several marker lines: the last one
        ("#### 5 #### 6", "6"),  # several markers on the line: the last one
        ("#### 72\nThe answer is: 72", "72"),  # text after the line does not matter
    ],
)
def test_strict_reads_one_number_on_the_hash_line(completion, expected):
    found = extract_final_answer(completion, "strict")
    assert found is not None and found.text == expected and found.method == "hash"


@pytest.mark.parametrize(
    "completion",
    [
        "####\n\n72",  # the number must be on the marker's own line
        "#### \n72",
        "#### 72\n####",  # the last marker line is empty
        "#### 2+3",  # an expression is not its first number
        "#### 2 + 3 = 5",
        "#### 5-3",
        "#### 5 - 3",
        "#### 2^3",
        "#### 5!",  # a factorial, not an exclamation
        "#### 3/4/5",
        "#### The answer is 5",  # words before the number
        "#### x = 5",
        "#### 5 apples and 3 oranges",  # two numbers
        "#### 12 3",  # not 123
        "#### 1 1/2",  # not 11/2 (a mixed number is refused, not misread)
        "#### 5k",  # 5 or 5000?
        "#### 5 x",
        "#### 5e",
        "#### 1,2345",  # a malformed thousands separator
        "#### 12,34",
        "#### 1.2.3",
        "#### --5",
        "#### -$-5",
        "#### 3/0",
        "#### (72)",
        "#### \\boxed{72}",  # strict takes numbers, not LaTeX (math_answer's symbolic path reads it)
        "#### " + "9" * 65,  # more than MAX_NUMBER_CHARS digits
        "#### " + "1,000" * 20,
        "#### 72 " + "clips " * 60,  # a line longer than MAX_ANSWER_CHARS
    ],
)
def test_strict_gives_no_answer_for_anything_but_one_number(completion):
    assert extract_final_answer(completion, "strict") is None


@pytest.mark.parametrize(
    "completion, expected, method",
    [
        ("#### \\boxed{72}", "72", "boxed"),  # an unreadable marker line, then the box
        ("####\n\n72", "72", "last_number"),  # an empty marker line holds no answer: last number
        ("#### 72\n####", "72", "last_number"),
        ("costs $1,234.50.", "1234.5", "last_number"),
        ("x = -5", "-5", "last_number"),
        ("x = \u22125", "-5", "last_number"),
        ("the difference is 10-5", "5", "last_number"),  # a minus after a digit subtracts
        ("then 3/4 of them", "0.75", "last_number"),
        ("\\boxed{72 \\text{ clips}} and 3 more", "72", "boxed"),  # nested braces in the box
    ],
)
def test_flexible_extraction_cases(completion, expected, method):
    found = extract_final_answer(completion, "flexible")
    assert found is not None and (found.text, found.method) == (expected, method)


@pytest.mark.parametrize(
    "completion",
    [
        "#### 2+3",  # not 3: a fragment of the declared answer
        "#### 5 apples and 3 oranges",
        "#### 5k",
        "so \\boxed{\\frac{3}{4}}",  # not 4 (math_answer's symbolic path reads the box)
        "#### 2^3 and \\boxed{2^3}",
    ],
)
def test_flexible_never_reads_a_fragment_of_a_declared_answer(completion):
    assert extract_final_answer(completion, "flexible") is None


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("#### $-5", True),
        ("#### \u22125", True),
        ("#### 3/4", True),
        ("#### 1,080.50.", True),
        ("####\n\n72", False),  # the number on a later line
        ("#### 2+3", False),
        ("#### 5%", False),  # a unit: readable, but not the bare format
        ("#### **72**", False),
        ("#### 72\n####", False),
    ],
)
def test_well_formed_cases(completion, expected):
    assert is_well_formed(completion) is expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$-0.50", -0.5),
        ("1.5 million", 1_500_000.0),
        ("72 clips", 72.0),
        ("1e3", 1000.0),
        ("5 a day", 5.0),
    ],
)
def test_parse_number_units_and_scales(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text", ["5k", "5 M", "2+3", "about 5", "5!", "1 1/2", "1e999", "9" * 5000])
def test_parse_number_refuses_ambiguous_forms(text):
    assert parse_number(text) is None


def test_extraction_of_huge_texts_is_linear():
    for completion in ("#### " * 100_000, "1" * 1_000_000, "-$" * 200_000, "1," * 300_000 + "5", "12 " * 300_000):
        for mode in ("strict", "flexible"):
            extract_final_answer(completion, mode)  # returns (a regex blow-up would not)
    assert extract_final_answer("12 " * 300_000, "flexible").text == "12"
