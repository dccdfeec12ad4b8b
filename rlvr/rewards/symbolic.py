"""MATH-style symbolic answers: ``math_verify`` (math-verify's equivalence) and ``boxed`` (the format).

The answer is the completion's last ``\\boxed{}``, else its last non-empty line (math-verify finds
``the answer is $x$`` there); it is verified against the reference ``gold``, gold first (math-verify's
``verify`` is not symmetric). Both first pass :func:`rlvr.rewards.math.symbolic_refusal`, so sympy never
sees what could hold the process for hours. math-verify times out with ``signal.alarm``, which only the
main thread may set: in any other thread its timeouts are off and the guards (and, in a ``RewardPool``
worker, the pool's timeout) bound the work.
"""

from __future__ import annotations

import re
import threading

from rlvr.answers import last_boxed, with_ascii_minus
from rlvr.rewards.math import symbolic_refusal
from rlvr.rewards.registry import RewardResult, register_reward

TIMEOUT_S = 5  # math-verify's own limit per parse and per comparison, in the main thread
_DELIMITED_RE = re.compile(r"(?<!\\)\$|\\boxed\b")  # a gold that already marks its math (an unescaped $, or \boxed)


@register_reward("math_verify")
def math_verify_reward(completion: str, gold: str, **_) -> RewardResult:
    """1 when math-verify finds the completion's final answer equivalent to ``gold`` (LaTeX), else 0.

    Details: ``extracted`` (the answer's text), ``method`` ("boxed" or "last_line"), ``parsed``
    (math-verify's reading of it), and ``refused`` (why sympy was not run) or ``reason``.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"math_verify needs a non-empty 'gold' answer, got {gold!r}")
    completion = with_ascii_minus(completion)
    boxed = last_boxed(completion)
    answer, method = (boxed, "boxed") if boxed else (_last_line(completion), "last_line")
    details = {"extracted": answer, "method": method if answer else None}
    if not answer:
        return RewardResult(0.0, {**details, "reason": "no answer"})
    if refused := symbolic_refusal(answer, gold):
        return RewardResult(0.0, {**details, "refused": refused})
    timeout_s = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_text = gold if _DELIMITED_RE.search(gold) else f"${gold}$"
    gold_parsed = parse(gold_text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=timeout_s)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    answer_text = f"\\boxed{{{answer}}}" if method == "boxed" else answer
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    answer_parsed = parse(answer_text, extraction_config=config, extraction_mode="first_match", parsing_timeout=timeout_s)
    details["parsed"] = [str(item)[:200] for item in answer_parsed]
    if not answer_parsed:
        return RewardResult(0.0, {**details, "reason": "math-verify found no answer"})
    return RewardResult(float(verify(gold_parsed, answer_parsed, timeout_seconds=timeout_s)), details)


@register_reward("boxed")
def boxed_reward(completion: str, **_) -> RewardResult:
    """1 when the completion holds a closed, non-empty ``\\boxed{...}``."""
    boxed = last_boxed(completion)
    return RewardResult(float(boxed is not None), {"boxed": boxed})


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None
