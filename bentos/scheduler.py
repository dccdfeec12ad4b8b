"""Who runs the model: the service's rollout jobs as requests of the generation engine, on one model thread.

:class:`ContinuousScheduler` hands each job to ``rlvr.generation.Engine`` (continuous batching: requests
join and leave the running batch at every step, long prompts are prefilled in chunks between decode
steps, each request keeps to a fair share of the rows and KV budget; with batching off, one request at a
time). Jobs roll out in the policy's environment (``rlvr.environments``), as in training: a tool's text is
written into the row as the engine runs it and its calls come back in ``RolloutResult.tool_calls``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
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
from rlvr.environments.base import Environment, ToolCall
from rlvr.generation import Engine, EngineRequest

MAX_BATCH_ROWS = 64  # running rows (prompts x samples)
STEP_TOKENS = 256  # tokens per engine step (decode rows + prefill chunk)


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
    progress: list[list[int]] | None = None  # each sample's tokens so far (the engine's lists, once submitted)

    def tokens_so_far(self) -> list[int]:
        """How many tokens each sample has so far (what a timed-out request's record keeps)."""
        return [len(ids) for ids in self.progress] if self.progress is not None else [0] * self.num_samples


@dataclass
class RolloutResult:
    texts: list[str]
    finish_reasons: list[str]
    completion_tokens: list[int]
    generation_s: float  # queueing to last token
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


def make_scheduler(model: Any, tokenizer: Any, kv_budget_bytes: int, batching: bool, seed: int, environment: Environment | None = None) -> ContinuousScheduler:
    """The service's scheduler; every job rolls out in ``environment`` (the policy's; None: single-turn)."""
    return ContinuousScheduler(model, tokenizer, kv_budget_bytes, seed, environment, batching)


class ContinuousScheduler:
    """Rollout jobs as ``rlvr.generation.EngineRequest``s; each job's result set when its last row ends
    (``batching`` off: one request runs at a time)."""

    name = "continuous"

    def __init__(self, model: Any, tokenizer: Any, kv_budget_bytes: int, seed: int, environment: Environment | None = None, batching: bool = True):
        self.tokenizer, self.environment = tokenizer, environment
        self.engine = Engine(
            model, tokenizer, max_rows=MAX_BATCH_ROWS, step_tokens=STEP_TOKENS, kv_budget_bytes=kv_budget_bytes, max_requests=None if batching else 1
        )
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
        job.progress = request.token_ids
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

    def estimated_s(self, prompt_tokens: int, rows: int, max_new_tokens: int) -> float:
        return self.engine.estimated_seconds(prompt_tokens, rows, max_new_tokens)

    def warm_up(self, job: RolloutJob) -> RolloutResult:
        """Run ``job`` twice on this thread: the first compiles and packs, the second measures the step time
        the admission estimates start from."""
        for attempt in (job, dataclasses.replace(job, result=Future(), cancelled=threading.Event(), progress=None)):
            if attempt is not job:
                self.engine.step_seconds = 0.0
            self.submit(attempt)
            while not attempt.result.done():
                self.engine._take_inbox(block=False)
                self.engine.step()
        return attempt.result.result()

    def start_wait_s(self) -> float:
        wait = self.engine.start_wait_s()
        START_WAIT_ESTIMATE.set(wait)
        return wait

    def run(self) -> None:
        self.engine.run()
