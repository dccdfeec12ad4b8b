"""OpenAI's wire format for the service's ``/v1`` endpoints: errors, choices, log-probs, streamed chunks.

No state and no model here: ``bentos.service`` validates, prices, batches, cancels and logs a
``/v1`` request on the same paths as ``/generate`` and ``/solve``, and calls these functions to
say it in OpenAI's words. Finish reasons: the engine's ``eos`` and ``stop`` (a stop string) are
``"stop"``, ``length`` is ``"length"``; a choice's text ends before the first stop string in it, and
without a character left incomplete by its last token (``returned_text``); its log-probs list the
tokens that start inside that text (``logprob_token_count``).
"""

from __future__ import annotations

import contextlib
import json
from typing import AsyncGenerator, Callable, Sequence

from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from bentos.openai_models import ChatLogprobs, CompletionLogprobs, OpenAIError, OpenAIErrorResponse, TokenLogprob, Usage

SSE_DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``: ``invalid_request_error`` below 500, else ``server_error``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return OpenAIErrorResponse(error=OpenAIError(message=message, type=kind, param=param, code=code)).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def param_name(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI names a field: ``("messages", 1, "content")`` -> ``messages[1].content``."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name or None


def error_parts(err: ValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of a 400: every error, each with its field; the param and code of the first."""
    errors = err.errors(include_url=False, include_input=False, include_context=False)

    def error_text(error: dict) -> str:
        if error["type"] == "extra_forbidden":
            return "not supported by this server (an unknown field)"
        return error["msg"].removeprefix("Value error, ")

    message = "; ".join(f"{param_name(e['loc']) or 'body'}: {error_text(e)}" for e in errors)
    return message, param_name(errors[0]["loc"]), errors[0]["type"]


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """The text before the first stop string in it, and whether there was one."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def returned_text(text: str, stopped: bool, ends_inside_a_character: bool) -> str:
    """A choice's text (already cut at its stop string, if ``stopped``) without the incomplete character
    its tokens end in when ``max_tokens`` cut one (decoded alone, U+FFFD): as vLLM, whose incremental
    detokenizer emits a character only once its bytes are complete, and as our stream, which holds it back."""
    if not stopped and ends_inside_a_character and text.endswith("\ufffd"):
        return text[:-1]
    return text


def logprob_token_count(offsets: list[int], text: str, whole: bool) -> int:
    """How many of a choice's tokens its log-probs list (``offsets``: where each starts in the decoded
    tokens, in characters): all of them, the end token included, when ``text`` is their ``whole`` text,
    else those that start inside ``text`` (the last may run on into the cut stop string or character)."""
    return len(offsets) if whole else sum(offset < len(text) for offset in offsets)


def finish_reason(engine_reason: str, stopped: bool) -> str:
    return "length" if engine_reason == "length" and not stopped else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def chat_logprobs(tokens: list[str], token_bytes: list[bytes], logprobs: list[float]) -> ChatLogprobs:
    """Each listed token with its log-prob and its own bytes (part of a character when it splits one; its
    text then ``bytes:\\xe4\\xbd``, as ``Vocabulary.token_texts`` writes it); joined, the bytes begin with
    the content's UTF-8. No alternatives."""
    return ChatLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(b)) for t, b, lp in zip(tokens, token_bytes, logprobs)])


def completion_logprobs(
    tokens: list[str], logprobs: list[float | None], offsets: list[int], alternatives: list[dict[str, float] | None] | None = None
) -> CompletionLogprobs:
    """Legacy completions log-probs: each token, its log-prob, the most likely tokens at its position with
    the token itself (itself alone without ``alternatives``; null where its log-prob is: an echoed
    prompt's first token), and its offset in the choice's text, in characters."""
    alternatives = alternatives or [{} for _ in tokens]
    top = [None if lp is None else {**(alt or {}), t: lp} for t, lp, alt in zip(tokens, logprobs, alternatives)]
    return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets)


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def chunk(chat: bool, response_id: str, created: int, model: str, index: int, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
    """One streamed chunk of one choice: its first (chat: the role), a text delta, or its finish reason."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    return _chunk_of(chat, response_id, created, model, [choice])


def usage_chunk(chat: bool, response_id: str, created: int, model: str, used: Usage) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
    return _chunk_of(chat, response_id, created, model, [], usage=used.model_dump())


def _chunk_of(chat: bool, response_id: str, created: int, model: str, choices: list[dict], **extra) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}


class TextStream:
    """One choice's text as its tokens arrive: what may be sent now, held back while it could still
    turn into a stop string or ends in a partial character, so the deltas add up to the final text."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]):
        self.decode, self.stop = decode, stop
        self.token_ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text that is now safe to send."""
        self.token_ids += token_ids
        if self.stopped:
            return ""
        text, self.stopped = cut_at_stop(self.decode(self.token_ids), self.stop)
        if not self.stopped:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character
            held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - held]
        return self._unsent_delta(text)

    def finish(self, final_text: str) -> str:
        """The rest of the choice's final text (the engine's, cut at its stop string)."""
        return self._unsent_delta(final_text)

    def _unsent_delta(self, text: str) -> str:
        """The part of ``text`` past what was sent, now counted as sent; "" when ``text`` does not extend it."""
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


class EventStream(Response):
    """Server-sent events from an async generator, which is closed however the response ends (so its
    cleanup runs at once when the client hangs up while the generator waits on a send)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]):
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        async with contextlib.aclosing(self.events):
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
