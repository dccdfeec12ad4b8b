"""Final-answer parsing and normalization for GSM8k-style problems.

GSM8k reference solutions end with a line ``#### <answer>``; policies are asked to do the same.
Two extraction modes, as in lm-evaluation-harness and verl:

* ``strict``: only a ``#### <number>`` marker counts (the last one in the text);
* ``flexible``: strict first, then ``\\boxed{...}``, then the last number in the text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

_NUMBER = r"-?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*(" + _NUMBER + r")")
_BOXED_RE = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_WELL_FORMED_END_RE = re.compile(r"####\s*(" + _NUMBER + r")\s*\.?\s*$")

EXTRACTION_MODES = ("strict", "flexible")
MAX_NUMBER_CHARS = 64  # longer digit strings are no answer (and would overflow a float)


@dataclass(frozen=True)
class ExtractedAnswer:
    """An answer found in a completion: its normalized text, numeric value and how it was found."""

    text: str
    value: float
    method: str  # "hash", "boxed" or "last_number"


def parse_number(text: str) -> float | None:
    """Parse a number as written in math answers: ``1,080``, ``$18.00``, ``-7``, ``0.5``, ``3/4``.

    Returns None when ``text`` is not a single number (units and trailing punctuation are allowed:
    ``18 dollars``, ``50%``, ``12.``).
    """
    fraction = _parse_fraction(text)
    return None if fraction is None else float(fraction)


def normalize_answer(text: str) -> str | None:
    """Canonical text of a numeric answer: ``"1,080.00"`` -> ``"1080"``, ``"$-0.50"`` -> ``"-0.5"``.

    Fractions become decimals when exact (``"6/8"`` -> ``"0.75"``) and stay reduced fractions
    otherwise (``"2/6"`` -> ``"1/3"``).
    Returns None when ``text`` holds no single number.
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


def extract_final_answer(completion: str, mode: str = "strict") -> ExtractedAnswer | None:
    """Find the final numeric answer in a completion (see the module docstring for ``mode``)."""
    if mode not in EXTRACTION_MODES:
        raise ValueError(f"unknown extraction mode {mode!r}; expected one of {EXTRACTION_MODES}")
    candidates = [("hash", m.group(1)) for m in _HASH_RE.finditer(completion)][-1:]
    if mode == "flexible" and not candidates:
        candidates = [("boxed", m.group(1)) for m in _BOXED_RE.finditer(completion)][-1:]
        if not candidates:
            candidates = [("last_number", m.group(0)) for m in _NUMBER_RE.finditer(completion)][-1:]
    for method, raw in candidates:
        fraction = _parse_fraction(raw)
        if fraction is not None:
            return ExtractedAnswer(text=format_number(fraction), value=float(fraction), method=method)
    return None


def is_well_formed(completion: str) -> bool:
    """True when the completion ends with a ``#### <number>`` line and nothing after it."""
    return _WELL_FORMED_END_RE.search(completion.rstrip()) is not None


def answers_match(predicted: float, reference: float, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Numeric equality with tolerance, as used to grade GSM8k answers."""
    return math.isclose(predicted, reference, rel_tol=rel_tol, abs_tol=abs_tol)


def _parse_fraction(text: str) -> Fraction | None:
    cleaned = text.strip().rstrip(".").strip()
    cleaned = re.sub(r"\s*(%|percent|dollars?|cents?|units?)$", "", cleaned, flags=re.IGNORECASE)
    cleaned = cleaned.replace("$", "").replace(" ", "")
    if cleaned.startswith("-"):
        sign, cleaned = -1, cleaned[1:]
    else:
        sign = 1
    if len(cleaned) > MAX_NUMBER_CHARS:
        return None
    if not re.fullmatch(r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/(?:\d+(?:\.\d+)?))?", cleaned):
        return None
    cleaned = cleaned.replace(",", "")
    numerator, _, denominator = cleaned.partition("/")
    value = Fraction(numerator)
    if denominator:
        if Fraction(denominator) == 0:
            return None
        value /= Fraction(denominator)
    return sign * value
