"""The engine's scheduler (rlvr.generation.scheduler) without a model: the KV budget's gate, prompt chunks
under the step's token budget, running rows before prompts, arrival order and the oldest request's room,
fair shares, releasing on finish or cancel, the rows' slots allocated at admission and a step's output applied.
One byte per token keeps the budgets readable; slots are padded to 128 positions (kv_cache.quantized)."""

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from rlvr.environments.driver import TokenTexts
from rlvr.generation.outputs import OutputProcessor
from rlvr.generation.prefix_cache import PrefixCache
from rlvr.generation.request import EngineRequest, RowSampling
from rlvr.generation.scheduler import (
    Backlog,
    Lane,
    LaneOutput,
    LaneStep,
    PrefillChunk,
    PrefillOutput,
    QueuedWork,
    Row,
    Scheduler,
    StepOutput,
    prompt_work,
    shared_prompts,
)
from rlvr.generation.stops import StopChecker
from support.tiny_models import char_tokenizer


def _chunk(request: EngineRequest, begin: int, end: int) -> PrefillChunk:
    """The plan's chunk of ``request``'s prompt tokens ``begin`` .. ``end`` - 1, as plain data."""
    sampling = tuple(map(request.sampling, range(request.num_samples))) if end == len(request.prompt_ids) else ()
    return PrefillChunk(request.request_id, request.prompt_ids[begin:end], begin, end, sampling)


def _scheduler(kv_budget_bytes: int = 10_000, max_rows: int = 8, step_tokens: int = 128, **kwargs) -> Scheduler:
    return Scheduler(
        [Lane(2, None)],
        PrefixCache(1, 0),
        bytes_per_token=1,
        kv_budget_bytes=kv_budget_bytes,
        max_rows=max_rows,
        step_tokens=step_tokens,
        max_share=kwargs.pop("max_share", 0.5),
        **kwargs,
    )


def _request(prompt_tokens: int, samples: int = 1, max_new_tokens: int = 10, submitted_s: float = 0.0) -> EngineRequest:
    request = EngineRequest(prompt_ids=list(range(prompt_tokens)), num_samples=samples, temperatures=(0.0,), max_new_tokens=max_new_tokens)
    request.submitted_s = submitted_s
    return request


def _prefilled(scheduler: Scheduler, request: EngineRequest) -> EngineRequest:
    """``request`` waiting with its whole prompt's cache, as the engine leaves it after its last chunk."""
    scheduler.add(request)
    assert scheduler.reserve(request)
    scheduler.states[request].prefilled = len(request.prompt_ids)
    return request


def _start_rows(scheduler: Scheduler, request: EngineRequest, count: int) -> None:
    """What the engine does with an admission: the rows join their lane (slots unallocated here)."""
    scheduler.lane_for(request).rows += [Row(request, sample) for sample in scheduler.admit(request, count)]


def test_the_gate_counts_prefilled_prompt_tokens_and_refuses_past_the_budget():
    scheduler = _scheduler(kv_budget_bytes=100)
    assert scheduler.fits(100) and not scheduler.fits(101)
    _prefilled(scheduler, _request(60))
    assert scheduler.held_bytes() == 60 and scheduler.room_bytes() == 40
    assert scheduler.fits(40) and not scheduler.fits(41)


def test_a_prompt_starts_only_when_its_whole_cache_fits_and_those_after_it_wait():
    """Arrival order: a prompt that does not fit yet holds back a younger one that would (it would take
    the room the older one waits for), as vLLM's scheduler does."""
    scheduler = _scheduler(kv_budget_bytes=100 + 128, step_tokens=1000)  # a 128-position slot beside 100 prompt tokens
    running = _prefilled(scheduler, _request(60))
    too_long, short = _request(41, submitted_s=1.0), _request(40, submitted_s=2.0)
    scheduler.add(too_long)
    scheduler.add(short)
    assert scheduler.schedule().prefill == []
    assert scheduler.states[too_long].cache is None and scheduler.states[short].cache is None
    _start_rows(scheduler, running, 1)  # the engine allocates its slot where its prompt was: held the same
    scheduler.lanes[0].rows.clear()
    assert scheduler.release_row(running, 10) is False and scheduler.release(running) is True
    plan = scheduler.schedule()
    assert plan.prefill == [_chunk(short, 0, 40), _chunk(too_long, 0, 41)]  # both started; the shorter prefills first


