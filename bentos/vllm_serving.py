"""The service on vLLM's engine (``RLVR_ENGINE=vllm``): :class:`VllmServingEngine` is
``bentos.serving_engine.ServingEngine`` (same results, metrics, warm-up) with its engine swapped for
:class:`VllmEngine`, which runs the service's ``EngineRequest``s on vLLM's ``LLMEngine`` in this process,
stepped on the model thread.

Each sample is one vLLM request (n=1) seeded from (seed, prompt index, sample) as ours are; our stop
checker ends each sample (vLLM's stop tokens and strings only save it work), so finish reasons and lengths
follow the native engine's rules. Tool episodes are not run: a policy whose environment drives them is
refused. Other model work (``ModelCall``: prompt scoring) runs between two steps, on the HF model.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from bentos.serving_engine import ServingEngine
from rlvr.environments.base import Environment
from rlvr.environments.driver import drives_episodes
from rlvr.generation import EngineRequest
from rlvr.generation.outputs import finish
from rlvr.generation.request import RequestDoesNotFit
from rlvr.generation.stops import StopChecker
from rlvr.generation.vllm_engine import VllmSettings, sampling_params, starting_vllm


class VllmServingEngine(ServingEngine):
    """The service's engine on vLLM: ``ServingEngine``'s surface; ``model`` (the HF policy) gives the stop
    tokens and runs the service's ``ModelCall``s. Refuses an ``environment`` that drives tool episodes."""

    name = "vllm"

    def __init__(self, settings: VllmSettings, model: Any, tokenizer: Any, seed: int, batching: bool = True, environment: Environment | None = None):
        if drives_episodes(environment):
            raise ValueError(
                f"RLVR_ENGINE=vllm cannot serve this policy: its environment {environment.name!r} runs tool episodes, "
                "which vLLM's engine does not; set RLVR_ENGINE=native (or auto)"
            )
        self._serve(VllmEngine(settings, StopChecker(model, tokenizer), batching), tokenizer, seed)


