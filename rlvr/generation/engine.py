"""The engine: continuous batching (iteration-level scheduling, as Orca and vLLM do) over one model.

Every caller submits :class:`EngineRequest`s: training rollouts and evaluation (``rlvr.generation.rollouts``,
stepping until every row is done) and the service (stepping on its model thread). Each :meth:`Engine.step`
drops cancelled rows, starts the rows the scheduler admits and allocates (``rlvr.generation.scheduler``),
has the executor run one forward over the scheduler's plain-data plan and sample (``rlvr.generation.executor``):
every running row's next token and the prompt chunks that fit the step's token budget; the output processor
applies the step's output: records the tokens, applies the stop rules and the rows' tool episodes, and
retires finished rows (``rlvr.generation.outputs``).
docs/architecture.md ("The generation engine") tells the whole mechanism.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from rlvr.cpu_threads import tune_threads
from rlvr.environments.driver import EpisodeDriver, TokenTexts, drives_episodes
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.eligibility import attention_window, head_dim
from rlvr.fastpaths.heap import keep_freed_memory
from rlvr.fastpaths.packed_linear import WeightVersions
from rlvr.fastpaths.plan import BackendPlan, log_plan, plan_backend
from rlvr.generation.executor import StepExecutor
from rlvr.generation.kv_cache import kv_cache_bytes_per_token, quantized
from rlvr.generation.outputs import OutputProcessor, finish
from rlvr.generation.prefix_cache import PrefixCache
from rlvr.generation.request import EngineRequest, RequestDoesNotFit
from rlvr.generation.scheduler import Backlog, Lane, Row, Scheduler, expected_tokens, prompt_work
from rlvr.generation.stops import StopChecker

SHORT_LANE_TOKENS = 512  # rows of at most this many tokens (prompt + new) decode in a lane of their own


class StartWait(NamedTuple):
    """A new request's wait for its first token (:meth:`Engine.start_wait`), in parts."""

    under_way_s: float  # what is left of the step under way
    slot_steps: int  # decode steps until a slot takes it (its own step comes after)
    decode_step_s: float  # a step's time without prompt tokens, lately
    prompt_tokens: int  # its prompt's and those prefilled before it
    prompt_work: float  # the same in token-equivalents, their attention counted (scheduler.prompt_work)
    prompt_token_s: float  # what a prompt token-equivalent adds to a step, lately
    prompt_step_s: float = 0.0  # what its prompt's step adds whatever its tokens, lately (0: no prompt tokens)
    arriving_tokens: float = 0.0  # prompt tokens expected to arrive before its prompt's step and join it

    @property
    def seconds(self) -> float:
        prompts_s = self.prompt_step_s + (self.prompt_work + self.arriving_tokens) * self.prompt_token_s
        return self.under_way_s + (self.slot_steps + 1) * self.decode_step_s + prompts_s


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
        if plan.keep_freed_memory:
            keep_freed_memory()  # each step's logits and sampling temporaries (MBs at 32 rows) would be page-faulted in afresh
        self.executor: StepExecutor | None = StepExecutor(model, max_rows, plan)
        self._packed = WeightVersions(model)  # the weights the runner packed (see weights_changed)
        self.window = attention_window(model.config)
        self.context_tokens: int | None = getattr(model.config, "max_position_embeddings", None)
        embeddings = getattr(model, "get_input_embeddings", None)
        self.vocab_size: int | None = embeddings().weight.shape[0] if embeddings is not None else getattr(model.config, "vocab_size", None)
        self.bytes_per_token = kv_cache_bytes_per_token(model.config, model.dtype)
        self._prefix_share = 8 if prefix_cache_bytes is None else None  # the prefix cache's limit: an eighth of the KV budget, or as given
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
            keys_per_token=keys_per_token(model),
        )
        self._inbox: deque[EngineRequest | Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self.steps = 0  # steps run
        self.reset_step_times()
        self.outputs = OutputProcessor(self.scheduler, self.stops, self.token_texts, lambda: self._post(_wake))
        self.backlog = self.scheduler.backlog()  # the work in the engine, as of the last step since start_wait_s was first asked
        self._backlog_asked = False  # training and evaluation never ask: their steps skip building it
        self._since_backlog: list[EngineRequest] = []  # submitted after the backlog was built (kept once it is asked)
        self.arrivals = ArrivalRate()  # prompt tokens submitted per second (counted once the backlog is asked)

    def reset_step_times(self) -> None:
        """Forget the measured step times (0: none measured yet), e.g. those of a warm-up's first, compiling steps."""
        self.step_seconds = 0.0  # a moving average of steps with rows, for the time estimates
        self.decode_step_seconds = 0.0  # ... of those steps without prompt tokens
        self._prompt_steps = MovingLine()  # the time a step's prompt tokens add to it (over a decoding one), by their number
        self._step_started_s = 0.0  # the step under way: when it started (0: none) and how long it is expected to take
        self._step_estimate_s = 0.0
        self._overrun_s = 0.0  # a moving average of how far steps that overran their estimate ran past it

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

    # ---- between calls (an idle engine kept for a trainer's whole run) -------------------------

    def idle(self) -> bool:
        """Whether no request is in the engine or on its way to it."""
        with self._wakeup:
            return not self._inbox and not self.scheduler.states

    def weights_changed(self) -> bool:
        """Whether any of the model's weights changed (another tensor, or one written in place) since the
        runner packed them."""
        return not self._packed.current(self.model)

    def refresh(self) -> None:
        """Ready the engine for a call after the weights may have changed (a trainer's update): where any
        did, the prefix cache empties (its keys and values came from the old weights) and the runner packs
        them afresh, as it does after :meth:`release_buffers`."""
        if self.weights_changed():
            self.reset_prefix_cache()
            self.executor, self._packed = None, WeightVersions(self.model)
        if self.executor is None:
            self.executor = StepExecutor(self.model, self.max_rows, self.plan)

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (its keys and values came from other weights, or a measurement wants a prompt prefilled)."""
        self.prefixes.shrink_to(0)

    def release_buffers(self) -> None:
        """After a call: forget any request left in the engine (an abandoned call's) and drop the lanes'
        KV buffers and the runner's packed weights, so neither is kept through the trainer's update (where
        it would double the weights' memory); :meth:`refresh` (or the next step) packs them again."""
        for request in self.scheduler.drop_all():
            request.error = request.error or RuntimeError("the engine's call ended before the request was done")
        with self._wakeup:
            self._inbox.clear()
        self.executor = None

    def resize(self, max_rows: int, kv_budget_bytes: int) -> None:
        """Size an idle engine for a call: ``max_rows`` rows at once within ``kv_budget_bytes`` of KV cache
        (the runner, packed for the rows, is rebuilt where they change)."""
        if not self.idle():
            raise RuntimeError("an engine with requests in it cannot be resized")
        if max_rows != self.max_rows:
            self.executor = None
        self.scheduler.resize(max_rows, kv_budget_bytes)
        if self._prefix_share is not None:
            self.prefixes.limit_bytes = kv_budget_bytes // self._prefix_share
            self.prefixes.shrink_to(self.prefixes.limit_bytes)

    # ---- from any thread ----------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        """Queue ``request``; :class:`RequestDoesNotFit` (:meth:`check`) for one it could never run."""
        self.check(request)
        request.submitted_s = time.monotonic()
        if self._backlog_asked:  # the start wait expects prompts at the rate they have lately arrived
            tokens = self.prefixes.uncached_tokens(request.prompt_ids)
            with self._wakeup:
                self.arrivals.add(tokens, request.submitted_s)
        self._post(request)

    def check(self, *requests: EngineRequest) -> None:
        """Raise :class:`RequestDoesNotFit` for a request this engine could never run as asked: a token id
        outside the vocabulary, prompt + new tokens over the model's context or sliding window (the engine
        attends over whole sequences), its prompt and one row past the KV budget, or its rows that run at
        once (at most ``max_rows``) past it; ``requests`` together: all their rows at once (one client
        request's prompts)."""
        for request in requests:
            self._check_one(request)
        if len(requests) > 1:
            self._check_rows(requests)

    def _check_one(self, request: EngineRequest) -> None:
        ids, new = request.prompt_ids, request.max_new_tokens
        if ids and self.vocab_size is not None and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = max(ids) if max(ids) >= self.vocab_size else min(ids)
            raise RequestDoesNotFit(f"the prompt holds token id {bad}, outside the model's vocabulary of {self.vocab_size}", "prompt")
        for limit, name in ((self.context_tokens, "context"), (self.window, "sliding window")):
            if limit is not None and request.slot_length > limit:
                part = "prompt" if len(ids) >= limit else "new_tokens"
                raise RequestDoesNotFit(f"a {len(ids)}-token prompt + {new} new tokens is over the model's {name} of {limit} tokens", part)
        need = (len(ids) + quantized(request.slot_length)) * self.bytes_per_token
        if need > self.kv_budget_bytes:
            raise RequestDoesNotFit(
                f"a {len(ids)}-token prompt and one row of {request.slot_length} tokens need {need} bytes of KV cache, "
                f"past the engine's budget of {self.kv_budget_bytes}",
                "prompt" if (len(ids) + quantized(len(ids) + 1)) * self.bytes_per_token > self.kv_budget_bytes else "new_tokens",
            )
        self._check_rows([request])

    def _check_rows(self, requests: tuple[EngineRequest, ...] | list[EngineRequest]) -> None:
        """All ``requests``' rows that run at once (each at most ``max_rows``) within the KV budget."""
        rows = [min(q.num_samples, self.max_rows) for q in requests]
        need = sum(r * q.slot_length for r, q in zip(rows, requests)) * self.bytes_per_token
        if need > self.kv_budget_bytes:
            tokens = " + ".join(f"{r} x ({len(q.prompt_ids)} + {q.max_new_tokens})" for r, q in zip(rows, requests))
            raise RequestDoesNotFit(
                f"{tokens} tokens: a KV cache of {need / 2**20:.1f} MiB, over the budget of {self.kv_budget_bytes / 2**20:g} MiB",
                "rows",
            )

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

    def typical_seconds(self, prompt_tokens: int, rows: int, max_new_tokens: int) -> float:
        """:meth:`estimated_seconds` with its rows making the tokens rows have lately made of their budget
        (:attr:`row_fill`) rather than all of it."""
        return self.estimated_seconds(prompt_tokens, rows, expected_tokens(max_new_tokens, self.row_fill))

    @property
    def row_fill(self) -> float:
        """The share of their token budget finished rows have lately used (1 until one finishes)."""
        return self.scheduler.row_fill

    def start_wait_steps(self, prompt_ids: Sequence[int] = ()) -> float:
        """How many steps a new request of ``prompt_ids`` would wait for its first token (its own step
        included): the work in the engine as of the last step (:class:`~rlvr.generation.scheduler.Backlog`;
        each step builds it from the first call on) and the requests submitted since."""
        return self._backlog().start_steps(self.step_tokens, self.prefixes.uncached_tokens(prompt_ids))

    def start_wait_s(self, prompt_ids: Sequence[int] = ()) -> float:
        """How long a new request of ``prompt_ids`` would wait for its first token (:meth:`start_wait`)."""
        return self.start_wait(prompt_ids).seconds

    def start_wait(self, prompt_ids: Sequence[int] = ()) -> StartWait:
        """A new request's wait for its first token, in parts at the measured times: the decode steps until
        a slot takes it, its prompt (what the prefix cache does not hold of it) and those prefilled before
        it (beside the decoding), what is left of the step under way and its own; and the prompts expected
        to arrive until its prompt's step, which join that step (as far as its budget: :class:`ArrivalRate`)."""
        backlog, own, now = self._backlog(), self.prefixes.uncached_tokens(prompt_ids), time.monotonic()
        under_way_s = self._under_way_s(now)
        decode_s, token_s = self.decode_step_seconds or self.step_seconds, self.prompt_token_seconds
        prompt_tokens = backlog.prefill_before(own) + own
        work = backlog.prefill_work(len(prompt_ids) - own, len(prompt_ids))
        slot_steps = backlog.slot_steps()
        prompt_step_s = self.prompt_step_seconds if prompt_tokens else 0.0
        ahead_s = under_way_s + slot_steps * decode_s + (work - prompt_work(len(prompt_ids) - own, len(prompt_ids), self.scheduler.keys_per_token)) * token_s
        room = float("inf") if backlog.prefill_budget is None else -prompt_tokens % backlog.prefill_budget  # in its prompt's last step
        with self._wakeup:
            arriving = max(0.0, min(room, self.arrivals.per_s(now) * ahead_s)) if own else 0.0
        return StartWait(under_way_s, slot_steps, decode_s, prompt_tokens, work, token_s, prompt_step_s, arriving)

    def _under_way_s(self, now: float) -> float:
        """What is left of the step under way: its estimate less its time so far; once past its estimate, how
        far overrunning steps have lately run past theirs (not 0: it is still running)."""
        if not self._step_started_s:
            return 0.0
        left = self._step_estimate_s - (now - self._step_started_s)
        return left if left > 0 else self._overrun_s

    def _backlog(self) -> Backlog:
        with self._wakeup:
            self._backlog_asked = True
            backlog = self.backlog.with_posted(list(self._since_backlog), self.scheduler.row_fill, self.prefixes.uncached_tokens)
        return backlog.live()  # a request cancelled during the step under way holds no one up

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
        if self.executor is None:  # released after the last call
            self.refresh()
        self.steps += 1
        tune_threads()  # the CPUs this process may use, less those others keep busy
        started = self._step_started_s = time.monotonic()
        with torch.inference_mode():
            self._drop_cancelled()
            self._admit_rows()
            tokens, prompt_tokens, work = self._forward()
            self._admit_rows()
        self._publish_backlog()
        self._step_started_s = 0.0
        elapsed = time.monotonic() - started
        if 0 < self._step_estimate_s < elapsed:
            self._overrun_s = _moving_average(self._overrun_s, elapsed - self._step_estimate_s)
        self._measure(elapsed, tokens, prompt_tokens, work)

    def _publish_backlog(self, planned: dict[int, int] | None = None) -> None:
        """The backlog other threads read (once asked): as of now, the prompt chunks ``planned`` for the step
        under way counted as prefilled (its time is counted apart, as what is left of it)."""
        if self._backlog_asked:
            backlog = self.scheduler.backlog(planned)
            with self._wakeup:  # requests still in the inbox are not in it yet
                self.backlog, self._since_backlog = backlog, [item for item in self._inbox if isinstance(item, EngineRequest)]

    def _measure(self, elapsed: float, tokens: int, prompt_tokens: int, work: float) -> None:
        """Fold a step of ``tokens`` (``prompt_tokens`` of them prefill, ``work`` token-equivalents) into the
        moving averages of the time a step with rows takes, one without prompt tokens, and a prompt token-equivalent's share of a step."""
        decoded = tokens > prompt_tokens
        if self.rows and tokens <= self.step_tokens:  # steps past the base budget (an idle engine's long prefills) are not typical
            self.step_seconds = _moving_average(self.step_seconds, elapsed)
        if decoded and not prompt_tokens:
            self.decode_step_seconds = _moving_average(self.decode_step_seconds, elapsed)
        elif prompt_tokens and self.decode_step_seconds:  # what its prompt tokens add to a step (over a decoding one)
            self._prompt_steps.add(work, max(0.0, elapsed - self.decode_step_seconds))

    @property
    def prompt_token_seconds(self) -> float:
        """What a prompt token-equivalent (``scheduler.prompt_work``) adds to a step, lately."""
        return self._prompt_steps.slope

    @property
    def prompt_step_seconds(self) -> float:
        """What a step with prompt tokens adds whatever their number (admitting rows, growing a lane), lately."""
        return self._prompt_steps.intercept

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
        """Start ``count`` of ``request``'s rows (the scheduler allocates their slots) with the first tokens
        sampled when its prompt was whole."""
        state = self.scheduler.states[request]
        first, last = state.next_sample, state.next_sample + count
        lane, slots = self.scheduler.start_rows(request, [self._new_row(request, sample) for sample in range(first, last)])
        if request.first_token_s is None:
            request.first_token_s = time.monotonic()
        self.outputs.first_tokens(lane, slots, state.first_tokens[first:last], state.first_logprobs[first:last])
        if not state.pending_rows:
            self._release_prompt(request)

    def _new_row(self, request: EngineRequest, sample: int) -> Row:
        driver = EpisodeDriver(request.environment, self.tokenizer, self.token_texts) if drives_episodes(request.environment) else None
        if driver is not None:
            request.tool_calls[sample] = driver.calls
        return Row(request, sample, driver)

    def _release_prompt(self, request: EngineRequest) -> None:
        if self.scheduler.release(request):
            finish(request)

    def _forward(self) -> tuple[int, int, float]:
        """One forward of the model over the scheduler's plan (every lane's running rows, one token each,
        and the prompt chunks it picks), its rows' next tokens sampled (``rlvr.generation.executor``); the
        output processor applies the result. Returns the tokens it ran, the prompt tokens among them and
        their work (``scheduler.prompt_work``)."""
        for lane in self.lanes:
            self.outputs.resume_parked(lane)
        plan = self.scheduler.schedule()
        prompt_tokens = sum(chunk.end - chunk.begin for chunk in plan.prefill)
        work = sum(prompt_work(chunk.begin, chunk.end, self.scheduler.keys_per_token) for chunk in plan.prefill)
        self._step_estimate_s = (self.decode_step_seconds if plan.decode else 0.0) + (self._prompt_steps.at(work) if prompt_tokens else 0.0)
        self._publish_backlog({chunk.request_id: chunk.end for chunk in plan.prefill})
        prompt_caches = {chunk.request_id: self.scheduler.by_id[chunk.request_id].cache for chunk in plan.prefill}
        output = self.executor.execute(plan, [lane.cache for lane in self.lanes], prompt_caches)
        if output.decode:
            self._note_neighbours()
        self.outputs.update_from_output(output)
        return output.tokens, prompt_tokens, work

    def _note_neighbours(self) -> None:
        neighbours = len(self.scheduler.running)
        for request in self.scheduler.running:
            request.max_neighbours = max(request.max_neighbours, neighbours)


def keys_per_token(model: Any) -> float:
    """How many keys a prompt token's attention (scores and weighted values, every layer) takes for the
    multiply-adds of its projections: the weights less the embeddings and output head (a prompt's logits are
    its last token's) over 2 x heads x head width x layers."""
    config, weights = model.config, {id(p): p.numel() for p in model.parameters()}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            weights.pop(id(module.weight), None)
    return sum(weights.values()) / (2 * config.num_attention_heads * head_dim(config) * config.num_hidden_layers)


class ArrivalRate:
    """Amounts arriving per second, lately: each arrival counts ``exp(-age / horizon_s) / horizon_s`` per second."""

    def __init__(self, horizon_s: float = 30.0):
        self.horizon_s, self.level, self.at = horizon_s, 0.0, 0.0

    def add(self, amount: float, now: float) -> None:
        self.level, self.at = self.level * self._decay(now) + amount, now

    def per_s(self, now: float) -> float:
        return self.level * self._decay(now) / self.horizon_s

    def _decay(self, now: float) -> float:
        return math.exp(-max(0.0, now - self.at) / self.horizon_s)


class MovingLine:
    """A line ``intercept + slope * x`` fitted by least squares to the (x, y) pairs seen, each weighing a
    tenth against those before it; neither below 0, and through 0 while the x seen barely differ."""

    def __init__(self):
        self.means: tuple[float, float, float, float] | None = None  # of x, y, x * x, x * y

    def add(self, x: float, y: float) -> None:
        pair = (x, y, x * x, x * y)
        self.means = pair if self.means is None else tuple(0.9 * m + 0.1 * v for m, v in zip(self.means, pair))

    @property
    def slope(self) -> float:
        if self.means is None or not self.means[0]:
            return 0.0
        mx, my, mxx, mxy = self.means
        variance = mxx - mx * mx
        if variance <= 0.01 * mx * mx:
            return my / mx
        return min(max(0.0, (mxy - mx * my) / variance), my / mx)

    @property
    def intercept(self) -> float:
        return 0.0 if self.means is None else max(0.0, self.means[1] - self.slope * self.means[0])

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def _moving_average(average: float, value: float) -> float:
    return value if not average else 0.9 * average + 0.1 * value


def _wake() -> None:
    """Posted when a parked row's observation is back: wakes an engine waiting for work."""
