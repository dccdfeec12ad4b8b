"""The engine's scheduler: who runs each step and how many tokens each (vLLM v1's split of the engine).

It owns the waiting and running requests, the lanes of running rows and the KV budget, behind one gate
(:meth:`Scheduler.fits`, :meth:`Scheduler.reserve`, :meth:`Scheduler.release`), and allocates the KV of
the rows it admits (:meth:`Scheduler.start_rows`). Each step it hands the executor a :class:`StepPlan` of
plain data and takes back a :class:`StepOutput` (applied by ``rlvr.generation.outputs``). Requests start
in arrival order within a lookahead of rows; the oldest with no row yet (the head) is never overtaken for
the KV budget (docs/architecture.md, "The generation engine"). It reads request metadata only and keeps
each request's progress (:class:`RequestState`), so it is tested without a model (tests/test_engine_scheduler.py).
"""

from __future__ import annotations

import heapq
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

from transformers import DynamicCache

from rlvr.generation.kv_cache import SlotCache, quantized
from rlvr.generation.prefix_cache import PrefixCache
from rlvr.generation.request import RowSampling

if TYPE_CHECKING:
    from rlvr.environments.driver import EpisodeDriver
    from rlvr.generation.request import EngineRequest


@dataclass
class Row:
    request: EngineRequest
    sample: int
    driver: EpisodeDriver | None = None  # its episode (requests with an environment)
    parked: Future | None = None  # a turn end being observed off the engine thread
    parked_reason: str | None = None  # how the row finishes if that observation injects nothing
    sampling: RowSampling = field(init=False)  # how it draws, its seed derived once (each step's plan carries it)

    def __post_init__(self) -> None:
        self.sampling = self.request.sampling(self.sample)


class Lane:
    """Running rows whose slots share one :class:`SlotCache` and one decode step: rows whose slot (prompt
    + new tokens) is at most ``max_length`` (``None``: any), so a long request's rows do not pad every
    short one to their length."""

    def __init__(self, num_layers: int, max_length: int | None):
        self.num_layers, self.max_length = num_layers, max_length
        self.cache = SlotCache(num_layers)
        self.rows: list[Row] = []
        self.next_tokens: list[int] = []  # each row's token for the next step

    def takes(self, request: EngineRequest) -> bool:
        return self.max_length is None or request.slot_length <= self.max_length

    def slot_length(self, request: EngineRequest) -> int:
        """The lane's slot length once ``request``'s rows join."""
        return max(self.cache.capacity_length if self.rows else 0, quantized(request.slot_length))

    def clear(self) -> None:
        self.cache, self.rows, self.next_tokens = SlotCache(self.num_layers), [], []

    def capacity(self, trimmed: bool = False) -> tuple[int, int]:
        """The slots and positions the lane's buffers hold (``trimmed``: would hold after :meth:`trim`)."""
        if trimmed:
            return len(self.rows), max((quantized(row.request.slot_length) for row in self.rows), default=0)
        return self.cache.capacity_rows, self.cache.capacity_length

    def slack_bytes(self, bytes_per_token: int) -> int:
        """What :meth:`trim` would free."""
        return self.cache.bytes(bytes_per_token) - self.cache.bytes(bytes_per_token, *self.capacity(trimmed=True))

    def trim(self) -> None:
        """Buffers for the running rows only: no free slots, no positions past the longest row's slot."""
        self.cache.resize(*self.capacity(trimmed=True), self.cache.layers[0].keys)


@dataclass(eq=False)
class RequestState:
    """The scheduler's part of a request: its prompt cache and how far it got, its rows started and running."""

    request: EngineRequest
    prefilled: int = 0  # prompt tokens whose keys and values are cached
    cache: DynamicCache | None = None  # the prompt's, while rows wait to start from it
    first_tokens: list[int] = field(default_factory=list)  # each row's first token (sampled once the prompt is whole)
    first_logprobs: list[float] = field(default_factory=list)
    next_sample: int = 0  # the next row to start
    running: int = 0  # rows running

    @property
    def whole_prompt(self) -> bool:
        return self.prefilled == len(self.request.prompt_ids)

    @property
    def pending_rows(self) -> int:
        return self.request.num_samples - self.next_sample


class PrefillChunk(NamedTuple):
    """A request's prompt tokens ``begin`` .. ``end`` - 1 (``tokens``), prefilled this step; on the prompt's
    last chunk, how each of its rows draws its first token (``sampling``, every sample's; empty before)."""

    request_id: int
    tokens: list[int]
    begin: int
    end: int
    sampling: tuple[RowSampling, ...] = ()

    @property
    def last(self) -> bool:
        return bool(self.sampling)


