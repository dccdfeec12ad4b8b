"""The engine: continuous batching (iteration-level scheduling, as Orca and vLLM do) over one model.

Every caller submits :class:`EngineRequest`s: training rollouts and evaluation (``rlvr.generation.rollouts``,
stepping until every row is done) and the service (stepping on its model thread). Each :meth:`Engine.step`
drops cancelled rows, starts the rows the scheduler admits (``rlvr.generation.scheduler``), runs one forward
over its plan: every running row's next token and the prompt chunks that fit the step's token budget
(``rlvr.generation.model_runner``), samples (``rlvr.generation.sampler``), applies the stop rules
(``rlvr.generation.stops``) and the rows' tool episodes, and retires finished rows.
docs/architecture.md ("The generation engine") tells the whole mechanism.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch
from transformers import DynamicCache

from rlvr.cpu_threads import tune_threads
from rlvr.environments.base import Injection
from rlvr.environments.driver import EpisodeDriver, TokenTexts, drives_episodes
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.eligibility import attention_window
from rlvr.fastpaths.fused_decode import Attend, cached_attention, gqa_attention
from rlvr.fastpaths.plan import BackendPlan, log_plan, plan_backend
from rlvr.fastpaths.slot_attention import slot_attention
from rlvr.generation.cuda_graphs import GraphedDecode
from rlvr.generation.kv_cache import SlotCache, kv_cache_bytes_per_token, quantized
from rlvr.generation.model_runner import model_runner
from rlvr.generation.prefix_cache import PrefixCache
from rlvr.generation.request import EngineRequest
from rlvr.generation.sampler import draw_uniforms, row_generator, sample_tokens
from rlvr.generation.scheduler import Backlog, Lane, Row, Scheduler
from rlvr.generation.stops import StopChecker

SHORT_LANE_TOKENS = 512  # rows of at most this many tokens (prompt + new) decode in a lane of their own
TOOL_WORKERS = 4  # threads observing turn ends (tools that may run for seconds) off the engine's thread


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
        self.runner = model_runner(model, max_rows, plan)  # packs the linear layers where the plan says so
        self.window = attention_window(model.config)
        self.device = next(model.parameters()).device
        self.graphed = GraphedDecode(self.runner, self.device, graphs=True, float32_attention=plan.float32_attention) if plan.cuda_graphs else None
        self.slot_kernel = plan.slot_attention  # decode attention to each row's own length
        self.bytes_per_token = kv_cache_bytes_per_token(model.config, model.dtype)
        self.prefixes = PrefixCache(self.bytes_per_token, kv_budget_bytes // 8 if prefix_cache_bytes is None else prefix_cache_bytes)
        self.stops = StopChecker(model, tokenizer, stop_token_ids)
        self.token_texts = TokenTexts(tokenizer)
        self._tool_pool: ThreadPoolExecutor | None = None
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
            self._finish(request)

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
                    self._retire(lane, i, "cancelled")

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
        tokens, logprobs = self._draw_tokens(state.last_logits.expand(count, -1), new_rows)
        lane.next_tokens = torch.cat([lane.next_tokens, tokens])
        if request.first_token_s is None:
            request.first_token_s = time.monotonic()
        self._record(lane, list(slots), tokens, logprobs)
        if not state.pending_rows:
            self._release_prompt(request)

    def _release_prompt(self, request: EngineRequest) -> None:
        if self.scheduler.release(request):
            self._finish(request)

    def _forward(self) -> int:
        """One forward of the model over the step's tokens: the scheduler's plan (every lane's running
        rows, one token each, and the prompt chunks it picks), so the weights are read once per step
        however many lanes and prompts take part; then each lane's rows sample and record their
        tokens, and each prompt that is now whole keeps its last logits for its rows' first tokens. Returns
        the tokens it ran."""
        for lane in self.lanes:
            self._resume_parked(lane)
        plan = self.scheduler.schedule()
        chunks = plan.prefill
        if self.graphed is not None and not chunks and self._graphed_step():
            return len(self.rows)
        tokens, positions, segments, logits_at = [], [], [], []
        for lane, live in plan.decode:
            start, cache = sum(map(len, tokens)), lane.cache
            rows = len(lane.rows)
            cache.step_length = int(cache.lengths[:rows].max()) + 1
            lane_positions = cache.lengths[:rows].clone()
            tokens.append(lane.next_tokens)
            positions.append(lane_positions)
            segments.append((start, start + rows, _slot_attention(cache, lane_positions, self.device, self.slot_kernel, self.plan.float32_attention)))
            logits_at += [start + i for i in live]  # parked rows ride along; their outputs are dropped
        for request, begin, end in chunks:
            start = sum(map(len, tokens))
            tokens.append(torch.tensor(request.prompt_ids[begin:end]))
            positions.append(torch.arange(begin, end))
            cache = self.scheduler.states[request].cache
            segments.append((start, start + end - begin, _prompt_attention(cache, begin, end, self.device, self.plan.float32_attention)))
            logits_at.append(start + end - begin - 1)
        if not segments:
            return 0
        logits = self.runner.forward(
            torch.cat(tokens).to(self.device), torch.cat(positions).to(self.device), _segmented(segments), torch.tensor(logits_at, device=self.device)
        )
        if plan.decode:
            self._note_neighbours()
        offset = 0
        for lane, live in plan.decode:
            rows = len(lane.rows)
            if len(live) < rows:  # parked rows do not advance
                lane.cache.lengths[live] += 1
            else:
                lane.cache.lengths[:rows] += 1
            self._append_next_tokens(lane, live, logits[offset : offset + len(live)])
            offset += len(live)
        for k, (request, _, end) in enumerate(chunks):
            state = self.scheduler.states[request]
            state.prefilled = end
            if state.whole_prompt:
                state.last_logits = logits[offset + k : offset + k + 1]
                self.prefixes.store(request.prompt_ids, state.cache, self.scheduler.room_bytes())
        return sum(map(len, tokens))

    def _graphed_step(self) -> bool:
        """A decode-only step of the one lane with rows, none parked, from a CUDA graph; False where it does not fit."""
        lanes = [lane for lane in self.lanes if lane.rows]
        if len(lanes) != 1 or any(row.parked is not None for row in lanes[0].rows):
            return False
        lane = lanes[0]
        rows = len(lane.rows)
        if not self.graphed.fits(lane.cache, rows):
            return False
        logits = self.graphed.step(lane.cache, lane.next_tokens.to(self.device), lane.cache.lengths[:rows].to(self.device))
        self._note_neighbours()
        lane.cache.lengths[:rows] += 1
        self._append_next_tokens(lane, list(range(rows)), logits)
        return True

    def _note_neighbours(self) -> None:
        neighbours = len(self.scheduler.running)
        for request in self.scheduler.running:
            request.max_neighbours = max(request.max_neighbours, neighbours)

    def _append_next_tokens(self, lane: Lane, live: list[int], logits: torch.Tensor) -> None:
        """The live rows' next tokens from their ``logits`` (or their environment's), recorded."""
        tokens, logprobs = self._draw_tokens(logits, [lane.rows[i] for i in live])
        forced = self._force_tokens(lane, live, tokens, logprobs)
        lane.next_tokens[live] = tokens
        self._record(lane, live, tokens, logprobs, forced)

    def _force_tokens(self, lane: Lane, live: list[int], tokens: torch.Tensor, logprobs: torch.Tensor) -> list[bool] | None:
        """Replace each row's sampled token by the next one its environment writes, if any (log-prob 0)."""
        forced = None
        for k, i in enumerate(live):
            driver = lane.rows[i].driver
            if driver is not None and (token := driver.next_forced()) is not None:
                forced = forced or [False] * len(live)
                tokens[k], logprobs[k], forced[k] = token, 0.0, True
        return forced

    def _resume_parked(self, lane: Lane) -> None:
        """Rows whose turn-end observation came back: an injection resumes them, none retires them."""
        for slot in reversed(range(len(lane.rows))):
            row = lane.rows[slot]
            if row.parked is None or not row.parked.done():
                continue
            injection: Injection | None = row.parked.result()
            reason, row.parked, row.parked_reason = row.parked_reason, None, None
            if not row.driver.inject(injection):
                self._retire(lane, slot, reason)

    def _park(self, row: Row, token: int, reason: str) -> None:
        """Observe a turn end on the tool pool; the row keeps its place but waits (docs/architecture.md, "Tool-calling rollouts")."""
        if self._tool_pool is None:
            self._tool_pool = ThreadPoolExecutor(TOOL_WORKERS, thread_name_prefix="rlvr-tools")
        row.parked = self._tool_pool.submit(row.driver.episode.observe, self.token_texts[token], True)
        row.parked_reason = reason
        row.parked.add_done_callback(lambda _: self._post(_wake))

    def _draw_tokens(self, logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its log-prob, drawn from its own generator at its temperature and top-p."""
        temperatures = torch.tensor([r.request.temperature(r.sample) for r in rows], dtype=torch.float32)
        top_p = torch.tensor([r.request.top_p for r in rows], dtype=torch.float32)
        uniforms = draw_uniforms([r.generator for r in rows])
        tokens, logprobs = sample_tokens(logits, temperatures.to(logits.device), top_p.to(logits.device), None, uniforms=uniforms.to(logits.device))
        return tokens.cpu(), logprobs.cpu()

    def _record(self, lane: Lane, slots: list[int], tokens: torch.Tensor, logprobs: torch.Tensor, forced: list[bool] | None = None) -> None:
        """Append each row's new token (``forced``: the environment's), tell the streams, retire the rows
        that finished."""
        finished: list[tuple[int, str]] = []
        by_request: dict[EngineRequest, list[tuple[int, int]]] = {}
        for k, (slot, token, logprob) in enumerate(zip(slots, tokens.tolist(), logprobs.tolist())):
            row = lane.rows[slot]
            request, sample = row.request, row.sample
            request.token_ids[sample].append(token)
            request.logprobs[sample].append(logprob)
            request.environment_masks[sample].append(int(forced is not None and forced[k]))
            by_request.setdefault(request, []).append((sample, token))
            if row.driver is None:
                reason = self._finish_reason(request, sample)
            else:
                reason = self._environment_turn(row, token, forced is not None and forced[k])
            if reason is not None:
                finished.append((slot, reason))
        for request, pairs in by_request.items():
            if request.on_tokens is not None:
                request.on_tokens(pairs)
        for slot, reason in sorted(finished, reverse=True):  # highest first: a retired slot is refilled by the last
            self._retire(lane, slot, reason)

    def _environment_turn(self, row: Row, token: int, forced: bool) -> str | None:
        """The finish reason of a row with an episode: a forced token ends it only at the budget; a
        policy token with budget left is observed (inline, or parked for a turn end) and an
        injection keeps the row going."""
        request, sample = row.request, row.sample
        budget_left = len(request.token_ids[sample]) < request.max_new_tokens
        if forced:
            return None if budget_left else "length"
        reason = self._finish_reason(request, sample)
        if not budget_left:  # no room for an answer: not observed
            return reason
        if token in self.stops.stop_ids:
            self._park(row, token, reason)
            return None
        return None if row.driver.observe(token, False) else reason

    def _finish_reason(self, request: EngineRequest, sample: int) -> str | None:
        return self.stops.finish_reason(request.token_ids[sample], request.max_new_tokens, request.stop_at_final_answer, request.stop_strings)

    def _retire(self, lane: Lane, slot: int, reason: str) -> None:
        row = lane.rows[slot]
        request = row.request
        request.finish_reasons[row.sample] = reason
        moved = lane.cache.remove_row(slot)
        last = lane.rows.pop()
        if moved is not None:
            lane.rows[slot] = last
            lane.next_tokens[slot] = lane.next_tokens[moved]
        lane.next_tokens = lane.next_tokens[: len(lane.rows)]
        if self.scheduler.release_row(request, None if reason == "cancelled" else len(request.token_ids[row.sample])):
            self._finish(request)
        if not lane.rows:
            lane.clear()  # every slot free: the buffers go
        elif (needed := quantized(max(r.request.slot_length for r in lane.rows))) * 2 <= lane.cache.capacity_length:
            lane.cache.resize(lane.cache.capacity_rows, needed, lane.cache.layers[0].keys)

    def _finish(self, request: EngineRequest) -> None:
        request.done_s = time.monotonic()
        if request.on_done is not None:
            request.on_done(request)


def _wake() -> None:
    """Posted when a parked row's observation is back: wakes an engine waiting for work."""


