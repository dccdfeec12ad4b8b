"""Requests and responses of the policy service, every bound the service enforces, and the
service's OpenAPI document, in one place.

Requests are validated by pydantic before any handler runs (strict types, unknown fields
rejected): a bad request gets HTTP 400 whose body (``ErrorResponse``) lists each error with its
field in ``loc``, and messages of our own validators name the field too. A request's cost is
bounded here by what it says (characters, rollouts x new tokens) and, once the model is loaded,
by what it would cost that model (``MAX_PROMPT_TOKENS``, its context, the KV-cache budget): the
service answers those with the same 400.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.json_schema import models_json_schema

from rlvr.answers import format_number
from rlvr.rewards import DEFAULT_GSM8K_REWARD, reward_names

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
MAX_BODY_BYTES = 64 * 1024  # 413 above this, before parsing: a 4,000-char prompt is at most 24 KB of JSON
BODY_TIMEOUT_S = 10.0  # 408 when the whole body has not arrived by then (a slow client holds no slot)

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

RewardName = Literal[tuple(SERVED_REWARDS)]
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
Question = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
NewTokens = Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _not_blank(value: str | float | None, info: ValidationInfo) -> str | float | None:
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{info.field_name} is empty (only whitespace)")
    return value


def _completion_tokens_bounded(rows_field: str):
    """A ``max_new_tokens`` validator: (rows x max_new_tokens) completion tokens at most ``MAX_COMPLETION_TOKENS``."""

    def check(value: int, info: ValidationInfo) -> int:
        rows = info.data.get(rows_field)  # absent when it failed its own validation
        if rows is not None and rows * value > MAX_COMPLETION_TOKENS:
            raise ValueError(f"{rows_field} x max_new_tokens = {rows} x {value} = {rows * value} completion "
                             f"tokens; at most {MAX_COMPLETION_TOKENS} per request")
        return value

    return field_validator("max_new_tokens")(check)


class GenerateRequest(_Request):
    """``POST /generate``: ``num_rollouts`` completions of one prompt, graded when ``ground_truth`` is given."""

    prompt: Question
    num_rollouts: Annotated[int, Field(ge=1, le=MAX_ROLLOUTS)] = DEFAULT_NUM_ROLLOUTS
    temperature: Temperature | Annotated[list[Temperature], Field(min_length=1, max_length=MAX_ROLLOUTS)] = Field(
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
    reward: RewardName = Field(default=DEFAULT_REWARD, description="the reward that grades against ground_truth")

    _blank_refused = field_validator("prompt", "ground_truth")(_not_blank)
    _bounded = _completion_tokens_bounded("num_rollouts")

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
    finish_reason: Literal["eos", "answer", "length"] = Field(
        description="eos, answer (stopped after the '#### <number>' line) or length")
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

    _blank_refused = field_validator("question")(_not_blank)
    _bounded = _completion_tokens_bounded("k")

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


class ErrorDetail(BaseModel):
    type: str
    loc: list[str | int] = Field(description="the field (and list index) in error; empty for the body as a whole")
    msg: str
    url: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error: what went wrong; a 400 lists each invalid field in ``detail``."""

    error: str
    detail: list[ErrorDetail] | None = None


ERRORS = {
    400: "Invalid request: each error in `detail` names its field in `loc` (a value out of its bounds, or the "
         "request's cost on the loaded model over a limit: prompt tokens, context, KV-cache budget)",
    408: f"The body did not arrive within {BODY_TIMEOUT_S:g} s",
    413: f"The body is over {MAX_BODY_BYTES} bytes",
    415: "The body is not application/json",
    500: "Unexpected server error",
    503: "Overloaded (every slot is taken) or the policy is not loaded yet: retry after `Retry-After` seconds",
    504: "Not answered within the request timeout (its generation is stopped)",
}


def openapi_document(title: str, version: str, description: str) -> dict:
    """The service's OpenAPI 3.1 document: the public endpoints with the request, response and error
    schemas pydantic validates and serializes with (JSON Schema 2020-12, as 3.1 takes it), and the probes."""
    models = [(GenerateRequest, "validation"), (GenerateResponse, "serialization"), (SolveRequest, "validation"),
              (SolveResponse, "serialization"), (ErrorResponse, "serialization")]
    refs, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")

    def json_body(model, mode: str) -> dict:
        return {"application/json": {"schema": refs[(model, mode)]}}

    def errors() -> dict:
        out = {str(code): {"description": text, "content": json_body(ErrorResponse, "serialization")}
               for code, text in ERRORS.items()}
        out["503"]["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
        return out

    def post(model_in, model_out, summary: str) -> dict:
        return {"post": {"summary": summary, "operationId": summary.split()[0].lower(),
                         "requestBody": {"required": True, "content": json_body(model_in, "validation")},
                         "responses": {"200": {"description": "OK", "content": json_body(model_out, "serialization")},
                                       **errors()}}}

    def probe(summary: str, media_type: str = "text/plain", not_ready: bool = False) -> dict:
        responses = {"200": {"description": "OK", "content": {media_type: {"schema": {"type": "string"}}}}}
        if not_ready:
            responses["503"] = {"description": "not ready: loading, or every slot is taken",
                                "content": {"text/plain": {"schema": {"type": "string"}}}}
        return {"get": {"summary": summary, "operationId": summary.split()[0].lower(), "responses": responses}}

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": {
            "/generate": post(GenerateRequest, GenerateResponse, "Generate rollouts of one prompt, graded against "
                                                                 "ground_truth when given"),
            "/solve": post(SolveRequest, SolveResponse, "Solve a math word problem by majority vote over k samples"),
            "/healthz": probe("Healthz: alive (loading has not failed)"),
            "/livez": probe("Livez: alive (loading has not failed)"),
            "/readyz": probe("Readyz: loaded, warmed up and not saturated", not_ready=True),
            "/metrics": probe("Metrics in Prometheus text format"),
        },
        "components": {"schemas": schemas["$defs"]},
    }