class LaneStep(NamedTuple):
    """One lane's decode in a step: its ``lane`` index, every row's next token and position (its cache
    length; parked rows ride along), the ``live`` (not parked) row slots whose tokens are sampled, and how;
    where each row's prompt is held (:func:`shared_prompts`)."""

    lane: int
    tokens: list[int]
    positions: list[int]
    live: list[int]
    sampling: list[RowSampling]  # of the live rows
    prompts: tuple[tuple[int, int], ...] = ()  # each row's (slot holding its prompt, prompt length): shared_prompts


def shared_prompts(rows: list[Row]) -> tuple[tuple[int, int], ...]:
    """Each of a lane's rows, by slot: the slot of its request's first row there and its prompt's length.
    Every slot of a request took the prompt's keys and values (``SlotCache.add_rows``) and writes only
    past them, so its rows may read them from that one slot."""
    first: dict[int, int] = {}
    return tuple((first.setdefault(row.request.request_id, slot), len(row.request.prompt_ids)) for slot, row in enumerate(rows))


@dataclass
class StepPlan:
    """One step's work, as plain data: each lane's rows decode one token, then the prompt chunks; and the
    requests done since the last plan (their rows' generators go)."""

    decode: list[LaneStep]
    prefill: list[PrefillChunk]
    finished: list[int] = field(default_factory=list)


class LaneOutput(NamedTuple):
    """A lane's sampled tokens and their log-probs, one per live row slot."""

    lane: int
    live: list[int]
    tokens: list[int]
    logprobs: list[float]


class PrefillOutput(NamedTuple):
    """A prompt chunk run: its request's id, the prompt tokens now cached, and once the prompt is whole its
    rows' first tokens and their log-probs (one per sample; empty before)."""

    request_id: int
    end: int
    tokens: list[int]
    logprobs: list[float]


@dataclass
class StepOutput:
    """What the executor computed for a :class:`StepPlan`: each lane's sampled tokens, each chunk's end, and the tokens the forward ran."""

    decode: list[LaneOutput] = field(default_factory=list)
    prefill: list[PrefillOutput] = field(default_factory=list)
    tokens: int = 0


class QueuedWork(NamedTuple):
    """One request as a :class:`Backlog` sees it: its running rows' expected tokens left, its rows not
    started and the expected tokens of each, whether its prompt cache is started and whether a row is, and
    its prompt tokens left to prefill (those the prefix cache is expected to hold left out) of its prompt's length."""

    running: tuple[int, ...]
    pending: int
    tokens: int
    prompt_started: bool
    row_started: bool
    prompt_left: int = 0
    prompt_length: int = 0


@dataclass(eq=False)
class _Replayed:
    """A :class:`QueuedWork` as :meth:`Backlog.slot_steps` replays it: its running rows' end steps, and ``index`` in the queue."""

    running: list[int]
    pending: int
    tokens: int
    prompt_started: bool
    row_started: bool
    index: int


