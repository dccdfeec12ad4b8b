"""``RlvrPolicy``: the trained policy as a BentoML service that holds under hostile clients.

* ``POST /generate``: ``num_rollouts`` rollouts of one prompt, each with its extracted answer and,
  given ``ground_truth``, its verifiable reward; the best rollout, mean reward, majority answer.
* ``POST /solve``: self-consistency (Wang et al. 2022): k samples, majority vote of their final
  answers, the vote share as confidence; k = 1 is one greedy decode.
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

Every request that reached generation is appended to the JSONL traffic log in
``Settings.traffic_dir`` (``$RLVR_TRAFFIC_DIR``, else ``$RLVR_HOME/traffic``; absolute paths), with
the status its client got and, when it failed, why; the drift monitoring reads it with
``rlvr.traffic.read_traffic``.
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

import bentoml
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from bentos import MODEL_NAME, MODEL_VERSION_LABEL
from bentos.schemas import (
    BODY_TIMEOUT_S,
    DEFAULT_KV_CACHE_BUDGET_MIB,
    EXTRACTION_MODE,
    MAX_BODY_BYTES,
    MAX_PROMPT_TOKENS,
    SERVED_REWARDS,
    GenerateRequest,
    GenerateResponse,
    Rollout,
    SolveRequest,
    SolveResponse,
    openapi_document,
)
from rlvr.answers import extract_final_answer
from rlvr.evaluation import majority_vote
from rlvr.policy import load_policy, load_tokenizer
from rlvr.prompts import render_prompt
from rlvr.rewards import RewardPool
from rlvr.rollout import SamplingConfig, generate_rollouts
from rlvr.settings import Settings
from rlvr.traffic import TrafficLog

logger = logging.getLogger("bentoml.rlvr_policy")

PUBLIC_ENDPOINTS = ("/generate", "/solve")
REQUEST_TIMEOUT_S = 300  # the whole request, queueing included: BentoML answers 504 and we stop its rows
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
    documentation="Requests to /generate and /solve by endpoint and the HTTP status their client received "
                  "(every refusal included; 499: the client hung up before its answer)",
    labelnames=["endpoint", "status"],
)
ROLLOUTS_GENERATED = Counter(
    name="rlvr_rollouts_generated_total", documentation="Completions generated by the policy"
)
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


class RequestGuard:
    """ASGI middleware on the public endpoints: the way in (module docstring), each refusal a JSON
    ``ErrorResponse``; every request counted in ``rlvr_requests_total`` with the status its client got."""

    def __init__(self, app, door: Door, endpoints: tuple[str, ...] = PUBLIC_ENDPOINTS,
                 max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.door, self.endpoints = app, door, endpoints
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.endpoints:
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
        headers = dict(scope["headers"])
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            return await _refuse(send, 415, f"Content-Type: {media_type.decode('latin-1') or 'none'}; "
                                            "send the body as application/json")
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await _refuse(send, 413, f"request body: larger than {self.max_body_bytes} bytes", close=True)
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        exchange.client_gone = True
                        return await _refuse(send, CLIENT_GONE, "client disconnected")
                    body += message.get("body", b"")
                    if len(body) > self.max_body_bytes:  # a chunked body without Content-Length
                        return await _refuse(send, 413, f"request body: larger than {self.max_body_bytes} bytes",
                                             close=True)
                    more = message.get("more_body", False)
        except TimeoutError:
            return await _refuse(send, 408, f"request body: not received within {self.body_timeout_s:g} s",
                                 close=True)
        if not self.door.loaded:
            return await _refuse(send, 503, "the policy is not loaded yet", retry_after=True)
        if self.door.saturated:
            return await _refuse(send, 503, f"overloaded: all {self.door.capacity} slots are taken",
                                 retry_after=True)
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
            await asyncio.wait({app, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not app.done():
                exchange.client_gone = True  # before the cancellation, so the handler can say why
                hung_up.set()
                app.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await app
                if exchange.status is None:
                    await _refuse(send, CLIENT_GONE, "client disconnected")
            else:
                app.result()
        finally:
            watcher.cancel()
            app.cancel()  # a no-op once done; when this request timed out it stops the handler


async def _refuse(send, status: int, message: str, *, retry_after: bool = False, close: bool = False) -> None:
    """A JSON ``ErrorResponse``. Sent to a client that hung up (499) it goes nowhere, but it ends the
    exchange for BentoML's middleware (its timeout would hold the request's task for the full timeout)."""
    body = JSONResponse({"error": message}).body
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
    one INFO line naming its fields (16,000 rejected requests made a 37 MB log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ValidationError):
            fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
                               for e in error.errors(include_url=False, include_input=False, include_context=False))
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
    """One request's share of a generation pass, queued for the model thread; ``cancelled`` stops its rows."""

    prompt: str  # rendered with the chat template
    num_samples: int
    temperatures: tuple[float, ...]
    max_new_tokens: int
    top_p: float
    kv_cache_bytes: int
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: Future = field(default_factory=Future)

    def sampling_key(self) -> tuple:
        return (self.num_samples, self.temperatures, self.max_new_tokens, self.top_p)


