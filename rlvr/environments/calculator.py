"""The calculator environment: GSM8k's inline annotations, ``<<48/2=24>>24``, with the tool writing
the result.

The policy writes ``<<48/2=``; when the row's text ends with ``=`` inside a ``<<`` not yet closed by
``>>``, the episode evaluates the expression (:func:`rlvr.environments.arithmetic.evaluate`, exact
and bounded) and injects ``24>>``; the policy goes on, writing the result again as GSM8k does. A
refused expression (``<<x=``, ``<<1/0=``, ``<<9**9**9=``) injects ``error>>`` and records why in
``ToolCall.error``. An ``=`` followed by more text in the same token is not a call: the policy
wrote the result itself. Past the budget nothing is injected and the policy computes alone.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from rlvr.environments.arithmetic import MAX_EXPRESSION_CHARS, ArithmeticRefused, evaluate, format_result
from rlvr.environments.base import Injection, ToolBudget, ToolCall

OPEN, EQUALS, CLOSE = "<<", "=", ">>"
_MAX_TAIL_CHARS = len(OPEN) + MAX_EXPRESSION_CHARS + len(EQUALS)
ERROR_RESULT = "error"  # written in place of a result the calculator refused: ``<<1/0=error>>``
INSTRUCTIONS = (
    "For arithmetic, write the expression as <<expression= and a calculator writes the result and >>, e.g. <<48/2=24>>24. Use numbers and + - * / ** ( ) only."
)


@dataclass(frozen=True)
class Calculator:
    """GSM8k-annotation calculator: ``<<expr=`` is answered with ``result>>``."""

    name: ClassVar[str] = "calculator"
    instructions: ClassVar[str] = INSTRUCTIONS
    budget: ToolBudget = field(default_factory=ToolBudget)

    def episode(self) -> CalculatorEpisode:
        return CalculatorEpisode(self.budget)

    def options(self) -> dict[str, Any]:
        return asdict(self.budget)


class CalculatorEpisode:
    """One row's annotations. Only an open annotation's text is kept (at most an expression's length),
    so a long completion costs no more per token than a short one; an annotation grown longer than
    an expression may be is not a call."""

    def __init__(self, budget: ToolBudget) -> None:
        self.budget = budget
        self.calls: list[ToolCall] = []
        self._tail = ""
        self._spent_s = 0.0

    def observe(self, text: str, ended_turn: bool) -> Injection | None:
        self._tail = _open_annotation_tail(self._tail + text)
        if ended_turn or not text.endswith(EQUALS) or len(self.calls) >= self.budget.max_calls or self._spent_s >= self.budget.max_seconds:
            return None
        start = self._tail.rfind(OPEN)
        if start < 0:
            return None
        expression = self._tail[start + len(OPEN) : -len(EQUALS)]
        if EQUALS in expression:  # an earlier "=" of this annotation came with its result: not a call
            return None
        injection = self._call(expression)
        self._tail = ""  # the injection closes the annotation
        return injection

    def _call(self, expression: str) -> Injection:
        began = time.perf_counter()
        try:
            result, error = format_result(evaluate(expression)), None
            if len(result) > self.budget.max_result_chars:
                result, error = ERROR_RESULT, f"result longer than {self.budget.max_result_chars} characters"
        except ArithmeticRefused as refused:
            result, error = ERROR_RESULT, str(refused)
        latency_s = time.perf_counter() - began
        self._spent_s += latency_s
        call = ToolCall(index=len(self.calls), tool=Calculator.name, call=expression, result=result, error=error, latency_s=latency_s)
        self.calls.append(call)
        return Injection(text=result + CLOSE, call=call)


_ANNOTATION = re.compile(r"<<[^<>]*?=([^<>=]*)>>")


def annotation_results(text: str) -> list[str]:
    """The results of a completion's closed annotations, in order: ``<<48/2=24>>`` gives ``"24"``
    (``"error"`` where the calculator refused the expression)."""
    return [result.strip() for result in _ANNOTATION.findall(text)]


def _open_annotation_tail(text: str) -> str:
    """The part of ``text`` that can still matter: from its last unclosed ``<<`` (when the expression
    there is not already too long to evaluate), else its last character (half of a ``<<``)."""
    start = text.rfind(OPEN)
    if start < 0 or CLOSE in text[start:] or len(text) - start > _MAX_TAIL_CHARS:
        return text[-1:]
    return text[start:]
