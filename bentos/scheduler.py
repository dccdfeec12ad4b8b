"""Who runs the model: the service's rollout jobs scheduled onto the policy, on one model thread.

Two schedulers with one interface (``submit`` a job, ``call`` other model work, ``run`` the thread's
loop, ``start_wait_s`` for readiness), chosen in one place (:func:`make_scheduler`):

* :class:`ContinuousScheduler` (the default where ``rlvr.engine.continuous_batching_eligible``):
  iteration-level scheduling by ``rlvr.engine.Engine``: requests join and leave the running batch at
  every decode step, long prompts are prefilled in chunks between decode steps, each request keeps to
  a fair share of the rows and KV budget;
* :class:`PassScheduler` (``RLVR_ENGINE=passes``, ``RLVR_BATCHING=0``, and models the engine does not
  take): whole generation passes of ``rlvr.rollout.generate_rollouts``: each pass takes the jobs queued
  while the previous one ran (up to ``MAX_BATCH_REQUESTS`` whose KV caches fit the budget together;
  one without batching), and jobs with equal sampling settings share one engine call.

Both roll out in the policy's environment (``rlvr.environments``: the one its checkpoint records, as
in training), every row of every request: a tool's text is written into the row as the engine runs
it, counts against the row's ``max_new_tokens``, and its calls come back in ``RolloutResult.tool_calls``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from bentos.metrics import (
    GENERATION_SECONDS,
    PASS_REQUESTS,
    PROMPT_TOKENS,
    PROMPT_TOKENS_CACHED,
    ROLLOUTS_CANCELLED,
    ROLLOUTS_GENERATED,
    START_WAIT_ESTIMATE,
    START_WAIT_SECONDS,
)
from rlvr.engine import Engine, EngineRequest, continuous_batching_eligible
from rlvr.environments.base import Environment, ToolCall
from rlvr.rollout import SamplingConfig, generate_rollouts, is_greedy

MAX_BATCH_REQUESTS = 8  # requests per generation pass (passes)
MAX_BATCH_ROWS = 64  # rows (prompts x samples) per forward pass / running rows (continuous)
STEP_TOKENS = 256  # continuous: tokens per engine step (decode rows + prefill chunk)


@dataclass(eq=False)
class RolloutJob:
    """One prompt of a request, queued for the model thread; ``cancelled`` stops its rows, ``on_tokens``
    (a streaming request's) sees them as they are sampled."""

    prompt_ids: tuple[int, ...]
    num_samples: int
    temperatures: tuple[float, ...]
    max_new_tokens: int
    top_p: float
    kv_cache_bytes: int
    stop_at_final_answer: bool = True  # /generate and /solve stop after the '#### <number>' line; /v1 does not
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # the client's: the same choices alone or batched
    on_tokens: Callable[[list[tuple[int, int]]], None] | None = None  # (sample, token) pairs of each decode step
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: Future = field(default_factory=Future)

    def sampling_key(self) -> tuple:
        """Passes: jobs with equal keys share one engine call; a seeded sampling job shares it with no one,
        so its draws do not depend on its neighbours."""
        own = self if self.seed is not None and not all(map(is_greedy, self.temperatures)) else None
        return (self.num_samples, self.temperatures, self.max_new_tokens, self.top_p, self.stop_at_final_answer, self.stop_strings, own)


@dataclass
class RolloutResult:
    texts: list[str]
    finish_reasons: list[str]
    completion_tokens: list[int]
    generation_s: float  # queueing to last token (continuous); the engine call (passes)
    batch_requests: int  # requests that shared the batch with it (most at once)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    tool_calls: list[list[ToolCall]] = field(default_factory=list)  # per sample, in order (none without an environment)


@dataclass(eq=False)
class ModelCall:
    """Work other than generation for the model thread (scoring prompts), run between two steps."""

    run: Callable[[], object]
    result: Future = field(default_factory=Future)

    def __call__(self) -> None:
        try:
            self.result.set_result(self.run())
        except Exception as err:  # noqa: BLE001 - its caller's 500
            self.result.set_exception(err)


def make_scheduler(
    model: Any, tokenizer: Any, kv_budget_bytes: int, batching: bool, seed: int, environment: Environment | None = None
) -> ContinuousScheduler | PassScheduler:
    """The continuous engine unless ``RLVR_ENGINE=passes``, batching is off, or the model is not eligible;
    every job rolls out in ``environment`` (the policy's; None: single-turn)."""
    wanted = os.environ.get("RLVR_ENGINE", "continuous").strip().lower()
    if batching and wanted != "passes" and continuous_batching_eligible(model):
        return ContinuousScheduler(model, tokenizer, kv_budget_bytes, seed, environment)
    return PassScheduler(model, tokenizer, kv_budget_bytes, batching, seed, environment)


class ContinuousScheduler:
    """Rollout jobs as ``rlvr.engine.EngineRequest``s; each job's result set when its last row ends."""

    name = "continuous"

    def __init__(self, model: Any, tokenizer: Any, kv_budget_bytes: int, seed: int, environment: Environment | None = None):
        self.tokenizer, self.environment = tokenizer, environment
        self.engine = Engine(model, tokenizer, max_rows=MAX_BATCH_ROWS, step_tokens=STEP_TOKENS, kv_budget_bytes=kv_budget_bytes)
        self._seeds = itertools.count(seed)

    def submit(self, job: RolloutJob) -> None:
        request = EngineRequest(
            prompt_ids=list(job.prompt_ids),
            num_samples=job.num_samples,
            temperatures=job.temperatures,
            max_new_tokens=job.max_new_tokens,
            top_p=job.top_p,
            seed=job.seed if job.seed is not None else next(self._seeds),
            stop_at_final_answer=job.stop_at_final_answer,
            stop_strings=job.stop_strings,
            on_tokens=job.on_tokens,
            on_done=lambda request: self._done(job, request),
            cancelled=job.cancelled,
            environment=self.environment,
        )
        self.engine.submit(request)

    def _done(self, job: RolloutJob, request: EngineRequest) -> None:
        cancelled = request.finish_reasons.count("cancelled")
        ROLLOUTS_GENERATED.inc(request.num_samples - cancelled)
        ROLLOUTS_CANCELLED.inc(cancelled)
        elapsed = request.done_s - request.submitted_s
        GENERATION_SECONDS.observe(elapsed)
        if request.first_token_s is not None:
            START_WAIT_SECONDS.observe(request.first_token_s - request.submitted_s)
        PASS_REQUESTS.observe(request.max_neighbours)
        PROMPT_TOKENS.inc(len(request.prompt_ids))
        PROMPT_TOKENS_CACHED.inc(request.cached_prompt_tokens)
        if not job.result.set_running_or_notify_cancel():  # its caller gave up
            return
        if request.error is not None:
            job.result.set_exception(request.error)
            return
        job.result.set_result(
            RolloutResult(
                texts=self.tokenizer.batch_decode(request.token_ids, skip_special_tokens=True),
                finish_reasons=list(request.finish_reasons),
                completion_tokens=[len(ids) for ids in request.token_ids],
                generation_s=elapsed,
                batch_requests=request.max_neighbours,
                token_ids=request.token_ids,
                logprobs=request.logprobs,
                tool_calls=[list(calls) for calls in request.tool_calls],
            )
        )

    def call(self, call: ModelCall) -> None:
        self.engine.call(call)

    def warm_up(self, job: RolloutJob) -> RolloutResult:
        self.submit(job)
        while not job.result.done():
            self.engine._take_inbox(block=False)
            self.engine.step()
        return job.result.result()

    def start_wait_s(self) -> float:
        wait = self.engine.start_wait_s()
        START_WAIT_ESTIMATE.set(wait)
        return wait

    def run(self) -> None:
        self.engine.run()


class PassScheduler:
    """Whole generation passes (module docstring)."""

    name = "passes"

    def __init__(self, model: Any, tokenizer: Any, kv_budget_bytes: int, batching: bool, seed: int, environment: Environment | None = None):
        self.model, self.tokenizer, self.kv_budget_bytes, self.batching = model, tokenizer, kv_budget_bytes, batching
        self.environment = environment
        self._seeds = itertools.count(seed)
        self._queue: deque[RolloutJob | ModelCall] = deque()
        self._queued = threading.Condition()
        self._queued_at: dict[RolloutJob, float] = {}
        self._pass_started: float | None = None

    def submit(self, job: RolloutJob) -> None:
        with self._queued:
            self._queued_at[job] = time.monotonic()
            self._queue.append(job)
            self._queued.notify()

    def call(self, call: ModelCall) -> None:
        with self._queued:
            self._queue.append(call)
            self._queued.notify()

    def start_wait_s(self) -> float:
        """The oldest queued job's wait so far, or the running pass's time so far (a new job waits for it)."""
        now = time.monotonic()
        waits = [now - t for t in list(self._queued_at.values())]
        if (started := self._pass_started) is not None:
            waits.append(now - started)
        wait = max(waits, default=0.0)
        START_WAIT_ESTIMATE.set(wait)
        return wait

    def warm_up(self, job: RolloutJob) -> RolloutResult:
        return self._generate([job], observe=False)[0]

    def run(self) -> None:
        while True:
            work = self._next_pass()
            if isinstance(work, ModelCall):
                work()
                continue
            self._pass_started = time.monotonic()
            try:
                results = self._generate(work)
            except Exception as err:  # noqa: BLE001 - each request of the pass gets its 500
                for job in work:
                    job.result.set_exception(err)
            else:
                for job, result in zip(work, results):
                    job.result.set_result(result)
            finally:
                self._pass_started = None

    def _next_pass(self) -> list[RolloutJob] | ModelCall:
        """The oldest queued jobs, up to ``MAX_BATCH_REQUESTS`` (1 without batching) whose KV caches fit
        the budget together; jobs whose callers gave up are dropped. A queued model call goes alone."""
        limit = MAX_BATCH_REQUESTS if self.batching else 1
        jobs, kv_bytes = [], 0
        with self._queued:
            while not jobs:
                self._queued.wait_for(lambda: self._queue)
                if isinstance(self._queue[0], ModelCall):
                    return self._queue.popleft()
                while (
                    self._queue
                    and not isinstance(self._queue[0], ModelCall)
                    and len(jobs) < limit
                    and (not jobs or kv_bytes + self._queue[0].kv_cache_bytes <= self.kv_budget_bytes)
                ):
                    job = self._queue.popleft()
                    self._queued_at.pop(job, None)
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
                environment=self.environment,
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
                    tool_calls=[list(rollouts.tool_calls[r]) for r in rows],
                )
        if observe:
            for _ in jobs:
                PASS_REQUESTS.observe(len(jobs))
        return results


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
