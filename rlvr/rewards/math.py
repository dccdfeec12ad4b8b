"""Correctness of a GSM8k-style final answer: ``math_answer`` (strict) and ``math_answer_flexible``.

Extraction is ``rlvr.answers.extract_final_answer`` (strict: the number on the last ``####`` line;
flexible: then ``\\boxed{x}``, then the last number), so training, evaluation and serving grade
alike. The two modes are registered separately so strict and flexible accuracy are reported side
by side. The answer is compared numerically with tolerance; an answer written as the reference
scores 1 as it stands; otherwise, when either is LaTeX or an expression (``\\frac{3}{4}``, ``2^3``),
math-verify checks symbolic equivalence in a worker process killed past its time limit
(:mod:`rlvr.rewards.sympy_worker`), unless :func:`explosive_reason` finds it hopeless first.
"""

from __future__ import annotations

import math
import numbers
import re

from rlvr.answers import (
    answers_match,
    extract_final_answer,
    format_number,
    hash_answer_text,
    last_boxed,
    parse_number,
    with_ascii_minus,
)
from rlvr.rewards.registry import RewardResult, register_reward
from rlvr.rewards.sympy_worker import TIMEOUT_S, SymbolicCheckAborted, run_bounded

_SYMBOLIC_HINT_RE = re.compile(r"[\\^{}!]|\*\*|\d\s*[*/]\s*\(|sqrt|pi")  # LaTeX, powers, factorials
MAX_POWER_DIGITS = 10**8  # a power of numbers past this is never computed (3^(3*10^7), 1.4e7 digits: 14 s)
_NUMBER = r"\d+(?:\.\d+)?"
_POWER_OF_NUMBERS_RE = re.compile(rf"(?<![\d.]){_NUMBER}(?:\^\{{?{_NUMBER})+")  # 2^{10}, 9^{9^{9}}, 9^9^9
_LATEX_SPACING_RE = re.compile(r"\$|\\[,;:! ]|\\q?quad\b|\\left\b|\\right\b|\\displaystyle\b")


@register_reward("math_answer")
def math_answer(
    completion: str, answer_value=None, answer_text=None, mode: str = "strict", rel_tol: float = 1e-6, abs_tol: float = 1e-6, symbolic: bool = True, **_
) -> RewardResult:
    """1 when the completion's final answer equals the reference, else 0.

    Reference keys: ``answer_value`` (number) and/or ``answer_text`` (normalized text); ``mode``
    ("strict" or "flexible"); ``rel_tol``/``abs_tol`` for the numeric comparison; ``symbolic``
    to allow math-verify on LaTeX answers. Details: ``extracted``, ``method`` (hash, boxed,
    last_number), ``strict`` (found by the ``####`` marker), ``match`` (numeric, text, symbolic or None),
    and ``refused`` (:func:`explosive_reason`) or ``aborted`` (the time limit) when math-verify gave no verdict.
    """
    reference = reference_value(answer_value, answer_text)
    gold_text = answer_text if isinstance(answer_text, str) and answer_text.strip() else (format_number(reference) if reference is not None else None)
    if gold_text is None:
        raise ValueError("math_answer needs a numeric answer_value or a non-empty answer_text")
    extracted = extract_final_answer(completion, mode)
    details = {
        "extracted": extracted.text if extracted else None,
        "method": extracted.method if extracted else None,
        "mode": mode,
        "strict": bool(extracted and extracted.method == "hash"),
        "match": None,
    }
    if extracted and reference is not None and answers_match(extracted.value, reference, rel_tol, abs_tol):
        return RewardResult(1.0, {**details, "match": "numeric"})
    span, method = final_answer_span(with_ascii_minus(completion), mode)
    if not span:
        return RewardResult(0.0, details)
    found = {**details, "extracted": span, "method": method, "strict": method == "hash"}
    if written_form(span) == written_form(gold_text):
        return RewardResult(1.0, {**found, "match": "text"})
    if symbolic and (_SYMBOLIC_HINT_RE.search(span) or _SYMBOLIC_HINT_RE.search(gold_text)):
        if refused := symbolic_refusal(span, gold_text):
            return RewardResult(0.0, {**details, "refused": refused})
        try:
            if symbolically_equal(span, gold_text):
                return RewardResult(1.0, {**found, "match": "symbolic"})
        except SymbolicCheckAborted as err:
            return RewardResult(0.0, {**details, "aborted": f"math-verify {err}"})
    return RewardResult(0.0, details)


