"""Every bound the policy service enforces, its defaults, and the field types and validators that both
APIs' request models (``bentos.native_models``, ``bentos.openai_models``) are built from.

A request's cost is bounded here by what it says (characters, rows x new tokens) and, once the model is
loaded, by what it would cost that model (``MAX_PROMPT_TOKENS``, its context, the KV-cache budget:
``bentos.request_cost``); the service answers both with a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rlvr.rewards import reward_names

# Bounds of a request (the 400 message names the field that broke one).
MAX_PROMPT_CHARS = 4_000
MAX_ROLLOUTS = 16  # /generate num_rollouts
MAX_SAMPLES = 16  # /solve k
MAX_NEW_TOKENS = 1_024
MAX_COMPLETION_TOKENS = 8_192  # rollouts (or k) x max_new_tokens of one request
MAX_PROMPT_TOKENS = 2_048  # the question in the chat template, in the model's tokens (4,000 rare CJK chars are ~16,000)
DEFAULT_KV_CACHE_BUDGET_MIB = 1_024  # a request's estimated KV cache; $RLVR_KV_CACHE_BUDGET_MIB overrides
MAX_TEMPERATURE = 2.0
MAX_GROUND_TRUTH_CHARS = 256
MAX_BODY_BYTES = 64 * 1024  # 413 above this, before parsing: a 4,000-char prompt is at most 48 KB of JSON (12-byte \uXXXX\uXXXX escapes)
BODY_TIMEOUT_S = 10.0  # 408 when the whole body has not arrived by then (a slow client holds no slot)

DEFAULT_NUM_ROLLOUTS = 4
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_SAMPLES = 5
DEFAULT_SOLVE_TEMPERATURE = 0.7

MAX_TASK_NAME_CHARS = 200

# The OpenAI-compatible API's own (/v1), in OpenAI's field names.
MAX_MESSAGES = 64
MAX_CHAT_CHARS = 16_000  # all message contents of a chat request; MAX_PROMPT_TOKENS is the binding bound
MAX_RAW_PROMPT_CHARS = 16_000  # one /v1/completions prompt (room for lm-eval's 5-shot GSM8k prompts: five worked examples and the question)
MAX_PROMPTS = MAX_SAMPLES  # prompts of one /v1/completions request; prompts x n at most MAX_SAMPLES too
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
MAX_NAME_CHARS = 256  # model, user
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 5  # /v1/completions logprobs: the k most likely tokens at each position (OpenAI's bound)

SERVED_REWARDS: dict[str, dict[str, float]] = {
    # Every registered reward that grades against a reference answer (a request's default is its task's own
    # training reward). code_execution is left out: it runs model-written programs against test cases that a
    # request does not carry.
    **{name: {name: 1.0} for name in reward_names() if name != "code_execution"},
}

TaskName = Annotated[str, Field(min_length=1, max_length=MAX_TASK_NAME_CHARS)]
RewardName = TaskName  # a served reward, or one of the policy's tasks (its training reward): checked once the policy is loaded
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
Question = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
NewTokens = Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class StrictRequest(BaseModel):
    """A request body: strict types, unknown fields refused (a 400 naming them)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def not_blank(value: str | float | None, info: ValidationInfo) -> str | float | None:
    """A field validator refusing a string of only whitespace."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{info.field_name} is empty (only whitespace)")
    return value


def completion_tokens_bounded(rows_field: str, *tokens_fields: str):
    """A validator of ``tokens_fields`` (default ``max_new_tokens``): rows x new tokens at most
    ``MAX_COMPLETION_TOKENS`` completion tokens."""

    def check(value: int | None, info: ValidationInfo) -> int | None:
        rows = info.data.get(rows_field)  # absent when it failed its own validation
        if value is not None and rows is not None and rows * value > MAX_COMPLETION_TOKENS:
            raise ValueError(
                f"{rows_field} x {info.field_name} = {rows} x {value} = {rows * value} completion tokens; at most {MAX_COMPLETION_TOKENS} per request"
            )
        return value

    return field_validator(*(tokens_fields or ("max_new_tokens",)))(check)
