"""The models of the native API, ``POST /generate`` and ``POST /solve``, and the error body of BentoML's
routes (the ``/v1`` and tokenizer routes answer in OpenAI's shape: ``bentos.openai_models``).

Requests are validated by pydantic before any handler runs (strict types, unknown fields rejected): a
bad request gets HTTP 400 whose body (``ErrorResponse``) lists each error with its field in ``loc``, and
messages of our own validators name the field too.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from bentos.limits import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_ROLLOUTS,
    DEFAULT_SAMPLES,
    DEFAULT_SOLVE_TEMPERATURE,
    DEFAULT_TEMPERATURE,
    MAX_GROUND_TRUTH_CHARS,
    MAX_ROLLOUTS,
    MAX_SAMPLES,
    NewTokens,
    Question,
    RewardName,
    StrictRequest,
    TaskName,
    Temperature,
    TopP,
    completion_tokens_bounded,
    not_blank,
)
from rlvr.answers import format_number

TASK_FIELD = "the task whose prompt renders the request and whose parser reads its answers: one of the policy's tasks; default: the policy's first"


class GenerateRequest(StrictRequest):
    """``POST /generate``: ``num_rollouts`` completions of one prompt, graded when ``ground_truth`` is given."""

    prompt: Question
    num_rollouts: Annotated[int, Field(ge=1, le=MAX_ROLLOUTS)] = DEFAULT_NUM_ROLLOUTS
    temperature: Temperature | Annotated[list[Temperature], Field(min_length=1, max_length=MAX_ROLLOUTS)] = Field(
        default=DEFAULT_TEMPERATURE,
        description="one temperature, or a list (at most num_rollouts long) cycled over the rollouts; 0 = greedy",
    )
    max_new_tokens: NewTokens = DEFAULT_MAX_NEW_TOKENS
    top_p: TopP = 1.0
    ground_truth: Annotated[str, Field(min_length=1, max_length=MAX_GROUND_TRUTH_CHARS)] | Annotated[float, Field(allow_inf_nan=False)] | None = None
    reward: RewardName | None = Field(
        default=None,
        description="the reward grading against ground_truth: a registered reward, or a task of the policy (its training reward); default: the request's task",
    )
    task: TaskName | None = Field(default=None, description=TASK_FIELD)

    _blank_refused = field_validator("prompt", "ground_truth")(not_blank)
    _bounded = completion_tokens_bounded("num_rollouts")

    @field_validator("temperature")
    @classmethod
    def _at_most_one_per_rollout(cls, value: float | list[float], info: ValidationInfo) -> float | list[float]:
        num_rollouts = info.data.get("num_rollouts")  # absent when it failed its own validation
        if isinstance(value, list) and num_rollouts is not None and len(value) > num_rollouts:
            raise ValueError(f"temperature lists {len(value)} values but num_rollouts is {num_rollouts}")
        return value

    def temperatures(self) -> list[float]:
        """One temperature per rollout: the list cycled over ``num_rollouts``, as the rollout engine does."""
        values = self.temperature if isinstance(self.temperature, list) else [self.temperature]
        return [float(values[j % len(values)]) for j in range(self.num_rollouts)]

    def reference(self) -> dict | None:
        """The reference fields the served rewards read: ``answer_text``, ``answer_value``, ``target``, ``label``, ``gold``."""
        if self.ground_truth is None:
            return None
        text = self.ground_truth if isinstance(self.ground_truth, str) else format_number(self.ground_truth)
        value = None if isinstance(self.ground_truth, str) else float(self.ground_truth)
        return {"answer_text": text, "answer_value": value, "target": text, "label": text, "gold": text}


class ToolCall(BaseModel):
    """One call the policy made to its environment's tool while it wrote a completion."""

    index: int = Field(description="the call's number within its completion, from 0")
    tool: str = Field(description="the tool called, e.g. calculator")
    call: str = Field(description="what the policy asked, as it wrote it")
    result: str = Field(description="the text the tool wrote back into the completion")
    error: str | None = Field(description="why the call failed (refused, raised, timed out); None when it succeeded")
    latency_s: float


class Rollout(BaseModel):
    text: str = Field(description="the completion, with the text its environment's tool wrote into it")
    answer: str | None = Field(description="the answer its task's parser reads in it (GSM8k: the normalized '####' number), None when there is none")
    reward: float | None = Field(description="None without ground_truth")
    finish_reason: Literal["eos", "answer", "stop", "length"] = Field(
        description="eos, answer (stopped after its task's answer line, e.g. GSM8k's '#### <number>'), stop (a stop string of its task, "
        "e.g. '</answer>') or length"
    )
    completion_tokens: int = Field(description="tokens of the completion, the tool's included (max_new_tokens bounds them all)")
    temperature: float
    tool_calls: list[ToolCall] = Field(default_factory=list, description="the tool calls it made, in order (none when the policy has no tool)")


class GenerateResponse(BaseModel):
    request_id: str
    model_version: str
    task: str = Field(description="the task that rendered the prompt and parsed the answers")
    rollouts: list[Rollout]
    best_index: int = Field(description="highest reward (first on ties); without ground_truth the first rollout giving the majority answer")
    best_response: str
    best_reward: float | None
    mean_reward: float | None
    reward: str | None = Field(description="the reward used (a task's name: its training reward), None without ground_truth")
    answer: str | None = Field(description="the majority answer of the rollouts")
    vote_share: float = Field(description="share of rollouts giving the majority answer (abstentions count)")


class SolveRequest(StrictRequest):
    """``POST /solve``: self-consistency over ``k`` samples (k = 1: one greedy decode) on a question of one of the policy's tasks."""

    question: Question
    k: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = DEFAULT_SAMPLES
    temperature: Temperature = Field(default=DEFAULT_SOLVE_TEMPERATURE, description="used when k > 1")
    max_new_tokens: NewTokens = DEFAULT_MAX_NEW_TOKENS
    task: TaskName | None = Field(default=None, description=TASK_FIELD)

    _blank_refused = field_validator("question")(not_blank)
    _bounded = completion_tokens_bounded("k")

    def temperatures(self) -> list[float]:
        return [0.0] if self.k == 1 else [float(self.temperature)] * self.k


class SolveResponse(BaseModel):
    request_id: str
    model_version: str
    task: str = Field(description="the task that rendered the question and parsed the answers")
    environment: str = Field(default="single_turn", description="the environment the policy rolls out in (its lineage), e.g. calculator")
    answer: str | None = Field(description="majority answer of the k samples, None when no sample gave one")
    vote_share: float = Field(description="the confidence: votes for the answer / k")
    reasoning: str = Field(description="the completion of the first sample that gave the answer")
    answers: list[str | None]
    k: int
    tool_calls: list[ToolCall] = Field(default_factory=list, description="the tool calls of the reasoning's sample, in order")


class ErrorDetail(BaseModel):
    type: str
    loc: list[str | int] = Field(description="the field (and list index) in error; empty for the body as a whole")
    msg: str
    url: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error: what went wrong; a 400 lists each invalid field in ``detail``."""

    error: str
    detail: list[ErrorDetail] | None = None
