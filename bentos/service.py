"""``RlvrPolicy``: the trained policy as a BentoML service that holds under hostile clients.

* ``POST /generate``: ``num_rollouts`` rollouts of one prompt, each with its extracted answer and,
  given ``ground_truth``, its verifiable reward; the best rollout, mean reward, majority answer.
* ``POST /solve``: self-consistency (Wang et al. 2022): k samples, majority vote of their final
  answers, the vote share as confidence; k = 1 is one greedy decode.
* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``: OpenAI's API, as vLLM
  serves it (``bentos.openai_api`` speaks its wire format): chat messages rendered with the model's
  chat template by ``rlvr.prompts.render_messages`` (control tokens in a message refused), completions
  on the raw prompt (text or token ids; no template, as vLLM's); ``n``, ``temperature``, ``top_p``,
  ``max_tokens``, ``stop`` (the text ends before it; finish reason ``stop``), ``seed`` (a seeded request
  samples in an engine call of its own: the same choices alone or batched), ``logprobs`` of the
  sampled tokens (no alternatives: ``top_logprobs`` / ``logprobs`` above 0 are refused), ``stream``
  (server-sent events token by token), usage. Every other OpenAI field gets a 400 naming it, in
  OpenAI's error shape, as does a value out of bounds.
* ``/healthz`` (alive: loading has not failed), ``/readyz`` (the policy is loaded, warmed up and a
  slot is free), ``/metrics`` (BentoML's ``bentoml_service_*`` plus the ``rlvr_*`` series),
  ``/docs.json`` (the OpenAPI 3.1 document of ``bentos.schemas``).

The policy comes from the BentoML model store (``model_tag`` bento argument, default
``rlvr_policy:latest``); ``bentoml build`` packs it into the Bento. Prompts are built by
``rlvr.prompts.render_prompt`` and answers read by ``rlvr.answers.extract_final_answer``, as in
training and evaluation.

A public request's way in, each bound enforced before any work (``RequestGuard``): JSON only
(415); the body whole within ``MAX_BODY_BYTES`` (413, chunked bodies included) and
``BODY_TIMEOUT_S`` (408), read before the request takes one of the ``MAX_CONCURRENCY`` slots, so a
slow client holds none; no free slot, or the policy not loaded yet: 503 with ``Retry-After``
(``/readyz`` answers 503 too). Then pydantic validates the body (400 naming the field) and the
handler prices it on the loaded model (400 naming the field: prompt tokens in the chat template,
the model's context, the KV-cache budget, ``$RLVR_KV_CACHE_BUDGET_MIB``) before queueing its job. BentoML's traffic
``timeout`` bounds the whole request (504). A request whose client hangs up, or whose time runs
out, has its rows stopped at the next decode step (``SamplingConfig.should_stop``).

Batching: one model thread runs generation passes; each pass takes the jobs queued while the
previous one ran (up to ``MAX_BATCH_REQUESTS`` whose KV caches fit the budget together), and jobs
with equal sampling settings share one ``generate_rollouts`` call. A lone request waits for no
one. ``RLVR_BATCHING=0`` runs one job per pass (the baseline of ``bench/serve_load.py``). (BentoML's
adaptive batching is not used: a batchable API is a public route whose internal call takes a
second concurrency slot, crosses an HTTP hop that cancellation cannot, and waits on a dispatcher
tuned for millisecond inference.)

The ``/v1`` endpoints take the same way in, pricing, batching and cancellation: one rollout job per
prompt (``stop_at_final_answer`` off), a streaming job's tokens handed to its handler as they are
sampled (``SamplingConfig.on_tokens``). A stream outlives BentoML's timeout, which ends at a
response's first message: it keeps to the timeout itself (an error event, then ``[DONE]``), and the
guard ends it ``STREAM_GRACE_S`` later if its client stopped reading.

Every request that reached generation is appended to the JSONL traffic log in
``Settings.traffic_dir`` (``$RLVR_TRAFFIC_DIR``, else ``$RLVR_HOME/traffic``; absolute paths), with
the status its client got and, when it failed, why; the drift monitoring reads it with
``rlvr.traffic.read_traffic``. ``endpoint`` says which endpoint served it; a ``/v1`` record's
``prompt`` is the last user message (chat) or the first prompt, and it adds ``messages`` (chat),
``prompts`` (completions of several prompts) and ``usage``; its ``completions`` and
``finish_reasons`` are what the client got (cut at the stop string; ``stop`` / ``length``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import functools
import itertools
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http import HTTPStatus
from typing import AsyncIterator, Callable, NamedTuple

import bentoml
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bentos import MODEL_NAME, MODEL_VERSION_LABEL, openai_api
from bentos.schemas import (
    BODY_TIMEOUT_S,
    DEFAULT_KV_CACHE_BUDGET_MIB,
    EXTRACTION_MODE,
    MAX_BODY_BYTES,
    MAX_COMPLETION_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_SAMPLES,
    SERVED_REWARDS,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    Rollout,
    SolveRequest,
    SolveResponse,
    openapi_document,
)
from rlvr.answers import extract_final_answer
from rlvr.evaluation import majority_vote
from rlvr.policy import load_policy, load_tokenizer
from rlvr.prompts import ControlTokensError, render_messages, render_prompt
from rlvr.rewards import RewardPool
from rlvr.rollout import SamplingConfig, generate_rollouts
from rlvr.settings import Settings
from rlvr.traffic import TrafficLog

logger = logging.getLogger("bentoml.rlvr_policy")

OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
PUBLIC_ENDPOINTS = ("/generate", "/solve", *OPENAI_ENDPOINTS)
REQUEST_TIMEOUT_S = 300  # the whole request, queueing included: BentoML answers 504 and we stop its rows
STREAM_GRACE_S = 2.0  # past the timeout, the guard ends a stream whose client stopped reading
MAX_CONCURRENCY = 64  # per replica: public requests past the body and in the handler; more get 503
RETRY_AFTER_S = 2
MAX_BATCH_REQUESTS = 8  # requests per generation pass
MAX_BATCH_ROWS = 64  # rows (prompts x samples) per forward pass; bigger passes stream through in chunks
REWARD_TIMEOUT_S = 10.0
TRAFFIC_MAX_BYTES = 16 * 2**20
WARM_UP_QUESTION = "What is 2 + 3?"
CLIENT_GONE = 499  # the status counted and logged for a request whose client hung up first (nginx's)


class ServiceArgs(BaseModel):
    """Bento arguments: ``bentoml build --arg model_tag=rlvr_policy:<version>`` (``bentos/build.py`` sets it)."""

    model_tag: str = f"{MODEL_NAME}:latest"


ARGS = bentoml.use_arguments(ServiceArgs)

REQUESTS = Counter(
    name="rlvr_requests_total",
    documentation="Requests to the public endpoints (/generate, /solve, /v1/chat/completions, /v1/completions) by "
    "endpoint and the HTTP status their client received (every refusal included; 499: the client hung "
    "up before its answer; a stream: how it ended)",
    labelnames=["endpoint", "status"],
)
ROLLOUTS_GENERATED = Counter(name="rlvr_rollouts_generated_total", documentation="Completions generated by the policy")
ROLLOUTS_CANCELLED = Counter(
    name="rlvr_rollouts_cancelled_total",
    documentation="Rows stopped mid-generation because their client hung up or their request timed out",
)
PASS_REQUESTS = Histogram(
    name="rlvr_pass_requests",
    documentation="Requests sharing one generation pass",
    buckets=[1, 2, 3, 4, 6, 8],
)
REWARD = Histogram(
    name="rlvr_reward",
    documentation="Verifiable reward of each rollout of /generate requests with ground truth",
    buckets=[i / 10 for i in range(11)],
)
VOTE_SHARE = Histogram(
    name="rlvr_vote_share",
    documentation="Share of a request's samples agreeing with the majority answer (requests with >= 2 samples)",
    buckets=[i / 10 for i in range(11)],
)
GENERATION_SECONDS = Histogram(
    name="rlvr_generation_seconds",
    documentation="Duration of one rollout-engine call (one generation pass of a batch)",
    buckets=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300],
)


def batching_enabled() -> bool:
    return os.environ.get("RLVR_BATCHING", "1").strip().lower() not in ("0", "false", "no", "off")


# ---- the way in ---------------------------------------------------------------------------------


class Door:
    """The slots of this worker's public requests: ``RequestGuard`` admits through it, the service
    opens it once the policy is loaded, and ``/readyz`` reads it (a saturated worker is not ready)."""

    def __init__(self, capacity: int):
        self.capacity, self.in_flight, self.loaded = capacity, 0, False

    @property
    def saturated(self) -> bool:
        return self.in_flight >= self.capacity


DOOR = Door(MAX_CONCURRENCY)


@dataclass
class Exchange:
    """What the guard knows of one public request: the status its client got, whether it hung up."""

    status: int | None = None
    client_gone: bool = False


EXCHANGE: contextvars.ContextVar[Exchange] = contextvars.ContextVar("rlvr_exchange")


def cancelled_status() -> tuple[int, str]:
    """Why a public request's handler was cancelled: its client hung up (the guard then cancels it),
    else its time ran out (BentoML's traffic timeout, the only other canceller, answers 504)."""
    exchange = EXCHANGE.get(None)
    if exchange is not None and exchange.client_gone:
        return CLIENT_GONE, "client disconnected"
    return 504, "timed out (the service's request timeout)"


@functools.cache
def request_timeout_s() -> float:
    """The service's traffic timeout as BentoML runs it (``BENTOML_CONFIG_OPTIONS`` included)."""
    from bentoml._internal.configuration.containers import BentoMLContainer

    try:
        return float(BentoMLContainer.config.services[RlvrPolicy.name].get()["traffic"]["timeout"])
    except (KeyError, TypeError, ValueError):
        return float(REQUEST_TIMEOUT_S)


class RequestGuard:
    """ASGI middleware on the public endpoints: the way in (module docstring), each refusal a JSON
    ``ErrorResponse`` (OpenAI's error shape on ``/v1``); every request counted in
    ``rlvr_requests_total`` with the status its client got. BentoML's timeout stops at a response's
    first message, so the guard ends a stream still running ``STREAM_GRACE_S`` past it (a client
    that stops reading would hold its slot)."""

    def __init__(self, app, door: Door):
        self.app, self.door = app, door

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in PUBLIC_ENDPOINTS:
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
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)  # 405 from the router
        _refuse = functools.partial(refuse, openai=scope["path"] in OPENAI_ENDPOINTS)  # in the path's shape
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
        if not self.door.loaded:
            return await _refuse(send, 503, "the policy is not loaded yet", retry_after=True)
        if self.door.saturated:
            return await _refuse(send, 503, f"overloaded: all {self.door.capacity} slots are taken", retry_after=True)
        self.door.in_flight += 1
        try:
            await self._run(scope, bytes(body), receive, send, exchange)
        finally:
            self.door.in_flight -= 1

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


