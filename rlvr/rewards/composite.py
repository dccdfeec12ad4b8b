"""Weighted combinations of named rewards, configured from run config."""

from __future__ import annotations

import math
import numbers
from typing import Mapping

from rlvr.rewards.registry import RewardError, RewardResult, get_reward, score


class CompositeReward:
    """``sum_i w_i r_i / sum_i w_i`` over named rewards, so the total stays in [0, 1].

    A reward with weight 0 is still computed and reported (e.g. ``math_answer_flexible`` next to
    the strict ``math_answer``) without affecting the total.
    """

    def __init__(self, weights: Mapping[str, float], name: str = "composite"):
        if not isinstance(weights, Mapping) or not weights:
            raise RewardError(f"composite reward {name!r} needs a non-empty mapping of reward name -> weight, got {weights!r}")
        for reward_name, weight in weights.items():
            get_reward(reward_name)  # raises RewardError naming the registered rewards
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight < 0:
                raise RewardError(f"composite reward {name!r}: weight of {reward_name!r} must be a finite number >= 0, got {weight!r}")
        if sum(weights.values()) <= 0:
            raise RewardError(f"composite reward {name!r}: weights are all zero")
        self.name = name
        self.weights = {reward_name: float(weight) for reward_name, weight in weights.items()}

    def __repr__(self) -> str:
        return f"CompositeReward({self.weights!r}, name={self.name!r})"

    def combine(self, components: Mapping[str, RewardResult]) -> RewardResult:
        """The weighted mean of already computed components; details hold each value and any errors."""
        total = sum(self.weights[n] * components[n].value for n in self.weights) / sum(self.weights.values())
        details = {n: components[n].value for n in self.weights}
        errors = {n: components[n].details["error"] for n in self.weights if "error" in components[n].details}
        if errors:
            details["errors"] = errors
        return RewardResult(min(1.0, max(0.0, total)), details)

    def __call__(self, completion: str, *, sample: int | str | None = None, **reference) -> RewardResult:
        return self.combine({n: score(n, completion, sample=sample, **reference) for n in self.weights})
