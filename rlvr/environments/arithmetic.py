"""Safe exact arithmetic for the calculator tool: GSM8k annotation expressions such as ``48/2``,
``120*.9`` or ``(1/2)*48``, evaluated with :class:`fractions.Fraction`.

The policy writes the expression, so it is hostile input: nothing reaches ``eval``; a whitelist of
``ast`` nodes is walked (numbers, unary ``+``/``-``, ``+ - * / // % **``, parentheses), and every cost
is bounded before the work (length, nesting, literal size, a power's size, every value's bit length).
``9**9**9`` or ``1e999999`` are refused in microseconds with :class:`ArithmeticRefused` naming why
(docs/architecture.md, "Tool-calling rollouts").
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

from rlvr.answers import format_number

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 256  # nodes of the parsed tree
MAX_DEPTH = 64  # depth of the parsed tree (chained operators, stacked signs): bounds the recursion
MAX_PARENTHESES = 10  # nesting of parentheses as written
MAX_LITERAL_DIGITS = 30  # digits of one number as written
MAX_LITERAL_EXPONENT = 30  # |e| in a literal such as 1.5e6
MAX_EXPONENT = 1000  # |e| in base ** e
MAX_BITS = 512  # bit length of the numerator and the denominator of every value
RESULT_DECIMALS = 6  # decimals a non-terminating result keeps

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Pow, *_BINARY, *_UNARY)
_LITERAL_RE = re.compile(r"(?P<mantissa>(?:\d[\d_]*)?(?:\.\d[\d_]*|\d\.?))(?:[eE](?P<exponent>[+-]?\d+))?")
_THOUSANDS_COMMA_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TIMES_X_RE = re.compile(r"(?<=[\d.)])(?<!\b0)\s*[xX]\s*(?=[\d.(])")  # 3 x 4, (2)x(3); 0x10 stays hex (refused)
_SPELLINGS = str.maketrans({"×": "*", "÷": "/", "−": "-", "⋅": "*", "·": "*"})


class ArithmeticRefused(ValueError):
    """The expression is not arithmetic we evaluate, or would cost too much; the message says why."""


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``; :class:`ArithmeticRefused` when it is not plain arithmetic,
    divides by zero, or exceeds a bound."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ArithmeticRefused(f"longer than {MAX_EXPRESSION_CHARS} characters")
    text = normalize_expression(expression)
    if not text:
        raise ArithmeticRefused("empty expression")
    depth = 0
    for char in text:
        depth += (char == "(") - (char == ")")
        if depth > MAX_PARENTHESES:
            raise ArithmeticRefused(f"parentheses nested deeper than {MAX_PARENTHESES}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as err:  # ValueError: null bytes
        raise ArithmeticRefused(f"not arithmetic: {err.msg if isinstance(err, SyntaxError) else err}") from None
    _check_shape(tree)
    return _value(tree.body, text)


def normalize_expression(expression: str) -> str:
    """GSM8k's spellings as Python operators: ``1,000`` -> ``1000``, ``3 x 4``/``3×4`` -> ``3*4``, ``÷`` -> ``/``."""
    text = expression.translate(_SPELLINGS)
    text = _THOUSANDS_COMMA_RE.sub("", text)
    return _TIMES_X_RE.sub("*", text).strip()


def format_result(value: Fraction) -> str:
    """A result as GSM8k's annotations write it: ``24``, ``0.75``, ``-3.5``; a non-terminating decimal
    rounded to ``RESULT_DECIMALS`` decimals (``3.333333``), or significant digits below 0.1
    (``0.000123457``), trailing zeros stripped."""
    if value.denominator != 1:
        places, magnitude = RESULT_DECIMALS, abs(value)
        while magnitude * 10 ** (places - RESULT_DECIMALS) < Fraction(1, 10):
            places += 1
        value = Fraction(round(value * 10**places), 10**places)
    return format_number(value)


def _check_shape(tree: ast.Expression) -> None:
    """Refuse disallowed nodes, too many nodes and too deep nesting before evaluating anything."""
    stack, count = [(tree, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ArithmeticRefused(f"more than {MAX_NODES} syntax nodes")
        if depth > MAX_DEPTH:
            raise ArithmeticRefused(f"nested deeper than {MAX_DEPTH}")
        if not isinstance(node, _ALLOWED_NODES):
            raise ArithmeticRefused(f"{type(node).__name__} is not arithmetic")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _value(node: ast.expr, text: str) -> Fraction:
    if isinstance(node, ast.Constant):
        return _literal(node, text)
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_value(node.operand, text))
    assert isinstance(node, ast.BinOp)  # _check_shape allowed nothing else
    left, right = _value(node.left, text), _value(node.right, text)
    if isinstance(node.op, ast.Pow):
        return _bounded(_power(left, right))
    try:
        return _bounded(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
        raise ArithmeticRefused("division by zero") from None


def _literal(node: ast.Constant, text: str) -> Fraction:
    """A number as written (``.9``, ``1_000``, ``1.5e3``), read exactly from the source, never via float."""
    written = ast.get_source_segment(text, node) or ""
    match = _LITERAL_RE.fullmatch(written)
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)) or match is None:
        raise ArithmeticRefused(f"{written or type(node.value).__name__!r} is not a decimal number")
    if sum(c.isdigit() for c in match["mantissa"]) > MAX_LITERAL_DIGITS:
        raise ArithmeticRefused(f"a number longer than {MAX_LITERAL_DIGITS} digits")
    if match["exponent"] and abs(int(match["exponent"])) > MAX_LITERAL_EXPONENT:
        raise ArithmeticRefused(f"a literal exponent above {MAX_LITERAL_EXPONENT}")
    return _bounded(Fraction(written))


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent`` for an integer exponent, refused before computing when the result would
    exceed ``MAX_BITS`` (its size is at most the base's bit length times the exponent)."""
    if exponent.denominator != 1:
        raise ArithmeticRefused("a non-integer exponent")
    if abs(exponent) > MAX_EXPONENT:
        raise ArithmeticRefused(f"an exponent above {MAX_EXPONENT}")
    base_bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if base_bits > 1 and base_bits * abs(exponent) > MAX_BITS:
        raise ArithmeticRefused(f"a power larger than {MAX_BITS} bits")
    if base == 0 and exponent < 0:
        raise ArithmeticRefused("division by zero")
    return base**exponent


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator).bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise ArithmeticRefused(f"a value larger than {MAX_BITS} bits")
    return value
