"""Verifiable tasks by name: GSM8k, HumanEval, MATH-style symbolic math, reasoning-gym's datasets, yours.

``get_task(name)`` resolves a name (``rlvr.tasks.registry``); a :class:`Task` says where its problems
come from, how one becomes a prompt and how a completion is graded (``rlvr.tasks.base``);
``TaskMixture`` draws each training step's groups from several tasks by weight.
"""

from rlvr.tasks.base import SPLITS, Task, TaskError, TaskProblem, normalized_text_hash, problem_record
from rlvr.tasks.classification_task import CLASSIFICATION
from rlvr.tasks.gsm8k import GSM8K
from rlvr.tasks.humaneval import HUMANEVAL
from rlvr.tasks.math_task import MATH
from rlvr.tasks.mixture import TaskMixture
from rlvr.tasks.qa_task import QA
from rlvr.tasks.reasoning_gym_task import reasoning_gym_task
from rlvr.tasks.registry import ENTRY_POINT_GROUP, get_task, register_task, register_task_family, task_names

for _task in (GSM8K, HUMANEVAL, MATH, QA, CLASSIFICATION):
    register_task(_task)
register_task_family("reasoning_gym", reasoning_gym_task)

DEFAULT_TASK = GSM8K.name  # what a run trains, and a policy that records no tasks is served as, when none is named

__all__ = [
    "CLASSIFICATION",
    "DEFAULT_TASK",
    "ENTRY_POINT_GROUP",
    "GSM8K",
    "HUMANEVAL",
    "MATH",
    "QA",
    "SPLITS",
    "Task",
    "TaskError",
    "TaskMixture",
    "TaskProblem",
    "get_task",
    "normalized_text_hash",
    "problem_record",
    "reasoning_gym_task",
    "register_task",
    "register_task_family",
    "task_names",
]
