"""Correctness of a GSM8k-style final answer: ``math_answer`` (strict) and ``math_answer_flexible``.

Extraction is ``rlvr.answers.extract_final_answer`` (strict: the number on the last ``####`` line;
flexible: then ``\\boxed{x}``, then the last number), so training, evaluation and serving grade
alike. The two modes are registered separately so strict and flexible accuracy are reported side
by side. The answer is compared numerically with tolerance; when that fails and the final answer
is written as LaTeX or an expression (``\\frac{3}{4}``, ``2^3``), math-verify checks symbolic
equivalence, unless :func:`explosive_reason` refuses the answer or the reference first (sympy on
``9^{9^{9}}`` held a process, and the GIL, past 40 s).
"""

from __future__ import annotations

import math
import numbers
import re
import threading

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

_SYMBOLIC_HINT_RE = re.compile(r"[\\^{}!]|\*\*|\d\s*[*/]\s*\(|sqrt|pi")  # LaTeX, powers, factorials
MAX_SYMBOLIC_CHARS = 120  # longer answers (or references) are not handed to sympy: parsing cost grows fast
MAX_SYMBOLIC_DIGITS = 20  # a longer run of digits is refused
MAX_OPERATORS = 12
MAX_NESTING = 5  # brackets and braces
MAX_EXPONENT = 1000  # bound on the numbers of one exponent, multiplied together
MAX_FACTORIAL = 100
_OPERATOR_RE = re.compile(r"[-+*/^!]|\\(?:cdot|times|div|d?t?frac|sqrt)")
_COSTLY_RE = re.compile(
    r"\\(?:sum|prod|i*int|oint|lim|[dt]?binom|choose|Gamma|uparrow)"
    r"|\b(?:pow|factorial|binomial|gamma|Sum|Product|Integral|Limit)\b"
)
_EXP_FUNCTION_RE = re.compile(r"\\?\bexp\b")
_NUMBER_IN_TEXT_RE = re.compile(r"\d+(?:\.\d+)?")
_CLOSING = {")": "(", "}": "{", "]": "["}


