"""MATH-style symbolic answers: ``math_verify`` (math-verify's equivalence) and ``boxed`` (the format).

The answer is the completion's last ``\\boxed{}``, else its last non-empty line (math-verify finds
``the answer is $x$`` there); it is verified against the reference ``gold``, gold first (math-verify's
``verify`` is not symmetric). An answer written as the gold scores 1 without sympy
(:func:`rlvr.rewards.math.written_form`); any other is parsed and verified in a worker process killed
past its time limit (:mod:`rlvr.rewards.sympy_worker`), in any thread or process, unless
:func:`rlvr.rewards.math.symbolic_refusal` finds it hopeless first.
"""

from __future__ import annotations

import re

from rlvr.answers import final_line, last_boxed, with_ascii_minus
from rlvr.rewards.math import symbolic_refusal, written_form
from rlvr.rewards.registry import RewardResult, register_reward
from rlvr.rewards.sympy_worker import SymbolicCheckAborted, run_bounded

_DELIMITED_RE = re.compile(r"(?<!\\)\$|\\boxed\b")  # a gold that already marks its math (an unescaped $, or \boxed)


@register_reward("math_verify")
def math_verify_reward(completion: str, gold: str, **_) -> RewardResult:
    """1 when math-verify finds the completion's final answer equivalent to ``gold`` (LaTeX), else 0.

    Details: ``extracted`` (the answer's text), ``method`` ("boxed" or "last_line"), ``match`` ("text"
    for an answer written as the gold), ``parsed`` (math-verify's reading of it), and ``refused`` or
    ``aborted`` (why sympy gave no verdict) or ``reason``. A gold math-verify cannot parse is an error.
    """
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"math_verify needs a non-empty 'gold' answer, got {gold!r}")
    completion = with_ascii_minus(completion)
    boxed = last_boxed(completion)
    answer, method = (boxed, "boxed") if boxed else (final_line(completion), "last_line")
    details = {"extracted": answer, "method": method if answer else None}
    if not answer:
        return RewardResult(0.0, {**details, "reason": "no answer"})
    if written_form(answer) == written_form(gold):
        return RewardResult(1.0, {**details, "match": "text"})
    if refused := symbolic_refusal(answer, gold):
        return RewardResult(0.0, {**details, "refused": refused})
    try:
        verdict, parsed = run_bounded(_verify, gold, answer, method)
    except SymbolicCheckAborted as err:
        return RewardResult(0.0, {**details, "aborted": f"math-verify {err}"})
    if not parsed:
        return RewardResult(0.0, {**details, "parsed": [], "reason": "math-verify found no answer"})
    return RewardResult(verdict, {**details, "parsed": parsed})


def _verify(gold: str, answer: str, method: str) -> tuple[float, list[str]]:
    """In the worker: math-verify's verdict and its reading of ``answer`` (its own timeouts off, as the
    worker's kill bounds it); ValueError when the gold does not parse."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_text = gold if _DELIMITED_RE.search(gold) else f"${gold}$"
    gold_parsed = parse(gold_text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    answer_text = f"\\boxed{{{answer}}}" if method == "boxed" else answer
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    answer_parsed = parse(answer_text, extraction_config=config, extraction_mode="first_match", parsing_timeout=None)
    parsed = [str(item)[:200] for item in answer_parsed]
    return (float(verify(gold_parsed, answer_parsed, timeout_seconds=None)) if answer_parsed else 0.0), parsed


@register_reward("boxed")
def boxed_reward(completion: str, **_) -> RewardResult:
    """1 when the completion holds a closed, non-empty ``\\boxed{...}``."""
    boxed = last_boxed(completion)
    return RewardResult(float(boxed is not None), {"boxed": boxed})
