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

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import models_json_schema
from pydantic_core import InitErrorDetails, PydanticCustomError

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
MAX_BODY_BYTES = 64 * 1024  # 413 above this, before parsing: a 4,000-char prompt is at most 48 KB of JSON (12-byte \uXXXX\uXXXX escapes)
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


def _completion_tokens_bounded(rows_field: str, *tokens_fields: str):
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
    ground_truth: Annotated[str, Field(min_length=1, max_length=MAX_GROUND_TRUTH_CHARS)] | Annotated[float, Field(allow_inf_nan=False)] | None = None
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
    answer: str | None = Field(description="the extracted final answer (normalized), None when there is none")
    reward: float | None = Field(description="None without ground_truth")
    finish_reason: Literal["eos", "answer", "length"] = Field(description="eos, answer (stopped after the '#### <number>' line) or length")
    completion_tokens: int = Field(description="tokens of the completion, the tool's included (max_new_tokens bounds them all)")
    temperature: float
    tool_calls: list[ToolCall] = Field(default_factory=list, description="the tool calls it made, in order (none when the policy has no tool)")


class GenerateResponse(BaseModel):
    request_id: str
    model_version: str
    rollouts: list[Rollout]
    best_index: int = Field(description="highest reward (first on ties); without ground_truth the first rollout giving the majority answer")
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
    environment: str = Field(default="single_turn", description="the environment the policy rolls out in (its lineage), e.g. calculator")
    answer: str | None = Field(description="majority answer of the k samples, None when no sample gave one")
    vote_share: float = Field(description="the confidence: votes for the answer / k")
    reasoning: str = Field(description="the completion of the first sample that gave the answer")
    answers: list[str | None]
    k: int
    tool_calls: list[ToolCall] = Field(default_factory=list, description="the tool calls of the reasoning's sample, in order")


# ---- The OpenAI-compatible API (/v1): the same bounds, in OpenAI's field names --------------------

MAX_MESSAGES = 64
MAX_CHAT_CHARS = 16_000  # all message contents of a chat request; MAX_PROMPT_TOKENS is the binding bound
MAX_RAW_PROMPT_CHARS = 16_000  # one /v1/completions prompt (room for lm-eval's 5-shot GSM8k prompts: five worked examples and the question)
MAX_PROMPTS = MAX_SAMPLES  # prompts of one /v1/completions request; prompts x n at most MAX_SAMPLES too
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
MAX_NAME_CHARS = 256  # model, user
MAX_SEED = 2**63 - 1
DEFAULT_CHAT_MAX_TOKENS = DEFAULT_MAX_NEW_TOKENS  # OpenAI's default is the rest of the context
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's
NO_ALTERNATIVES = "chat log-probs are the sampled tokens' (use /v1/completions with logprobs: k for alternatives)"
MAX_TOP_LOGPROBS = 5  # /v1/completions logprobs: the k most likely tokens at each position (OpenAI's bound)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
RawPrompt = Annotated[str, Field(min_length=1, max_length=MAX_RAW_PROMPT_CHARS)]
PromptInput = (
    RawPrompt
    | Annotated[list[RawPrompt], Field(min_length=1, max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
)
StopInput = (
    Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
    | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)]
    | None
)
TextPart = dict[Literal["type", "text"], str]


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(i) is int for i in value)


def _prompts(value) -> list[str] | list[list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(value, str) or _is_token_ids(value):
        prompts = [value]
    elif isinstance(value, list) and value and (all(isinstance(v, str) for v in value) or all(_is_token_ids(v) for v in value)):
        prompts = value
    else:
        raise ValueError("prompt is a string, a list of strings, a list of token ids or a list of lists of token ids")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS}")
    for p in prompts:
        if isinstance(p, str) and not 1 <= len(p) <= MAX_RAW_PROMPT_CHARS:
            raise ValueError(f"prompt is {len(p)} characters; 1 to {MAX_RAW_PROMPT_CHARS}")
        if isinstance(p, list) and (len(p) > MAX_PROMPT_TOKENS or min(p) < 0):
            raise ValueError(f"prompt token ids: 1 to {MAX_PROMPT_TOKENS} ids, each >= 0")
    return prompts


def _stop_strings(value) -> list[str]:
    """``stop``: null, a string or a list of strings (each generation ends where one first appears)."""
    values = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError("stop is a string or a list of strings")
    if len(values) > MAX_STOP_STRINGS:
        raise ValueError(f"stop lists {len(values)} strings; at most {MAX_STOP_STRINGS}")
    if not all(1 <= len(v) <= MAX_STOP_CHARS for v in values):
        raise ValueError(f"each stop string is 1 to {MAX_STOP_CHARS} characters")
    return list(dict.fromkeys(values))