def test_a_long_prompt_prefills_in_chunks_of_the_step_token_budget():
    scheduler = _scheduler(step_tokens=128)
    request = _request(300)
    scheduler.add(request)
    chunks, state = [], scheduler.states[request]
    while not state.whole_prompt:
        (chunk,) = scheduler.schedule().prefill
        chunks.append((chunk.begin, chunk.end))
        state.prefilled = chunk.end  # what the engine records after the forward
    assert chunks == [(0, 128), (128, 256), (256, 300)]


def test_the_step_budget_grows_with_free_row_slots():
    """An idle engine prefills a long prompt in one step; as rows take the slots, steps shrink to
    ``step_tokens``, and the rows' decode tokens come out of the budget first."""
    scheduler = _scheduler(step_tokens=256, max_step_tokens=2048, max_rows=64)
    request = _request(1500)
    scheduler.add(request)
    (chunk,) = scheduler.schedule().prefill
    assert (chunk.begin, chunk.end) == (0, 1500)
    budgets = []
    running = _prefilled(scheduler, _request(5, samples=64))
    for count in (16, 16, 16, 16):
        _start_rows(scheduler, running, count)
        budgets.append(scheduler.step_budget())
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] == 256 and budgets[0] < 2048
    assert scheduler.prefill_budget() == 256 - 64  # every slot taken: what 64 decode tokens leave
    assert _scheduler(step_tokens=256).step_budget() == 256  # no max_step_tokens: a fixed budget


def test_the_step_budget_stays_short_while_requests_queue_unstarted():
    """Few rows but the KV budget full: the queued request cannot start, so no step grows for prompts."""
    scheduler = _scheduler(step_tokens=256, max_step_tokens=2048, max_rows=64, kv_budget_bytes=1_000)
    running = _prefilled(scheduler, _request(5, samples=2))
    _start_rows(scheduler, running, 2)
    assert scheduler.step_budget() > 1_500
    scheduler.add(queued := _request(1_200))
    assert scheduler.schedule().prefill == [] and scheduler.states[queued].cache is None
    assert scheduler.step_budget() == 256


def test_running_rows_decode_first_and_prompts_get_the_rest_of_the_step():
    scheduler = _scheduler(step_tokens=64, max_rows=64)
    running = _prefilled(scheduler, _request(5, samples=60))
    _start_rows(scheduler, running, 3)
    assert scheduler.prefill_budget() == 64 - 3
    prompt = _request(100)
    scheduler.add(prompt)
    plan = scheduler.schedule()
    assert [(step.lane, step.live) for step in plan.decode] == [(0, [0, 1, 2])]
    assert plan.prefill == [_chunk(prompt, 0, 61)]
    _start_rows(scheduler, running, 60 - 3)
    assert scheduler.prefill_budget() == 64 // 8  # never less than an eighth
    small = _scheduler(step_tokens=4, max_rows=8)
    _start_rows(small, _prefilled(small, _request(5, samples=6)), 6)
    assert small.prefill_budget() == 1  # more rows than a step's tokens: prompts still move


def test_parked_rows_do_not_decode():
    scheduler = _scheduler()
    request = _prefilled(scheduler, _request(5, samples=3))
    _start_rows(scheduler, request, 3)
    scheduler.lanes[0].rows[1].parked = Future()
    assert [(step.lane, step.live) for step in scheduler.schedule().decode] == [(0, [0, 2])]
    assert scheduler.has_work()
    scheduler.lanes[0].rows[0].parked = scheduler.lanes[0].rows[2].parked = Future()
    scheduler.waiting.clear()
    assert not scheduler.has_work()