async def refuse(send, status: int, message: str, *, openai: bool = False, retry_after: bool = False, close: bool = False) -> None:
    """A JSON ``ErrorResponse`` (``openai``: OpenAI's error shape). Sent to a client that hung up (499) it
    goes nowhere, but it ends the exchange for BentoML's middleware (its timeout would hold the request's
    task for the full timeout)."""
    body = JSONResponse(openai_api.error_body(status, message) if openai else {"error": message}).body
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    if close:  # the rest of the body is never read: the connection cannot serve another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def invalid_request(title: str, field_name: str, message: str) -> ValidationError:
    """A 400 naming ``field_name`` in the shape of pydantic's own (BentoML answers a ValidationError so)."""
    error = PydanticCustomError("request_cost", "{message}", {"message": message})
    return ValidationError.from_exception_data(title, [InitErrorDetails(type=error, loc=(field_name,), input=None)])


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


def die_with_parent() -> None:
    """Have Linux send this worker SIGTERM when ``bentoml serve`` (its parent) dies, so a killed server
    leaves no worker holding its port (BentoML starts each worker in a process group of its own)."""
    if not sys.platform.startswith("linux"):
        return
    parent, pr_set_pdeathsig = os.getppid(), 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


# ---- rollout jobs -------------------------------------------------------------------------------


