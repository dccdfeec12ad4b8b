"""The models of vLLM's tokenizer routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``): what a
remote client (lm-eval's) needs to tokenize and template as the served policy does."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from bentos.limits import MAX_NAME_CHARS, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, StrictRequest
from bentos.openai_models import ChatMessages, RawPrompt


def _absent_unless_given(schema: dict) -> None:
    schema.pop("default", None)  # a field that is either given (not null) or absent


class TokenizeRequest(StrictRequest):
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


class DetokenizeRequest(StrictRequest):
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
