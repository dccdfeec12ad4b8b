"""The way in of a request, each bound enforced before any work (``RequestGuard``, an ASGI middleware):
the caller's API key on every route but the probes (``bentos.api_keys``: 401, or 429 past its rate, and on
the generating routes past its daily token quota), before anything is read; then, on the public endpoints, JSON only (415); a lone UTF-16 surrogate in it
refused naming its field (400); the body whole within ``MAX_BODY_BYTES`` (413, chunked bodies included)
and ``BODY_TIMEOUT_S`` (408), read before the request takes a slot (and one of its key's). Past the
engine's row slots a request queues (its wait shows in its time to first token and ``/readyz``); a 503
with ``Retry-After`` only before the policy is loaded, when ``$RLVR_MAX_REQUESTS`` requests are in flight,
or when its estimated start is past the request timeout (429 past its key's share); the handler, which
knows the request's size, raises :class:`FinishesTooLate` when its start and run would pass it. Every public
request is counted in ``rlvr_requests_total`` with its status; one whose client hangs up is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

from pydantic import ValidationError
from starlette.responses import JSONResponse

from bentos import SERVICE_NAME, openai_api
from bentos.api_keys import PROBES, Access, Refusal
from bentos.json_body import lone_surrogate_field
from bentos.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES
from bentos.metrics import REQUESTS

OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")  # errors in OpenAI's shape
PUBLIC_ENDPOINTS = ("/generate", "/solve", *OPENAI_ENDPOINTS)
GENERATING_ENDPOINTS = ("/generate", "/solve", "/v1/chat/completions", "/v1/completions")  # what a daily token quota meters
REQUEST_TIMEOUT_S = 300  # the whole request, queueing included: BentoML answers 504 and we stop its rows
STREAM_GRACE_S = 2.0  # past the timeout, the guard ends a stream whose client stopped reading
MAX_REQUESTS = 256  # per replica: public requests past the body, running or queued; more get 503 ($RLVR_MAX_REQUESTS)
RETRY_AFTER_S = 2
CLIENT_GONE = 499  # the status counted and logged for a request whose client hung up first (nginx's)
OPENAI_INFO_ROUTES = ("/tokenizer_info",)  # beside /v1/*: the other routes whose errors are OpenAI's shape


def openai_shaped(path: str) -> bool:
    """Whether ``path``'s errors come in OpenAI's shape (``/v1/*`` and vLLM's tokenizer routes)."""
    return path.startswith("/v1/") or path in OPENAI_ENDPOINTS or path in OPENAI_INFO_ROUTES


def refuse_past_timeout() -> bool:
    """Whether a request that cannot finish, or start, within the request timeout is refused before any
    work (``$RLVR_REFUSE_PAST_TIMEOUT``, on by default; off, it runs into the timeout)."""
    return os.environ.get("RLVR_REFUSE_PAST_TIMEOUT", "1").strip().lower() not in ("0", "false", "no", "off")


class RequestSlots:
    """The slots of this worker's public requests, running or queued: ``RequestGuard`` admits through
    it, the service opens it once the policy is loaded (with ``start_wait_s``, the estimated wait of a
    new request to start), and ``/readyz`` reads it (a saturated worker is not ready)."""

    def __init__(self, capacity: int):
        self.capacity, self.in_flight, self.loaded = capacity, 0, False
        self.start_wait_s: Callable[[], float] = lambda: 0.0

    @property
    def saturated(self) -> bool:
        return self.in_flight >= self.capacity


class FinishesTooLate(Exception):
    """A request that the queue ahead of it would make finish past the request timeout: a 503 with
    ``Retry-After`` (the seconds until it would finish in time), not a wait that ends in a 504."""

    def __init__(self, wait_s: float, run_s: float, timeout_s: float):
        timing = f"would start in about {wait_s:.0f} s and run about {run_s:.0f} s"
        super().__init__(f"overloaded: this request {timing}, past the request timeout of {timeout_s:.0f} s")
        self.retry_after_s = max(RETRY_AFTER_S, math.ceil(wait_s + run_s - timeout_s))

    def response(self, openai: bool) -> JSONResponse:
        """The 503 in the route's error shape."""
        content = openai_api.error_body(503, str(self), code="service_unavailable") if openai else {"error": str(self)}
        return JSONResponse(content, status_code=503, headers={"Retry-After": str(self.retry_after_s)})


def max_requests_from_env() -> int:
    """``$RLVR_MAX_REQUESTS``, else ``MAX_REQUESTS``; a ValueError names a bad value."""
    value = os.environ.get("RLVR_MAX_REQUESTS", str(MAX_REQUESTS))
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"RLVR_MAX_REQUESTS must be a whole number of requests, at least 1; got {value!r}")
    return int(value)


REQUEST_SLOTS = RequestSlots(max_requests_from_env())


@dataclass
class Exchange:
    """What the guard knows of one public request: the status its client got, whether it hung up, its key's id."""

    status: int | None = None
    client_gone: bool = False
    api_key_id: str | None = None


EXCHANGE: contextvars.ContextVar[Exchange] = contextvars.ContextVar("rlvr_exchange")


def cancelled_status() -> tuple[int, str]:
    """Why a public request's handler was cancelled: its client hung up (the guard then cancels it),
    else its time ran out (BentoML's traffic timeout, the only other canceller, answers 504)."""
    exchange = EXCHANGE.get(None)
    if exchange is not None and exchange.client_gone:
        return CLIENT_GONE, "client disconnected"
    return 504, "timed out (the service's request timeout)"


def caller_key_id() -> str | None:
    """The id of the API key that sent the public request being handled (None: an open service)."""
    exchange = EXCHANGE.get(None)
    return exchange.api_key_id if exchange is not None else None


@functools.cache
def request_timeout_s() -> float:
    """The service's traffic timeout as BentoML runs it (``BENTOML_CONFIG_OPTIONS`` included)."""
    from bentoml._internal.configuration.containers import BentoMLContainer

    try:
        return float(BentoMLContainer.config.services[SERVICE_NAME].get()["traffic"]["timeout"])
    except (KeyError, TypeError, ValueError):
        return float(REQUEST_TIMEOUT_S)


class RequestGuard:
    """ASGI middleware in front of every route: the way in (module docstring), each refusal a JSON
    ``ErrorResponse`` (OpenAI's error shape on ``/v1`` and the tokenizer routes); every public request
    counted in ``rlvr_requests_total`` with the status its client got. BentoML's timeout stops at a
    response's first message, so the guard ends a stream still running ``STREAM_GRACE_S`` past it (a
    client that stops reading would hold its slot)."""

    def __init__(self, app, slots: RequestSlots, access: Access):
        self.app, self.slots, self.access = app, slots, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        if scope["path"] not in PUBLIC_ENDPOINTS:  # the key only: no body, slot or count
            caller = self.access.caller(scope["path"], scope["headers"])
            if isinstance(caller, Refusal):
                return await refuse_for(send, caller, openai=openai_shaped(scope["path"]), close=scope["method"] not in ("GET", "HEAD"))
            return await self.app(scope, receive, send)
        exchange = Exchange()
        EXCHANGE.set(exchange)  # this request's task context: the handler reads it when cancelled

        async def counting_send(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            await send(message)

        try:
            await self._admit(scope, receive, counting_send, exchange)
        except asyncio.CancelledError:  # the request timed out: BentoML's TimeoutMiddleware answers 504
            exchange.status = exchange.status or 504
            raise
        except Exception:  # Starlette's ServerErrorMiddleware answers 500
            exchange.status = exchange.status or 500
            raise
        finally:
            REQUESTS.labels(endpoint=scope["path"], status=str(exchange.status)).inc()

    async def _admit(self, scope, receive, send, exchange: Exchange) -> None:
        openai = scope["path"] in OPENAI_ENDPOINTS  # refusals in the path's shape
        caller = self.access.caller(scope["path"], scope["headers"])  # before the body: a stranger costs nothing
        if isinstance(caller, Refusal):
            return await refuse_for(send, caller, openai=openai, close=scope["method"] not in ("GET", "HEAD"))
        exchange.api_key_id = caller.key_id
        if scope["path"] in GENERATING_ENDPOINTS and (spent := self.access.over_quota(caller)) is not None:
            return await refuse_for(send, spent, openai=openai, close=scope["method"] not in ("GET", "HEAD"))
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)  # 405 from the router
        _refuse = functools.partial(refuse, openai=openai)
        headers = dict(scope["headers"])
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            return await _refuse(send, 415, f"Content-Type: {media_type.decode('latin-1') or 'none'}; send the body as application/json")
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
            return await _refuse(send, 413, f"request body: larger than {MAX_BODY_BYTES} bytes", close=True)
        body = bytearray()
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        exchange.client_gone = True
                        return await _refuse(send, CLIENT_GONE, "client disconnected")
                    body += message.get("body", b"")
                    if len(body) > MAX_BODY_BYTES:  # a chunked body without Content-Length
                        return await _refuse(send, 413, f"request body: larger than {MAX_BODY_BYTES} bytes", close=True)
                    more = message.get("more_body", False)
        except TimeoutError:
            return await _refuse(send, 408, f"request body: not received within {BODY_TIMEOUT_S:g} s", close=True)
        if (location := lone_surrogate_field(bytes(body))) is not None:
            name = openai_api.param_name(location)
            return await _refuse(send, 400, f"{name}: holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not Unicode text", field=location)
        if not self.slots.loaded:
            return await _refuse(send, 503, "the policy is not loaded yet", retry_after=True)
        if self.slots.saturated:
            message = f"overloaded: all {self.slots.capacity} request slots (running or queued) are taken"
            return await _refuse(send, 503, message, retry_after=True, code="service_unavailable")
        if refuse_past_timeout() and (wait_s := self.slots.start_wait_s()) > (timeout_s := request_timeout_s()):
            message = f"overloaded: a new request would start in about {wait_s:.0f} s, past the request timeout of {timeout_s:.0f} s"
            return await _refuse(send, 503, message, retry_after=max(RETRY_AFTER_S, math.ceil(wait_s - timeout_s)), code="service_unavailable")
        if (over := self.access.take_share(caller, RETRY_AFTER_S)) is not None:
            return await refuse_for(send, over, openai=openai)
        self.slots.in_flight += 1
        try:
            await self._run(scope, bytes(body), receive, send, exchange)
        finally:
            self.slots.in_flight -= 1
            self.access.release(caller)

    async def _run(self, scope, body: bytes, receive, send, exchange: Exchange) -> None:
        """The app on the buffered body, cancelled when the client hangs up."""
        hung_up = asyncio.Event()
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await hung_up.wait()
            return {"type": "http.disconnect"}

        async def watch():  # with the body read, the client's next message is its disconnect
            while (await receive())["type"] != "http.disconnect":
                pass

        app = asyncio.ensure_future(self.app(scope, replay, send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({app, watcher}, timeout=request_timeout_s() + STREAM_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
            if not app.done():
                # the client hung up, or a stream outlived its time: the handler reads which when cancelled
                exchange.client_gone = watcher.done()
                hung_up.set()
                app.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await app
                if exchange.status is None:
                    await refuse(send, CLIENT_GONE, "client disconnected")
                else:  # a stream under way: its client got part of it
                    exchange.status = CLIENT_GONE if exchange.client_gone else 504
            else:
                app.result()
        finally:
            watcher.cancel()
            app.cancel()  # a no-op once done; when this request timed out it stops the handler


async def refuse(
    send,
    status: int,
    message: str,
    *,
    openai: bool = False,
    retry_after: bool | int = False,
    close: bool = False,
    field: tuple | None = None,
    code: str | None = None,
    challenge: str | None = None,
    detail: dict | None = None,
) -> None:
    """A JSON ``ErrorResponse`` (``openai``: OpenAI's error shape, with ``code``), naming ``field`` when given,
    ``detail``'s fields beside the native shape's ``error``;
    ``Retry-After`` of ``retry_after`` seconds (True: ``RETRY_AFTER_S``), ``WWW-Authenticate: challenge``.
    Sent to a client that hung up (499) it goes nowhere, but it ends the exchange for BentoML's middleware
    (its timeout would hold the request's task for the full timeout)."""
    if openai:
        content = openai_api.error_body(status, message, openai_api.param_name(field or ()), "invalid_value" if field else code)
    else:
        content = {"error": message, **({"detail": [{"type": "invalid_value", "loc": list(field), "msg": message}]} if field else {}), **(detail or {})}
    body = JSONResponse(content).body
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", str(RETRY_AFTER_S if retry_after is True else retry_after).encode()))
    if challenge:
        headers.append((b"www-authenticate", challenge.encode()))
    if close:  # the rest of the body is never read: the connection cannot serve another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def refuse_for(send, refusal: Refusal, *, openai: bool, close: bool = False) -> None:
    """``refuse`` with what ``bentos.api_keys`` said; ``close`` when the request's body is left unread."""
    await refuse(
        send,
        refusal.status,
        refusal.message,
        openai=openai,
        retry_after=refusal.retry_after_s or False,
        close=close,
        code=refusal.code,
        challenge=refusal.challenge,
        detail=refusal.detail,
    )


class ClientErrorsInOneLine(logging.Filter):
    """BentoML logs each request that fails validation at ERROR with a traceback: a client's error is
    one INFO line naming its fields (a flood of bad requests would fill the log with tracebacks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ValidationError):
            fields = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors(include_url=False, include_input=False, include_context=False)
            )
            record.msg, record.args = "400 on %s: %s", (record.getMessage().removeprefix("Exception on "), fields[:300])
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


logging.getLogger("bentoml._internal.server.http_app").addFilter(ClientErrorsInOneLine())
