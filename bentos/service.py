"""``RlvrPolicy``: the trained policy as a BentoML service that holds under hostile clients.

Routes: ``/generate`` (rollouts of one prompt, with answers and rewards), ``/solve`` (self-consistency,
Wang et al. 2022: a majority vote of k samples), OpenAI's ``/v1`` API and vLLM's tokenizer routes
(``bentos.openai_protocol``), the probes ``/healthz`` and ``/readyz``, ``/metrics`` and ``/docs.json`` (``bentos.openapi``).
Every route but the probes takes an API key (``bentos.api_keys``). The policy comes from the model
store (the ``model_tag`` Bento argument); the native routes render and parse each request with one of
the tasks it records (``rlvr.policy.policy_tasks``): training's prompt builder and the task's parser.
Admission (``bentos.admission``), request cost (``bentos.request_cost``), the engine (``bentos.serving_engine``;
vLLM's, ``bentos.vllm_serving``, by ``$RLVR_ENGINE``) and the traffic log (``bentos.traffic_log``) are modules of their own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
import time
import uuid
from typing import Callable

import bentoml
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from bentos import MODEL_NAME, MODEL_VERSION_LABEL, SERVICE_NAME, header_timeout
from bentos.admission import REQUEST_SLOTS, REQUEST_TIMEOUT_S, FinishesTooLate, RequestGuard
from bentos.api_keys import ACCESS, access_from_env
from bentos.limits import DEFAULT_KV_CACHE_BUDGET_MIB, SERVED_REWARDS
from bentos.metrics import REWARD, VOTE_SHARE
from bentos.native_models import GenerateRequest, GenerateResponse, Rollout, SolveRequest, SolveResponse, ToolCall
from bentos.openai_protocol import ROUTES, OpenAIProtocol
from bentos.openapi import openapi_document
from bentos.request_cost import CostFields, RequestCost, invalid_request
from bentos.serving_engine import ModelCall, RolloutResult, ServingEngine
from bentos.traffic_log import TrafficRecording, generation_fields, note_request
from bentos.vllm_serving import VllmServingEngine
from bentos.vocabulary import Vocabulary
from rlvr.environments.driver import drives_episodes
from rlvr.evaluation import majority_vote
from rlvr.generation import EngineRequest, kv_cache_bytes_per_token
from rlvr.generation.engines import choose_engine
from rlvr.generation.vllm_engine import VllmSettings
from rlvr.monitoring.traffic import TrafficLog, tokens_by_key
from rlvr.policy import load_policy, load_tokenizer, policy_environment, policy_tasks
from rlvr.process_lifetime import die_with_parent
from rlvr.rewards import RewardPool
from rlvr.settings import Settings
from rlvr.tasks import DEFAULT_TASK, Task, get_task

logger = logging.getLogger("bentoml.rlvr_policy")

READY_START_WAIT_S = 5.0  # /readyz is 503 while a new request would wait longer than this to start
REWARD_TIMEOUT_S = 10.0
TRAFFIC_MAX_BYTES = 16 * 2**20
WARM_UP_QUESTION = "What is 2 + 3?"


class ServiceArgs(BaseModel):
    """Bento arguments: ``bentoml build --arg model_tag=rlvr_policy:<version>`` (``bentos/build.py`` sets it)."""

    model_tag: str = f"{MODEL_NAME}:latest"


ARGS = bentoml.use_arguments(ServiceArgs)


def ready_start_wait_s() -> float:
    """``/readyz``'s bound on how long a new request would wait to start (``$RLVR_READY_START_WAIT_S``)."""
    return float(os.environ.get("RLVR_READY_START_WAIT_S", READY_START_WAIT_S))


def batching_enabled() -> bool:
    return os.environ.get("RLVR_BATCHING", "1").strip().lower() not in ("0", "false", "no", "off")


header_timeout.install()  # before the worker's uvicorn starts: its connections close when headers stall
try:  # on import: a bad key setting stops `bentoml serve` at once
    ACCESS.configure(access_from_env(os.environ))
except ValueError as err:
    logger.error("rlvr_policy: %s", err)  # BentoML's own message names only the module it could not import
    raise


