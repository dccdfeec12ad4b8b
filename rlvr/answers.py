"""Final-answer parsing and normalization for GSM8k-style problems.

Solutions end with a line ``#### <answer>``. ``strict`` extraction takes the one number after the last
``####`` line, else no answer; ``flexible`` falls back to the last ``\\boxed{...}``, then the last number
in the text. Neither returns a fragment of something that is not one number (``#### 2+3`` is not 3).
The mode names are verl's and lm-evaluation-harness'; the rules are ours (docs/architecture.md,
"Answers"). :func:`lm_eval_gsm8k_answers` and :func:`lm_eval_gsm8k_match` reproduce
lm-evaluation-harness' own gsm8k scoring, quirks included, so our numbers sit beside published ones.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

EXTRACTION_MODES = ("strict", "flexible")
MAX_NUMBER_CHARS = 64  # longer digit strings are no answer (and would overflow a float)
MAX_ANSWER_CHARS = 256  # a longer "#### ..." line or answer text is no single number

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"  # 1,234.5 / 1234 / .5; not 1,2345
_NUMBER_START_RE = re.compile(
    r"(?P<sign>[-+]?)\s*(?P<currency>\$?)\s*(?P<currency_sign>[-+]?)"  # -$5, $-5, $ 5
    r"(?P<numerator>" + _DIGITS + r")(?:[eE](?P<exponent>[-+]?\d{1,2}))?"
    r"(?:\s*/\s*(?P<denominator>" + _DIGITS + r"))?"
)
# A number in running text (flexible mode); a minus right after a word or bracket is a subtraction.
_NUMBER_TOKEN_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?:\$\s?-?)?(?:" + _DIGITS + r")(?:[eE][-+]?\d{1,2})?(?:\s*/\s*(?:" + _DIGITS + r"))?")
# After a number: a digit, an operator or a hyphen not joining two letters means it was not alone.
_NOT_A_UNIT_RE = re.compile(r"[\d+*/^=!?<>×÷·\\{}\[\]|#@&~]|(?<![^\W\d_])-|-(?![^\W\d_])")
_FIRST_WORD_RE = re.compile(r"\s*([^\W\d_]+)")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{([^{}\d]*)\}|\\([$%])")  # \text{ clips}, \$, \%
_AMBIGUOUS_SUFFIXES = {"k", "m", "b", "bn", "x", "e"}  # 5k, 5 m, 5x: a scale, a unit or a product?
_SCALE_WORDS = {"dozen": 12, "hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}


@dataclass(frozen=True)
class ExtractedAnswer:
    """An answer found in a completion: its normalized text, numeric value and how it was found."""

    text: str
    value: float
    method: str  # "hash", "boxed" or "last_number"


def with_ascii_minus(text: str) -> str:
    """Replace unicode minus signs (``−5``) by ``-`` so the answer keeps its sign."""
    return text.translate(_MINUS_SIGNS)


def parse_number(text: str) -> float | None:
    """Parse one number as written in math answers; None when ``text`` is anything else.

    Accepts a sign and ``$`` in either order (``-$5``, ``$-5``, ``−5``), thousands groups (``1,080``),
    decimals (``.5``), a fraction (``3/4``), ``1.5e6``; then a unit (``50%``, ``72 clips``), a scale word
    (``3 dozen`` = 36) and a final period; markdown and LaTeX text markup are ignored (``**72**``). Refuses a
    second number, an operator (``2+3``, ``5!``), words before the number, one letter after it (``5k``),
    malformed separators (``1,08``) and more than ``MAX_NUMBER_CHARS`` digits.
    """
    fraction = _parse_fraction(text)
    return None if fraction is None else float(fraction)


def normalize_answer(text: str) -> str | None:
    """Canonical text of a numeric answer: ``"1,080.00"`` -> ``"1080"``, ``"$-0.50"`` -> ``"-0.5"``.

    Fractions become decimals when exact (``"6/8"`` -> ``"0.75"``) and stay reduced fractions
    otherwise (``"2/6"`` -> ``"1/3"``); ``-0`` is ``0``.
    Returns None when ``text`` holds no single number (see :func:`parse_number`).
    """
    fraction = _parse_fraction(text)
    if fraction is None:
        return None
    return format_number(fraction)


def format_number(value: Fraction | float | int) -> str:
    """Shortest exact text of a number: integers without ``.0``, decimals without trailing zeros."""
    if not isinstance(value, Fraction):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"not a finite number: {value!r}")
        value = Fraction(str(value)) if isinstance(value, float) else Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator != 1:  # not a terminating decimal: keep the fraction
        return f"{value.numerator}/{value.denominator}"
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    whole, rest = divmod(magnitude.numerator, magnitude.denominator)
    digits = []
    while rest:
        rest *= 10
        digit, rest = divmod(rest, magnitude.denominator)
        digits.append(str(digit))
    return f"{sign}{whole}.{''.join(digits)}"


def split_gsm8k_answer(answer: str) -> tuple[str, str]:
    """Split an official GSM8k ``answer`` field into (reasoning, final answer text).

    Raises ValueError when the field has no ``####`` line.
    """
    reasoning, sep, final = answer.rpartition("####")
    if not sep:
        raise ValueError("GSM8k answer has no '#### <answer>' line")
    final = final.strip()
    if not final:
        raise ValueError("GSM8k answer has an empty '####' line")
    return reasoning.strip(), final


def count_reasoning_steps(reasoning: str) -> int:
    """Number of reasoning steps in a reference solution: its non-empty lines (the GSM8k convention)."""
    return sum(1 for line in reasoning.splitlines() if line.strip())


def hash_answer_text(text: str) -> str | None:
    """What follows the last ``####`` up to the end of its line, stripped; None without a marker or when empty.

    Only that line counts: ``"####\\n\\n72"`` has an empty answer line, not the answer 72.
    """
    start = text.rfind("####")
    if start < 0:
        return None
    return text[start + 4 :].split("\n", 1)[0].strip() or None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, nested braces included (``\\boxed{\\frac{3}{4}}`` -> ``\\frac{3}{4}``)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip() or None
    return None


def final_line(text: str) -> str | None:
    """The last non-empty line, stripped; None for a blank text."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def extract_final_answer(completion: str, mode: str = "strict") -> ExtractedAnswer | None:
    """Find the final numeric answer in a completion (see the module docstring for ``mode``)."""
    if mode not in EXTRACTION_MODES:
        raise ValueError(f"unknown extraction mode {mode!r}; expected one of {EXTRACTION_MODES}")
    completion = with_ascii_minus(completion)
    declared = [("hash", hash_answer_text(completion))]
    if mode == "flexible":
        declared.append(("boxed", last_boxed(completion)))
    unreadable = False
    for method, raw in declared:
        if raw is None:
            continue
        fraction = _parse_fraction(raw)
        if fraction is not None:
            return ExtractedAnswer(text=format_number(fraction), value=float(fraction), method=method)
        unreadable = unreadable or any(c.isdigit() for c in raw)
    if mode == "strict" or unreadable:
        return None
    last = None
    for last in _NUMBER_TOKEN_RE.finditer(completion):  # noqa: B007 - the loop finds the last match
        pass
    fraction = _parse_fraction(last.group(0)) if last else None
    if fraction is None:
        return None
    return ExtractedAnswer(text=format_number(fraction), value=float(fraction), method="last_number")


