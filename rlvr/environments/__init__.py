"""Environments: what a rollout is besides the policy's own text (see :mod:`rlvr.environments.base`).

``make_environment(name, **options)`` builds one by name from plain options (the tool budget's
fields and the environment's own), so a run config, MLflow params or a Bento can name it, and
``make_environment(env.name, **env.options())`` rebuilds an equal one.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from rlvr.environments.base import Environment, Episode, Injection, SingleTurn, ToolBudget, ToolCall
from rlvr.environments.calculator import Calculator
from rlvr.environments.code import CodeTool

ENVIRONMENTS: dict[str, type] = {"single_turn": SingleTurn, "calculator": Calculator, "python": CodeTool}
_BUDGET_OPTIONS = frozenset(f.name for f in fields(ToolBudget))
_IDENTITY = frozenset({"name", "instructions", "budget"})

__all__ = [
    "ENVIRONMENTS",
    "Calculator",
    "CodeTool",
    "Environment",
    "Episode",
    "Injection",
    "SingleTurn",
    "ToolBudget",
    "ToolCall",
    "environment_options",
    "make_environment",
]


def environment_options(name: str) -> frozenset[str]:
    """The options ``make_environment(name, ...)`` accepts: the tool budget's fields and the environment's own."""
    cls = _environment_class(name)
    own = {f.name for f in fields(cls) if f.init} - _IDENTITY
    return frozenset(own | _BUDGET_OPTIONS)


def make_environment(name: str = "single_turn", /, **options: Any) -> Environment:
    """The environment registered as ``name``, configured by ``options``; ``ValueError`` naming an
    unknown environment (with the known ones) or an unknown option (with the accepted ones)."""
    cls = _environment_class(name)
    unknown = sorted(set(options) - environment_options(name))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for environment {name!r}; accepted: {', '.join(sorted(environment_options(name)))}")
    budget = ToolBudget(**{key: value for key, value in options.items() if key in _BUDGET_OPTIONS})
    own = {key: value for key, value in options.items() if key not in _BUDGET_OPTIONS}
    if "control_tokens" in own:  # options() writes it as a list (JSON, MLflow params)
        own["control_tokens"] = tuple(own["control_tokens"])
    return cls(budget=budget, **own)


def _environment_class(name: str) -> type:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
    return ENVIRONMENTS[name]
