"""What a caller submits to the engine: one prompt's samples, their sampling and stop settings, and what
the engine fills in (tokens, log-probs, tool calls, finish reasons, timings); how far it got is the
scheduler's (``rlvr.generation.scheduler.RequestState``)."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from rlvr.environments.base import Environment, ToolCall
from rlvr.generation.sampler import row_seed
from rlvr.generation.stops import NO_STOP_RULE, StopRule

_REQUEST_IDS = itertools.count()


class RequestDoesNotFit(ValueError):
    """An engine can never run this request: over the model's context or sliding window, or a KV cache the
    engine cannot hold. ``part`` names what is over: ``"prompt"``, ``"new_tokens"`` or ``"rows"``."""

    def __init__(self, message: str, part: str):
        super().__init__(message)
        self.part = part


class RowSampling(NamedTuple):
    """How a row draws its tokens: its ``key`` (request id, sample), temperature and top-p, and the
    seed of its own generator (None: greedy), which the executor keeps by key."""

    key: tuple[int, int]
    temperature: float
    top_p: float
    seed: int | None


@dataclass(eq=False)
class EngineRequest:
    """One prompt's ``num_samples`` completions. ``on_tokens`` sees each step's (sample, token) pairs,
    ``on_done`` the finished request (both on the engine's thread); ``cancelled`` stops its rows.
    ``environment``: tool calling (``rlvr.environments``); each sample's ``environment_masks`` (1 per
    token the environment wrote, parallel to ``token_ids``) and ``tool_calls`` report it."""

    prompt_ids: list[int]
    num_samples: int
    temperatures: tuple[float, ...]  # cycled over the samples
    max_new_tokens: int
    top_p: float = 1.0
    seed: int = 0
    prompt_index: int = 0  # its prompt's index in its caller's call: with ``seed``, what seeds each row's generator
    stop: StopRule = NO_STOP_RULE  # stop strings and answer lines (a task's parser gives them)
    on_tokens: Callable[[list[tuple[int, int]]], None] | None = None
    on_done: Callable[[EngineRequest], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    environment: Environment | None = None
    request_id: int = field(default_factory=lambda: next(_REQUEST_IDS))  # what a step's plan and output name it by
    # filled by the engine
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    environment_masks: list[list[int]] = field(default_factory=list)
    tool_calls: list[list[ToolCall]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    submitted_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None
    max_neighbours: int = 1  # most requests that shared a decode step with it
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    error: Exception | None = None  # set when a step failed under it

    def __post_init__(self) -> None:
        self.token_ids = [[] for _ in range(self.num_samples)]
        self.logprobs = [[] for _ in range(self.num_samples)]
        self.environment_masks = [[] for _ in range(self.num_samples)]
        self.tool_calls = [[] for _ in range(self.num_samples)]
        self.finish_reasons = [None] * self.num_samples

    @property
    def slot_length(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    def temperature(self, sample: int) -> float:
        return self.temperatures[sample % len(self.temperatures)]

    def sampling(self, sample: int) -> RowSampling:
        """How sample ``sample``'s row draws: its generator seeded by (``seed``, ``prompt_index``, ``sample``)."""
        temperature = self.temperature(sample)
        return RowSampling((self.request_id, sample), temperature, self.top_p, row_seed(self.seed, self.prompt_index, sample, temperature))