def is_well_formed(completion: str) -> bool:
    """True when the completion's last line is ``#### <number>`` (a final period allowed) and nothing else.

    Stricter than strict extraction: no unit, no words (``#### 72 clips`` is not well formed).
    """
    last_line = with_ascii_minus(completion).rstrip().rpartition("\n")[2]
    span = hash_answer_text(last_line)
    read = _read_number(span) if span else None
    return read is not None and read[1].strip() in ("", ".")


def answers_match(predicted: float, reference: float, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Numeric equality with tolerance, as used to grade GSM8k answers."""
    return math.isclose(predicted, reference, rel_tol=rel_tol, abs_tol=abs_tol)


def _read_number(text: str) -> tuple[Fraction, str] | None:
    """The number ``text`` starts with and the text after it (None when it starts with none)."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    found = _NUMBER_START_RE.match(text)
    if found is None or (found["sign"] and found["currency_sign"]):
        return None
    numerator, denominator = found["numerator"], found["denominator"]
    if len(numerator) > MAX_NUMBER_CHARS or (denominator and len(denominator) > MAX_NUMBER_CHARS):
        return None
    value = Fraction(numerator.replace(",", ""))
    if found["exponent"]:
        value *= Fraction(10) ** int(found["exponent"])
    if denominator:
        divisor = Fraction(denominator.replace(",", ""))
        if divisor == 0:
            return None
        value /= divisor
    if "-" in (found["sign"], found["currency_sign"]):
        value = -value
    return value, text[found.end() :]


def _parse_fraction(text: str) -> Fraction | None:
    """``text`` as one number (see :func:`parse_number`); markdown emphasis (``**72**``) and LaTeX
    text markup (``\\$18 \\text{ dollars}``) are ignored."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    text = _LATEX_TEXT_RE.sub(lambda m: m[2] or f" {m[1]}", with_ascii_minus(text))
    read = _read_number(text.strip().strip("*_").strip())
    if read is None:
        return None
    value, tail = read
    if _NOT_A_UNIT_RE.search(tail):
        return None
    word = _FIRST_WORD_RE.match(tail)
    if word is None:
        return value
    word = word.group(1).lower()
    if word in _AMBIGUOUS_SUFFIXES:
        return None
    return value * _SCALE_WORDS.get(word.removesuffix("s"), 1)


# ---- lm-evaluation-harness gsm8k ---------------------------------------------------------------
# lm-eval 0.4.13, lm_eval/tasks/gsm8k/gsm8k.yaml (version 3.0): generation stops at `until`; the
# "strict-match" filter takes the first match of its regex, "flexible-extract" the last match of
# its own (the first non-empty group), each stripped, "[invalid]" without a match; exact_match
# then deletes `regexes_to_ignore` in order from prediction and reference, lowercases, compares.
LM_EVAL_GSM8K_UNTIL = ("Question:", "</s>", "<|im_end|>")
LM_EVAL_GSM8K_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
LM_EVAL_GSM8K_FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
LM_EVAL_GSM8K_IGNORE = tuple(re.compile(p) for p in (",", "\\$", "(?s).*#### ", "\\.$"))
LM_EVAL_INVALID = "[invalid]"


def lm_eval_gsm8k_answers(completion: str) -> tuple[str, str]:
    """(strict-match, flexible-extract) answers as lm-evaluation-harness' gsm8k task extracts them.

    Its quirks are kept, not fixed: the completion is cut at the first stop string
    (``Question:``, ...); strict takes the *first* ``#### `` (one space exactly: ``####5`` and
    ``#### $5`` are invalid); flexible ignores ``####`` and takes the last run of ``$0-9.,`` of two
    or more characters (``"... 72..."`` gives ``72...``; a lone ``..`` counts), else the last
    integer; a unicode minus is no sign. No match gives ``"[invalid]"``.
    """
    for stop in LM_EVAL_GSM8K_UNTIL:
        completion = completion.split(stop, 1)[0]
    strict = LM_EVAL_GSM8K_STRICT_RE.findall(completion)
    flexible = LM_EVAL_GSM8K_FLEXIBLE_RE.findall(completion)
    flexible_answer = next((group for group in flexible[-1] if group), LM_EVAL_INVALID) if flexible else LM_EVAL_INVALID
    return (strict[0].strip() if strict else LM_EVAL_INVALID), flexible_answer.strip()


def lm_eval_gsm8k_match(prediction: str, reference: str) -> bool:
    """The harness's gsm8k exact_match of an extracted answer and a reference (a final answer or a whole solution).

    Both lose ``,`` and ``$``, everything up to the last ``#### ``, one trailing ``.``, and case;
    then they are compared as strings, so ``5.0`` does not match ``5``.
    """
    if not isinstance(prediction, str) or not isinstance(reference, str):
        raise TypeError(f"lm_eval_gsm8k_match compares strings, got {type(prediction).__name__} and {type(reference).__name__}")

    def clean(text: str) -> str:
        for pattern in LM_EVAL_GSM8K_IGNORE:
            text = pattern.sub("", text)
        return text.lower()

    return clean(prediction) == clean(reference)
