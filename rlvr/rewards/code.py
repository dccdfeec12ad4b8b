"""``code_execution``: the fraction of a program's tests that pass, run in ``rlvr.sandbox``."""

from __future__ import annotations

import re

from rlvr.rewards.registry import RewardResult, register_reward
from rlvr.sandbox import SandboxLimits, run_tests

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ```) of a completion, else the whole completion."""
    blocks = _FENCE_RE.findall(completion)
    return blocks[-1] if blocks else completion


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
