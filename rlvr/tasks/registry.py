"""Tasks by name: ``register_task`` and ``get_task``.

A name resolves to, in order: a registered task (``gsm8k``, ``humaneval``, ``math``); a family and its
argument (``reasoning_gym:<dataset>``, built by the family's factory); an installed package's entry
point in the group ``rlvr.tasks``; a dotted path ``package.module:attribute`` to a :class:`Task` or a
function returning one. So a user's task needs no edit of the core.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points
from typing import Callable

from rlvr.tasks.base import Task, TaskError

ENTRY_POINT_GROUP = "rlvr.tasks"
_TASKS: dict[str, Task] = {}
_FAMILIES: dict[str, Callable[[str], Task]] = {}


def register_task(task: Task, replace: bool = False) -> Task:
    """Register ``task`` under its name; a name taken by another definition raises unless ``replace``."""
    if not isinstance(task, Task):
        raise TaskError(f"register_task takes a Task, got {type(task).__name__}")
    if ":" in task.name and task.name.partition(":")[0] in _FAMILIES:
        raise TaskError(f"task name {task.name!r} is taken by the family {task.name.partition(':')[0]!r}")
    existing = _TASKS.get(task.name)
    if existing is not None and existing is not task and not replace and _origin(existing) != _origin(task):
        raise TaskError(f"task {task.name!r} is already registered; pass replace=True to override it")
    _TASKS[task.name] = task
    return task


def register_task_family(prefix: str, factory: Callable[[str], Task]) -> None:
    """Register ``factory(argument) -> Task`` for the names ``<prefix>:<argument>``."""
    _FAMILIES[prefix] = factory


def task_names() -> list[str]:
    """Registered task names, and each family as ``<prefix>:<name>``."""
    return sorted(_TASKS) + [f"{prefix}:<name>" for prefix in sorted(_FAMILIES)]


def get_task(name: str) -> Task:
    """The task called ``name`` (see the module docstring); a TaskError lists the registered ones."""
    if not isinstance(name, str) or not name.strip():
        raise TaskError(f"a task name must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in _TASKS:
        return _TASKS[name]
    prefix, colon, argument = name.partition(":")
    if colon and prefix in _FAMILIES:
        if not argument:
            raise TaskError(f"task {name!r}: the family {prefix!r} needs a name after the colon")
        return _FAMILIES[prefix](argument)
    found = _from_entry_point(name)
    if found is None and colon and re.fullmatch(r"[A-Za-z_][\w.]*", prefix) and re.fullmatch(r"[A-Za-z_]\w*", argument):
        found = _from_dotted_path(prefix, argument, name)
    if found is None:
        raise TaskError(
            f"unknown task {name!r}; registered tasks: {', '.join(task_names())} (or 'package.module:attribute', or an entry point in {ENTRY_POINT_GROUP!r})"
        )
    if found.name != name:  # reached by a path or an entry point: named as it was asked for
        found = Task(**{**found.__dict__, "name": name})
    return found


def _from_entry_point(name: str) -> Task | None:
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name == name:
            return _as_task(point.load(), f"entry point {point.value}")
    return None


def _from_dotted_path(module: str, attribute: str, name: str) -> Task:
    try:
        target = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise TaskError(f"task {name!r}: cannot load {attribute!r} from module {module!r}: {err}") from None
    return _as_task(target, name)


def _as_task(target, where: str) -> Task:
    task = target if isinstance(target, Task) else target() if callable(target) else None
    if not isinstance(task, Task):
        raise TaskError(f"{where} is not a Task nor a function returning one")
    return task


def _origin(task: Task) -> tuple:
    load = getattr(task.load, "__code__", None)
    return (getattr(task.load, "__module__", None), getattr(task.load, "__qualname__", None), load and load.co_firstlineno)