def _two_lanes(kv_budget_bytes: int, running_rows: int, capacity_rows: int) -> tuple[Scheduler, EngineRequest]:
    """A short lane (slots up to 128) with ``running_rows`` rows of one request in buffers of
    ``capacity_rows`` slots, and an empty lane for longer rows."""
    scheduler = Scheduler(
        [Lane(2, 128), Lane(2, None)], PrefixCache(1, 0), bytes_per_token=1, kv_budget_bytes=kv_budget_bytes, max_rows=16, step_tokens=1000, max_share=1.0
    )
    running = _prefilled(scheduler, _request(5, samples=running_rows, submitted_s=-1.0))
    _start_rows(scheduler, running, running_rows)
    assert scheduler.release(running) is False  # every row started: its prompt cache goes
    scheduler.lanes[0].cache.resize(capacity_rows, 128, torch.zeros(1, 1, 1, 1))
    return scheduler, running


def test_short_requests_do_not_take_the_kv_the_oldest_waiting_prompt_needs():
    """Six short rows fill their lane; a long request (100 prompt tokens, a 256-position slot in the
    other lane) does not fit beside them, and a short one arriving after it, which would, waits too.
    Three short rows finish: their lane gives up the free slots, and both start, the older first."""
    scheduler, running = _two_lanes(kv_budget_bytes=860, running_rows=6, capacity_rows=6)
    long, short = _request(100, max_new_tokens=100, submitted_s=1.0), _request(5, submitted_s=2.0)
    scheduler.add(long)
    scheduler.add(short)
    assert scheduler.head().request is long and scheduler.head_need(scheduler.head()) == 100 + 256
    assert scheduler.fits(5) and not scheduler.fits(5, scheduler.kept_for_head(short))  # alone it would fit; beside the long one's need, not
    assert scheduler.schedule().prefill == []
    for finished in range(3):
        scheduler.lanes[0].rows.pop()
        assert scheduler.release_row(running, 10) is False
        if finished == 1:  # 4 x 128 + 356 is still past 860: no copy for nothing
            assert scheduler.schedule().prefill == [] and scheduler.lanes[0].cache.capacity_rows == 6
    assert scheduler.schedule().prefill == [_chunk(short, 0, 5), _chunk(long, 0, 100)]
    assert scheduler.lanes[0].cache.capacity_rows == 3 and scheduler.held_bytes() == 3 * 128 + 105
    scheduler.states[long].prefilled, scheduler.states[short].prefilled = 100, 5
    assert [request for request, _ in scheduler.admissions()] == [long]  # the head's row first; the short one's would leave it no room


def test_free_slots_give_way_only_when_that_lets_the_oldest_prompt_start():
    scheduler, _ = _two_lanes(kv_budget_bytes=1_200, running_rows=6, capacity_rows=7)
    scheduler.add(long := _request(100, max_new_tokens=100, submitted_s=1.0))
    scheduler.make_way_for_head(scheduler.head())
    assert scheduler.lanes[0].cache.capacity_rows == 6  # 7 x 128 + 356 > 1,200; 6 x 128 + 356 fits
    assert scheduler.schedule().prefill == [_chunk(long, 0, 100)]
    scheduler, _ = _two_lanes(kv_budget_bytes=1_000, running_rows=6, capacity_rows=7)
    scheduler.add(_request(100, max_new_tokens=100, submitted_s=1.0))
    scheduler.make_way_for_head(scheduler.head())
    assert scheduler.lanes[0].cache.capacity_rows == 7  # trimmed, it would still not fit: no copy for nothing