@dataclass(frozen=True)
class Backlog:
    """The work in the engine at the end of a step, each request's rows counted at how much of its budget
    a finished row has used lately; built on the engine's thread, read from any other. :meth:`start_steps`
    replays the scheduler's admission over it for a new request."""

    requests: tuple[QueuedWork, ...] = ()  # in arrival order
    rows: int = 1  # rows that run at once: the row slots, or fewer where the KV budget holds fewer at these lengths
    max_rows: int = 1
    lookahead_rows: int = 1  # rows running or about to start past which no prompt starts (Scheduler.start_prompts)
    max_share: float = 1.0  # of the rows the others leave, the most a request's rows take (the KV budget's share)
    max_requests: int | None = None  # the oldest this many requests run (None: any number)
    cancels: tuple[threading.Event, ...] = field(default=(), compare=False, repr=False)  # each request's, where known
    prefill_budget: int | None = None  # prompt tokens a step carries now (None: not known, see prefill_before)
    keys_per_token: float = 0.0  # keys whose attention costs a token's projections (0: not counted, see prompt_work)

    def live(self) -> Backlog:
        """This backlog without the requests cancelled since it was built (their rows go at the next step)."""
        keep = [i for i, cancelled in enumerate(self.cancels) if not cancelled.is_set()]
        if len(keep) == len(self.cancels):
            return self
        return replace(self, requests=tuple(self.requests[i] for i in keep), cancels=tuple(self.cancels[i] for i in keep))

    def start_steps(self, step_tokens: int, prompt_tokens: int = 0) -> float:
        """Steps until a new request of ``prompt_tokens`` has its first token: until a slot takes it
        (:meth:`slot_steps`) or its prompt and those prefilled before it (:meth:`prefill_before`) have
        prefilled at ``prefill_budget`` (where known, else ``step_tokens``) a step, whichever is later, then
        its own step."""
        prompt_steps = (self.prefill_before(prompt_tokens) + prompt_tokens) / (step_tokens if self.prefill_budget is None else self.prefill_budget)
        return 1 + max(self.slot_steps(), prompt_steps)

    def prefill_before(self, prompt_tokens: int) -> int:
        """Prompt tokens the steps up to a new prompt's last chunk carry beside it. Prompts prefill shortest
        first (:meth:`Scheduler.schedule`), so the shorter ones whole and the longer ones as far as its
        length; and each step fills its ``prefill_budget`` with whatever prompts wait, so a prompt that
        would fit a step's spare room waits for the others in that step too."""
        ahead = sum(min(q.prompt_left, prompt_tokens) for q in self.requests)
        if self.prefill_budget is None:
            return ahead
        steps = -(-(ahead + prompt_tokens) // self.prefill_budget)
        return min(sum(q.prompt_left for q in self.requests), steps * self.prefill_budget - prompt_tokens)

    def prefill_work(self, begin: int, end: int) -> float:
        """A new prompt's positions ``begin`` .. ``end`` - 1 and the tokens prefilled before it
        (:meth:`prefill_before`) in token-equivalents (:func:`prompt_work`), each prompt ahead from the
        position it has reached."""
        own = end - begin
        spans = [(start := max(q.prompt_length, q.prompt_left) - q.prompt_left, start + min(q.prompt_left, own)) for q in self.requests]
        ahead = sum(e - b for b, e in spans)
        before = self.prefill_before(own)
        work = sum(prompt_work(b, e, self.keys_per_token) for b, e in spans) * before / ahead if ahead else before
        return work + prompt_work(begin, end, self.keys_per_token)

    def slot_steps(self) -> int:
        """Decode steps until a new one-row request's first row would start, replaying
        :meth:`Scheduler.start_prompts` and :meth:`Scheduler.admissions` as rows end: prompts start in
        arrival order within the lookahead; free slots go to the oldest request with no row started (the
        head) once its prompt has started, then to the others, shortest first, each within its fair share
        of the rows and of the KV budget."""
        queue = [_Replayed(list(q.running), q.pending, q.tokens, q.prompt_started, q.row_started, i) for i, q in enumerate(self.requests)]
        new = _Replayed([], 1, 1, False, False, len(queue))
        queue.append(new)
        ends = [(end, q.index) for q in queue for end in q.running]
        heapq.heapify(ends)
        now = 0
        while True:
            active = [q for q in queue if q.running or q.pending][: self.max_requests]
            ahead = len(ends) + sum(q.pending for q in active if q.prompt_started)
            for q in (q for q in active if not q.prompt_started):
                if ahead >= self.lookahead_rows:
                    break
                q.prompt_started, ahead = True, ahead + q.pending
            wanting = sum(1 for q in queue if q.running or q.pending)
            share = self.max_rows if wanting == 1 else max(1, self.max_rows // wanting)
            head = next((q for q in active if not q.row_started and q.pending), None)
            for q in sorted((q for q in active if q.prompt_started and q.pending), key=lambda q: (q is not head, q.pending * q.tokens)):
                kv_share = max(int(self.max_share * (self.rows - len(ends) + len(q.running))), 0 if q.running else 1)
                count = min(q.pending, self.rows - len(ends), share - len(q.running), kv_share - len(q.running))
                if count <= 0:
                    continue
                if q is new:
                    return now
                for _ in range(count):
                    q.running.append(now + q.tokens)
                    heapq.heappush(ends, (now + q.tokens, q.index))
                q.pending, q.row_started = q.pending - count, True
            if not ends:
                return now
            now = ends[0][0]
            while ends and ends[0][0] == now:  # every row ending at this step frees its slot
                queue[heapq.heappop(ends)[1]].running.remove(now)

    def with_posted(self, requests: list[EngineRequest], row_fill: float, uncached: Callable[[Sequence[int]], int] = len) -> Backlog:
        """This backlog with ``requests`` queued behind it: those posted since the step that built it, so
        a burst arriving between two steps sees each other's rows and prompts (each prompt's ``uncached``
        tokens: what the prefix cache does not hold of it)."""
        if not requests:
            return self
        posted = tuple(
            QueuedWork((), q.num_samples, expected_tokens(q.max_new_tokens, row_fill), False, False, uncached(q.prompt_ids), len(q.prompt_ids))
            for q in requests
        )
        cancels = self.cancels + tuple(q.cancelled for q in requests) if len(self.cancels) == len(self.requests) else ()
        return replace(self, requests=self.requests + posted, cancels=cancels)


def prompt_work(begin: int, end: int, keys_per_token: float) -> float:
    """Prefilling prompt positions ``begin`` .. ``end`` - 1 in token-equivalents: each token's projections (1)
    and its attention to the keys up to its own (every layer's, no sliding window), ``keys_per_token`` keys
    costing one token's projections (0: not counted). A 1,000-token prompt of the embedded model (3,073 keys a
    token) is 1,163 of them."""
    tokens = end - begin
    return tokens + (end * (end + 1) - begin * (begin + 1)) / (2 * keys_per_token) if keys_per_token else float(tokens)


def expected_tokens(max_new_tokens: int, row_fill: float) -> int:
    """The tokens a row of ``max_new_tokens`` is expected to make: ``row_fill``, the share of their budget finished rows have lately used."""
    return max(1, round(row_fill * max_new_tokens))


class Scheduler:
    """Queues, lanes and the KV budget of an engine. ``max_rows`` rows run at once, a step carries
    ``step_tokens`` tokens with every row slot taken and up to ``max_step_tokens`` (None: as many) with
    none (see :meth:`prefill_budget`), a request keeps to ``max_share`` of the KV the others leave it, the
    oldest ``max_requests`` requests run (None: any number); ``model_config`` shapes the prompt caches;
    ``keys_per_token`` weighs a prompt token's attention in the backlog's prefill work (:func:`prompt_work`)."""

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
        max_step_tokens: int | None = None,
        max_requests: int | None = None,
        model_config: Any = None,
        keys_per_token: float = 0.0,
    ):
        self.lanes, self.prefixes, self.model_config, self.keys_per_token = lanes, prefixes, model_config, keys_per_token
        self.bytes_per_token, self.kv_budget_bytes = bytes_per_token, kv_budget_bytes
        self.max_rows, self.step_tokens, self.max_share, self.max_requests = max_rows, step_tokens, max_share, max_requests
        self.max_step_tokens = max(step_tokens, max_step_tokens or step_tokens)
        self.waiting: list[EngineRequest] = []  # submitted, some rows not yet running
        self.running: set[EngineRequest] = set()  # some rows running
        self.states: dict[EngineRequest, RequestState] = {}  # every request in the engine
        self.by_id: dict[int, RequestState] = {}  # the same, by request id (a step's plan and output name them so)
        self.finished_ids: list[int] = []  # requests forgotten since the last plan (its ``finished``)
        self.row_fill = 1.0  # a moving average of the share of its token budget a finished row used
        self.reserved_tokens = 0  # the whole prompts of the requests whose prompt caches are started
        self.lookahead_rows = max_rows + max_rows // 4  # rows running or about to start, past which no request starts

    @property
    def rows(self) -> list[Row]:
        """Every running row (all lanes)."""
        return [row for lane in self.lanes for row in lane.rows]

    def resize(self, max_rows: int, kv_budget_bytes: int) -> None:
        """``max_rows`` rows at once within ``kv_budget_bytes`` (an idle engine's, sized for its next call)."""
        self.max_rows, self.kv_budget_bytes = max_rows, kv_budget_bytes
        self.lookahead_rows = max_rows + max_rows // 4

    def add(self, request: EngineRequest) -> None:
        self.waiting.append(request)
        self.states[request] = RequestState(request)
        self.by_id[request.request_id] = self.states[request]

    def has_work(self) -> bool:
        """Whether a step now would do anything but wait for parked rows."""
        return bool(self.waiting) or any(row.parked is None for row in self.rows)

    def drop_all(self) -> set[EngineRequest]:
        """Forget every request (a step failed under them); returns them."""
        requests = {*self.waiting, *(row.request for row in self.rows)}
        self.finished_ids += list(self.by_id)
        self.waiting, self.running, self.states, self.by_id, self.reserved_tokens = [], set(), {}, {}, 0
        for lane in self.lanes:
            lane.clear()
        return requests

    # ---- the KV budget: the one gate ----------------------------------------------------------

    def held_bytes(self) -> int:
        """The KV cache requests hold: every lane's slots and the whole prompts of the started requests
        whose rows wait (the prefix cache's blocks give way to it)."""
        return sum(lane.cache.bytes(self.bytes_per_token) for lane in self.lanes) + self.reserved_tokens * self.bytes_per_token

    def room_bytes(self) -> int:
        """What the KV budget leaves beside what requests hold: the most the prefix cache may keep."""
        return self.kv_budget_bytes - self.held_bytes()

    def fits(self, extra_bytes: int, kept_bytes: int = 0) -> bool:
        """Whether requests may hold ``extra_bytes`` more (negative: less) within the KV budget, leaving
        ``kept_bytes`` free (:meth:`kept_for_head`)."""
        return self.held_bytes() + extra_bytes + kept_bytes <= self.kv_budget_bytes

    def kept_for_head(self, request: EngineRequest, head: RequestState | None = None) -> int:
        """The KV ``request`` must leave free: what the head (None: :meth:`head`) still needs, unless it is the head."""
        head = head or self.head()
        return 0 if head is None or head.request is request else self.head_need(head)

    def head(self) -> RequestState | None:
        """The oldest live request with no row started yet: no other request takes the KV it needs."""
        candidates = [self.states[q] for q in self._active(self.waiting) if not q.cancelled.is_set()]
        return min((s for s in candidates if s.next_sample == 0), key=lambda s: s.request.submitted_s, default=None)

    def head_need(self, head: RequestState, trimmed: bool = False) -> int:
        """The KV ``head`` needs to start its first row: its whole prompt if not started, and the growth of
        its lane by one slot (``trimmed``: once the lanes give up their free slots)."""
        request = head.request
        lane = self.lane_for(request)
        rows, length = lane.capacity(trimmed)
        padded = max(length if lane.rows else 0, quantized(request.slot_length))
        growth = 0 if len(lane.rows) < rows and padded <= length else (len(lane.rows) + 1) * padded - rows * length
        return (growth + (0 if head.cache is not None else len(request.prompt_ids))) * self.bytes_per_token

    def make_way_for_head(self, head: RequestState | None) -> None:
        """Lanes give up their free slots (:meth:`Lane.trim`) when ``head`` does not fit and that makes it fit."""
        if head is None or self.fits(self.head_need(head)):
            return
        slack = sum(lane.slack_bytes(self.bytes_per_token) for lane in self.lanes if lane.rows)
        if slack and self.fits(self.head_need(head, trimmed=True) - slack):
            for lane in self.lanes:
                if lane.rows and lane.slack_bytes(self.bytes_per_token):
                    lane.trim()

    def reserve(self, request: EngineRequest) -> bool:
        """Start ``request``'s prompt cache if its whole prompt fits the budget (beside the head's need),
        after the blocks of it the prefix cache holds (which then gives way to it); False: not now."""
        if not self.fits(len(request.prompt_ids) * self.bytes_per_token, self.kept_for_head(request)):
            return False
        self.reserved_tokens += len(request.prompt_ids)
        state = self.states[request]
        state.prefilled, cache = self.prefixes.lookup(request.prompt_ids, self.model_config)
        request.cached_prompt_tokens = state.prefilled
        state.cache = cache if cache is not None else DynamicCache(config=self.model_config)
        self.make_room()
        return True

    def release(self, request: EngineRequest) -> bool:
        """Free ``request``'s prompt cache; with no rows left to start it leaves the waiting queue. True:
        it is done (no rows waiting or running)."""
        state = self.states[request]
        if state.cache is not None:
            self.reserved_tokens -= len(request.prompt_ids)
        state.cache, state.first_tokens, state.first_logprobs = None, [], []
        if state.pending_rows:
            return False
        self.waiting.remove(request)
        return self._forget_if_done(state)

    def skip_pending(self, request: EngineRequest) -> range:
        """``request``'s rows not started yet never will (it was cancelled); returns their samples."""
        state = self.states[request]
        skipped = range(state.next_sample, request.num_samples)
        state.next_sample = request.num_samples
        return skipped

    def release_row(self, request: EngineRequest, generated: int | None = None) -> bool:
        """One of ``request``'s rows retired (its slot already freed) after ``generated`` tokens (None:
        cancelled). True: the request is done."""
        if generated is not None:
            self.row_fill = 0.95 * self.row_fill + 0.05 * min(1.0, generated / max(1, request.max_new_tokens))
        state = self.states[request]
        state.running -= 1
        if state.running:
            return False
        self.running.discard(request)
        return self._forget_if_done(state)

    def _forget_if_done(self, state: RequestState) -> bool:
        """Forget ``state``'s request if no rows of it wait or run; True: it is done."""
        if state.running or state.pending_rows or state.request in self.waiting:
            return False
        del self.states[state.request]
        del self.by_id[state.request.request_id]
        self.finished_ids.append(state.request.request_id)
        return True

    def slot_capacity(self, lane: Lane, rows_needed: int, length: int, request: EngineRequest) -> int:
        """Slots to allocate in ``lane`` for ``rows_needed`` rows of ``length`` positions, ``request``'s
        joining: room for the rows of started requests waiting to join it (one allocation, not a copy as
        each joins) and to grow (doubling, at least 8, the free slots within an eighth of the KV budget), at
        most ``max_rows``, where the budget holds it beside the head's need."""
        cache = lane.cache
        capacity = min(self.max_rows, max(rows_needed, 8, 2 * cache.capacity_rows if cache.capacity_rows < rows_needed else 0))
        capacity = min(capacity, rows_needed + self.kv_budget_bytes // (8 * length * self.bytes_per_token))
        capacity = max(capacity, min(self.max_rows, len(lane.rows) + self.joining_rows(lane, length)))
        lane_bytes, kept = cache.bytes(self.bytes_per_token), self.kept_for_head(request)
        while capacity > rows_needed and not self.fits(cache.bytes(self.bytes_per_token, capacity, length) - lane_bytes, kept):
            capacity -= 1
        return capacity

    def joining_rows(self, lane: Lane, length: int) -> int:
        """Rows of the live started requests (their prompts cached or being cached) still to start in
        ``lane`` within slots of ``length`` positions."""
        live = (self.states[q] for q in self._active(self.waiting) if not q.cancelled.is_set())
        started = [s for s in live if s.cache is not None or s.whole_prompt]
        return sum(s.pending_rows for s in started if self.lane_for(s.request) is lane and quantized(s.request.slot_length) <= length)

    def make_room(self) -> None:
        """The prefix cache gives way to what requests hold (after a prompt cache started or a lane grew)."""
        self.prefixes.shrink_to(self.room_bytes())

    def backlog(self, planned: dict[int, int] | None = None) -> Backlog:
        """The work in the engine now (see :class:`Backlog`), the prompts ``planned`` (by request id) as far as the end of their chunk."""
        fill, running = self.row_fill, {}
        for row in self.rows:
            left = max(1, expected_tokens(row.request.max_new_tokens, fill) - len(row.request.token_ids[row.sample]))
            running.setdefault(row.request, []).append(left)
        in_waiting = set(self.waiting)
        in_engine = [*self.waiting, *(q for q in self.running if q not in in_waiting)]
        live = [q for q in in_engine if not q.cancelled.is_set() and q in self.states]
        planned = planned or {}
        live.sort(key=lambda q: q.submitted_s)  # stable
        requests = tuple(self._queued_work(q, running.get(q, ()), fill, planned.get(q.request_id, 0)) for q in live)
        lengths = [quantized(row.request.slot_length) for row in self.rows]
        lengths += [quantized(q.slot_length) for q in self.waiting if not q.cancelled.is_set() and self.states[q].pending_rows]
        fit = self.kv_budget_bytes * len(lengths) // (self.bytes_per_token * sum(lengths)) if lengths else self.max_rows
        rows = max(1, min(self.max_rows, fit))
        cancels = tuple(q.cancelled for q in live)
        budget = self.prefill_budget()
        return Backlog(requests, rows, self.max_rows, self.lookahead_rows, self.max_share, self.max_requests, cancels, budget, self.keys_per_token)

    def _queued_work(self, request: EngineRequest, running: list[int], fill: float, planned_end: int = 0) -> QueuedWork:
        state = self.states[request]
        prefilled = max(state.prefilled, planned_end)
        started = state.cache is not None or state.whole_prompt
        prompt_left = len(request.prompt_ids) - prefilled if started else self.prefixes.uncached_tokens(request.prompt_ids)
        tokens = expected_tokens(request.max_new_tokens, fill)
        return QueuedWork(tuple(running), state.pending_rows, tokens, started, state.next_sample > 0, prompt_left, len(request.prompt_ids))

    # ---- each step's plan ---------------------------------------------------------------------

    def step_budget(self) -> int:
        """Tokens this step may carry: ``max_step_tokens`` with every row slot free, shrinking in step with
        the slots taken to ``step_tokens`` with none free, and ``step_tokens`` while requests queue unstarted
        (the rows or the KV budget are full: prompts ahead of them would only wait). A long prompt on an
        idle engine prefills in one step; under load a step stays short (the running rows' next tokens
        wait for it)."""
        if any(s.cache is None and not s.whole_prompt for q in self.waiting if not q.cancelled.is_set() and (s := self.states[q])):
            return self.step_tokens
        free = 1 - min(len(self.rows), self.max_rows) / self.max_rows
        return self.step_tokens + int((self.max_step_tokens - self.step_tokens) * free)

    def prefill_budget(self) -> int:
        """Prompt tokens a step may carry: running rows decode first (one token each), prompts get the
        rest of :meth:`step_budget`, and at least an eighth of ``step_tokens`` (and one token)."""
        return max(self.step_budget() - len(self.rows), self.step_tokens // 8, 1)

    def schedule(self, prefill_budget: int | None = None) -> StepPlan:
        """This step's plan: every lane's live rows, and prompt chunks within ``prefill_budget`` tokens
        (None: :meth:`prefill_budget` once the prompts that may start have started)."""
        prefill = self._prefill_chunks(prefill_budget)
        decode = []
        for index, lane in enumerate(self.lanes):
            live = [i for i, row in enumerate(lane.rows) if row.parked is None]
            if live:
                positions = lane.cache.lengths[: len(lane.rows)].tolist()
                sampling = [lane.rows[i].sampling for i in live]
                decode.append(LaneStep(index, list(lane.next_tokens), positions, live, sampling, shared_prompts(lane.rows)))
        finished, self.finished_ids = self.finished_ids, []
        return StepPlan(decode, prefill, finished)

    def _prefill_chunks(self, budget: int | None) -> list[PrefillChunk]:
        """Prompt chunks of the started requests, shortest remaining first (for its wait so far), within
        ``budget`` tokens, after :meth:`start_prompts`."""
        live = [self.states[q] for q in self._active([q for q in self.waiting if not q.cancelled.is_set()])]
        self.start_prompts(live)
        budget = self.prefill_budget() if budget is None else budget
        now = time.monotonic()
        todo = [s for s in live if s.cache is not None and not s.whole_prompt]
        todo.sort(key=lambda s: ((len(s.request.prompt_ids) - s.prefilled) / (1 + now - s.request.submitted_s), s.request.submitted_s))
        chunks = []
        for state in todo:
            if budget <= 0:
                break
            end = min(len(state.request.prompt_ids), state.prefilled + budget)
            request = state.request
            sampling = tuple(map(request.sampling, range(request.num_samples))) if end == len(request.prompt_ids) else ()
            chunks.append(PrefillChunk(request.request_id, request.prompt_ids[state.prefilled : end], state.prefilled, end, sampling))
            budget -= end - state.prefilled
        return chunks

    def start_prompts(self, live: list[RequestState]) -> None:
        """Start the ``live`` requests' prompt caches in arrival order while fewer than ``lookahead_rows``
        rows run or wait in started requests, and :meth:`reserve` holds each; the first that does not
        fit waits, and so do those after it."""
        self.make_way_for_head(self.head())
        ahead = len(self.rows) + sum(s.pending_rows for s in live if s.cache is not None or s.whole_prompt)
        for state in sorted((s for s in live if s.cache is None and not s.whole_prompt), key=lambda s: s.request.submitted_s):
            if ahead >= self.lookahead_rows or not self.reserve(state.request):
                return
            ahead += state.pending_rows

    def admissions(self) -> Iterator[tuple[EngineRequest, int]]:
        """(request, rows to start) for the prefilled requests, the head first, then short requests (for
        their wait so far), each within a fair share of ``max_rows`` and the KV budget. Lazy: the caller starts each request's rows (see
        :meth:`start_rows`) before the next is weighed."""
        ready = [self.states[q] for q in self._active(list(self.waiting))]
        ready = [s for s in ready if s.whole_prompt and s.pending_rows]
        if not ready:
            return
        head = self.head()  # once a pass: each request's rows leave it room, until its own rows start
        self.make_way_for_head(head)
        now = time.monotonic()  # the head first, then the shortest for its wait so far
        ready.sort(key=lambda s: (s is not head, s.pending_rows * s.request.max_new_tokens / (1 + now - s.request.submitted_s), s.request.submitted_s))
        requests_wanting = self._requests_wanting_rows()
        for state in ready:
            room = self.max_rows - len(self.rows)
            share = self.max_rows if requests_wanting == 1 else max(1, self.max_rows // requests_wanting)
            count = min(state.pending_rows, room, max(0, share - state.running))
            count = self.rows_that_fit(state.request, count, head)
            if count:
                yield state.request, count
                if state is head:
                    head = self.head()

    def start_rows(self, request: EngineRequest, rows: list[Row]) -> tuple[Lane, range]:
        """Start ``rows``, ``request``'s next samples (as :meth:`admissions` allows): their lane grows where it
        must (:meth:`slot_capacity`), each new slot takes the prompt's keys and values, and they count as
        running. Returns the lane and their slots."""
        state, count = self.states[request], len(rows)
        if [row.sample for row in rows] != list(range(state.next_sample, state.next_sample + count)):
            raise ValueError(f"rows of samples {[row.sample for row in rows]}: the request's next {count} start from {state.next_sample}")
        lane = self.lane_for(request)
        cache, length = lane.cache, lane.slot_length(request)
        rows_needed = len(lane.rows) + count
        if rows_needed > cache.capacity_rows or length > cache.capacity_length:
            cache.resize(self.slot_capacity(lane, rows_needed, length, request), length, state.cache.layers[0].keys)
            self.make_room()
        slots = cache.add_rows(state.cache, count)
        self.admit(request, count)
        lane.rows += rows
        return lane, slots

    def prefilled(self, output: PrefillOutput) -> None:
        """A chunk's ``output``: the request's prompt is cached up to its end; once whole, its rows' first
        tokens are kept for when they start and its blocks offered to the prefix cache."""
        state = self.by_id[output.request_id]
        request, state.prefilled = state.request, output.end
        if state.whole_prompt:
            state.first_tokens, state.first_logprobs = output.tokens, output.logprobs
            self.prefixes.store(request.prompt_ids, state.cache, self.room_bytes())

    def admit(self, request: EngineRequest, count: int) -> range:
        """Count ``count`` more of ``request``'s rows as running; returns their samples."""
        state = self.states[request]
        samples = range(state.next_sample, state.next_sample + count)
        state.next_sample += count
        state.running += count
        self.running.add(request)
        return samples

    def rows_that_fit(self, request: EngineRequest, count: int, head: RequestState | None = None) -> int:
        """As many of ``count`` rows as the KV budget holds (slots padded to the longest row of their
        lane), the request keeping to ``max_share`` of what the others leave of it (so there is always
        room for one more request's first row) and leaving the head's need; a request's first row needs
        only to fit."""
        lane = self.lane_for(request)
        length = lane.slot_length(request)
        lane_bytes = lane.cache.bytes(self.bytes_per_token)
        held = self.held_bytes() - lane_bytes
        state = self.states[request]
        own_prompt = len(request.prompt_ids) * self.bytes_per_token if state.cache is not None else 0
        others = (len(lane.rows) - state.running) * length * self.bytes_per_token + held - own_prompt
        kept = self.kept_for_head(request, head)
        while count:
            fits = self.fits(lane.cache.bytes(self.bytes_per_token, len(lane.rows) + count, length) - lane_bytes, kept)
            own = (state.running + count) * length * self.bytes_per_token
            if fits and (own <= self.max_share * (self.kv_budget_bytes - others) or state.running == 0 and count == 1):
                return count
            count -= 1
        return 0

    def lane_for(self, request: EngineRequest) -> Lane:
        return next(lane for lane in self.lanes if lane.takes(request))

    def _requests_wanting_rows(self) -> int:
        """How many requests run rows or wait for some (the fair share of the rows divides by it)."""
        return len({*self.running, *(q for q in self.waiting if self.states[q].pending_rows)})

    def _active(self, requests: list[EngineRequest]) -> list[EngineRequest]:
        """``requests`` less those beyond ``max_requests`` (the oldest requests in the engine run first)."""
        if self.max_requests is None:
            return requests
        oldest = sorted({*self.running, *self.waiting}, key=lambda q: q.submitted_s)[: self.max_requests]
        return [q for q in requests if q in oldest]