@dataclass
class RolloutResult:
    texts: list[str]
    finish_reasons: list[str]
    completion_tokens: list[int]
    generation_s: float  # the engine call that produced these rollouts
    batch_requests: int  # requests in the generation pass


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
        self.batching = batching_enabled()
        self.kv_cache_budget_bytes = int(os.environ.get("RLVR_KV_CACHE_BUDGET_MIB", DEFAULT_KV_CACHE_BUDGET_MIB)) * 2**20
        self.traffic = TrafficLog(Settings.from_env(require_absolute=True).traffic_dir, max_bytes=TRAFFIC_MAX_BYTES)
        self.rewards = RewardPool(workers=2, timeout_s=REWARD_TIMEOUT_S)
        self.model = self.tokenizer = self.prompt_tokenizer = None
        self.context_tokens: int | None = None
        self.kv_bytes_per_token = 0
        self._seeds = itertools.count(int(os.environ.get("RLVR_SEED", "0")))
        self._queue: deque[RolloutJob] = deque()
        self._queued = threading.Condition()
        self._load_error: BaseException | None = None
        die_with_parent()
        threading.Thread(target=self._serve_model, args=(stored.path,), name="rlvr-policy", daemon=True).start()
        logger.info("rlvr_policy: model %s (version %s), batching %s, KV-cache budget %d MiB, traffic log %s",
                    self.model_tag, self.model_version, "on" if self.batching else "off",
                    self.kv_cache_budget_bytes // 2**20, self.traffic.folder)

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
        job = self._priced_job("GenerateRequest", "prompt", request.prompt, "num_rollouts", request.num_rollouts,
                               temperatures, request.max_new_tokens, request.top_p)
        record = {"endpoint": "/generate", "prompt": request.prompt,
                  "params": request.model_dump(exclude={"prompt", "ground_truth"})}
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
                    Rollout(text=text, answer=a, reward=None if rewards is None else rewards[i],
                            finish_reason=result.finish_reasons[i], completion_tokens=result.completion_tokens[i],
                            temperature=temperatures[i])
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
            record.update(_generation_fields(result), answers=answers, answer=answer, vote_share=vote_share,
                          ground_truth=None if reference is None else reference["answer_text"],
                          rewards=rewards, best_reward=response.best_reward, mean_reward=response.mean_reward)
        return response

    @bentoml.api(route="/solve")
    async def solve(self, request: SolveRequest, /) -> SolveResponse:
        """Answer a math word problem by majority vote over ``k`` samples (greedy when k = 1)."""
        started, request_id = time.perf_counter(), uuid.uuid4().hex
        job = self._priced_job("SolveRequest", "question", request.question, "k", request.k, request.temperatures(),
                               request.max_new_tokens, 1.0)
        record = {"endpoint": "/solve", "prompt": request.question,
                  "params": request.model_dump(exclude={"question"})}
        async with self._traffic_record(request_id, started, record):
            result = await self._rollouts(job)
            answers = [self._answer(text) for text in result.texts]
            answer, vote_share = majority_vote(answers)
            winner = answers.index(answer) if answer is not None else 0
            if request.k > 1:
                VOTE_SHARE.observe(vote_share)
            response = SolveResponse(request_id=request_id, model_version=self.model_version, answer=answer,
                                     vote_share=vote_share, reasoning=result.texts[winner], answers=answers,
                                     k=request.k)
            record.update(_generation_fields(result), answers=answers, answer=answer, vote_share=vote_share)
        return response

    # ---- admission by cost, batching ----------------------------------------------------------

    def _priced_job(self, title: str, text_field: str, question: str, rows_field: str, rows: int,
                    temperatures: list[float], max_new_tokens: int, top_p: float) -> RolloutJob:
        """The request's rollout job once its cost on the loaded model fits; else a 400 naming the field:
        the question in the chat template within ``MAX_PROMPT_TOKENS`` (control tokens refused), prompt and
        new tokens within the model's context, and the KV cache of its rows within the budget."""
        try:
            prompt = render_prompt(self.prompt_tokenizer, question)
        except ValueError as err:
            raise invalid_request(title, text_field, f"{text_field} refused by the prompt builder: {err}") from None
        tokens = len(self.prompt_tokenizer(prompt, add_special_tokens=False).input_ids)
        if tokens > MAX_PROMPT_TOKENS:
            raise invalid_request(title, text_field, f"{text_field} is {tokens} tokens in the chat template; "
                                                     f"at most {MAX_PROMPT_TOKENS}")
        if self.context_tokens is not None and tokens + max_new_tokens > self.context_tokens:
            raise invalid_request(title, "max_new_tokens",
                                  f"{text_field} ({tokens} tokens in the chat template) + max_new_tokens "
                                  f"({max_new_tokens}) is over the model's context of {self.context_tokens} tokens")
        kv_bytes = rows * (tokens + max_new_tokens) * self.kv_bytes_per_token
        if kv_bytes > self.kv_cache_budget_bytes:
            raise invalid_request(title, rows_field,
                                  f"{rows_field} x ({text_field} + max_new_tokens) = {rows} x ({tokens} + "
                                  f"{max_new_tokens}) tokens: a KV cache of {kv_bytes / 2**20:.1f} MiB, over the "
                                  f"budget of {self.kv_cache_budget_bytes / 2**20:.0f} MiB")
        return RolloutJob(prompt=prompt, num_samples=rows, temperatures=tuple(temperatures),
                          max_new_tokens=max_new_tokens, top_p=top_p, kv_cache_bytes=kv_bytes)

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
            warm_up = RolloutJob(prompt=render_prompt(self.tokenizer, WARM_UP_QUESTION), num_samples=1,
                                 temperatures=(0.0,), max_new_tokens=4, top_p=1.0, kv_cache_bytes=0)
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
                while self._queue and len(jobs) < limit and (
                        not jobs or kv_bytes + self._queue[0].kv_cache_bytes <= self.kv_cache_budget_bytes):
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
        for (num_samples, temperatures, max_new_tokens, top_p), members in groups.items():
            config = SamplingConfig(max_new_tokens=max_new_tokens, temperatures=list(temperatures), top_p=top_p,
                                    seed=next(self._seeds), max_batch_rows=MAX_BATCH_ROWS,
                                    should_stop=lambda p, members=members: jobs[members[p]].cancelled.is_set())
            started = time.perf_counter()
            rollouts = generate_rollouts(self.model, self.tokenizer, [jobs[i].prompt for i in members], num_samples,
                                         config)
            elapsed = time.perf_counter() - started
            if observe:
                GENERATION_SECONDS.observe(elapsed)
                cancelled = rollouts.finish_reasons.count("cancelled")
                ROLLOUTS_GENERATED.inc(len(rollouts) - cancelled)
                ROLLOUTS_CANCELLED.inc(cancelled)
            lengths = rollouts.completion_lengths.tolist()
            for n, i in enumerate(members):
                rows = range(n * num_samples, (n + 1) * num_samples)
                results[i] = RolloutResult(
                    texts=[rollouts.texts[r] for r in rows],
                    finish_reasons=[rollouts.finish_reasons[r] for r in rows],
                    completion_tokens=[int(lengths[r]) for r in rows],
                    generation_s=elapsed,
                    batch_requests=len(jobs),
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
        except asyncio.CancelledError:
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


def _generation_fields(result: RolloutResult) -> dict:
    return {"completions": result.texts, "finish_reasons": result.finish_reasons,
            "completion_tokens": result.completion_tokens, "generation_s": round(result.generation_s, 4),
            "batch_requests": result.batch_requests}


@functools.cache
def _openapi() -> dict:
    return openapi_document(RlvrPolicy.name, ARGS.model_tag, (__doc__ or "").split("\n\n")[0])


async def _openapi_view(_request) -> JSONResponse:
    return JSONResponse(_openapi())


RlvrPolicy.add_asgi_middleware(RequestGuard, door=DOOR)
# Matched before BentoML's own /docs.json, which flattens every union to its first member (OpenAPI 3.0).
RlvrPolicy.mount_asgi_app(Starlette(routes=[Route("/docs.json", _openapi_view)]), path="/")