def test_requests_start_while_the_rows_ahead_are_within_the_lookahead():
    """Eight row slots and a lookahead of ten rows: four running and six waiting in a started request,
    so of three more two-row requests none starts until rows finish (their prompts would wait holding KV)."""
    scheduler = _scheduler(max_rows=8, step_tokens=1000, kv_budget_bytes=100_000)
    assert scheduler.lookahead_rows == 10
    running = _prefilled(scheduler, _request(5, samples=10))
    _start_rows(scheduler, running, 4)
    later = [_request(5, samples=2, submitted_s=float(k)) for k in (1, 2, 3)]
    for request in later:
        scheduler.add(request)
    assert scheduler.schedule().prefill == []
    _start_rows(scheduler, running, 4)
    scheduler.lanes[0].rows[:6] = []
    for _ in range(6):
        scheduler.release_row(running, 10)
    # 2 running + 2 waiting to start: two more requests of two rows fit in the lookahead of 10
    assert [scheduler.by_id[chunk.request_id].request for chunk in scheduler.schedule().prefill] == later


def test_prefilled_requests_share_the_rows_fairly_the_oldest_then_short_ones_first():
    """The head (the oldest with no row yet) takes its share first; after it, short requests before long."""
    scheduler = _scheduler(max_rows=6)
    oldest = _request(5, samples=4, max_new_tokens=100)
    long, short = _request(5, samples=4, max_new_tokens=100, submitted_s=1.0), _request(5, samples=4, max_new_tokens=10, submitted_s=2.0)
    for request in (oldest, long, short):
        _prefilled(scheduler, request)
    admitted = []
    for request, count in scheduler.admissions():
        admitted.append((request, count))
        _start_rows(scheduler, request, count)
    assert admitted == [(oldest, 2), (short, 2), (long, 2)]
    assert list(scheduler.admissions()) == []  # every row taken


def test_a_long_request_that_has_waited_starts_before_a_short_one_just_arrived():
    """Short first, for its wait so far: 100 new tokens waiting 60 s weigh less than 10 arriving now,
    so short requests arriving without end do not starve a long one."""
    now = time.monotonic()
    scheduler = _scheduler(max_rows=1)
    long, short = _request(5, max_new_tokens=100, submitted_s=now - 60), _request(5, max_new_tokens=10, submitted_s=now)
    _prefilled(scheduler, short)
    _prefilled(scheduler, long)
    assert next(scheduler.admissions()) == (long, 1)


def test_rows_keep_to_their_share_of_the_kv_budget_but_a_first_row_only_needs_to_fit():
    scheduler = _scheduler(kv_budget_bytes=4 * 128 + 5, max_share=0.5)  # four 128-position slots beside a 5-token prompt
    request = _prefilled(scheduler, _request(5, samples=4))
    assert scheduler.rows_that_fit(request, 4) == 2  # half of what the others (its prompt aside) leave it
    scheduler.kv_budget_bytes = 128 + 5
    assert scheduler.rows_that_fit(request, 4) == 1
    scheduler.kv_budget_bytes = 128 + 4
    assert scheduler.rows_that_fit(request, 4) == 0


def test_only_the_oldest_max_requests_are_scheduled():
    scheduler = _scheduler(max_requests=1)
    old, new = _request(10, submitted_s=1.0), _request(3, submitted_s=2.0)
    scheduler.add(new)
    scheduler.add(old)
    assert [scheduler.by_id[chunk.request_id].request for chunk in scheduler.schedule().prefill] == [old]


def test_release_frees_the_prompt_and_the_last_row_finishes_the_request():
    scheduler = _scheduler()
    request = _prefilled(scheduler, _request(50, samples=2))
    _start_rows(scheduler, request, 2)
    assert scheduler.held_bytes() == 50 and request in scheduler.running
    assert scheduler.release(request) is False  # rows still running: not done
    assert request not in scheduler.waiting and scheduler.held_bytes() == 0
    assert scheduler.release_row(request) is False
    assert scheduler.release_row(request) is True and request not in scheduler.running


