"""Verifiable rewards: a registry of ``fn(completion, **reference) -> value in [0, 1]``.

Registered: ``math_answer``, ``math_answer_flexible``, ``format``, ``exact_match``, ``token_f1``,
``classification``, ``regression``, ``qa_exact_match``, ``qa_token_f1``, ``answer_line``, ``label_match``, ``label_line``,
``code_execution``, ``humaneval_tests``, ``math_verify``, ``boxed``, ``reasoning_gym_score``,
``reasoning_gym_correct``, ``answer_tags``; add your own with ``@register_reward``.
``score`` contains failures, ``CompositeReward`` weighs rewards, ``RewardPool`` scores batches.
"""

from rlvr.rewards import code, math, reasoning_gym, symbolic, text  # noqa: F401 - importing registers the built-in rewards
from rlvr.rewards.composite import CompositeReward
from rlvr.rewards.pool import RewardPool
from rlvr.rewards.registry import (
    Reward,
    RewardError,
    RewardResult,
    get_reward,
    load_pickled_reward,
    pickled_reward,
    register_reward,
    reward_names,
    score,
)

__all__ = [
    "CompositeReward",
    "Reward",
    "RewardError",
    "RewardPool",
    "RewardResult",
    "get_reward",
    "load_pickled_reward",
    "pickled_reward",
    "register_reward",
    "reward_names",
    "score",
]
