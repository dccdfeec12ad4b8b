"""The reward registry: every reward is one function with one signature, registered by name.

``fn(completion: str, **reference) -> float | RewardResult``, the value in [0, 1]. ``reference``
holds the problem's fields (for GSM8k: ``answer_text``, ``answer_value``, ``question``, ...);
a reward reads the keys it documents and ignores the rest, so one call site serves every reward.
As in verl, variants are added by registering, not by growing an if-chain.
"""

from __future__ import annotations

import functools
import inspect
import logging
import numbers
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger("rlvr.rewards")

_REWARDS: dict[str, "Reward"] = {}
_WARNED: set[str] = set()
TOTAL = "total"  # the composite's entry in a scored batch, so no reward may take this name


class RewardError(ValueError):
    """A reward is unknown, badly registered or badly configured, or returned a bad value."""


@dataclass(frozen=True)
class RewardResult:
    """A reward's value in [0, 1] and what led to it (extracted answer, method, error, ...)."""

    value: float
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.value, bool) or not isinstance(self.value, numbers.Real):
            raise TypeError(f"RewardResult.value must be a number, got {type(self.value).__name__}")
        value = float(self.value)
        if not 0.0 <= value <= 1.0:  # also rejects nan
            raise ValueError(f"RewardResult.value must be in [0, 1], got {value!r}")
        object.__setattr__(self, "value", value)


@dataclass(frozen=True)
class Reward:
    """A registered reward: calling it checks the completion and what the function returned."""

    name: str
    fn: Callable

    @property
    def qualname(self) -> str:
        fn = inspect.unwrap(self.fn)
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def __call__(self, completion: str, **reference) -> RewardResult:
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        output = self.fn(completion, **reference)
        if isinstance(output, RewardResult):
            return output
        if isinstance(output, numbers.Real) and 0.0 <= float(output) <= 1.0:  # bools count as 0/1
            return RewardResult(float(output))
        raise RewardError(
            f"reward {self.name!r} ({self.qualname}) returned {output!r:.80} of type {type(output).__name__}; "
            "a reward must return a float in [0, 1] or a RewardResult"
        )

    def score(self, completion: str, *, sample: int | str | None = None, **reference) -> RewardResult:
        """This reward's result; a failure inside it scores 0 instead of raising.

        The error (in ``details["error"]`` and logged once per reward) names the function and the
        sample (``sample``, else the reference's ``problem_id``).
        """
        try:
            return self(completion, **reference)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - a reward bug must not kill the run
            where = sample if sample is not None else reference.get("problem_id", "?")
            message = f"reward {self.name!r} ({self.qualname}) failed on sample {where}: {type(err).__name__}: {err}"
            if self.name not in _WARNED:
                _WARNED.add(self.name)
                logger.warning("%s (further failures of this reward are not logged)", message)
            return RewardResult(0.0, {"error": message})


def register_reward(name: str | Callable | None = None, *, replace: bool = False):
    """Decorator registering ``fn(completion, **reference)`` under ``name`` (default: its own name).

    Use as ``@register_reward``, ``@register_reward("name")`` or ``register_reward("name")(fn)``.
    A function without ``**kwargs`` only receives the reference keys it names. Registering a name
    twice raises unless ``replace=True`` (re-running the same definition, e.g. on reload, is fine).
    """
    if callable(name):
        return register_reward()(name)

    def decorate(fn: Callable) -> Callable:
        reward_name = fn.__name__ if name is None else name
        if not isinstance(reward_name, str) or not reward_name.strip() or reward_name != reward_name.strip():
            raise RewardError(f"reward name must be a non-empty string without surrounding spaces, got {reward_name!r}")
        if reward_name == TOTAL:
            raise RewardError(f"reward name {reward_name!r} is reserved")
        if not callable(fn):
            raise RewardError(f"reward {reward_name!r} must be callable, got {type(fn).__name__}")
        reward = Reward(reward_name, _accepting_any_keywords(reward_name, fn))
        existing = _REWARDS.get(reward_name)
        if existing is not None and not replace and _definition(existing.fn) != _definition(reward.fn):
            raise RewardError(f"reward {reward_name!r} is already registered by {existing.qualname}; pass replace=True to override it")
        _REWARDS[reward_name] = reward
        return fn

    return decorate


def get_reward(name: str) -> Reward:
    """The registered reward called ``name``; raises RewardError naming the known ones otherwise."""
    try:
        return _REWARDS[name]
    except (KeyError, TypeError):
        raise RewardError(f"unknown reward {name!r}; registered rewards: {', '.join(reward_names())}") from None


def reward_names() -> list[str]:
    return sorted(_REWARDS)


def score(name: str, completion: str, *, sample: int | str | None = None, **reference) -> RewardResult:
    """Score one completion with the reward ``name`` (:meth:`Reward.score`: failures score 0); unknown names raise RewardError."""
    return get_reward(name).score(completion, sample=sample, **reference)


def pickled_reward(name: str) -> bytes:
    """The reward ``name`` as bytes another process can load (:func:`load_pickled_reward`): cloudpickle,
    by reference when its function's module can be imported there, by value for lambdas and local functions."""
    import cloudpickle

    reward = get_reward(name)
    try:
        return cloudpickle.dumps(reward)
    except Exception as err:  # noqa: BLE001 - e.g. a closure over a lock or a connection
        raise RewardError(f"reward {name!r} ({reward.qualname}) cannot be sent to another process: {type(err).__name__}: {err}") from None


def load_pickled_reward(payload: bytes, register: bool = False) -> Reward:
    """A reward from :func:`pickled_reward`; with ``register``, also registered under its name (replacing)."""
    import pickle

    reward = pickle.loads(payload)
    if not isinstance(reward, Reward):
        raise RewardError(f"payload holds a {type(reward).__name__}, not a Reward")
    if register:
        _REWARDS[reward.name] = reward
    return reward


def _definition(fn: Callable) -> tuple:
    """Where a function was defined: equal for the same source re-run (a module reload)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None), code and (code.co_filename, code.co_firstlineno))


def _accepting_any_keywords(name: str, fn: Callable) -> Callable:
    """``fn`` itself if it takes ``**kwargs``, else a wrapper dropping the keywords it does not name."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: pass everything
        return fn
    if not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters):
        raise RewardError(f"reward {name!r} must take the completion as its first positional argument")
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return fn
    accepted = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @functools.wraps(fn)
    def call(completion, **reference):
        return fn(completion, **{k: v for k, v in reference.items() if k in accepted})

    return call