def _slot_attention(cache: SlotCache, positions: torch.Tensor, device: torch.device, kernel: bool, upcast: bool) -> Attend:
    """A lane's decode attention: each row's new key and value go into its slot at its position, and
    its query attends over its slot up to there (``kernel``: through ``rlvr.fastpaths.slot_attention``,
    which writes them and reads each slot to that position only; else SDPA over the lane's longest
    row, masked; ``upcast``: in float32 for bf16 / fp16)."""
    if kernel:

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
            layer = cache.layers[index]
            return slot_attention(queries, keys, values, layer.keys, layer.values, positions, scaling)

        return attend
    key_mask = (torch.arange(cache.step_length).unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]
    return cached_attention(cache, None if bool(key_mask.all()) else key_mask.to(device), upcast)


def _prompt_attention(cache: DynamicCache, begin: int, end: int, device: torch.device, upcast: bool) -> Attend:
    """A prompt chunk's attention (positions ``begin`` .. ``end`` - 1): its keys and values are appended
    to the prompt's cache, each query attends causally over the prompt so far (a first chunk without a
    mask, so SDPA skips the blocks above the diagonal; ``upcast``: in float32 for bf16 / fp16)."""
    first = begin == 0
    mask = None if first else (torch.arange(end).unsqueeze(0) <= torch.arange(begin, end).unsqueeze(1)).to(device)  # [chunk, end]

    def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        keys, values = cache.layers[index].update(keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0))
        attended = gqa_attention(queries.transpose(0, 1).unsqueeze(0), keys, values, mask, scaling, upcast, causal=first)
        return attended[0].transpose(0, 1).reshape(len(queries), -1)

    return attend


def _segmented(segments: list[tuple[int, int, Attend]]) -> Attend:
    """One :data:`Attend` over a flat batch whose rows ``start`` .. ``end`` - 1 belong to each segment."""
    if len(segments) == 1:
        return segments[0][2]

    def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        return torch.cat([fn(index, queries[a:b], keys[a:b], values[a:b], scaling) for a, b, fn in segments])

    return attend
