"""Requests and responses of the policy service, and every bound the service enforces, in one place.

Requests are validated by pydantic before any handler runs (strict types, unknown fields
rejected): a bad request gets HTTP 400 whose body lists each error with its field in ``loc``,
and messages of our own validators name the field too.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rlvr.answers import format_number
from rlvr.rewards import DEFAULT_GSM8K_REWARD, reward_names

# Bounds of a request (the 400 message names the field that broke one).
MAX_PROMPT_CHARS = 4_000
MAX_ROLLOUTS = 16  # /generate num_rollouts
MAX_SAMPLES = 16  # /solve k
MAX_NEW_TOKENS = 1_024
MAX_TEMPERATURE = 2.0
MAX_GROUND_TRUTH_CHARS = 256
MAX_BODY_BYTES = 64 * 1024  # 413 above this, before parsing: a 4,000-char prompt is at most 24 KB of JSON

DEFAULT_NUM_ROLLOUTS = 4
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_SAMPLES = 5
DEFAULT_SOLVE_TEMPERATURE = 0.7

EXTRACTION_MODE = "strict"  # the final answer is the last '#### <number>', as in evaluation's maj@k

DEFAULT_REWARD = "gsm8k"
SERVED_REWARDS: dict[str, dict[str, float]] = {
    DEFAULT_REWARD: dict(DEFAULT_GSM8K_REWARD),  # the training reward: correctness + 0.2 format
    # Every registered reward that grades against a reference answer. code_execution is left out:
    # it runs model-written programs against test cases that a request does not carry.
    **{name: {name: 1.0} for name in reward_names() if name != "code_execution"},
}

Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
Question = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
NewTokens = Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _not_blank(value: str, info: ValidationInfo) -> str:
    if not value.strip():
        raise ValueError(f"{info.field_name} is empty (only whitespace)")
    return value


class GenerateRequest(_Request):
    """``POST /generate``: ``num_rollouts`` completions of one prompt, graded when ``ground_truth`` is given."""

    prompt: Question
    num_rollouts: Annotated[int, Field(ge=1, le=MAX_ROLLOUTS)] = DEFAULT_NUM_ROLLOUTS
    temperature: Temperature | Annotated[list[Temperature], Field(min_length=1)] = Field(
        default=DEFAULT_TEMPERATURE,
        description="one temperature, or a list (at most num_rollouts long) cycled over the rollouts; 0 = greedy",
    )
    max_new_tokens: NewTokens = DEFAULT_MAX_NEW_TOKENS
    top_p: TopP = 1.0
    ground_truth: (
        Annotated[str, Field(min_length=1, max_length=MAX_GROUND_TRUTH_CHARS)]
        | Annotated[float, Field(allow_inf_nan=False)]
        | None
    ) = None
    reward: str = Field(default=DEFAULT_REWARD, description="a reward name; see SERVED_REWARDS")

    _prompt_not_blank = field_validator("prompt")(_not_blank)

    @field_validator("temperature")
    @classmethod
    def _at_most_one_per_rollout(cls, value: float | list[float], info: ValidationInfo) -> float | list[float]:
        num_rollouts = info.data.get("num_rollouts")  # absent when it failed its own validation
        if isinstance(value, list) and num_rollouts is not None and len(value) > num_rollouts:
            raise ValueError(f"temperature lists {len(value)} values but num_rollouts is {num_rollouts}")
        return value

    @field_validator("reward")
    @classmethod
    def _served_reward(cls, value: str) -> str:
        if value not in SERVED_REWARDS:
            raise ValueError(f"reward {value!r} is not served; choose one of {', '.join(SERVED_REWARDS)}")
        return value

    def temperatures(self) -> list[float]:
        """One temperature per rollout: the list cycled over ``num_rollouts``, as the rollout engine does."""
        values = self.temperature if isinstance(self.temperature, list) else [self.temperature]
        return [float(values[j % len(values)]) for j in range(self.num_rollouts)]

    def reference(self) -> dict | None:
        """The reference fields the served rewards read: ``answer_text``, ``answer_value``, ``target``, ``label``."""
        if self.ground_truth is None:
            return None
        text = self.ground_truth if isinstance(self.ground_truth, str) else format_number(self.ground_truth)
        value = None if isinstance(self.ground_truth, str) else float(self.ground_truth)
        return {"answer_text": text, "answer_value": value, "target": text, "label": text}


class Rollout(BaseModel):
    text: str
    answer: str | None = Field(description="the extracted final answer (normalized), None when there is none")
    reward: float | None = Field(description="None without ground_truth")
    finish_reason: str = Field(description="eos, answer (stopped after the '#### <number>' line) or length")
    completion_tokens: int
    temperature: float


class GenerateResponse(BaseModel):
    request_id: str
    model_version: str
    rollouts: list[Rollout]
    best_index: int = Field(
        description="highest reward (first on ties); without ground_truth the first rollout giving the majority answer"
    )
    best_response: str
    best_reward: float | None
    mean_reward: float | None
    reward: str | None = Field(description="the reward used, None without ground_truth")
    answer: str | None = Field(description="the majority answer of the rollouts")
    vote_share: float = Field(description="share of rollouts giving the majority answer (abstentions count)")


class SolveRequest(_Request):
    """``POST /solve``: self-consistency over ``k`` samples (k = 1: one greedy decode)."""

    question: Question
    k: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = DEFAULT_SAMPLES
    temperature: Temperature = Field(default=DEFAULT_SOLVE_TEMPERATURE, description="used when k > 1")
    max_new_tokens: NewTokens = DEFAULT_MAX_NEW_TOKENS

    _question_not_blank = field_validator("question")(_not_blank)

    def temperatures(self) -> list[float]:
        return [0.0] if self.k == 1 else [float(self.temperature)] * self.k


class SolveResponse(BaseModel):
    request_id: str
    model_version: str
    answer: str | None = Field(description="majority answer of the k samples, None when no sample gave one")
    vote_share: float = Field(description="the confidence: votes for the answer / k")
    reasoning: str = Field(description="the completion of the first sample that gave the answer")
    answers: list[str | None]
    k: int


class RolloutJob(BaseModel):
    """One request's share of a generation pass; jobs with equal ``sampling_key`` share one engine call."""

    model_config = ConfigDict(extra="forbid", strict=True)

    question: Question
    num_samples: Annotated[int, Field(ge=1, le=max(MAX_ROLLOUTS, MAX_SAMPLES))]
    temperatures: Annotated[list[Temperature], Field(min_length=1, max_length=max(MAX_ROLLOUTS, MAX_SAMPLES))]
    max_new_tokens: NewTokens
    top_p: TopP = 1.0

    def sampling_key(self) -> tuple:
        return (self.num_samples, tuple(self.temperatures), self.max_new_tokens, self.top_p)


class RolloutResult(BaseModel):
    texts: list[str]
    finish_reasons: list[str]
    completion_tokens: list[int]
    generation_s: float = Field(description="duration of the engine call that produced these rollouts")
    batch_requests: int = Field(description="requests in the generation pass")