def _message_text(value) -> str:
    """A message's ``content``: a string, or text parts (``{"type": "text", "text": ...}``) joined by
    newlines, as vLLM joins them."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.keys() == {"type", "text"} and p["type"] == "text" and isinstance(p["text"], str) for p in value
    ):
        return "\n".join(p["text"] for p in value)
    raise ValueError('content is a string or a list of text parts {"type": "text", "text": ...} (images, audio and files are not supported)')


def _unsupported_unless(allowed, why: str, *fields: str):
    """A validator refusing what the engine cannot do, rather than ignoring it."""

    def check(value, info: ValidationInfo):
        if not allowed(value, info.data):
            raise ValueError(f"{info.field_name}={value!r} is not supported: {why}")
        return value

    return field_validator(*fields)(check)


class StreamOptions(_Request):
    include_usage: bool = Field(default=False, description="a last chunk with the usage and no choices")


class _OpenAIRequest(_Request):
    """What ``/v1/chat/completions`` and ``/v1/completions`` share. Unknown fields get a 400 naming them."""

    model: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | None = Field(
        default=None, description="the id of /v1/models (its tag or name also served); null: the served policy"
    )
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = Field(default=1, description="choices per prompt")
    temperature: Temperature = Field(default=1.0, description="0 = greedy")
    top_p: TopP = 1.0
    stop: Annotated[list[str], PlainValidator(_stop_strings, json_schema_input_type=StopInput)] = Field(
        default_factory=list, description="each choice ends where one of these first appears (not included; finish_reason stop)"
    )
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = Field(
        default=None, description="the same seed and request give the same sampled choices, batched or not"
    )
    stream: bool = Field(default=False, description="server-sent events, one chunk per decode step, then [DONE]")
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False)] = Field(default=0.0, description="only 0")
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False)] = Field(default=0.0, description="only 0")
    logit_bias: dict[str, float] | None = Field(default=None, description="only null or {}")
    user: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = Field(default=None, description="kept in the traffic log")

    _no_penalties = _unsupported_unless(lambda v, _: v == 0, "the engine samples without penalties (only 0)", "presence_penalty", "frequency_penalty")
    _no_logit_bias = _unsupported_unless(lambda v, _: not v, "the engine samples without logit biases", "logit_bias")
    _options_with_stream = _unsupported_unless(lambda v, data: v is None or data.get("stream") is True, "stream_options needs stream: true", "stream_options")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, PlainValidator(_message_text, json_schema_input_type=str | list[TextPart])]


def _bounded_chat_text(messages: list[ChatMessage]) -> list[ChatMessage]:
    chars = sum(len(m.content) for m in messages)
    if chars > MAX_CHAT_CHARS:
        raise ValueError(f"messages hold {chars} characters of content; at most {MAX_CHAT_CHARS}")
    return messages


ChatMessages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES), AfterValidator(_bounded_chat_text)]


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions``: ``n`` replies to the messages, rendered with the model's chat
    template as given (no system prompt is added; rlvr.prompts.SYSTEM_PROMPT is training's)."""

    messages: ChatMessages
    max_tokens: NewTokens | None = Field(default=None, description=f"default {DEFAULT_CHAT_MAX_TOKENS}")
    max_completion_tokens: NewTokens | None = Field(default=None, description="max_tokens' newer name")
    logprobs: bool = Field(default=False, description="each generated token's log-prob (not with stream)")
    top_logprobs: Annotated[int, Field(ge=0, json_schema_extra={"maximum": 0})] | None = Field(default=None, description=f"only 0: {NO_ALTERNATIVES}")

    _bounded = _completion_tokens_bounded("n", "max_tokens", "max_completion_tokens")
    _one_name = _unsupported_unless(
        lambda v, data: v is None or data.get("max_tokens") is None, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens"
    )
    _no_stream_logprobs = _unsupported_unless(lambda v, data: not v or not data.get("stream"), "log-probs are not streamed", "logprobs")
    _no_alternatives = _unsupported_unless(lambda v, _: not v, NO_ALTERNATIVES, "top_logprobs")

    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``: ``n`` continuations of each prompt, taken as it is (no chat template,
    as vLLM's /v1/completions; control tokens are the client's own to write)."""

    prompt: Annotated[list[str] | list[list[int]], PlainValidator(_prompts, json_schema_input_type=PromptInput)]
    max_tokens: NewTokens = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        default=None, description="each token's log-prob and, at each position, the k most likely tokens' (with the token's own)"
    )
    echo: bool = Field(default=False, description="the prompt before the completion, with its tokens' log-probs under logprobs (the first: null)")
    best_of: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = Field(default=None, description="only n")
    suffix: str | None = Field(default=None, description="only null")

    _bounded = _completion_tokens_bounded("n", "max_tokens")
    _no_stream_logprobs = _unsupported_unless(lambda v, data: v is None or not data.get("stream"), "log-probs are not streamed", "logprobs")
    _no_stream_echo = _unsupported_unless(lambda v, data: not v or not data.get("stream"), "an echo is not streamed", "echo")
    _no_best_of = _unsupported_unless(lambda v, data: v is None or v == data.get("n"), "choices are not ranked (best_of must equal n)", "best_of")
    _no_suffix = _unsupported_unless(lambda v, _: not v, "no insertion (suffix)", "suffix")


def _absent_unless_given(schema: dict) -> None:
    schema.pop("default", None)  # a field that is either given (not null) or absent


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): the served tokenizer's ids of ``prompt`` as it is, or of chat
    ``messages`` rendered as ``/v1/chat/completions`` renders them; one of the two."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | None = None
    prompt: RawPrompt = Field(default=None, json_schema_extra=_absent_unless_given, description="text, tokenized as it is")
    messages: ChatMessages = Field(default=None, json_schema_extra=_absent_unless_given, description="a chat, in /v1/chat/completions' chat template")
    add_generation_prompt: bool = Field(default=True, description="with messages: the assistant's turn opened, as the chat endpoint does")
    add_special_tokens: bool = Field(
        default=None, json_schema_extra=_absent_unless_given, description="the tokenizer's own (this one adds none); default: with prompt only, as vLLM"
    )
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            field, said = ("messages", "not both") if self.prompt is not None else ("prompt", "the body has neither")
            error = PydanticCustomError("prompt_or_messages", "give prompt (text) or messages (a chat), {said}", {"said": said})
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(type=error, loc=(field,), input=None)])
        return self

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens: as asked, else with ``prompt`` (a chat template holds them)."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKENS + MAX_NEW_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): what a client needs to tokenize and template as the server does."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int | None


class Usage(BaseModel):
    prompt_tokens: int = Field(description="each prompt once, whatever n")
    completion_tokens: int = Field(description="every generated token of every choice (a stop string's included)")
    total_tokens: int


class TokenLogprob(BaseModel):
    token: str = Field(description="its text; one that is part of a character: its bytes written out, bytes:\\xe4\\xbd")
    logprob: float = Field(description="under the distribution it was sampled from (temperature applied, before top-p; greedy: the model's own)")
    bytes: list[int] = Field(description="the token's own UTF-8 bytes (part of a character when it splits one)")
    top_logprobs: list[dict] = Field(default_factory=list, description=f"always empty: {NO_ALTERNATIVES}")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class _CompletionAnswer(BaseModel):
    """What a /v1 answer holds, chat or not; each kind narrows ``object`` and ``choices``."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage


