"""The engine: continuous batching (iteration-level scheduling, as Orca and vLLM do) over one model.

Every caller submits :class:`EngineRequest`s: training rollouts and evaluation (``rlvr.generation.rollouts``,
stepping until every row is done) and the service (stepping on its model thread). Each :meth:`Engine.step`
drops cancelled rows, starts the rows the scheduler admits (``rlvr.generation.scheduler``), has the
executor run one forward over its plan and sample (``rlvr.generation.executor``): every running row's next
token and the prompt chunks that fit the step's token budget; the output processor records the tokens,
applies the stop rules and the rows' tool episodes, and retires finished rows (``rlvr.generation.outputs``).
docs/architecture.md ("The generation engine") tells the whole mechanism.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Iterator

import torch

from rlvr.cpu_threads import tune_threads
from rlvr.environments.driver import EpisodeDriver, TokenTexts, drives_episodes
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.eligibility import attention_window
from rlvr.fastpaths.plan import BackendPlan, log_plan, plan_backend
from rlvr.generation.executor import StepExecutor
from rlvr.generation.kv_cache import kv_cache_bytes_per_token, quantized
from rlvr.generation.outputs import OutputProcessor, finish
from rlvr.generation.prefix_cache import PrefixCache
from rlvr.generation.request import EngineRequest
from rlvr.generation.sampler import row_generator
from rlvr.generation.scheduler import Backlog, Lane, Row, Scheduler
from rlvr.generation.stops import StopChecker

SHORT_LANE_TOKENS = 512  # rows of at most this many tokens (prompt + new) decode in a lane of their own


class Engine:
    """Continuous batching over ``model`` (see the module docstring). :meth:`submit` from any thread;
    :meth:`run` (or :meth:`take_submissions` and :meth:`step`) on the one thread that owns the model;
    its :class:`Scheduler` decides each step's work. ``plan``: what runs
    (``rlvr.fastpaths.plan``); by default planned here from ``fast_paths`` after tuning this thread's torch
    threads, so every caller (rollouts, evaluation, the service) gets the same backend for the same model."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_rows: int = 64,
        step_tokens: int = 256,
        max_step_tokens: int | None = None,
        kv_budget_bytes: int = 2**30,
        max_share: float = 0.5,
        short_lane_tokens: int | None = SHORT_LANE_TOKENS,
        prefix_cache_bytes: int | None = None,
        fast_paths: FastPaths = FastPaths(),
        stop_token_ids: list[int] | None = None,
        max_requests: int | None = None,
        plan: BackendPlan | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        if plan is None:
            tune_threads()  # the thread count the steps run at (they re-tune it), before slot attention is decided
            plan = plan_backend(model, fast_paths)
            log_plan(plan, "engine")
        self.plan = plan
        self.executor = StepExecutor(model, max_rows, plan)
        self.window = attention_window(model.config)
        self.bytes_per_token = kv_cache_bytes_per_token(model.config, model.dtype)
        self.prefixes = PrefixCache(self.bytes_per_token, kv_budget_bytes // 8 if prefix_cache_bytes is None else prefix_cache_bytes)
        self.stops = StopChecker(model, tokenizer, stop_token_ids)
        self.token_texts = TokenTexts(tokenizer)
        layers = model.config.num_hidden_layers
        self.scheduler = Scheduler(
            [Lane(layers, short_lane_tokens), Lane(layers, None)] if short_lane_tokens else [Lane(layers, None)],
            self.prefixes,
            bytes_per_token=self.bytes_per_token,
            kv_budget_bytes=kv_budget_bytes,
            max_rows=max_rows,
            step_tokens=step_tokens,
            max_step_tokens=max_step_tokens,  # None: every step carries step_tokens
            max_share=max_share,
            max_requests=max_requests,  # None: any number run at once; else the oldest that many
            model_config=model.config,
        )
        self._inbox: deque[EngineRequest | Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self.step_seconds = 0.0  # a moving average of steps with rows (0: none measured yet), for the time estimates
        self.outputs = OutputProcessor(self.scheduler, self.stops, self.token_texts, self.executor.draw_tokens, lambda: self._post(_wake))
        self.backlog = Backlog()  # the work ahead of a new request, as of the last step since start_wait_s was first asked
        self._backlog_asked = False  # training and evaluation never ask: their steps skip building it
        self._since_backlog: list[EngineRequest] = []  # submitted after the backlog was built (kept once it is asked)

    @property
    def rows(self) -> list[Row]:
        """Every running row (all lanes)."""
        return self.scheduler.rows

    @property
    def lanes(self) -> list[Lane]:
        return self.scheduler.lanes

    @property
    def max_rows(self) -> int:
        return self.scheduler.max_rows

    @property
    def step_tokens(self) -> int:
        return self.scheduler.step_tokens

    @property
    def kv_budget_bytes(self) -> int:
        return self.scheduler.kv_budget_bytes

    def kv_bytes(self) -> int:
        """The KV cache held: every lane's slots, the prompt caches of requests whose rows wait, and the
        prefix cache's blocks."""
        return self.scheduler.held_bytes() + self.prefixes.bytes

    # ---- from any thread ----------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        """Queue ``request``; raises ValueError for one the model cannot attend over whole or the KV budget
        cannot hold (its prompt and one row) even alone."""
        if self.window is not None and request.slot_length > self.window:
            raise ValueError(
                f"prompt + max_new_tokens = {request.slot_length} tokens exceed the model's sliding attention window "
                f"({self.window}); the engine attends over whole sequences"
            )
        need = (len(request.prompt_ids) + quantized(request.slot_length)) * self.bytes_per_token
        if need > self.kv_budget_bytes:
            raise ValueError(
                f"a prompt of {len(request.prompt_ids)} tokens and one row of {request.slot_length} need {need} bytes of KV cache, "
                f"past the engine's budget of {self.kv_budget_bytes}"
            )
        request.submitted_s = time.monotonic()
        self._post(request)

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine's thread between two steps (work that needs the model, e.g. scoring)."""
        self._post(fn)

    def _post(self, item) -> None:
        with self._wakeup:
            self._inbox.append(item)
            if self._backlog_asked and isinstance(item, EngineRequest):
                self._since_backlog.append(item)
            self._wakeup.notify()

    def estimated_seconds(self, prompt_tokens: int, rows: int, max_new_tokens: int) -> float:
        """A new request's time at the measured step time, at best: its prompt's chunks, then its new
        tokens in waves of at most ``max_rows`` rows (queueing and slower steps only add to it)."""
        waves = -(-rows // self.max_rows)
        return (-(-prompt_tokens // self.step_tokens) + max_new_tokens * waves) * self.step_seconds

    def start_wait_s(self) -> float:
        """How long a new request would wait for its first row to start, at the measured step time: the
        rows and prompts ahead of it as of the last step (:class:`~rlvr.generation.scheduler.Backlog`;
        each step builds it from the first call on) and the requests submitted since."""
        with self._wakeup:
            self._backlog_asked = True
            backlog = self.backlog.with_posted(list(self._since_backlog), self.scheduler.row_fill)
        return backlog.start_steps(self.step_tokens) * self.step_seconds

    # ---- on the engine's thread ---------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Steps for as long as there is work (waiting for it in between); a failing step fails every
        request in the engine (``error``) and the engine starts afresh."""
        while stop is None or not stop.is_set():
            self.take_submissions(block=not self.scheduler.has_work())
            try:
                self.step()
            except Exception as err:  # noqa: BLE001 - each request in the engine gets it
                self._fail_all(err)

    def run_requests(self, requests: list[EngineRequest]) -> Iterator[EngineRequest]:
        """Submit ``requests`` and step on this thread until each is done, yielding each as it finishes
        (a failing step raises)."""
        done: deque[EngineRequest] = deque()
        for request in requests:
            request.on_done = done.append
            self.submit(request)
        left = len(requests)
        while left:
            self.take_submissions(block=not self.scheduler.has_work())
            self.step()
            while done:
                left -= 1
                yield done.popleft()

    def _fail_all(self, err: Exception) -> None:
        for request in self.scheduler.drop_all():
            request.error = err
            finish(request)

    def take_submissions(self, block: bool = False) -> None:
        """Take in what other threads posted since the last call: submitted requests join the waiting
        queue, :meth:`call` functions run here, on the engine's thread. ``block``: wait up to a second
        for something first. :meth:`run` and :meth:`run_requests` call it before each step; a caller
        driving :meth:`step` itself calls it too."""
        with self._wakeup:
            if block:
                self._wakeup.wait_for(lambda: self._inbox, timeout=1.0)
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if isinstance(item, EngineRequest):
                self.scheduler.add(item)
            else:
                item()

    def step(self) -> None:
        tune_threads()  # the CPUs this process may use, less those others keep busy
        started = time.monotonic()
        with torch.inference_mode():
            self._drop_cancelled()
            self._admit_rows()
            tokens = self._forward()
            self._admit_rows()
        if self._backlog_asked:
            backlog = self.scheduler.backlog()
            with self._wakeup:  # requests still in the inbox are not in it yet
                self.backlog, self._since_backlog = backlog, [item for item in self._inbox if isinstance(item, EngineRequest)]
        if self.rows and tokens <= self.step_tokens:  # steps past the base budget (an idle engine's long prefills) are not typical
            elapsed = time.monotonic() - started
            self.step_seconds = elapsed if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * elapsed

    def _drop_cancelled(self) -> None:
        for request in [q for q in self.scheduler.waiting if q.cancelled.is_set()]:
            for sample in self.scheduler.skip_pending(request):
                request.finish_reasons[sample] = "cancelled"
            self._release_prompt(request)
        for lane in self.lanes:
            for i in reversed(range(len(lane.rows))):
                if lane.rows[i].request.cancelled.is_set():
                    self.outputs.retire(lane, i, "cancelled")

    def _admit_rows(self) -> None:
        for request, count in self.scheduler.admissions():
            self._add_rows(request, count)

    def _add_rows(self, request: EngineRequest, count: int) -> None:
        state = self.scheduler.states[request]
        lane = self.scheduler.lane_for(request)
        cache, length = lane.cache, lane.slot_length(request)
        rows_needed = len(lane.rows) + count
        if rows_needed > cache.capacity_rows or length > cache.capacity_length:
            cache.resize(self.scheduler.slot_capacity(lane, rows_needed, length, request), length, state.cache.layers[0].keys)
            self.scheduler.make_room()
        slots = cache.add_rows(state.cache, count)
        samples = self.scheduler.admit(request, count)
        new_rows = []
        for sample in samples:
            generator = row_generator(request.seed, request.prompt_index, sample, request.temperature(sample))
            driver = EpisodeDriver(request.environment, self.tokenizer, self.token_texts) if drives_episodes(request.environment) else None
            if driver is not None:
                request.tool_calls[sample] = driver.calls
            new_rows.append(Row(request, sample, generator, driver))
        lane.rows += new_rows
        if request.first_token_s is None:
            request.first_token_s = time.monotonic()
        self.outputs.first_tokens(lane, list(slots), state.last_logits)
        if not state.pending_rows:
            self._release_prompt(request)

    def _release_prompt(self, request: EngineRequest) -> None:
        if self.scheduler.release(request):
            finish(request)

    def _forward(self) -> int:
        """One forward of the model over the scheduler's plan (every lane's running rows, one token each,
        and the prompt chunks it picks; ``rlvr.generation.executor``); then each lane's rows sample and
        record their tokens, and each prompt that is now whole keeps its last logits for its rows' first
        tokens. Returns the tokens it ran."""
        for lane in self.lanes:
            self.outputs.resume_parked(lane)
        plan = self.scheduler.schedule()
        states = self.scheduler.states
        output = self.executor.execute(plan, {request: states[request].cache for request, _, _ in plan.prefill})
        if output.decode:
            self._note_neighbours()
        for lane, live, logits in output.decode:
            self.outputs.next_tokens(lane, live, logits)
        for request, end, logits in output.prefill:
            state = states[request]
            state.prefilled = end
            if state.whole_prompt:
                state.last_logits = logits
                self.prefixes.store(request.prompt_ids, state.cache, self.scheduler.room_bytes())
        return output.tokens

    def _note_neighbours(self) -> None:
        neighbours = len(self.scheduler.running)
        for request in self.scheduler.running:
            request.max_neighbours = max(request.max_neighbours, neighbours)


def _wake() -> None:
    """Posted when a parked row's observation is back: wakes an engine waiting for work."""
