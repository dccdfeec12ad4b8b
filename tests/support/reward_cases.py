"""Reward-test inputs: a GSM8k reference row, and names that no earlier registration used."""

from __future__ import annotations

import itertools
import time

GSM8K = {"answer_text": "72", "answer_value": 72.0, "question": "How many clips?", "problem_id": "p-1", "solution": "48/2 = 24\n48+24 = 72", "num_steps": 2}
_unique = itertools.count()


def unique_name(prefix: str) -> str:
    """``prefix`` made unique in this process and across processes (a reward name to register)."""
    return f"{prefix}_{next(_unique)}_{time.monotonic_ns()}"