class ChatCompletion(_CompletionAnswer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionLogprobs(BaseModel):
    """The tokens that start inside the choice's text (and the end token that ended it)."""

    tokens: list[str] = Field(description="each token's text; one that is part of a character: its bytes written out, bytes:\\xe4\\xbd")
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(description="the k most likely tokens and the token itself; null where token_logprobs is")
    text_offset: list[int] = Field(description="where each token starts in the choice's text, in characters")


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt index x n + sample index")
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class Completion(_CompletionAnswer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str = Field(description="the served policy's version (its model_version label, else the tag's version)")
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str = Field(description="the BentoML model tag")
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIError(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx)")
    param: str | None = Field(description="the field in error, e.g. temperature or messages[1].content")
    code: str | None


class OpenAIErrorResponse(BaseModel):
    """The body of every /v1 error but BentoML's 504: OpenAI's shape."""

    error: OpenAIError


class ErrorDetail(BaseModel):
    type: str
    loc: list[str | int] = Field(description="the field (and list index) in error; empty for the body as a whole")
    msg: str
    url: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error: what went wrong; a 400 lists each invalid field in ``detail``."""

    error: str
    detail: list[ErrorDetail] | None = None


OPENAI_ERRORS = {  # the /v1 endpoints' own
    400: "Invalid request: `error.param` names the field (a value out of its bounds, something the engine cannot do, "
    "or the request's cost on the loaded model over a limit)",
    404: "No such model: `model` is not the served policy (see /v1/models)",
}
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
    models = [
        (GenerateRequest, "validation"),
        (GenerateResponse, "serialization"),
        (SolveRequest, "validation"),
        (SolveResponse, "serialization"),
        (ErrorResponse, "serialization"),
        (ChatCompletionRequest, "validation"),
        (ChatCompletion, "serialization"),
        (CompletionRequest, "validation"),
        (Completion, "serialization"),
        (ModelList, "serialization"),
        (OpenAIErrorResponse, "serialization"),
        (TokenizeRequest, "validation"),
        (TokenizeResponse, "serialization"),
        (DetokenizeRequest, "validation"),
        (DetokenizeResponse, "serialization"),
        (TokenizerInfo, "serialization"),
    ]
    refs, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")

    def json_body(model, mode: str) -> dict:
        return {"application/json": {"schema": refs[(model, mode)]}}

    def errors(openai: bool = False) -> dict:
        shape = OpenAIErrorResponse if openai else ErrorResponse
        out = {
            str(code): {"description": text, "content": json_body(shape, "serialization")}
            for code, text in {**ERRORS, **(OPENAI_ERRORS if openai else {})}.items()
        }
        out["503"]["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
        out["504"]["content"] = json_body(ErrorResponse, "serialization")  # BentoML's own timeout answer
        return out

    def post(model_in, model_out, summary: str, openai: bool = False, stream: bool = False) -> dict:
        ok = json_body(model_out, "serialization")
        if stream:
            ok["text/event-stream"] = {
                "schema": {  # each event (OpenAPI 3.1)
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {
                            "type": "string",
                            "description": "with stream: true, one chunk's JSON per "
                            "event (chat.completion.chunk or text_completion; an error's last), then [DONE]",
                        }
                    },
                }
            }
        return {
            "post": {
                "summary": summary,
                "operationId": summary.split()[0].lower(),
                "requestBody": {"required": True, "content": json_body(model_in, "validation")},
                "responses": {"200": {"description": "OK", "content": ok}, **errors(openai)},
            }
        }

    def probe(summary: str, media_type: str = "text/plain", not_ready: bool = False) -> dict:
        responses = {"200": {"description": "OK", "content": {media_type: {"schema": {"type": "string"}}}}}
        if not_ready:
            responses["503"] = {"description": "not ready: loading, or every slot is taken", "content": {"text/plain": {"schema": {"type": "string"}}}}
        return {"get": {"summary": summary, "operationId": summary.split()[0].lower(), "responses": responses}}

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": {
            "/generate": post(GenerateRequest, GenerateResponse, "Generate rollouts of one prompt, graded against ground_truth when given"),
            "/solve": post(SolveRequest, SolveResponse, "Solve a math word problem by majority vote over k samples"),
            "/v1/chat/completions": post(ChatCompletionRequest, ChatCompletion, "Chat: OpenAI-compatible chat completions", openai=True, stream=True),
            "/v1/completions": post(CompletionRequest, Completion, "Completions: OpenAI-compatible completions of raw prompts", openai=True, stream=True),
            "/v1/models": {
                "get": {
                    "summary": "Models: the served policy",
                    "operationId": "models",
                    "responses": {"200": {"description": "OK", "content": json_body(ModelList, "serialization")}},
                }
            },
            "/tokenize": post(TokenizeRequest, TokenizeResponse, "Tokenize: token ids of a prompt or a chat, as vLLM's /tokenize", openai=True),
            "/detokenize": post(DetokenizeRequest, DetokenizeResponse, "Detokenize: the text of token ids, as vLLM's /detokenize", openai=True),
            "/tokenizer_info": {
                "get": {
                    "summary": "Tokenizer_info: the tokenizer's class, special tokens and chat template, as vLLM's /tokenizer_info",
                    "operationId": "tokenizer_info",
                    "responses": {
                        "200": {"description": "OK", "content": json_body(TokenizerInfo, "serialization")},
                        "503": {"description": "the policy is not loaded yet", "content": json_body(OpenAIErrorResponse, "serialization")},
                    },
                }
            },
            "/healthz": probe("Healthz: alive (loading has not failed)"),
            "/livez": probe("Livez: alive (loading has not failed)"),
            "/readyz": probe("Readyz: loaded, warmed up and not saturated", not_ready=True),
            "/metrics": probe("Metrics in Prometheus text format"),
        },
        "components": {"schemas": schemas["$defs"]},
    }
