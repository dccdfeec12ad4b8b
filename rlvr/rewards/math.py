"""Correctness of a GSM8k-style final answer: ``math_answer`` (strict) and ``math_answer_flexible``.

Extraction is ``rlvr.answers.extract_final_answer`` (strict: the last ``#### x``; flexible: then
``\\boxed{x}``, then the last number), so training, evaluation and serving grade alike. The two
modes are registered separately so strict and flexible accuracy are reported side by side.
The answer is compared numerically with tolerance; when that fails and the final answer is written
as LaTeX or an expression (``\\frac{3}{4}``, ``2^3``), math-verify checks symbolic equivalence.
"""

from __future__ import annotations

import math
import numbers
import re
import threading

from rlvr.answers import (
    ExtractedAnswer,
    answers_match,
    extract_final_answer,
    format_number,
    parse_number,
)
from rlvr.rewards.registry import RewardResult, register_reward

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_HASH_LINE_RE = re.compile(r"####[ \t]*([^\n]*)")
_SYMBOLIC_HINT_RE = re.compile(r"[\\^{}]|\d\s*[*/]\s*\(|sqrt|pi")
MAX_SYMBOLIC_CHARS = 120  # longer final answers are not handed to sympy: parsing cost grows fast


def with_ascii_minus(text: str) -> str:
    """Replace unicode minus signs (``−5``) by ``-`` so the answer keeps its sign."""
    return text.translate(_MINUS_SIGNS)


def find_answer(completion: str, mode: str) -> ExtractedAnswer | None:
    """``extract_final_answer`` after ``with_ascii_minus``."""
    return extract_final_answer(with_ascii_minus(completion), mode)


@register_reward("math_answer")
def math_answer(completion: str, answer_value=None, answer_text=None, mode: str = "strict",
                rel_tol: float = 1e-6, abs_tol: float = 1e-6, symbolic: bool = True, **_) -> RewardResult:
    """1 when the completion's final answer equals the reference, else 0.

    Reference keys: ``answer_value`` (number) and/or ``answer_text`` (normalized text); ``mode``
    ("strict" or "flexible"); ``rel_tol``/``abs_tol`` for the numeric comparison; ``symbolic``
    to allow math-verify on LaTeX answers. Details: ``extracted``, ``method`` (hash, boxed,
    last_number), ``strict`` (found by the ``####`` marker), ``match`` (numeric, symbolic or None).
    """
    reference = reference_value(answer_value, answer_text)
    gold_text = answer_text if isinstance(answer_text, str) and answer_text.strip() else (
        format_number(reference) if reference is not None else None)
    if gold_text is None:
        raise ValueError("math_answer needs a numeric answer_value or a non-empty answer_text")
    extracted = find_answer(completion, mode)
    details = {"extracted": extracted.text if extracted else None,
               "method": extracted.method if extracted else None,
               "mode": mode, "strict": bool(extracted and extracted.method == "hash"), "match": None}
    if extracted and reference is not None and answers_match(extracted.value, reference, rel_tol, abs_tol):
        return RewardResult(1.0, {**details, "match": "numeric"})
    span, method = final_answer_span(with_ascii_minus(completion), mode)
    if symbolic and span and _SYMBOLIC_HINT_RE.search(span) and len(span) <= MAX_SYMBOLIC_CHARS:
        if symbolically_equal(span, gold_text):
            return RewardResult(1.0, {**details, "extracted": span, "method": method,
                                      "strict": method == "hash", "match": "symbolic"})
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
        return parse_number(with_ascii_minus(str(answer_text)))
    return None


def final_answer_span(text: str, mode: str) -> tuple[str | None, str | None]:
    """The raw final answer, unparsed: the rest of the last ``####`` line, else (flexible) the last ``\\boxed{}``."""
    lines = _HASH_LINE_RE.findall(text)
    if lines and lines[-1].strip():
        return lines[-1].strip().rstrip("."), "hash"
    if mode == "flexible":
        boxed = last_boxed(text)
        if boxed:
            return boxed, "boxed"
    return None, None


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


def symbolically_equal(predicted: str, gold: str) -> bool:
    """math-verify's verdict on two LaTeX answers (False when either does not parse).

    Its timeouts rely on SIGALRM, which only the main thread may use: elsewhere (reward pool
    threads) they are off, and the length cap plus the pool's own timeout bound the cost.
    """
    from math_verify import parse, verify

    timeout_s = 3 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s)
    predicted_parsed = parse(f"${predicted}$", parsing_timeout=timeout_s)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout_s))
