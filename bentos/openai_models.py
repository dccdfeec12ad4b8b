"""The models of the OpenAI-compatible API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``
and its error body): the native API's bounds (``bentos.limits``) in OpenAI's field names, and what the
engine cannot do refused with a 400 naming the field rather than ignored. vLLM's tokenizer routes'
models are ``bentos.tokenizer_models``; the wire format (choices, chunks, errors) is ``bentos.openai_api``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, PlainValidator, ValidationInfo, field_validator

from bentos.limits import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_CHAT_CHARS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_RAW_PROMPT_CHARS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    NewTokens,
    StrictRequest,
    Temperature,
    TopP,
    completion_tokens_bounded,
)

DEFAULT_CHAT_MAX_TOKENS = DEFAULT_MAX_NEW_TOKENS  # OpenAI's default is the rest of the context
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's
NO_ALTERNATIVES = "chat log-probs are the sampled tokens' (use /v1/completions with logprobs: k for alternatives)"

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


class StreamOptions(StrictRequest):
    include_usage: bool = Field(default=False, description="a last chunk with the usage and no choices")


class _OpenAIRequest(StrictRequest):
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


class ChatMessage(StrictRequest):
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
    template as given (no system prompt is added; rlvr.tasks.gsm8k.prompt.SYSTEM_PROMPT is GSM8k training's)."""

    messages: ChatMessages
    max_tokens: NewTokens | None = Field(default=None, description=f"default {DEFAULT_CHAT_MAX_TOKENS}")
    max_completion_tokens: NewTokens | None = Field(default=None, description="max_tokens' newer name")
    logprobs: bool = Field(default=False, description="each generated token's log-prob (not with stream)")
    top_logprobs: Annotated[int, Field(ge=0, json_schema_extra={"maximum": 0})] | None = Field(default=None, description=f"only 0: {NO_ALTERNATIVES}")

    _bounded = completion_tokens_bounded("n", "max_tokens", "max_completion_tokens")
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

    _bounded = completion_tokens_bounded("n", "max_tokens")
    _no_stream_logprobs = _unsupported_unless(lambda v, data: v is None or not data.get("stream"), "log-probs are not streamed", "logprobs")
    _no_stream_echo = _unsupported_unless(lambda v, data: not v or not data.get("stream"), "an echo is not streamed", "echo")
    _no_best_of = _unsupported_unless(lambda v, data: v is None or v == data.get("n"), "choices are not ranked (best_of must equal n)", "best_of")
    _no_suffix = _unsupported_unless(lambda v, _: not v, "no insertion (suffix)", "suffix")


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