def test_a_cancelled_waiting_request_is_released_and_done():
    scheduler = _scheduler()
    request = _prefilled(scheduler, _request(50, samples=3))
    _start_rows(scheduler, request, 1)
    assert list(scheduler.skip_pending(request)) == [1, 2]  # the rows a cancel stops before they start
    assert scheduler.release(request) is False  # its running row retires later
    assert scheduler.release_row(request) is True and request not in scheduler.states
    waiting = _request(20)
    scheduler.add(waiting)
    scheduler.schedule()
    assert list(scheduler.skip_pending(waiting)) == [0]
    assert scheduler.release(waiting) is True and scheduler.waiting == [] and scheduler.held_bytes() == 0
    assert scheduler.states == {}


def test_a_new_request_starts_when_the_rows_ahead_of_it_free_a_slot():
    """Two slots: rows with 5 and 9 tokens left, then a waiting request of two rows of 10: its first row
    takes the slot freed at 5, a new request's the one freed at 9 (before the waiting request's second
    row: the oldest with no row started goes first), beside the prefill; then its own step."""
    work = (QueuedWork((9, 5), 0, 20, True, True), QueuedWork((), 2, 10, False, False, 64 * 128))
    backlog = Backlog(work, rows=2, max_rows=2, lookahead_rows=4)
    assert backlog.start_steps(step_tokens=128, prompt_tokens=64) == 1 + 9  # the waiting prompt as far as its 64 tokens, then its own: a step
    assert backlog.start_steps(step_tokens=128, prompt_tokens=64 * 128) == 1 + 128  # a prompt as long: both prefill first
    assert Backlog(rows=2, max_rows=2).start_steps(step_tokens=128) == 1  # idle: its own step
    assert Backlog(work[:1], rows=4, max_rows=4, lookahead_rows=5).start_steps(step_tokens=128) == 1  # a slot is free
    assert Backlog(work, rows=2, max_rows=2, lookahead_rows=4, max_requests=1).start_steps(step_tokens=128) == 1 + 29
    # one request at a time: after the waiting one's two rows, run one after the other (its fair share beside the new one)


def test_a_new_prompt_waits_for_the_prompts_its_steps_carry_beside_it():
    """Prompts prefill shortest first, but a step fills its budget with whatever waits: a short prompt
    arriving behind longer ones whose rest fits the next step waits for all of them; where they do not
    fit, the steps up to its own carry a budget each."""
    waiting = (QueuedWork((), 1, 10, True, False, 300), QueuedWork((), 1, 10, True, False, 100))
    assert Backlog(waiting).prefill_before(50) == 50 + 50  # budget not known: each as far as its length
    assert Backlog(waiting, prefill_budget=1000).prefill_before(50) == 400  # one step carries all
    assert Backlog(waiting, prefill_budget=120).prefill_before(50) == 2 * 120 - 50  # 150 tokens to its end: two full steps
    assert Backlog(waiting, prefill_budget=1000).prefill_before(0) == 0  # no prompt: no prompt step
    free = Backlog(waiting, rows=8, max_rows=8, lookahead_rows=8, prefill_budget=1000)  # a slot free: the prompts decide
    assert free.start_steps(step_tokens=128, prompt_tokens=50) == 1 + 450 / 1000


def test_prompt_work_counts_each_token_s_attention_to_the_keys_up_to_its_own():
    """A token costs its projections (1) and, per ``keys_per_token`` keys it attends to, one more: a later
    chunk of a prompt costs more than its first, the same tokens split into chunks cost what they cost whole."""
    assert prompt_work(0, 100, 0.0) == 100  # attention not counted
    assert prompt_work(0, 1, 1.0) == 2  # one token, one key
    assert prompt_work(0, 4, 10.0) == pytest.approx(4 + (1 + 2 + 3 + 4) / 10)
    assert prompt_work(1000, 1100, 3000.0) > prompt_work(0, 100, 3000.0)
    assert prompt_work(0, 300, 500.0) == pytest.approx(prompt_work(0, 120, 500.0) + prompt_work(120, 300, 500.0))