class VllmEngine:
    """``EngineRequest``s on an in-process vLLM ``LLMEngine``, with the interface of ``rlvr.generation.Engine``
    that ``ServingEngine`` uses: :meth:`check`, :meth:`submit`, :meth:`call`, :meth:`estimated_seconds`, :meth:`reset_prefix_cache`,
    :meth:`start_wait_s` and ``step_seconds`` from any thread; :meth:`run` (or :meth:`take_submissions` and
    :meth:`step`) on the model thread. ``batching`` off: one request at a time."""

    def __init__(self, settings: VllmSettings, stops: StopChecker, batching: bool = True):
        with starting_vllm():
            from vllm import EngineArgs
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.llm_engine import LLMEngine

            self.llm = LLMEngine.from_engine_args(EngineArgs(**settings.engine_kwargs()))
        self._delta = RequestOutputKind.DELTA
        config = self.llm.vllm_config
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.get_vocab_size()
        self.kv_cache_tokens = (config.cache_config.num_gpu_blocks - 1) * config.cache_config.block_size  # less its null block
        self.max_rows = config.scheduler_config.max_num_seqs
        self.step_tokens = config.scheduler_config.max_num_batched_tokens
        self.stops, self.batching = stops, batching
        self.step_seconds = 0.0  # a moving average of steps with rows (0: none measured yet), for the time estimates
        self._inbox: deque[EngineRequest | Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self._held: deque[EngineRequest] = deque()  # taken in, not yet given to vLLM (batching off: one at a time)
        self._samples: dict[str, tuple[EngineRequest, int]] = {}  # vLLM request id -> (request, sample), unfinished
        self._running: dict[EngineRequest, set[str]] = {}  # request -> its unfinished samples' vLLM ids
        self._backlog: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int, int], ...]] = ((), ())

    # ---- from any thread ----------------------------------------------------------------------

    def check(self, *requests: EngineRequest) -> None:
        """Raise :class:`RequestDoesNotFit` for a request vLLM could never run: a token id outside the
        vocabulary, prompt + new tokens over its context (``max_model_len``), or the rows that run at once
        (at most ``max_rows``) over its KV cache; ``requests`` together: all their rows at once."""
        for request in requests:
            ids = request.prompt_ids
            if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
                bad = max(ids) if max(ids) >= self.vocab_size else min(ids)
                raise RequestDoesNotFit(f"the prompt holds token id {bad}, outside the model's vocabulary of {self.vocab_size}", "prompt")
            if request.slot_length > self.max_model_len:
                part = "prompt" if len(ids) >= self.max_model_len else "new_tokens"
                raise RequestDoesNotFit(
                    f"a {len(ids)}-token prompt + {request.max_new_tokens} new tokens is over the engine's context of {self.max_model_len} tokens", part
                )
        rows = [min(q.num_samples, self.max_rows) for q in requests]
        if sum(r * q.slot_length for r, q in zip(rows, requests)) > self.kv_cache_tokens:
            tokens = " + ".join(f"{r} x ({len(q.prompt_ids)} + {q.max_new_tokens})" for r, q in zip(rows, requests))
            raise RequestDoesNotFit(f"{tokens} tokens, over the engine's KV cache of {self.kv_cache_tokens} tokens", "rows")

    def submit(self, request: EngineRequest) -> None:
        """Queue ``request`` (:meth:`check` first)."""
        self.check(request)
        request.submitted_s = time.monotonic()
        self._post(request)

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the model thread between two steps."""
        self._post(fn)

    def _post(self, item) -> None:
        with self._wakeup:
            self._inbox.append(item)
            self._wakeup.notify()

    def estimated_seconds(self, prompt_tokens: int, rows: int, max_new_tokens: int) -> float:
        """A new request's time at the measured step time, at best: its prompt's chunks, then its new tokens
        in waves of at most ``max_rows`` rows."""
        waves = -(-rows // self.max_rows)
        return (-(-prompt_tokens // self.step_tokens) + max_new_tokens * waves) * self.step_seconds

    typical_seconds = estimated_seconds  # vLLM's rows' use of their budget is not measured: the whole of it

    def start_wait_s(self, prompt_ids: Sequence[int] = ()) -> float:
        """How long a new request (of ``prompt_ids``) would wait to start, at the measured step time: 0
        while the running rows and those waiting leave rows and KV cache free; else the new tokens ahead of it
        shared over the running rows, and the prompts ahead of it and its own (one request at a time without
        batching: all the new tokens ahead)."""
        with self._wakeup:
            posted = [(len(q.prompt_ids), q.num_samples, q.max_new_tokens) for q in self._inbox if isinstance(q, EngineRequest)]
        running, waiting = self._backlog
        waiting = (*waiting, *posted)
        if not running and not waiting:
            return 0.0
        rows = len(running) + sum(r for _, r, _ in waiting)
        kv_tokens = sum(slot for _, slot in running) + sum(r * (p + n) for p, r, n in waiting)
        if self.batching and rows < self.max_rows and kv_tokens < self.kv_cache_tokens:
            return 0.0
        prefill_steps = sum(-(-p // self.step_tokens) for p in (len(prompt_ids), *(p for p, _, _ in waiting)))
        if not self.batching:
            return (max((left for left, _ in running), default=0) + sum(n for _, _, n in waiting) + prefill_steps) * self.step_seconds
        new_tokens = sum(left for left, _ in running) + sum(r * n for _, r, n in waiting)
        return (new_tokens / max(1, len(running)) + prefill_steps) * self.step_seconds

    # ---- on the model thread ------------------------------------------------------------------

    def reset_step_times(self) -> None:
        """Forget the measured step time (0: none measured yet), e.g. that of a warm-up's first steps."""
        self.step_seconds = 0.0

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache (the warm-up's last run prefills its prompt afresh)."""
        self.llm.reset_prefix_cache()

    def run(self, stop: threading.Event | None = None) -> None:
        """Steps for as long as the process lives (waiting for work in between); a failing step fails every
        request in the engine (``error``)."""
        while stop is None or not stop.is_set():
            self.take_submissions(block=not (self._running or self._held))
            try:
                self.step()
            except Exception as err:  # noqa: BLE001 - each request in the engine gets it
                self._fail_all(err)

    def take_submissions(self, block: bool = False) -> None:
        """Take in what other threads posted: requests wait to start, calls run here. ``block``: wait up to a
        second for something first."""
        with self._wakeup:
            if block:
                self._wakeup.wait_for(lambda: self._inbox, timeout=1.0)
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if isinstance(item, EngineRequest):
                self._held.append(item)
            else:
                item()
        self._note_backlog()

    def step(self) -> None:
        """Drop cancelled requests, start the waiting ones (batching off: the next, once none runs), run one
        vLLM step and record its tokens; finished requests are done (``on_done``)."""
        self._drop_cancelled()
        while self._held and (self.batching or not self._running):
            self._start(self._held.popleft())
        if not self._running:
            return
        started = time.monotonic()
        outputs = self.llm.step()
        tokens: dict[EngineRequest, list[tuple[int, int]]] = {}
        done: list[EngineRequest] = []
        for output in outputs:
            self._record(output, tokens, done)
        for request, pairs in tokens.items():
            request.max_neighbours = max(request.max_neighbours, len(tokens))
            if request.on_tokens is not None and pairs:
                request.on_tokens(pairs)
        for request in done:
            finish(request)
        if tokens:
            elapsed = time.monotonic() - started
            self.step_seconds = elapsed if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * elapsed
        self._note_backlog()

    def _start(self, request: EngineRequest) -> None:
        ids = set()
        for sample in range(request.num_samples):
            request_id = f"{request.request_id}-{sample}"
            self.llm.add_request(request_id, {"prompt_token_ids": list(request.prompt_ids)}, self._sampling(request, sample))
            self._samples[request_id] = (request, sample)
            ids.add(request_id)
        self._running[request] = ids

    def _sampling(self, request: EngineRequest, sample: int) -> Any:
        """vLLM's sampling parameters of one sample, as ours draws it; each step's new tokens."""
        row, stop_ids = request.sampling(sample), sorted(self.stops.stop_ids)
        return sampling_params(row.temperature, row.top_p, row.seed, request.max_new_tokens, stop_ids, request.stop.strings, output_kind=self._delta)

    def _record(self, output: Any, tokens: dict[EngineRequest, list[tuple[int, int]]], done: list[EngineRequest]) -> None:
        """One sample's new tokens, each checked by our stop rules; a sample they end is aborted in vLLM."""
        if output.request_id not in self._samples:  # ended by our stop rules or cancelled
            return
        request, sample = self._samples[output.request_id]
        completion = output.outputs[0]
        if completion.token_ids and request.first_token_s is None:
            request.first_token_s = time.monotonic()
        if sample == 0 and output.num_cached_tokens:
            request.cached_prompt_tokens = output.num_cached_tokens
        pairs, reason = tokens.setdefault(request, []), None
        logprobs = completion.logprobs or [None] * len(completion.token_ids)
        for token, logprob in zip(completion.token_ids, logprobs):
            request.token_ids[sample].append(token)
            request.logprobs[sample].append(logprob[token].logprob if logprob else 0.0)
            request.environment_masks[sample].append(0)
            pairs.append((sample, token))
            if reason := self.stops.finish_reason(request.token_ids[sample], request.max_new_tokens, request.stop):
                break
        if reason is None and output.finished:
            reason = _finish_reason(completion)
        if reason is not None:
            if not output.finished:
                self.llm.abort_request([output.request_id])
            if self._end_sample(output.request_id, reason):
                done.append(request)

    def _end_sample(self, request_id: str, reason: str) -> bool:
        """Note a sample's finish; whether it was its request's last."""
        request, sample = self._samples.pop(request_id)
        request.finish_reasons[sample] = reason
        left = self._running[request]
        left.discard(request_id)
        if left:
            return False
        del self._running[request]
        return True

    def _drop_cancelled(self) -> None:
        for request in [q for q in self._held if q.cancelled.is_set()]:
            self._held.remove(request)
            request.finish_reasons = ["cancelled"] * request.num_samples
            finish(request)
        for request in [q for q in self._running if q.cancelled.is_set()]:
            ids = list(self._running[request])
            self.llm.abort_request(ids)
            for request_id in ids:
                self._end_sample(request_id, "cancelled")
            finish(request)

    def _fail_all(self, err: Exception) -> None:
        with contextlib.suppress(Exception):  # a dead engine cannot abort
            self.llm.abort_request(list(self._samples))
        failed = [*self._running, *self._held]
        self._samples.clear()
        self._running.clear()
        self._held.clear()
        for request in failed:
            request.error = err
            finish(request)

    def _note_backlog(self) -> None:
        """What a new request would queue behind, for :meth:`start_wait_s` (read from other threads): each
        started row's (new tokens left, slot length), each waiting request's (prompt, rows, new tokens)."""
        running, waiting = [], [(len(q.prompt_ids), q.num_samples, q.max_new_tokens) for q in self._held]
        for request, sample in self._samples.values():
            generated = len(request.token_ids[sample])
            if generated:
                running.append((request.max_new_tokens - generated, request.slot_length))
            else:
                waiting.append((len(request.prompt_ids), 1, request.max_new_tokens))
        self._backlog = (tuple(running), tuple(waiting))


def _finish_reason(completion: Any) -> str:
    """Our finish reason for a sample vLLM ended where our stop rules did not (they agree in practice)."""
    if completion.finish_reason == "length":
        return "length"
    if completion.finish_reason == "abort":
        return "cancelled"
    return "stop" if isinstance(completion.stop_reason, str) else "eos"
