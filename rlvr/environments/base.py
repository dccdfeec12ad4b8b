"""What an environment is: the thing that turns one problem into a rollout of one or more turns.

After each policy token the row's :class:`Episode` sees the new text and may answer with an
:class:`Injection`, text the environment writes into the row (a calculator's result, a tool turn);
the engine appends its tokens to the row's KV cache and generation resumes. Injected tokens are masked
out of GRPO's loss (``Rollouts.environment_mask``). Episodes are per row and stateful
(``Environment.episode`` makes a fresh one); every cost is bounded by the :class:`ToolBudget`, past
which the row goes on as single-turn generation (docs/architecture.md, "Tool-calling rollouts").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolBudget:
    """Bounds on one row's tool use: calls, seconds spent in tools, characters a tool may write back."""

    max_calls: int = 8
    max_seconds: float = 10.0
    max_result_chars: int = 400

    def __post_init__(self) -> None:
        if self.max_calls < 0 or self.max_seconds <= 0 or self.max_result_chars < 1:
            raise ValueError(f"tool budget must have max_calls >= 0, max_seconds > 0, max_result_chars >= 1, got {self}")


@dataclass(frozen=True)
class ToolCall:
    """One call an episode made: what the policy asked, what came back, how long it took."""

    index: int  # the call's number within its completion, from 0
    tool: str  # "calculator", "python", ...
    call: str  # the expression or program, as the policy wrote it
    result: str  # the text written back into the row ("" when the call failed with nothing to show)
    error: str | None  # why the call failed (refused, raised, timed out), None when it succeeded
    latency_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Injection:
    """Text the environment writes into a row, and the call it answers (None for a plain turn marker)."""

    text: str
    call: ToolCall | None = None


class Episode(Protocol):
    """One row's conversation with its environment."""

    calls: list[ToolCall]

    def observe(self, text: str, ended_turn: bool) -> Injection | None:
        """``text``: the policy's newest token(s), decoded; ``ended_turn``: that token ends the policy's
        turn (an end/stop token). Return what the environment writes next, or None. On an
        ``ended_turn`` observation, an injection keeps the row going; None lets it finish."""


class Environment(Protocol):
    """A kind of rollout. ``name`` and ``options()`` are its identity in lineage (run config, MLflow,
    the Bento); ``instructions`` is appended to the system prompt (how to call the tool, or "")."""

    name: str
    instructions: str

    def episode(self) -> Episode: ...

    def options(self) -> dict[str, Any]: ...


@dataclass
class SingleTurn:
    """The default: the policy answers in one turn, nothing is ever injected."""

    name: str = "single_turn"
    instructions: str = ""
    budget: ToolBudget = field(default_factory=ToolBudget)

    def episode(self) -> "_NoTools":
        return _NoTools()

    def options(self) -> dict[str, Any]:
        return {}


class _NoTools:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def observe(self, text: str, ended_turn: bool) -> Injection | None:
        return None