@bentoml.service(
    name=SERVICE_NAME,
    workers=1,  # one copy of the policy per replica; scale with replicas (deploy/k8s/bento-hpa.yaml)
    traffic={"timeout": REQUEST_TIMEOUT_S},  # concurrency is RequestGuard's: past the body, public requests only
)
class RlvrPolicy(OpenAIProtocol, RequestCost, TrafficRecording):
    policy = bentoml.models.BentoModel(ARGS.model_tag)

    def __init__(self) -> None:
        (logger.info if ACCESS.config.keys else logger.warning)("rlvr_policy: %s", ACCESS.config.summary())
        stored = self.policy
        self.model_tag = str(stored.tag)
        self.model_version = stored.info.labels.get(MODEL_VERSION_LABEL) or str(stored.tag.version)
        self.model_names = {self.model_version, self.model_tag, MODEL_NAME}  # what /v1 requests may call it
        self.created = int(stored.info.creation_time.timestamp())
        self.batching = batching_enabled()
        self.kv_cache_budget_bytes = int(os.environ.get("RLVR_KV_CACHE_BUDGET_MIB", DEFAULT_KV_CACHE_BUDGET_MIB)) * 2**20
        self.traffic = TrafficLog(Settings.from_env(require_absolute=True).traffic_dir, max_bytes=TRAFFIC_MAX_BYTES)
        if ACCESS.config.limits.has_quota:  # today's tokens so far, so a restart does not reset the quotas
            day = ACCESS.tokens_today.today()
            ACCESS.tokens_today.restore(day, used := tokens_by_key(self.traffic.folder, day))
            logger.info("rlvr_policy: daily token quotas: %d tokens of %d keys used today (%s UTC) so far", sum(used.values()), len(used), day)
        self.rewards = RewardPool(workers=2, timeout_s=REWARD_TIMEOUT_S)
        self.model = self.tokenizer = self.prompt_tokenizer = self.vocabulary = self.environment = None
        self.tasks: dict[str, Task] = {}
        self.context_tokens: int | None = None
        self.kv_bytes_per_token = self.vocab_size = 0
        self.serving_engine: ServingEngine | None = None
        self._load_error: BaseException | None = None
        die_with_parent(signal.SIGTERM)  # a killed `bentoml serve` takes this worker along
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
        """Loaded, a slot free, and a new request would start within ``READY_START_WAIT_S``."""
        return REQUEST_SLOTS.loaded and not REQUEST_SLOTS.saturated and self.serving_engine.start_wait_s() <= ready_start_wait_s()

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
        task = self._task("GenerateRequest", request.task)
        weights = self._reward_weights(request.reward, task)
        prompt = self._rendered("GenerateRequest", "prompt", request.prompt, task)
        try:
            (engine_request,) = self._requests_within_limits(
                CostFields("GenerateRequest", "prompt", "num_rollouts", "max_new_tokens", True),
                [prompt],
                request.num_rollouts,
                request.max_new_tokens,
                temperatures=tuple(temperatures),
                top_p=request.top_p,
                stop=task.stop_rule,
            )
        except FinishesTooLate as late:
            return late.response(openai=False)
        record = {"endpoint": "/generate", "task": task.name, "prompt": request.prompt, "params": request.model_dump(exclude={"prompt", "ground_truth"})}
        async with self._traffic_record(request_id, started, record):
            result = await self._rollouts(engine_request)
            answers = [task.parse(text) for text in result.texts]
            answer, vote_share = majority_vote(answers)
            reference = request.reference()
            rewards = None
            if reference is not None:
                rewards = await asyncio.to_thread(self._score, weights, result.texts, reference)
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
                task=task.name,
                rollouts=[
                    Rollout(
                        text=text,
                        answer=a,
                        reward=None if rewards is None else rewards[i],
                        finish_reason=result.finish_reasons[i],
                        completion_tokens=result.completion_tokens[i],
                        temperature=temperatures[i],
                        tool_calls=_tool_calls(result, i),
                    )
                    for i, (text, a) in enumerate(zip(result.texts, answers))
                ],
                best_index=best,
                best_response=result.texts[best],
                best_reward=None if rewards is None else rewards[best],
                mean_reward=None if rewards is None else sum(rewards) / len(rewards),
                reward=None if rewards is None else request.reward or task.name,
                answer=answer,
                vote_share=vote_share,
            )
            record.update(
                generation_fields(result),
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
        """Answer a question of one of the policy's tasks by majority vote over ``k`` samples (greedy when k = 1)."""
        started, request_id = time.perf_counter(), uuid.uuid4().hex
        task = self._task("SolveRequest", request.task)
        question = self._rendered("SolveRequest", "question", request.question, task)
        try:
            (engine_request,) = self._requests_within_limits(
                CostFields("SolveRequest", "question", "k", "max_new_tokens", True),
                [question],
                request.k,
                request.max_new_tokens,
                temperatures=tuple(request.temperatures()),
                top_p=1.0,
                stop=task.stop_rule,
            )
        except FinishesTooLate as late:
            return late.response(openai=False)
        record = {"endpoint": "/solve", "task": task.name, "prompt": request.question, "params": request.model_dump(exclude={"question"})}
        async with self._traffic_record(request_id, started, record):
            result = await self._rollouts(engine_request)
            answers = [task.parse(text) for text in result.texts]
            answer, vote_share = majority_vote(answers)
            winner = answers.index(answer) if answer is not None else 0
            if request.k > 1:
                VOTE_SHARE.observe(vote_share)
            response = SolveResponse(
                request_id=request_id,
                model_version=self.model_version,
                task=task.name,
                answer=answer,
                vote_share=vote_share,
                reasoning=result.texts[winner],
                answers=answers,
                k=request.k,
                environment=self.environment.name,
                tool_calls=_tool_calls(result, winner),
            )
            record.update(generation_fields(result), answers=answers, answer=answer, vote_share=vote_share)
        return response

    # ---- the OpenAI-compatible API (/v1): the same way in, request cost, batching, cancellation and logs --

    async def _on_model(self, fn: Callable, *args):
        """``fn(*args)`` on the model thread, between two engine steps (the model is that thread's)."""
        call = ModelCall(functools.partial(fn, *args))
        self.serving_engine.call(call)
        return await asyncio.wrap_future(call.result)

    # ---- admission by cost, batching ----------------------------------------------------------

    async def _rollouts(self, request: EngineRequest) -> RolloutResult:
        """Queue the request for the model thread and wait for it; a caller that gives up (its client hung
        up, its time ran out) stops the request's rows at the next decode step."""
        note_request(request)
        result = self.serving_engine.submit(request)
        try:
            return await asyncio.wrap_future(result)
        except asyncio.CancelledError:
            request.cancelled.set()
            result.cancel()
            raise

    def _serve_model(self, path: str) -> None:
        """The model thread: load the policy, warm it up (one short greedy generation), open the slots,
        then run the engine for as long as the process lives."""
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.environment = policy_environment(path)  # its protocol, as trained: before any prompt is rendered
            engine = self._engine_choice(device)
            self.tasks = {name: get_task(name) for name in policy_tasks(path) or {DEFAULT_TASK: 1.0}}  # what it was trained on
            self.model, self.tokenizer = load_policy(path, device, torch.bfloat16 if device == "cuda" else None)
            self.model.eval().requires_grad_(False)  # frozen: every pass reuses one packed copy of its weights
            self.prompt_tokenizer = load_tokenizer(path)  # the event loop's own: cost checks never share the model's
            self.vocabulary = Vocabulary(self.prompt_tokenizer)
            self.context_tokens = getattr(self.model.config, "max_position_embeddings", None)
            self.kv_bytes_per_token = kv_cache_bytes_per_token(self.model.config, self.model.dtype)
            self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
            seed = int(os.environ.get("RLVR_SEED", "0"))
            if engine == "vllm":
                self.serving_engine = self._vllm_engine(path, device, seed)
            else:
                self.serving_engine = ServingEngine(self.model, self.tokenizer, self.kv_cache_budget_bytes, seed, self.batching)
            prompt_ids = self._rendered("warm-up", "question", WARM_UP_QUESTION, next(iter(self.tasks.values())))
            self.serving_engine.warm_up(
                functools.partial(EngineRequest, prompt_ids, num_samples=1, temperatures=(0.0,), max_new_tokens=4, environment=self.environment)
            )
            REQUEST_SLOTS.start_wait_s = self.serving_engine.start_wait_s
            REQUEST_SLOTS.loaded = True
            logger.info(
                "rlvr_policy: %s loaded on %s and warmed up; engine %s; environment %s %s; tasks %s",
                self.model_tag,
                device,
                engine,
                self.environment.name,
                self.environment.options(),
                ", ".join(self.tasks),
            )
        except BaseException as err:
            self._load_error = err
            logger.exception("rlvr_policy: loading %s failed", self.model_tag)
            return
        self.serving_engine.run()

    def _engine_choice(self, device: str) -> str:
        """``$RLVR_ENGINE`` (auto, native or vllm; ``rlvr.generation.engines``) on ``device``; ``auto`` keeps
        the native engine for a policy whose environment runs tool episodes, which vLLM does not."""
        setting = os.environ.get("RLVR_ENGINE", "auto").strip().lower()
        try:
            engine = choose_engine(setting, device)
        except ValueError as err:
            raise ValueError(f"RLVR_ENGINE: {err}") from None
        if engine == "vllm" and setting == "auto" and drives_episodes(self.environment):
            logger.info("rlvr_policy: the native engine: vLLM does not run %s's tool episodes", self.environment.name)
            return "native"
        return engine

    def _vllm_engine(self, path: str, device: str, seed: int) -> VllmServingEngine:
        """vLLM's engine over the policy's checkpoint, its KV cache the service's budget; on CPU in float32 and
        eager (``$RLVR_VLLM_COMPILE=1`` compiles: slower start, faster steps)."""
        on_cpu = device == "cpu"
        settings = VllmSettings(
            model_dir=path,
            dtype="float32" if on_cpu else "bfloat16",
            max_model_len=-1,  # the model's context, or as much of it as the KV cache holds (vLLM's auto-fit)
            seed=seed,
            kv_cache_bytes=self.kv_cache_budget_bytes,
            enforce_eager=on_cpu and os.environ.get("RLVR_VLLM_COMPILE", "0") != "1",
        )
        return VllmServingEngine(settings, self.model, self.tokenizer, seed, self.batching, self.environment)

    # ---- answers, rewards, traffic -----------------------------------------------------------

    def _task(self, title: str, name: str | None) -> Task:
        """The request's task: ``name`` among the policy's tasks (a 400 naming the field otherwise), default its first."""
        if name is None:
            return next(iter(self.tasks.values()))
        if name not in self.tasks:
            raise invalid_request(title, "task", f"task {name!r} is not one of the policy's tasks: {', '.join(self.tasks)}")
        return self.tasks[name]

    def _reward_weights(self, reward: str | None, task: Task) -> dict[str, float]:
        """The weights of the reward ``reward`` names: a served reward, one of the policy's tasks (its training
        reward), default ``task``'s; a 400 naming the field otherwise."""
        if reward is None:
            return dict(task.rewards)
        if reward in SERVED_REWARDS:
            return SERVED_REWARDS[reward]
        if reward in self.tasks:
            return dict(self.tasks[reward].rewards)
        choices = ", ".join([*self.tasks, *SERVED_REWARDS])
        raise invalid_request("GenerateRequest", "reward", f"reward {reward!r} is neither a served reward nor one of the policy's tasks: {choices}")

    def _score(self, weights: dict[str, float], texts: list[str], reference: dict) -> list[float]:
        """Each completion's reward; a failing or slow reward scores 0 (``RewardPool`` contains it)."""
        scored = self.rewards.score_batch(weights, texts, [reference] * len(texts))
        return [row["total"].value for row in scored]


def _tool_calls(result: RolloutResult, sample: int) -> list[ToolCall]:
    """A sample's tool calls as the response lists them."""
    calls = result.tool_calls[sample] if sample < len(result.tool_calls) else []
    return [ToolCall(**call.as_dict()) for call in calls]


@functools.cache
def published_openapi(version: str = ARGS.model_tag) -> dict:
    """``/docs.json``: the OpenAPI document of the routes ``RlvrPolicy`` serves (``bentos.openapi``)."""
    return openapi_document(RlvrPolicy, version, (__doc__ or "").split("\n\n")[0])


async def _openapi_view(_request) -> JSONResponse:
    return JSONResponse(published_openapi())


RlvrPolicy.add_asgi_middleware(RequestGuard, slots=REQUEST_SLOTS, access=ACCESS)
# Matched before BentoML's own /docs.json, which flattens every union to its first member (OpenAPI 3.0).
# The /v1 routes are plain Starlette ones: BentoML's API layer would answer 400s in its own shape.
RlvrPolicy.mount_asgi_app(
    Starlette(
        routes=[
            Route("/docs.json", _openapi_view),
            *ROUTES,
        ]
    ),
    path="/",
)
