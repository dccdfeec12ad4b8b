"""The service's side of ``rlvr.generation.Engine``, on one model thread: the service builds the engine's own
``EngineRequest``s, and :class:`ServingEngine` submits them, turns each finished one into a
:class:`RolloutResult` (its texts decoded, its metrics counted) and resolves the caller's future.

The engine batches continuously (requests join and leave the running batch at every step, long prompts
are prefilled in chunks between decode steps, each request keeps to a fair share of the rows and KV
budget; with batching off, one request at a time). Requests roll out in the policy's environment
(``rlvr.environments``), as in training: a tool's calls come back in ``RolloutResult.tool_calls``.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

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
from rlvr.environments.base import ToolCall
from rlvr.generation import Engine, EngineRequest

MAX_BATCH_ROWS = 64  # running rows (prompts x samples)
STEP_TOKENS = 256  # tokens per engine step (decode rows + prefill chunk) with every row slot taken
MAX_STEP_TOKENS = 2_048  # with every row slot free: a prompt up to MAX_PROMPT_TOKENS prefills in one step


@dataclass
class RolloutResult:
    """A finished request as the service answers it: each sample's text (decoded), finish reason and tokens."""

    texts: list[str]
    finish_reasons: list[str]
    completion_tokens: list[int]
    generation_s: float  # queueing to last token
    batch_requests: int  # requests that shared the batch with it (most at once)
    prompt_tokens: int = 0  # of its prompt(s), each once whatever its samples
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


class ServingEngine:
    """The engine the service's requests run on (``batching`` off: one request at a time); unseeded
    requests take the next of the seeds counted from ``seed``. What the service asks of an engine:
    :meth:`check`, :meth:`submit`, :meth:`call`, :meth:`estimated_s`, :meth:`typical_s`, :meth:`start_wait_s`,
    :attr:`step_seconds`, :meth:`next_seed`, :meth:`warm_up` and :meth:`run`."""

    name = "native"

    def __init__(self, model: Any, tokenizer: Any, kv_budget_bytes: int, seed: int, batching: bool = True):
        engine = Engine(
            model,
            tokenizer,
            max_rows=MAX_BATCH_ROWS,
            step_tokens=STEP_TOKENS,
            max_step_tokens=MAX_STEP_TOKENS,
            kv_budget_bytes=kv_budget_bytes,
            max_requests=None if batching else 1,
        )
        self._serve(engine, tokenizer, seed)

    def _serve(self, engine: Any, tokenizer: Any, seed: int) -> None:
        """Serve on ``engine``, unseeded requests taking the seeds counted from ``seed``."""
        self.engine, self.tokenizer = engine, tokenizer
        self._seeds = itertools.count(seed)

    def next_seed(self) -> int:
        """The seed of a request whose client gave none."""
        return next(self._seeds)

    def check(self, *requests: EngineRequest) -> None:
        """``RequestDoesNotFit`` for requests the engine could never run, each alone or all their rows
        together (``rlvr.generation.Engine.check``)."""
        self.engine.check(*requests)

    @property
    def step_seconds(self) -> float:
        """The engine's measured time a step (0: none measured yet)."""
        return self.engine.step_seconds

    def submit(self, request: EngineRequest) -> Future:
        """Queue ``request``; its result (a :class:`RolloutResult`) once its last row ends. A caller that
        gives up sets ``request.cancelled`` (its rows stop at the next step) and cancels the future."""
        result: Future = Future()
        request.on_done = lambda done: self._done(result, done)
        self.engine.submit(request)
        return result

    def _done(self, result: Future, request: EngineRequest) -> None:
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
        if not result.set_running_or_notify_cancel():  # its caller gave up
            return
        if request.error is not None:
            result.set_exception(request.error)
            return
        result.set_result(
            RolloutResult(
                texts=self.tokenizer.batch_decode(request.token_ids, skip_special_tokens=True),
                finish_reasons=list(request.finish_reasons),
                completion_tokens=[len(ids) for ids in request.token_ids],
                generation_s=elapsed,
                batch_requests=request.max_neighbours,
                prompt_tokens=len(request.prompt_ids),
                token_ids=request.token_ids,
                logprobs=request.logprobs,
                tool_calls=[list(calls) for calls in request.tool_calls],
            )
        )

    def call(self, call: ModelCall) -> None:
        self.engine.call(call)

    def estimated_s(self, prompt_tokens: int, rows: int, max_new_tokens: int) -> float:
        """A new request's time at the measured step time, its rows making every token of their budget."""
        return self.engine.estimated_seconds(prompt_tokens, rows, max_new_tokens)

    def typical_s(self, prompt_tokens: int, rows: int, max_new_tokens: int) -> float:
        """:meth:`estimated_s` at the share of their budget the engine's rows have lately made (its
        ``typical_seconds``)."""
        return self.engine.typical_seconds(prompt_tokens, rows, max_new_tokens)

    def warm_up(self, new_request: Callable[[], EngineRequest]) -> RolloutResult:
        """Run a request of ``new_request()`` three times on this thread: the first compiles and packs, the
        second measures the step times the admission estimates start from, the third (its prompt no longer
        in the prefix cache) what a prompt token adds to a step."""
        for attempt in range(3):
            if attempt == 1:
                self.engine.reset_step_times()
            if attempt == 2:
                self.engine.reset_prefix_cache()
            result = self.submit(new_request())
            while not result.done():
                self.engine.take_submissions()
                self.engine.step()
        return result.result()

    def start_wait_s(self, prompt_ids: Sequence[int] = ()) -> float:
        """How long a new request (of ``prompt_ids``) would wait for its first token (``Engine.start_wait_s``)."""
        wait = self.engine.start_wait_s(prompt_ids)
        START_WAIT_ESTIMATE.set(wait)
        return wait

    def run(self) -> None:
        self.engine.run()