@register_reward("math_answer_flexible")
def math_answer_flexible(completion: str, **reference) -> RewardResult:
    """``math_answer`` in flexible mode: ``####`` first, then ``\\boxed{}``, then the last number."""
    return math_answer(completion, **{**reference, "mode": "flexible"})


def reference_value(answer_value, answer_text) -> float | None:
    """The reference answer as a float, from ``answer_value`` or else ``answer_text`` (None if neither parses)."""
    if isinstance(answer_value, numbers.Real) and not isinstance(answer_value, bool):
        if math.isfinite(answer_value):
            return float(answer_value)
    elif isinstance(answer_value, str) and (value := parse_number(answer_value)) is not None:
        return value
    if answer_text is not None:
        return parse_number(str(answer_text))
    return None


def final_answer_span(text: str, mode: str) -> tuple[str | None, str | None]:
    """The raw final answer, unparsed: the rest of the last ``####`` line, else (flexible) the last ``\\boxed{}``."""
    marked = hash_answer_text(text)
    if marked and marked.rstrip("."):
        return marked.rstrip("."), "hash"
    if mode == "flexible":
        boxed = last_boxed(text)
        if boxed:
            return boxed, "boxed"
    return None, None


def written_form(answer: str) -> str:
    """``answer`` as written, less what never changes its value: ``$``, LaTeX spacing, ``\\left``/``\\right``,
    ``\\dfrac``/``\\tfrac`` for ``\\frac``, a final period, and spaces not between two letters or digits."""
    text = _LATEX_SPACING_RE.sub(" ", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = " ".join(text.split()).rstrip(".").strip()
    return re.sub(r"(?<![A-Za-z0-9]) | (?![A-Za-z0-9])", "", text)


def symbolic_refusal(predicted: str, gold: str) -> str | None:
    """Why the pair must not reach sympy (``"answer: a power of over 100,000,000 digits"``), or None."""
    for role, expression in (("answer", predicted), ("reference", gold)):
        reason = explosive_reason(expression)
        if reason:
            return f"{role}: {reason}"
    return None


def explosive_reason(expression: str) -> str | None:
    """Why no time limit would let sympy finish with ``expression``, found without parsing it; else None.

    Refused: a power of numbers, towers included (``9^{9^{9}}``, ``9**9**9``, ``2^{10^{9}}``), one of
    whose powers has over ``MAX_POWER_DIGITS`` digits. Anything else, however long, is left to the
    time limit of :mod:`rlvr.rewards.sympy_worker`. Callers compare an answer written as the gold
    first (:func:`written_form`): a refused gold still scores against itself.
    """
    text = re.sub(r"\s+", "", expression).replace("**", "^")
    for power in _POWER_OF_NUMBERS_RE.finditer(text):
        if _largest_power_digits(re.findall(_NUMBER, power.group(0))) > MAX_POWER_DIGITS:
            return f"a power of over {MAX_POWER_DIGITS:,} digits"
    return None


def _largest_power_digits(tower: list[str]) -> float:
    """Digits of the largest power sympy computes for ``tower[0]^(tower[1]^(...))``, right to left
    (inf past a float): log10(b^e) = e * log10(b), bases up to 1 counting as 1."""
    largest = exponent_log10 = _log10(tower[-1])
    for base in reversed(tower[:-1]):
        base_log10 = _log10(base)
        exponent_log10 = 0.0 if base_log10 == 0 else (math.inf if exponent_log10 > 300 else 10**exponent_log10) * base_log10
        largest = max(largest, exponent_log10)
    return largest


def _log10(number: str) -> float:
    """log10 of a literal (0 for values up to 1), without turning a very long one into a float."""
    whole = number.split(".")[0].lstrip("0")
    return float(len(whole)) if len(whole) > 300 else math.log10(max(float(number), 1.0))


def symbolically_equal(predicted: str, gold: str, timeout_s: float = TIMEOUT_S) -> bool:
    """math-verify's verdict on two LaTeX answers (False when either does not parse), computed in a
    worker process killed past ``timeout_s``: then :class:`SymbolicCheckAborted`."""
    return run_bounded(_math_verify_equal, predicted, gold, timeout_s=timeout_s)


def _math_verify_equal(predicted: str, gold: str) -> bool:
    """In the worker: math-verify with its own (SIGALRM) timeouts off, as the worker's kill bounds it."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    predicted_parsed = parse(f"${predicted}$", parsing_timeout=None)
    return bool(gold_parsed and predicted_parsed and verify(gold_parsed, predicted_parsed, timeout_seconds=None))