def test_the_prefill_work_before_a_prompt_takes_each_waiting_prompt_from_where_it_has_reached():
    """Two prompts wait: 300 left of 1,300 (1,000 prefilled) and 100 left of 100. A new 50-token prompt
    waits for 50 of each (budget not known), the first's at positions 1,000..1,049; a full step of a
    budget carries the same tokens, counted as those ahead on average."""
    waiting = (QueuedWork((), 1, 10, True, False, 300, 1300), QueuedWork((), 1, 10, True, False, 100, 100))
    k = 2000.0
    assert Backlog(waiting, keys_per_token=k).prefill_work(10, 60) == pytest.approx(prompt_work(1000, 1050, k) + prompt_work(0, 50, k) + prompt_work(10, 60, k))
    assert Backlog(waiting).prefill_work(10, 60) == 50 + 50 + 50  # attention not counted: tokens
    budget = Backlog(waiting, prefill_budget=1000, keys_per_token=k)  # one step carries all 400 ahead
    ahead = prompt_work(1000, 1050, k) + prompt_work(0, 50, k)
    assert budget.prefill_work(0, 50) == pytest.approx(ahead * 400 / 100 + prompt_work(0, 50, k))
    assert Backlog(waiting, keys_per_token=k).prefill_work(0, 0) == 0  # no prompt: nothing before it


def test_requests_posted_since_the_backlog_was_built_queue_behind_it():
    backlog = Backlog((QueuedWork((9, 5), 0, 20, True, True), QueuedWork((), 2, 10, False, False, 64)), rows=2, max_rows=2, lookahead_rows=4)
    posted = backlog.with_posted([_request(64, samples=1, max_new_tokens=40)], row_fill=0.5, uncached=lambda ids: len(ids) - 16)
    assert posted.requests[2] == QueuedWork((), 1, 20, False, False, 48, 64)  # its opening 16 tokens held by the prefix cache
    # the waiting request's first row takes the slot freed at 5, the posted one's the slot freed at 9, a new
    # one the slot its first row frees at 15 (before its second row: the oldest without a row goes first), then its own step
    assert posted.start_steps(step_tokens=128) == 1 + 15
    assert backlog.start_steps(step_tokens=128) == 1 + 9
    assert backlog.with_posted([], row_fill=0.5) is backlog


def test_a_new_request_starts_beside_rows_a_running_request_has_left_waiting():
    """A request's rows past its fair share (or KV share) wait for slots, but a new request's first row does
    not wait behind them: the oldest request with no row started goes first."""
    running = QueuedWork((400,) * 4, 12, 500, True, True)  # 4 rows running, 12 waiting
    assert Backlog((running,), rows=8, max_rows=8, lookahead_rows=20, max_share=0.5).start_steps(step_tokens=128) == 1
    # every slot taken: the next one to free
    full = QueuedWork((400,) * 7 + (30,), 12, 500, True, True)
    assert Backlog((full,), rows=8, max_rows=8, lookahead_rows=30).start_steps(step_tokens=128) == 1 + 30
    # past the lookahead no prompt starts: the running request's waiting rows take the freed slots first
    assert Backlog((full,), rows=8, max_rows=8, lookahead_rows=10).start_steps(step_tokens=128) > 1 + 30


def test_the_backlog_counts_rows_at_the_share_of_their_budget_rows_have_used():
    scheduler = _scheduler(max_rows=2, kv_budget_bytes=100_000)
    running = _prefilled(scheduler, _request(5, samples=2, max_new_tokens=100))
    _start_rows(scheduler, running, 2)
    running.token_ids[0] += [1] * 30
    waiting = _request(40, samples=3, max_new_tokens=100)
    scheduler.add(waiting)
    backlog = scheduler.backlog()
    work = (QueuedWork((70, 100), 0, 100, True, True, 0, 5), QueuedWork((), 3, 100, False, False, 40, 40))
    assert backlog == Backlog(work, 2, 2, 2, 0.5, prefill_budget=128 - 2)  # the step's tokens less a token for each running row
    for _ in range(200):  # rows have lately stopped at a fifth of their budget
        scheduler.row_fill = 0.95 * scheduler.row_fill + 0.05 * 0.2
    assert scheduler.backlog().requests[0].running == (max(1, 20 - 30), 20)
    assert scheduler.backlog().start_steps(128) < backlog.start_steps(128)