@dataclass(eq=False)
class RolloutJob:
    """One prompt of a request, queued for the model thread as its share of a generation pass;
    ``cancelled`` stops its rows, ``on_tokens`` (a streaming request's) sees them as they are sampled."""

    prompt_ids: tuple[int, ...]
    num_samples: int
    temperatures: tuple[float, ...]
    max_new_tokens: int
    top_p: float
    kv_cache_bytes: int
    stop_at_final_answer: bool = True  # /generate and /solve stop after the '#### <number>' line; /v1 does not
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # the client's: its sampled rows get an engine call of their own
    on_tokens: Callable[[list[tuple[int, int]]], None] | None = None  # (sample, token) pairs of each decode step
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: Future = field(default_factory=Future)

    def sampling_key(self) -> tuple:
        """Jobs with equal keys share one engine call; a seeded sampling job shares it with no one, so
        its draws do not depend on its neighbours."""
        own = self if self.seed is not None and any(t > 0 for t in self.temperatures) else None
        return (self.num_samples, self.temperatures, self.max_new_tokens, self.top_p, self.stop_at_final_answer, self.stop_strings, own)


@dataclass
class RolloutResult:
    texts: list[str]
    finish_reasons: list[str]
    completion_tokens: list[int]
    generation_s: float  # the engine call that produced these rollouts
    batch_requests: int  # requests in the generation pass
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)


class CostFields(NamedTuple):
    """The request fields a 400 on its cost names."""

    title: str  # the request model
    prompt: str
    rows: str
    new_tokens: str
    templated: bool  # the prompt is counted in the chat template


@dataclass(frozen=True)
class OpenAIReply:
    """Who a /v1 answer is: its kind, id, time and model, and the request it answers."""

    chat: bool
    response_id: str
    created: int
    model: str
    body: ChatCompletionRequest | CompletionRequest
    prompt_tokens: int


class StreamTimedOut(Exception):
    """A stream past the request timeout (recorded as 504, told to the client in its last event)."""

    error_code = HTTPStatus.GATEWAY_TIMEOUT


