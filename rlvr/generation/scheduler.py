"""The engine's scheduler: who runs each step and how many tokens each (vLLM v1's split of the engine).

It owns the waiting and running requests, the lanes of running rows and the KV budget: every check of
the budget goes through one gate (:meth:`Scheduler.fits`, :meth:`Scheduler.reserve`,
:meth:`Scheduler.release`). Each step it hands the engine a :class:`StepPlan` (the rows that decode, the
prompt chunks that prefill) and the rows each prefilled request may start (:meth:`Scheduler.admissions`);
the engine executes them. It reads request metadata only (token counts, max tokens, submission times),
so it is tested without a model (tests/test_engine_scheduler.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import torch
from transformers import DynamicCache

from rlvr.generation.kv_cache import SlotCache, quantized
from rlvr.generation.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from rlvr.environments.driver import EpisodeDriver
    from rlvr.generation.request import EngineRequest


@dataclass
class Row:
    request: EngineRequest
    sample: int
    generator: torch.Generator | None  # None: greedy
    driver: EpisodeDriver | None = None  # its episode (requests with an environment)
    parked: Future | None = None  # a turn end being observed off the engine thread
    parked_reason: str | None = None  # how the row finishes if that observation injects nothing


class Lane:
    """Running rows whose slots share one :class:`SlotCache` and one decode step: rows whose slot (prompt
    + new tokens) is at most ``max_length`` (``None``: any), so a long request's rows do not pad every
    short one to their length."""

    def __init__(self, num_layers: int, max_length: int | None):
        self.num_layers, self.max_length = num_layers, max_length
        self.cache = SlotCache(num_layers)
        self.rows: list[Row] = []
        self.next_tokens = torch.zeros(0, dtype=torch.long)

    def takes(self, request: EngineRequest) -> bool:
        return self.max_length is None or request.slot_length <= self.max_length

    def slot_length(self, request: EngineRequest) -> int:
        """The lane's slot length once ``request``'s rows join."""
        return max(self.cache.capacity_length if self.rows else 0, quantized(request.slot_length))

    def clear(self) -> None:
        self.cache, self.rows, self.next_tokens = SlotCache(self.num_layers), [], torch.zeros(0, dtype=torch.long)


class PrefillChunk(NamedTuple):
    """Prompt tokens ``begin`` .. ``end`` - 1 of ``request``, prefilled this step."""

    request: EngineRequest
    begin: int
    end: int


@dataclass
class StepPlan:
    """One step's work: each lane's live (not parked) row slots decode one token, then the prompt chunks."""

    decode: list[tuple[Lane, list[int]]]
    prefill: list[PrefillChunk]


class Scheduler:
    """Queues, lanes and the KV budget of an engine. ``max_rows`` rows run at once, a step carries
    ``step_tokens`` tokens, a request keeps to ``max_share`` of the KV the others leave it, the oldest
    ``max_requests`` requests run (None: any number); ``model_config`` shapes the prompt caches."""

    def __init__(
        self,
        lanes: list[Lane],
        prefixes: PrefixCache,
        *,
        bytes_per_token: int,
        kv_budget_bytes: int,
        max_rows: int,
        step_tokens: int,
        max_share: float,
        max_requests: int | None = None,
        model_config: Any = None,
    ):
        self.lanes, self.prefixes, self.model_config = lanes, prefixes, model_config
        self.bytes_per_token, self.kv_budget_bytes = bytes_per_token, kv_budget_bytes
        self.max_rows, self.step_tokens, self.max_share, self.max_requests = max_rows, step_tokens, max_share, max_requests
        self.waiting: list[EngineRequest] = []  # submitted, some rows not yet running
        self.running: set[EngineRequest] = set()  # some rows running

    @property
    def rows(self) -> list[Row]:
        """Every running row (all lanes)."""
        return [row for lane in self.lanes for row in lane.rows]

    def add(self, request: EngineRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Whether a step now would do anything but wait for parked rows."""
        return bool(self.waiting) or any(row.parked is None for row in self.rows)

    def drop_all(self) -> set[EngineRequest]:
        """Forget every request (a step failed under them); returns them."""
        requests = {*self.waiting, *(row.request for row in self.rows)}
        self.waiting, self.running = [], set()
        for lane in self.lanes:
            lane.clear()
        return requests

    # ---- the KV budget: the one gate ----------------------------------------------------------

    def held_bytes(self) -> int:
        """The KV cache requests hold: every lane's slots and the prompt caches of requests whose rows
        wait (the prefix cache's blocks give way to it)."""
        return sum(lane.cache.bytes(self.bytes_per_token) for lane in self.lanes) + self._prompt_cache_bytes()

    def room_bytes(self) -> int:
        """What the KV budget leaves beside what requests hold: the most the prefix cache may keep."""
        return self.kv_budget_bytes - self.held_bytes()

    def fits(self, extra_bytes: int) -> bool:
        """Whether requests may hold ``extra_bytes`` more (negative: less) within the KV budget."""
        return self.held_bytes() + extra_bytes <= self.kv_budget_bytes

    def reserve(self, request: EngineRequest) -> bool:
        """Start ``request``'s prompt cache if its whole prompt fits the budget, after the blocks of it the
        prefix cache holds (which then gives way to it); False: it does not fit now."""
        if not self.fits(len(request.prompt_ids) * self.bytes_per_token):
            return False
        request._prefilled, cache = self.prefixes.lookup(request.prompt_ids, self.model_config)
        request.cached_prompt_tokens = request._prefilled
        request._cache = cache if cache is not None else DynamicCache(config=self.model_config)
        self.make_room()
        return True

    def release(self, request: EngineRequest) -> bool:
        """Free ``request``'s prompt cache; with no rows left to start it leaves the waiting queue. True:
        it is done (no rows waiting or running)."""
        request._cache = None
        if request.pending_rows:
            return False
        self.waiting.remove(request)
        return not request._running

    def release_row(self, request: EngineRequest) -> bool:
        """One of ``request``'s rows retired (its slot already freed). True: the request is done."""
        request._running -= 1
        if request._running:
            return False
        self.running.discard(request)
        return not request.pending_rows and request not in self.waiting

    def slot_capacity(self, lane: Lane, rows_needed: int, length: int) -> int:
        """Slots to allocate in ``lane`` for ``rows_needed`` rows of ``length`` positions: room to grow
        (doubling, at least 8, at most ``max_rows``) where the budget holds it."""
        cache = lane.cache
        capacity = min(self.max_rows, max(rows_needed, 8, 2 * cache.capacity_rows if cache.capacity_rows < rows_needed else 0))
        lane_bytes = cache.bytes(self.bytes_per_token)
        while not self.fits(cache.bytes(self.bytes_per_token, capacity, length) - lane_bytes) and capacity > rows_needed:
            capacity -= 1
        return capacity

    def make_room(self) -> None:
        """The prefix cache gives way to what requests hold (after a prompt cache started or a lane grew)."""
        self.prefixes.shrink_to(self.room_bytes())

    def _prompt_cache_bytes(self) -> int:
        return sum(q._prefilled for q in self.waiting if q._cache is not None) * self.bytes_per_token

    # ---- each step's plan ---------------------------------------------------------------------

    def prefill_budget(self) -> int:
        """Prompt tokens a step may carry: running rows decode first (one token each), prompts get the
        rest of ``step_tokens``, and at least an eighth of it."""
        return max(self.step_tokens - len(self.rows), self.step_tokens // 8)

    def schedule(self, prefill_budget: int) -> StepPlan:
        """This step's plan: every lane's live rows, and prompt chunks within ``prefill_budget`` tokens."""
        prefill = self._prefill_chunks(prefill_budget)
        decode = []
        for lane in self.lanes:
            live = [i for i, row in enumerate(lane.rows) if row.parked is None]
            if live:
                decode.append((lane, live))
        return StepPlan(decode, prefill)

    def _prefill_chunks(self, budget: int) -> list[PrefillChunk]:
        """Prompt chunks of the waiting requests, shortest remaining first (for its wait so far), within
        ``budget`` tokens; a prompt starts only when :meth:`reserve` holds it."""
        now = time.monotonic()
        todo = self._active([q for q in self.waiting if not q.prefilled and not q.cancelled.is_set()])
        todo.sort(key=lambda q: ((len(q.prompt_ids) - q._prefilled) / (1 + now - q.submitted_s), q.submitted_s))
        chunks = []
        for request in todo:
            if budget <= 0:
                break
            if request._cache is None and not self.reserve(request):
                continue
            end = min(len(request.prompt_ids), request._prefilled + budget)
            chunks.append(PrefillChunk(request, request._prefilled, end))
            budget -= end - request._prefilled
        return chunks

    def admissions(self) -> Iterator[tuple[EngineRequest, int]]:
        """(request, rows to start) for the prefilled requests, short requests first, each within a fair
        share of ``max_rows`` and the KV budget. Lazy: the caller starts each request's rows (see
        :meth:`admit`) before the next is weighed."""
        ready = self._active([q for q in self.waiting if q.prefilled and q.pending_rows])
        if not ready:
            return
        ready.sort(key=lambda q: (q.pending_rows * q.max_new_tokens, q.submitted_s))
        requests_wanting = self._requests_wanting_rows()
        for request in ready:
            room = self.max_rows - len(self.rows)
            share = self.max_rows if requests_wanting == 1 else max(1, self.max_rows // requests_wanting)
            count = min(request.pending_rows, room, max(0, share - request._running))
            count = self.rows_that_fit(request, count)
            if count:
                yield request, count

    def admit(self, request: EngineRequest, count: int) -> range:
        """Count ``count`` more of ``request``'s rows as running; returns their samples."""
        samples = range(request._next_sample, request._next_sample + count)
        request._next_sample += count
        request._running += count
        self.running.add(request)
        return samples

    def rows_that_fit(self, request: EngineRequest, count: int) -> int:
        """As many of ``count`` rows as the KV budget holds (slots padded to the longest row of their
        lane), the request keeping to ``max_share`` of what the others leave of it (so there is always
        room for one more request's first row); a request's first row needs only to fit."""
        lane = self.lane_for(request)
        length = lane.slot_length(request)
        lane_bytes = lane.cache.bytes(self.bytes_per_token)
        held = self.held_bytes() - lane_bytes
        own_prompt = request._prefilled * self.bytes_per_token if request._cache is not None else 0
        others = (len(lane.rows) - request._running) * length * self.bytes_per_token + held - own_prompt
        while count:
            fits = self.fits(lane.cache.bytes(self.bytes_per_token, len(lane.rows) + count, length) - lane_bytes)
            own = (request._running + count) * length * self.bytes_per_token
            if fits and (own <= self.max_share * (self.kv_budget_bytes - others) or request._running == 0 and count == 1):
                return count
            count -= 1
        return 0

    def lane_for(self, request: EngineRequest) -> Lane:
        return next(lane for lane in self.lanes if lane.takes(request))

    def _requests_wanting_rows(self) -> int:
        """How many requests run rows or wait for some (the fair share of the rows divides by it)."""
        return len({*self.running, *(q for q in self.waiting if q.pending_rows)})

    def _active(self, requests: list[EngineRequest]) -> list[EngineRequest]:
        """``requests`` less those beyond ``max_requests`` (the oldest requests in the engine run first)."""
        if self.max_requests is None:
            return requests
        oldest = sorted({*self.running, *self.waiting}, key=lambda q: q.submitted_s)[: self.max_requests]
        return [q for q in requests if q in oldest]