def test_the_backlog_built_during_a_step_counts_the_prompt_chunks_it_prefills_as_done():
    """The step under way's time is counted apart (what is left of it): its prompt chunks are not
    counted again among the prompt tokens prefilled before a new request."""
    scheduler = _scheduler(step_tokens=64)
    request = _request(200)
    scheduler.add(request)
    [chunk] = scheduler.schedule().prefill
    assert (chunk.begin, chunk.end) == (0, 64)
    assert scheduler.backlog().requests[0].prompt_left == 200
    assert scheduler.backlog({chunk.request_id: chunk.end}).requests[0].prompt_left == 136


def test_the_backlog_runs_as_many_rows_as_the_kv_budget_holds_at_their_lengths():
    """64 row slots, but a budget of 1,000 tokens: rows of 256 positions (quantized) run 3 at a time."""
    scheduler = _scheduler(max_rows=64, kv_budget_bytes=1_000)
    running = _prefilled(scheduler, _request(100, samples=3, max_new_tokens=100))
    _start_rows(scheduler, running, 3)
    scheduler.add(_request(100, samples=4, max_new_tokens=100))
    assert scheduler.backlog().rows == 3
    assert _scheduler(max_rows=8).backlog().rows == 8  # idle: every slot


def test_a_request_cancelled_since_the_backlog_was_built_holds_no_one_up():
    """A stream whose client left is dropped at the next step; until then the estimate already leaves it out."""
    import threading

    long, short = threading.Event(), threading.Event()
    work = (QueuedWork((400, 400), 0, 500, True, True), QueuedWork((), 1, 10, False, False, 64))
    backlog = Backlog(work, rows=2, max_rows=2, lookahead_rows=4, max_requests=1, cancels=(long, short))
    assert backlog.live() is backlog and backlog.slot_steps() >= 400  # one request at a time: behind the long one
    long.set()
    assert backlog.live().requests == work[1:] and backlog.live().slot_steps() < 20


def _prompt_cache(scheduler: Scheduler, request: EngineRequest) -> None:
    """``request``'s whole prompt cached (one KV head of one dimension per layer: position p holds p)."""
    cache = scheduler.states[request].cache
    length = len(request.prompt_ids)
    for layer in range(2):
        keys = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1)
        cache.update(keys, keys.clone(), layer)


def _outputs(scheduler: Scheduler) -> OutputProcessor:
    tokenizer = char_tokenizer()
    vocab = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=torch.zeros(len(tokenizer), 1)))  # the vocabulary's size
    return OutputProcessor(scheduler, StopChecker(vocab, tokenizer, stop_token_ids=[]), TokenTexts(tokenizer), wake=lambda: None)


def test_starting_rows_allocates_their_slots_from_the_prompts_cache():
    scheduler = _scheduler()
    request = _prefilled(scheduler, _request(5, samples=3))
    _prompt_cache(scheduler, request)
    rows = [Row(request, sample) for sample in range(2)]
    lane, slots = scheduler.start_rows(request, rows)
    assert lane is scheduler.lanes[0] and list(slots) == [0, 1] and lane.rows == rows
    assert lane.cache.capacity_rows >= 2 and lane.cache.capacity_length == 128 and lane.cache.lengths[:2].tolist() == [5, 5]
    assert lane.cache.layers[1].keys[1, 0, :6, 0].tolist() == [0, 1, 2, 3, 4, 0]
    assert scheduler.states[request].running == 2 and scheduler.states[request].pending_rows == 1
    assert scheduler.held_bytes() == lane.cache.capacity_rows * 128 + 5  # the slots and the prompt of the row still waiting
    with pytest.raises(ValueError, match="start from 2"):
        scheduler.start_rows(request, [Row(request, 0)])