def kv_cache_bytes_per_token(config, dtype) -> int:
    """Keys and values one token of one row holds in the cache: layers x 2 x KV heads x head dim x dtype size."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


@bentoml.service(
    name="rlvr_policy",
    workers=1,  # one copy of the policy per replica; scale with replicas (deploy/k8s/bento-hpa.yaml)
    traffic={"timeout": REQUEST_TIMEOUT_S},  # concurrency is RequestGuard's: past the body, public requests only
)
class RlvrPolicy:
    policy = bentoml.models.BentoModel(ARGS.model_tag)

    def __init__(self) -> None:
        stored = self.policy
        self.model_tag = str(stored.tag)
        self.model_version = stored.info.labels.get(MODEL_VERSION_LABEL) or str(stored.tag.version)
        self.model_names = {self.model_version, self.model_tag, MODEL_NAME}  # what /v1 requests may call it
        self.created = int(stored.info.creation_time.timestamp())
        self.batching = batching_enabled()
        self.kv_cache_budget_bytes = int(os.environ.get("RLVR_KV_CACHE_BUDGET_MIB", DEFAULT_KV_CACHE_BUDGET_MIB)) * 2**20
        self.traffic = TrafficLog(Settings.from_env(require_absolute=True).traffic_dir, max_bytes=TRAFFIC_MAX_BYTES)
        self.rewards = RewardPool(workers=2, timeout_s=REWARD_TIMEOUT_S)
        self.model = self.tokenizer = self.prompt_tokenizer = None
        self.context_tokens: int | None = None
        self.kv_bytes_per_token = self.vocab_size = 0
        self._seeds = itertools.count(int(os.environ.get("RLVR_SEED", "0")))
        self._queue: deque[RolloutJob] = deque()
        self._queued = threading.Condition()
        self._load_error: BaseException | None = None
        die_with_parent()
        threading.Thread(target=self._serve_model, args=(stored.path,), name="rlvr-policy", daemon=True).start()
        logger.info(
            "rlvr_policy: model %s (version %s), batching %s, KV-cache budget %d MiB, traffic log %s",
            self.model_tag,
            self.model_version,
            "on" if self.batching else "off",
            self.kv_cache_budget_bytes // 2**20,
            self.traffic.folder,
        )

    def __is_ready__(self) -> bool:
        return DOOR.loaded and not DOOR.saturated

    def __is_alive__(self) -> bool:
        return self._load_error is None

    @bentoml.on_shutdown
    def close(self) -> None:
        self.rewards.close()

    # ---- public endpoints -------------------------------------------------------------------

    @bentoml.api(route="/generate")
    async def generate(self, request: GenerateRequest, /) -> GenerateResponse:
        """Sample ``num_rollouts`` completions; with ``ground_truth``, grade each with ``reward``."""
        started, request_id = time.perf_counter(), uuid.uuid4().hex
        temperatures = request.temperatures()
        prompt = self._rendered("GenerateRequest", "prompt", request.prompt)
        (job,) = self._priced_jobs(
            CostFields("GenerateRequest", "prompt", "num_rollouts", "max_new_tokens", True),
            [prompt],
            request.num_rollouts,
            request.max_new_tokens,
            temperatures=tuple(temperatures),
            top_p=request.top_p,
        )
        record = {"endpoint": "/generate", "prompt": request.prompt, "params": request.model_dump(exclude={"prompt", "ground_truth"})}
        async with self._traffic_record(request_id, started, record):
            result = await self._rollouts(job)
            answers = [self._answer(text) for text in result.texts]
            answer, vote_share = majority_vote(answers)
            reference = request.reference()
            rewards = None
            if reference is not None:
                rewards = await asyncio.to_thread(self._score, request.reward, result.texts, reference)
                best = max(range(len(rewards)), key=lambda i: (rewards[i], -i))
                for value in rewards:
                    REWARD.observe(value)
            else:
                best = answers.index(answer) if answer is not None else 0
            if len(answers) > 1:
                VOTE_SHARE.observe(vote_share)
            response = GenerateResponse(
                request_id=request_id,
                model_version=self.model_version,
                rollouts=[
                    Rollout(
                        text=text,
                        answer=a,
                        reward=None if rewards is None else rewards[i],
                        finish_reason=result.finish_reasons[i],
                        completion_tokens=result.completion_tokens[i],
                        temperature=temperatures[i],
                    )
                    for i, (text, a) in enumerate(zip(result.texts, answers))
                ],
                best_index=best,
                best_response=result.texts[best],
                best_reward=None if rewards is None else rewards[best],
                mean_reward=None if rewards is None else sum(rewards) / len(rewards),
                reward=None if rewards is None else request.reward,
                answer=answer,
                vote_share=vote_share,
            )
            record.update(
                _generation_fields(result),
                answers=answers,
                answer=answer,
                vote_share=vote_share,
                ground_truth=None if reference is None else reference["answer_text"],
                rewards=rewards,
                best_reward=response.best_reward,
                mean_reward=response.mean_reward,
            )
        return response

    @bentoml.api(route="/solve")
    async def solve(self, request: SolveRequest, /) -> SolveResponse:
        """Answer a math word problem by majority vote over ``k`` samples (greedy when k = 1)."""
        started, request_id = time.perf_counter(), uuid.uuid4().hex
        question = self._rendered("SolveRequest", "question", request.question)
        (job,) = self._priced_jobs(
            CostFields("SolveRequest", "question", "k", "max_new_tokens", True),
            [question],
            request.k,
            request.max_new_tokens,
            temperatures=tuple(request.temperatures()),
            top_p=1.0,
        )
        record = {"endpoint": "/solve", "prompt": request.question, "params": request.model_dump(exclude={"question"})}
        async with self._traffic_record(request_id, started, record):
            result = await self._rollouts(job)
            answers = [self._answer(text) for text in result.texts]
            answer, vote_share = majority_vote(answers)
            winner = answers.index(answer) if answer is not None else 0
            if request.k > 1:
                VOTE_SHARE.observe(vote_share)
            response = SolveResponse(
                request_id=request_id,
                model_version=self.model_version,
                answer=answer,
                vote_share=vote_share,
                reasoning=result.texts[winner],
                answers=answers,
                k=request.k,
            )
            record.update(_generation_fields(result), answers=answers, answer=answer, vote_share=vote_share)
        return response

    # ---- the OpenAI-compatible API (/v1): the same way in, pricing, batching, cancellation and logs --

    def openai_models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=self.model_version, created=self.created, owned_by="rlvr-ops", root=self.model_tag, max_model_len=self.context_tokens)]
        )

    async def openai_completions(self, request: Request, chat: bool) -> Response:
        """``POST /v1/chat/completions`` (``chat``) or ``/v1/completions``: validated and priced before any
        work (400 naming the field, in OpenAI's error shape), one rollout job per prompt batched with all
        others, stopped when the client hangs up or its time runs out, logged in the traffic log."""
        started, endpoint = time.perf_counter(), request.url.path
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        schema = ChatCompletionRequest if chat else CompletionRequest
        try:
            body = schema.model_validate_json(await request.body())
            if body.model is not None and body.model not in self.model_names:
                return self._openai_refusal(
                    endpoint,
                    404,
                    f"the model `{body.model}` does not exist: this server serves `{self.model_version}` (GET /v1/models)",
                    "model",
                    "model_not_found",
                )
            prompts = self._openai_prompts(body, chat)
            max_tokens = body.new_tokens() if chat else body.max_tokens
            rows = "n" if body.n > 1 or len(prompts) == 1 else "prompt"
            if len(prompts) * body.n > MAX_SAMPLES:
                raise invalid_request(schema.__name__, rows, f"prompts x n = {len(prompts)} x {body.n}; at most {MAX_SAMPLES} choices per request")
            if len(prompts) * body.n * max_tokens > MAX_COMPLETION_TOKENS:
                raise invalid_request(
                    schema.__name__,
                    "max_tokens",
                    f"prompts x n x max_tokens = {len(prompts)} x {body.n} x {max_tokens}; at most {MAX_COMPLETION_TOKENS} completion tokens",
                )
            jobs = self._priced_jobs(
                CostFields(schema.__name__, "messages" if chat else "prompt", rows, "max_tokens", chat),
                prompts,
                body.n,
                max_tokens,
                temperatures=(body.temperature,),
                top_p=body.top_p,
                stop_at_final_answer=False,
                stop_strings=tuple(body.stop),
                seed=body.seed,
            )
        except ValidationError as err:
            return self._openai_refusal(endpoint, 400, *openai_api.invalid(err))
        record = {"endpoint": endpoint, "params": body.model_dump(exclude={"messages", "prompt"}, mode="json")}
        if chat:  # the traffic log's prompt: the question, as /solve logs it
            users = [m.content for m in body.messages if m.role == "user"]
            record.update(prompt=users[-1] if users else "", messages=[m.model_dump() for m in body.messages])
        else:
            shown = body.prompt if isinstance(body.prompt[0], str) else self.prompt_tokenizer.batch_decode(prompts)
            record.update(prompt=shown[0], **({"prompts": shown} if len(shown) > 1 else {}))
        reply = OpenAIReply(chat, response_id, int(time.time()), self.model_version, body, prompt_tokens=sum(len(ids) for ids in prompts))
        if body.stream:
            return openai_api.EventStream(self._openai_stream(reply, jobs, started, record))
        async with self._traffic_record(response_id, started, record):
            results = await asyncio.gather(*(self._rollouts(job) for job in jobs))
            response = self._openai_response(reply, results, record)
        return JSONResponse(response.model_dump(mode="json"))

    def _openai_prompts(self, body, chat: bool) -> list[list[int]]:
        """The request's prompts as token ids: the chat messages rendered by ``render_messages`` (a 400
        naming the message that holds control tokens), or the completions' prompts as they are."""
        if chat:
            try:
                rendered = render_messages(self.prompt_tokenizer, [m.model_dump() for m in body.messages])
            except ControlTokensError as err:
                raise invalid_request("ChatCompletionRequest", err.field, str(err)) from None
            return [self.prompt_tokenizer(rendered, add_special_tokens=False).input_ids]
        if isinstance(body.prompt[0], str):
            return self.prompt_tokenizer(body.prompt, add_special_tokens=False).input_ids
        return body.prompt

    def _openai_response(self, reply: OpenAIReply, results: list[RolloutResult], record: dict):
        """The whole answer, its choices in order (prompt index x n + sample index), and the traffic record's
        generation fields (texts as the client got them)."""
        texts, reasons, tokens, choices = [], [], [], []
        for result in results:
            for text, engine_reason, ids, logprobs in zip(result.texts, result.finish_reasons, result.token_ids, result.logprobs):
                text, stopped = openai_api.cut_at_stop(text, reply.body.stop)
                reason = openai_api.finish_reason(engine_reason, stopped)
                index = len(choices)
                if reply.chat:
                    choices.append(
                        ChatChoice(
                            index=index,
                            message=AssistantMessage(content=text),
                            finish_reason=reason,
                            logprobs=openai_api.chat_logprobs(self._token_texts(ids), logprobs) if reply.body.logprobs else None,
                        )
                    )
                else:
                    choices.append(
                        CompletionChoice(
                            index=index,
                            text=text,
                            finish_reason=reason,
                            logprobs=openai_api.completion_logprobs(self._token_texts(ids), logprobs) if reply.body.logprobs is not None else None,
                        )
                    )
                texts.append(text)
                reasons.append(reason)
                tokens.append(len(ids))
        used = openai_api.usage(reply.prompt_tokens, sum(tokens))
        merged = RolloutResult(
            texts=texts,
            finish_reasons=reasons,
            completion_tokens=tokens,
            generation_s=max(r.generation_s for r in results),
            batch_requests=max(r.batch_requests for r in results),
        )
        answers = [self._answer(text) for text in texts]
        answer, vote_share = majority_vote(answers)
        record.update(_generation_fields(merged), answers=answers, answer=answer, vote_share=vote_share, usage=used.model_dump())
        response_type = ChatCompletion if reply.chat else Completion
        return response_type(id=reply.response_id, created=reply.created, model=reply.model, choices=choices, usage=used)

    async def _openai_stream(self, reply: OpenAIReply, jobs: list[RolloutJob], started: float, record: dict) -> AsyncIterator[bytes]:
        """Server-sent events: each choice's text as its tokens are sampled (held back while it could still
        become a stop string), its finish reason, the usage when asked, ``[DONE]``. A stream past the request
        timeout ends with an error event (504 in the log and the metrics)."""
        loop, arrived = asyncio.get_running_loop(), asyncio.Queue()
        n = reply.body.n
        streams = [openai_api.TextStream(self._decode, reply.body.stop) for _ in range(len(jobs) * n)]
        for i, job in enumerate(jobs):
            job.on_tokens = lambda pairs, i=i: loop.call_soon_threadsafe(arrived.put_nowait, (i, pairs))
        deadline = started + request_timeout_s()
        say = functools.partial(openai_api.chunk, reply.chat, reply.response_id, reply.created, reply.model)
        try:
            async with self._traffic_record(reply.response_id, started, record):
                generation = asyncio.gather(*(self._rollouts(job) for job in jobs))
                generation.add_done_callback(lambda _: arrived.put_nowait(None))
                try:
                    if reply.chat:
                        for index in range(len(streams)):
                            yield openai_api.sse(say(index, role=True))
                    finished = False
                    while not finished:
                        try:
                            items = [await asyncio.wait_for(arrived.get(), deadline - time.perf_counter())]
                        except TimeoutError:
                            raise StreamTimedOut("timed out (the service's request timeout)") from None
                        while not arrived.empty():
                            items.append(arrived.get_nowait())
                        new: dict[int, list[int]] = {}
                        for item in items:
                            if item is None:
                                finished = True
                                continue
                            for sample, token in item[1]:
                                new.setdefault(item[0] * n + sample, []).append(token)
                        for index, tokens in new.items():
                            if delta := streams[index].add(tokens):
                                yield openai_api.sse(say(index, text=delta))
                    results = generation.result()
                finally:
                    generation.cancel()
                response = self._openai_response(reply, results, record)
                for choice, stream in zip(response.choices, streams):
                    text = choice.message.content if reply.chat else choice.text
                    rest = stream.finish(text)
                    yield openai_api.sse(say(choice.index, text=rest or None, finish=choice.finish_reason))
                if reply.body.include_usage():
                    yield openai_api.sse(openai_api.usage_chunk(reply.chat, reply.response_id, reply.created, reply.model, response.usage))
        except Exception as err:  # noqa: BLE001 - the response has begun: the error is its last event
            status = getattr(getattr(err, "error_code", None), "value", 500)
            if status == 500:
                logger.exception("rlvr_policy: a streamed %s request failed", record["endpoint"])
            if (exchange := EXCHANGE.get(None)) is not None:
                exchange.status = status
            yield openai_api.sse(openai_api.error_body(status, str(err) if status != 500 else "generation failed"))
        yield openai_api.SSE_DONE

    def _openai_refusal(self, endpoint: str, status: int, message: str, param: str | None, code: str | None):
        logger.info("%d on %s: %s", status, endpoint, message[:300])
        return openai_api.error_response(status, message, param, code)

    def _decode(self, token_ids: list[int]) -> str:
        """Completion text as the engine decodes it (special tokens skipped)."""
        return self.prompt_tokenizer.decode(token_ids, skip_special_tokens=True)

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (as vLLM's log-probs show them)."""
        return self.prompt_tokenizer.batch_decode([[t] for t in token_ids])

    # ---- admission by cost, batching ----------------------------------------------------------

    def _rendered(self, title: str, text_field: str, question: str) -> list[int]:
        """The question in the training prompt, as token ids; a 400 naming the field when the prompt
        builder refuses it (control tokens)."""
        try:
            prompt = render_prompt(self.prompt_tokenizer, question)
        except ValueError as err:
            raise invalid_request(title, text_field, f"{text_field} refused by the prompt builder: {err}") from None
        return self.prompt_tokenizer(prompt, add_special_tokens=False).input_ids

    def _priced_jobs(self, names: CostFields, prompts: list[list[int]], rows: int, max_new_tokens: int, **sampling) -> list[RolloutJob]:
        """One rollout job per prompt once the request's cost on the loaded model fits; else a 400 naming
        the field: each prompt within ``MAX_PROMPT_TOKENS`` and, with its new tokens, the model's context;
        the KV cache of all the request's rows within the budget."""
        title, where = names.title, " in the chat template" if names.templated else ""
        for ids in prompts:
            tokens = len(ids)
            if tokens > MAX_PROMPT_TOKENS:
                raise invalid_request(title, names.prompt, f"{names.prompt} is {tokens} tokens{where}; at most {MAX_PROMPT_TOKENS}")
            if self.context_tokens is not None and tokens + max_new_tokens > self.context_tokens:
                raise invalid_request(
                    title,
                    names.new_tokens,
                    f"{names.prompt} ({tokens} tokens{where}) + {names.new_tokens} "
                    f"({max_new_tokens}) is over the model's context of {self.context_tokens} tokens",
                )
            if max(ids) >= self.vocab_size:
                raise invalid_request(title, names.prompt, f"{names.prompt} holds token id {max(ids)}, outside the model's vocabulary of {self.vocab_size}")
        kv_bytes = [rows * (len(ids) + max_new_tokens) * self.kv_bytes_per_token for ids in prompts]
        if sum(kv_bytes) > self.kv_cache_budget_bytes:
            tokens = " + ".join(str(len(ids)) for ids in prompts)
            raise invalid_request(
                title,
                names.rows,
                f"{names.rows} x ({names.prompt} + {names.new_tokens}) = {rows} x ({tokens} + "
                f"{max_new_tokens}) tokens: a KV cache of {sum(kv_bytes) / 2**20:.1f} MiB, over the "
                f"budget of {self.kv_cache_budget_bytes / 2**20:.0f} MiB",
            )
        return [
            RolloutJob(prompt_ids=tuple(ids), num_samples=rows, max_new_tokens=max_new_tokens, kv_cache_bytes=kv, **sampling)
            for ids, kv in zip(prompts, kv_bytes)
        ]

    async def _rollouts(self, job: RolloutJob) -> RolloutResult:
        """Queue the job for the model thread and wait for it; a caller that gives up (its client hung
        up, its time ran out) stops the job's rows at the next decode step."""
        with self._queued:
            self._queue.append(job)
            self._queued.notify()
        try:
            return await asyncio.wrap_future(job.result)
        except asyncio.CancelledError:
            job.cancelled.set()
            job.result.cancel()
            raise

    def _serve_model(self, path: str) -> None:
        """The model thread: load the policy, warm it up (one short greedy generation), open the door,
        then run generation passes for as long as the process lives."""
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model, self.tokenizer = load_policy(path, device, torch.bfloat16 if device == "cuda" else None)
            self.model.eval().requires_grad_(False)  # frozen: every pass reuses one packed copy of its weights
            self.prompt_tokenizer = load_tokenizer(path)  # the event loop's own: pricing never shares the model's
            self.context_tokens = getattr(self.model.config, "max_position_embeddings", None)
            self.kv_bytes_per_token = kv_cache_bytes_per_token(self.model.config, self.model.dtype)
            self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
            warm_up = RolloutJob(
                prompt_ids=tuple(self._rendered("warm-up", "question", WARM_UP_QUESTION)),
                num_samples=1,
                temperatures=(0.0,),
                max_new_tokens=4,
                top_p=1.0,
                kv_cache_bytes=0,
            )
            self._generate([warm_up], observe=False)
            DOOR.loaded = True
            logger.info("rlvr_policy: %s loaded on %s and warmed up", self.model_tag, device)
        except BaseException as err:
            self._load_error = err
            logger.exception("rlvr_policy: loading %s failed", self.model_tag)
            return
        while True:
            jobs = self._next_pass()
            try:
                results = self._generate(jobs)
            except Exception as err:  # noqa: BLE001 - each request of the pass gets its 500
                logger.exception("rlvr_policy: a generation pass of %d requests failed", len(jobs))
                for job in jobs:
                    job.result.set_exception(err)
            else:
                for job, result in zip(jobs, results):
                    job.result.set_result(result)

    def _next_pass(self) -> list[RolloutJob]:
        """The oldest queued jobs, up to ``MAX_BATCH_REQUESTS`` (1 without batching) whose KV caches fit
        the budget together; jobs whose callers gave up are dropped."""
        limit = MAX_BATCH_REQUESTS if self.batching else 1
        jobs, kv_bytes = [], 0
        with self._queued:
            while not jobs:
                self._queued.wait_for(lambda: self._queue)
                while self._queue and len(jobs) < limit and (not jobs or kv_bytes + self._queue[0].kv_cache_bytes <= self.kv_cache_budget_bytes):
                    job = self._queue.popleft()
                    if job.result.set_running_or_notify_cancel():
                        jobs.append(job)
                        kv_bytes += job.kv_cache_bytes
        return jobs

    def _generate(self, jobs: list[RolloutJob], observe: bool = True) -> list[RolloutResult]:
        """One generation pass over a batch of jobs: jobs with equal sampling settings share one engine call."""
        groups: dict[tuple, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.sampling_key(), []).append(i)
        results: list[RolloutResult | None] = [None] * len(jobs)
        for (num_samples, temperatures, max_new_tokens, top_p, at_answer, stop, own), members in groups.items():
            config = SamplingConfig(
                max_new_tokens=max_new_tokens,
                temperatures=list(temperatures),
                top_p=top_p,
                seed=own.seed if own is not None else next(self._seeds),
                max_batch_rows=MAX_BATCH_ROWS,
                stop_at_final_answer=at_answer,
                stop_strings=stop,
                should_stop=lambda p, members=members: jobs[members[p]].cancelled.is_set(),
                on_tokens=_token_router([jobs[i].on_tokens for i in members], num_samples),
            )
            started = time.perf_counter()
            rollouts = generate_rollouts(self.model, self.tokenizer, [list(jobs[i].prompt_ids) for i in members], num_samples, config)
            elapsed = time.perf_counter() - started
            if observe:
                GENERATION_SECONDS.observe(elapsed)
                cancelled = rollouts.finish_reasons.count("cancelled")
                ROLLOUTS_GENERATED.inc(len(rollouts) - cancelled)
                ROLLOUTS_CANCELLED.inc(cancelled)
            lengths = rollouts.completion_lengths.tolist()
            token_ids = rollouts.completion_token_lists()
            for n, i in enumerate(members):
                rows = range(n * num_samples, (n + 1) * num_samples)
                results[i] = RolloutResult(
                    texts=[rollouts.texts[r] for r in rows],
                    finish_reasons=[rollouts.finish_reasons[r] for r in rows],
                    completion_tokens=[int(lengths[r]) for r in rows],
                    generation_s=elapsed,
                    batch_requests=len(jobs),
                    token_ids=[token_ids[r] for r in rows],
                    logprobs=[rollouts.logprobs[r, : lengths[r]].tolist() for r in rows],
                )
        if observe:
            PASS_REQUESTS.observe(len(jobs))
        return results

    # ---- answers, rewards, traffic -----------------------------------------------------------

    @staticmethod
    def _answer(text: str) -> str | None:
        found = extract_final_answer(text, EXTRACTION_MODE)
        return found.text if found else None

    def _score(self, reward: str, texts: list[str], reference: dict) -> list[float]:
        """Each completion's reward; a failing or slow reward scores 0 (``RewardPool`` contains it)."""
        scored = self.rewards.score_batch(SERVED_REWARDS[reward], texts, [reference] * len(texts))
        return [row["total"].value for row in scored]

    @contextlib.asynccontextmanager
    async def _traffic_record(self, request_id: str, started: float, record: dict):
        """Append the request's traffic record on exit: the status its client got (200; 499 when it hung
        up; 504 when its time ran out; the error's) and, when not 200, why."""
        received_at, status, why = datetime.now(timezone.utc), 200, None
        try:
            yield record
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: a stream closed by its response
            status, why = cancelled_status()
            raise
        except BaseException as err:
            status = getattr(getattr(err, "error_code", None), "value", 500)
            why = f"{type(err).__name__}: {err}"[:500]
            raise
        finally:
            entry = {
                "timestamp": received_at.isoformat(timespec="milliseconds"),
                "request_id": request_id,
                "model_version": self.model_version,
                "model_tag": self.model_tag,
                **record,
                "status": status,
                "latency_s": round(time.perf_counter() - started, 4),
                "batching": self.batching,
            }
            if why is not None:
                entry["error"] = why
            self._append_traffic(entry)

    def _append_traffic(self, entry: dict) -> None:
        """Append to the traffic log; a failed write (e.g. a full disk) must not fail the request."""
        try:
            self.traffic.append(entry)
        except OSError:
            logger.exception("rlvr_policy: could not append to the traffic log in %s", self.traffic.folder)


def _token_router(sinks: list, num_samples: int):
    """The engine's ``on_tokens`` for one call: each step's (row, token) pairs to their prompt's sink as
    (sample, token) pairs; None when no prompt of the call streams."""
    if not any(sinks):
        return None

    def route(rows: list[int], tokens: list[int]) -> None:
        by_prompt: dict[int, list[tuple[int, int]]] = {}
        for row, token in zip(rows, tokens):
            if sinks[row // num_samples] is not None:
                by_prompt.setdefault(row // num_samples, []).append((row % num_samples, token))
        for prompt, pairs in by_prompt.items():
            sinks[prompt](pairs)

    return route


def _generation_fields(result: RolloutResult) -> dict:
    return {
        "completions": result.texts,
        "finish_reasons": result.finish_reasons,
        "completion_tokens": result.completion_tokens,
        "generation_s": round(result.generation_s, 4),
        "batch_requests": result.batch_requests,
    }


@functools.cache
def _openapi() -> dict:
    return openapi_document(RlvrPolicy.name, ARGS.model_tag, (__doc__ or "").split("\n\n")[0])


async def _openapi_view(_request) -> JSONResponse:
    return JSONResponse(_openapi())


async def _models_view(_request) -> JSONResponse:
    return JSONResponse(bentoml.get_current_service().openai_models().model_dump())


async def _chat_view(request: Request) -> Response:
    return await bentoml.get_current_service().openai_completions(request, chat=True)


async def _completions_view(request: Request) -> Response:
    return await bentoml.get_current_service().openai_completions(request, chat=False)


RlvrPolicy.add_asgi_middleware(RequestGuard, door=DOOR)
# Matched before BentoML's own /docs.json, which flattens every union to its first member (OpenAPI 3.0).
# The /v1 routes are plain Starlette ones: BentoML's API layer would answer 400s in its own shape.
RlvrPolicy.mount_asgi_app(
    Starlette(
        routes=[
            Route("/docs.json", _openapi_view),
            Route("/v1/models", _models_view),
            Route("/v1/chat/completions", _chat_view, methods=["POST"]),
            Route("/v1/completions", _completions_view, methods=["POST"]),
        ]
    ),
    path="/",
)