@register_reward("math_answer")
def math_answer(
    completion: str, answer_value=None, answer_text=None, mode: str = "strict", rel_tol: float = 1e-6, abs_tol: float = 1e-6, symbolic: bool = True, **_
) -> RewardResult:
    """1 when the completion's final answer equals the reference, else 0.

    Reference keys: ``answer_value`` (number) and/or ``answer_text`` (normalized text); ``mode``
    ("strict" or "flexible"); ``rel_tol``/``abs_tol`` for the numeric comparison; ``symbolic``
    to allow math-verify on LaTeX answers. Details: ``extracted``, ``method`` (hash, boxed,
    last_number), ``strict`` (found by the ``####`` marker), ``match`` (numeric, symbolic or None),
    and ``refused`` (why the symbolic check was not run) when :func:`explosive_reason` refused.
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
    if symbolic and span and _SYMBOLIC_HINT_RE.search(span):
        refused = symbolic_refusal(span, gold_text)
        if refused:
            return RewardResult(0.0, {**details, "refused": refused})
        if symbolically_equal(span, gold_text):
            return RewardResult(1.0, {**details, "extracted": span, "method": method, "strict": method == "hash", "match": "symbolic"})
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


def symbolic_refusal(predicted: str, gold: str) -> str | None:
    """Why the pair must not reach sympy (``"answer: stacked exponents"``), or None when both may."""
    for role, expression in (("answer", predicted), ("reference", gold)):
        reason = explosive_reason(expression)
        if reason:
            return f"{role}: {reason}"
    return None


def explosive_reason(expression: str) -> str | None:
    """Why parsing ``expression`` could run for hours, found without parsing it; None when it is safe.

    Refused: over ``MAX_SYMBOLIC_CHARS`` characters, a digit run over ``MAX_SYMBOLIC_DIGITS``,
    sums/products/integrals/limits/binomials, over ``MAX_OPERATORS`` operators, nesting deeper
    than ``MAX_NESTING``, stacked exponents (``9^{9^{9}}``, ``(9^9)^9``, ``9^99!``), an exponent
    whose numbers multiply past ``MAX_EXPONENT``, a factorial of anything but an integer up to
    ``MAX_FACTORIAL``. ``**`` counts as ``^`` and ``\\exp(x)`` as ``e^(x)``.
    """
    if len(expression) > MAX_SYMBOLIC_CHARS:
        return f"longer than {MAX_SYMBOLIC_CHARS} characters"
    text = _EXP_FUNCTION_RE.sub("e^", expression.replace("**", "^"))
    if re.search(r"\d{%d}" % (MAX_SYMBOLIC_DIGITS + 1), text.replace(",", "")):
        return f"a digit string longer than {MAX_SYMBOLIC_DIGITS} digits"
    if _COSTLY_RE.search(text):
        return "a sum, product, integral, limit or combinatorial function"
    if len(_OPERATOR_RE.findall(text)) > MAX_OPERATORS:
        return f"more than {MAX_OPERATORS} operators"
    depth = 0
    for char in text:
        depth += (char in "({[") - (char in ")}]")
        if depth > MAX_NESTING:
            return f"nested deeper than {MAX_NESTING}"
    for caret in (i for i, char in enumerate(text) if char == "^"):
        exponent, end = _operand_after(text, caret + 1)
        if "^" in exponent or "^" in _operand_before(text, caret) or text[end:].lstrip()[:1] in ("^", "!"):
            return "stacked exponents"
        if math.prod(max(1.0, float(n)) for n in _NUMBER_IN_TEXT_RE.findall(exponent)) > MAX_EXPONENT:
            return f"an exponent above {MAX_EXPONENT}"
    for bang in (i for i, char in enumerate(text) if char == "!"):
        argument = re.search(r"(?<![\d.])(\d+)\s*$", text[:bang])
        if argument is None or int(argument.group(1)) > MAX_FACTORIAL or text[bang + 1 : bang + 2] == "!":
            return f"a factorial of more than {MAX_FACTORIAL} or of an expression"
    return None


def _operand_after(text: str, start: int) -> tuple[str, int]:
    """The operand that starts at ``start`` (a bracketed group, a ``\\command`` with its groups, or a
    run of letters, digits and dots) and the index after it."""
    i = len(text) - len(text[start:].lstrip())
    if i < len(text) and text[i] in "({[":
        end = _matching_close(text, i)
        return text[i:end], end
    command = re.match(r"\\[A-Za-z]+", text[i:])
    if command:
        end = i + command.end()
        while end < len(text) and text[end] in "{[":
            end = _matching_close(text, end)
        return text[i:end], end
    run = re.match(r"[\w.]*", text[i:])
    return run.group(0), i + run.end()


def _operand_before(text: str, end: int) -> str:
    """The bracketed group that ends just before ``end`` (spaces skipped), else ``""``."""
    j = len(text[:end].rstrip()) - 1
    if j < 0 or text[j] not in _CLOSING:
        return ""
    depth = 0
    for i in range(j, -1, -1):
        depth += (text[i] in _CLOSING) - (text[i] in "({[")
        if depth == 0:
            return text[i : j + 1]
    return text[: j + 1]


def _matching_close(text: str, start: int) -> int:
    """Index after the bracket closing the one at ``start`` (the end of ``text`` when unbalanced)."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] in "({[") - (text[i] in ")}]")
        if depth == 0:
            return i + 1
    return len(text)


def symbolically_equal(predicted: str, gold: str) -> bool:
    """math-verify's verdict on two LaTeX answers (False when either does not parse or is refused).

    Its timeouts rely on SIGALRM, which only the main thread may use, and cannot interrupt a big
    integer power holding the GIL: :func:`explosive_reason` keeps those from it.
    """
    if symbolic_refusal(predicted, gold):
        return False
    from math_verify import parse, verify

    timeout_s = 3 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s)
    predicted_parsed = parse(f"${predicted}$", parsing_timeout=timeout_s)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout_s))