def test_a_lane_is_sized_at_once_for_the_started_requests_waiting_to_join_it():
    scheduler = _scheduler(kv_budget_bytes=100_000, max_rows=32)
    first, second, longer = (_prefilled(scheduler, _request(n, samples=12)) for n in (5, 6, 300))
    for request in (first, second, longer):
        _prompt_cache(scheduler, request)
    scheduler.add(_request(5, samples=12))  # its prompt not started: it may wait long
    lane, _ = scheduler.start_rows(first, [Row(first, sample) for sample in range(12)])
    assert lane.cache.capacity_rows == 24  # its rows and the second's; the longer request's slots would not hold
    allocation = lane.cache.allocation
    scheduler.start_rows(second, [Row(second, sample) for sample in range(12)])
    assert lane.cache.allocation == allocation and lane.cache.rows == 24  # no copy as it joined


def test_a_steps_output_moves_prompts_and_rows_on_in_one_place():
    scheduler, request, waiting = _scheduler(), _request(5, samples=3, max_new_tokens=2), _request(50)
    _prefilled(scheduler, request)
    _prompt_cache(scheduler, request)
    outputs = _outputs(scheduler)
    lane, slots = scheduler.start_rows(request, [Row(request, sample) for sample in range(3)])
    outputs.first_tokens(lane, slots, [4, 5, 6], [-1.0, -2.0, -3.0])
    lane.rows[1].parked = Future()
    scheduler.add(waiting)
    assert scheduler.reserve(waiting)
    plan = scheduler.schedule(prefill_budget=20)
    assert plan.decode == [
        LaneStep(0, [4, 5, 6], [5, 5, 5], [0, 2], [RowSampling((request.request_id, k), 0.0, 1.0, None) for k in (0, 2)], ((0, 5),) * 3)
    ] and plan.prefill == [_chunk(waiting, 0, 20)]  # its 5-token prompt held in slot 0 for each row, the parked one's too

    outputs.update_from_output(StepOutput([LaneOutput(0, [0, 2], [7, 8], [-0.5, -0.25])], [PrefillOutput(waiting.request_id, 20, [], [])], tokens=23))
    assert request.token_ids == [[4, 7], [5], [6, 8]] and request.logprobs[2] == [-3.0, -0.25]
    assert request.finish_reasons[0] == request.finish_reasons[2] == "length"  # their budget spent: retired, the parked row moved to slot 0
    assert lane.rows[0].sample == 1 and lane.next_tokens == [5] and lane.cache.lengths[:1].tolist() == [5]  # parked: not advanced
    assert scheduler.states[waiting].prefilled == 20 and scheduler.states[waiting].first_tokens == []

    outputs.update_from_output(StepOutput(prefill=[PrefillOutput(waiting.request_id, 50, [9], [-0.125])]))
    state = scheduler.states[waiting]
    assert state.whole_prompt and (state.first_tokens, state.first_logprobs) == ([9], [-0.125]) and waiting.token_ids == [[]]


def test_each_row_reads_its_prompt_from_its_requests_first_slot_in_the_lane():
    """Rows of two requests interleaved in a lane (a finished row's slot refilled by another's): each
    names the first slot of its own request there and its own prompt's length."""
    first, second = _request(5, samples=3), _request(9, samples=2)
    rows = [Row(second, 0), Row(first, 0), Row(first, 1), Row(second, 1), Row(first, 2)]
    assert shared_prompts(rows) == ((0, 9), (1, 5), (1, 5), (0, 9), (1, 5))
    assert shared_prompts([]) == ()
