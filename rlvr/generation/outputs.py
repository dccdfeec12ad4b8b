"""The output processor: a step's :class:`~rlvr.generation.scheduler.StepOutput` applied, the one place
progress moves: prompt chunks cached, rows one position on, each row's new token recorded, its stop rules
and tool episode applied, and finished rows retired from their lane.

A row's sampled token is replaced by its environment's where the episode writes one (log-prob 0); a turn
end whose tool may run for seconds is observed on a thread pool while the row keeps its slot, parked
(docs/architecture.md, "Tool-calling rollouts"). A retired row's slot is refilled by the lane's last
row, and a request whose last row retires is done (``on_done``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rlvr.environments.base import Injection
from rlvr.environments.driver import TokenTexts
from rlvr.generation.kv_cache import quantized
from rlvr.generation.request import EngineRequest
from rlvr.generation.scheduler import Lane, LaneOutput, Row, Scheduler, StepOutput
from rlvr.generation.stops import StopChecker

TOOL_WORKERS = 4  # threads observing turn ends (tools that may run for seconds) off the engine's thread


class OutputProcessor:
    """Applies what the rows of ``scheduler``'s lanes generate: ``stops`` ends them, ``wake`` is called
    (from a tool thread) when a parked row's observation is back."""

    def __init__(self, scheduler: Scheduler, stops: StopChecker, token_texts: TokenTexts, wake: Callable[[], None]):
        self.scheduler, self.stops, self.token_texts, self.wake = scheduler, stops, token_texts, wake
        self._tool_pool: ThreadPoolExecutor | None = None

    def update_from_output(self, output: StepOutput) -> None:
        """Apply a step's ``output``: each lane's live rows one position on, their tokens (or their
        environment's) recorded; each prompt chunk cached to its end (``Scheduler.prefilled``)."""
        for lane_output in output.decode:
            self._next_tokens(lane_output)
        for prefill in output.prefill:
            self.scheduler.prefilled(prefill)

    def first_tokens(self, lane: Lane, slots: range, tokens: list[int], logprobs: list[float]) -> None:
        """New rows' first tokens (sampled when their prompt was whole), recorded."""
        lane.next_tokens += tokens
        self.record(lane, list(slots), tokens, logprobs)

    def _next_tokens(self, output: LaneOutput) -> None:
        lane, live = self.scheduler.lanes[output.lane], output.live
        tokens, logprobs = list(output.tokens), list(output.logprobs)
        if len(live) < len(lane.rows):  # parked rows do not advance
            lane.cache.lengths[live] += 1
        else:
            lane.cache.lengths[: len(lane.rows)] += 1
        forced = self._force_tokens(lane, live, tokens, logprobs)
        for slot, token in zip(live, tokens):
            lane.next_tokens[slot] = token
        self.record(lane, live, tokens, logprobs, forced)

    def record(self, lane: Lane, slots: list[int], tokens: list[int], logprobs: list[float], forced: list[bool] | None = None) -> None:
        """Append each row's new token (``forced``: the environment's), tell the streams, retire the rows
        that finished."""
        finished: list[tuple[int, str]] = []
        by_request: dict[EngineRequest, list[tuple[int, int]]] = {}
        for k, (slot, token, logprob) in enumerate(zip(slots, tokens, logprobs)):
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
            self.retire(lane, slot, reason)

    def resume_parked(self, lane: Lane) -> None:
        """Rows whose turn-end observation came back: an injection resumes them, none retires them."""
        for slot in reversed(range(len(lane.rows))):
            row = lane.rows[slot]
            if row.parked is None or not row.parked.done():
                continue
            injection: Injection | None = row.parked.result()
            reason, row.parked, row.parked_reason = row.parked_reason, None, None
            if not row.driver.inject(injection):
                self.retire(lane, slot, reason)

    def retire(self, lane: Lane, slot: int, reason: str) -> None:
        """The row in ``slot`` finished (``reason``): the lane's last row takes its slot; its buffers go
        with its last row, or halve when the rows left need half their length."""
        row = lane.rows[slot]
        request = row.request
        request.finish_reasons[row.sample] = reason
        moved = lane.cache.remove_row(slot)
        last = lane.rows.pop()
        if moved is not None:
            lane.rows[slot] = last
            lane.next_tokens[slot] = lane.next_tokens[moved]
        del lane.next_tokens[len(lane.rows) :]
        if self.scheduler.release_row(request, None if reason == "cancelled" else len(request.token_ids[row.sample])):
            finish(request)
        if not lane.rows:
            lane.clear()  # every slot free: the buffers go
        elif (needed := quantized(max(r.request.slot_length for r in lane.rows))) * 2 <= lane.cache.capacity_length:
            lane.cache.resize(lane.cache.capacity_rows, needed, lane.cache.layers[0].keys)

    def _force_tokens(self, lane: Lane, live: list[int], tokens: list[int], logprobs: list[float]) -> list[bool] | None:
        """Replace each row's sampled token by the next one its environment writes, if any (log-prob 0)."""
        forced = None
        for k, i in enumerate(live):
            driver = lane.rows[i].driver
            if driver is not None and (token := driver.next_forced()) is not None:
                forced = forced or [False] * len(live)
                tokens[k], logprobs[k], forced[k] = token, 0.0, True
        return forced

    def _park(self, row: Row, token: int, reason: str) -> None:
        """Observe a turn end on the tool pool; the row keeps its place but waits."""
        if self._tool_pool is None:
            self._tool_pool = ThreadPoolExecutor(TOOL_WORKERS, thread_name_prefix="rlvr-tools")
        row.parked = self._tool_pool.submit(row.driver.episode.observe, self.token_texts[token], True)
        row.parked_reason = reason
        row.parked.add_done_callback(lambda _: self.wake())

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
        return self.stops.finish_reason(request.token_ids[sample], request.max_new_tokens, request.stop)


def finish(request: EngineRequest) -> None:
    """``request`` is done: its time noted, its ``on_done`` told."""
    request.done_s = time.monotonic()
    if request.on_done is not None:
        request.on_done(request)
