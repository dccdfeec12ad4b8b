"""Rollouts: G sampled completions for each of many prompts, through the engine (``rlvr.generation.engine``).

Training and evaluation submit every prompt at once and step the engine until each row is done, so
they sample, stop and run tool episodes exactly as the service does: row j of prompt i draws from its
own generator seeded by (``config.seed``, i, j). Each token's log-prob is taken under the
temperature-scaled softmax before top-p truncation (temperature 1 for greedy rows): GRPO's "old"
log-probs, with no extra forward pass. With ``config.environment`` (tool calling) an environment's
tokens are marked in ``Rollouts.environment_mask`` with log-prob 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from rlvr.environments.base import Environment, ToolCall
from rlvr.fastpaths import FastPaths
from rlvr.generation.engine import SHORT_LANE_TOKENS, Engine
from rlvr.generation.kv_cache import kv_cache_bytes_per_token, quantized
from rlvr.generation.request import EngineRequest
from rlvr.generation.stops import NO_STOP_RULE, StopRule

ROLLOUT_STEP_TOKENS = 2048  # prompt tokens one engine step may prefill (every prompt is known at once)


@dataclass
class SamplingConfig:
    """How completions are sampled. ``temperatures`` is cycled over the G samples of a group."""

    max_new_tokens: int = 256
    temperatures: list[float] = field(default_factory=lambda: [1.0])
    top_p: float = 1.0
    seed: int = 0
    max_batch_rows: int | None = None  # most rows running at once; stream_rollouts yields chunks of at most this many
    stop_token_ids: list[int] | None = None  # default: eos, pad and <|im_end|> of the tokenizer
    stop_strings: tuple[str, ...] = ()  # a row ends once its text holds one (finish reason "stop"; not cut)
    fast_paths: FastPaths = field(default_factory=FastPaths)  # the engine's speed-ups (rlvr.fastpaths)
    environment: Environment | None = None  # tool calling (rlvr.environments); None: single-turn

    def __post_init__(self) -> None:
        self.fast_paths = FastPaths.coerce(self.fast_paths)
        if isinstance(self.temperatures, (int, float)):
            self.temperatures = [float(self.temperatures)]
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {self.temperatures}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.stop_strings = tuple(self.stop_strings)
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings}")


@dataclass
class Rollouts:
    """N = prompts x samples completions; row ``i * G + j`` is sample j of prompt i.

    Tensors are on CPU; ``completion_ids``, ``completion_mask``, ``logprobs`` and ``environment_mask``
    are [N, T], right-padded to the longest completion. ``environment_mask`` marks the tokens an
    environment wrote (log-prob 0; zeros when none is given), ``tool_calls`` each row's calls in order.
    """

    prompt_ids: list[list[int]]  # per row, unpadded
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    temperatures: torch.Tensor  # [N]
    finish_reasons: list[str]
    texts: list[str]
    group_index: torch.Tensor  # [N] index of the prompt
    sample_index: torch.Tensor  # [N] index within the group
    pad_token_id: int = 0  # fills completion_ids past each completion's end
    environment_mask: torch.Tensor | None = None  # [N, T] long, within completion_mask; None: zeros
    tool_calls: list[list[ToolCall]] | None = None  # None: no calls

    def __post_init__(self) -> None:
        if self.environment_mask is None:
            self.environment_mask = torch.zeros_like(self.completion_mask)
        if self.tool_calls is None:
            self.tool_calls = [[] for _ in self.finish_reasons]

    def __len__(self) -> int:
        return len(self.finish_reasons)

    @property
    def policy_mask(self) -> torch.Tensor:
        """The tokens the policy sampled: the completion less what the environment wrote."""
        return self.completion_mask * (1 - self.environment_mask)

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)

    def completion_token_lists(self) -> list[list[int]]:
        return [ids[:n].tolist() for ids, n in zip(self.completion_ids, self.completion_lengths.tolist())]


def generate_rollouts(
    model: Any,
    tokenizer: Any,
    prompts: list[str] | list[list[int]],
    num_samples: int = 1,
    config: SamplingConfig | None = None,
    stops: Sequence[StopRule] | None = None,
) -> Rollouts:
    """Sample ``num_samples`` completions for each prompt: texts, or token ids taken as they are. ``stops``:
    each prompt's own stop rule (its task's), with ``config.stop_strings`` added; default: those strings alone."""
    return concat_rollouts(list(stream_rollouts(model, tokenizer, prompts, num_samples, config, stops)))


def stream_rollouts(
    model: Any,
    tokenizer: Any,
    prompts: list[str] | list[list[int]],
    num_samples: int = 1,
    config: SamplingConfig | None = None,
    stops: Sequence[StopRule] | None = None,
    backend: RolloutBackend | None = None,
) -> Iterator[Rollouts]:
    """Like :func:`generate_rollouts`, yielding the prompts in order as they finish, in chunks of at most
    ``config.max_batch_rows`` rows (at least one prompt's G samples); ``group_index`` counts prompts
    across chunks. The concatenated chunks are the same rollouts whatever the chunk size. ``backend``:
    the engine kept from earlier calls (a trainer's), else one for this call."""
    config = config or SamplingConfig()
    encoded, rules = encode_prompts(tokenizer, prompts, num_samples, config, stops)
    max_rows = max(num_samples, min(len(encoded) * num_samples, config.max_batch_rows or len(encoded) * num_samples))
    prompts_per_chunk = max(1, max_rows // num_samples)
    engine = (backend or RolloutBackend()).engine_for(model, tokenizer, encoded, num_samples, max_rows, config)
    requests = [
        EngineRequest(
            prompt_ids=ids,
            num_samples=num_samples,
            temperatures=tuple(config.temperatures),
            max_new_tokens=config.max_new_tokens,
            top_p=config.top_p,
            seed=config.seed,
            prompt_index=i,
            stop=rules[i],
            environment=config.environment,
        )
        for i, ids in enumerate(encoded)
    ]
    try:
        yield from _stream_chunks(engine, requests, num_samples, prompts_per_chunk, tokenizer)
    finally:
        engine.release_buffers()  # nothing of the call is kept through the trainer's update


def _stream_chunks(engine: Engine, requests: list[EngineRequest], num_samples: int, prompts_per_chunk: int, tokenizer: Any) -> Iterator[Rollouts]:
    """``requests`` run on ``engine``, yielded in prompt order as they finish, ``prompts_per_chunk`` prompts a chunk."""
    finished: set[int] = set()
    next_prompt = 0
    with torch.inference_mode():  # the engine's plan packs the linear layers where it says so
        for request in engine.run_requests(requests):
            if request.error is not None:
                raise request.error
            finished.add(request.prompt_index)
            ready = next_prompt
            while ready in finished:
                ready += 1
            while ready - next_prompt >= prompts_per_chunk or (ready == len(requests) and ready > next_prompt):
                end = min(ready, next_prompt + prompts_per_chunk)
                with torch.inference_mode(False):  # ordinary tensors: training takes gradients through them
                    chunk = _rollouts(requests[next_prompt:end], next_prompt, num_samples, tokenizer)
                yield chunk
                next_prompt = end


def encode_prompts(
    tokenizer: Any, prompts: list[str] | list[list[int]], num_samples: int, config: SamplingConfig, stops: Sequence[StopRule] | None
) -> tuple[list[list[int]], list[StopRule]]:
    """The prompts as token ids (texts tokenized without special tokens, ids as they are) and each one's
    stop rule with ``config.stop_strings`` added; a ValueError naming what is wrong with the call."""
    if stops is not None and len(stops) != len(prompts):
        raise ValueError(f"{len(stops)} stop rules for {len(prompts)} prompts: give one per prompt")
    if num_samples < 1:
        raise ValueError("num_samples must be >= 1")
    if not prompts:
        raise ValueError("no prompts")
    texts = sum(isinstance(p, str) for p in prompts)
    if texts not in (0, len(prompts)):
        raise ValueError("prompts are all texts or all token ids")
    encoded = tokenizer(list(prompts), add_special_tokens=False).input_ids if texts else [list(p) for p in prompts]
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("empty prompt")
    rules = [(rule or NO_STOP_RULE).with_strings(config.stop_strings) for rule in stops] if stops is not None else None
    return encoded, rules or [StopRule(config.stop_strings)] * len(encoded)


class RolloutBackend:
    """What rollouts keep from call to call (a trainer's whole run): one engine for the model and its
    settings, its backend planned at the first call. Each call sizes it for its prompts and refreshes it
    (the trainer updates the weights in place between calls: the runner packs them afresh and the prefix
    cache empties where any changed); after the call it lets go of its KV buffers and packed weights."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._key: tuple | None = None

    def engine_for(self, model: Any, tokenizer: Any, encoded: list[list[int]], num_samples: int, max_rows: int, config: SamplingConfig) -> Engine:
        """The engine for one call, sized for it: KV room for ``max_rows`` rows of the longest prompt plus
        the budget, twice over (two lanes), and its prompts' prefill caches."""
        longest = max(len(ids) for ids in encoded) + config.max_new_tokens
        per_token = kv_cache_bytes_per_token(model.config, model.dtype)
        budget = per_token * (2 * max_rows * quantized(longest) + sum(len(ids) for ids in encoded[: max(1, max_rows // num_samples)]))
        stop_ids = None if config.stop_token_ids is None else tuple(config.stop_token_ids)
        key = (id(model), id(tokenizer), model.dtype, config.fast_paths, stop_ids)
        if self.engine is not None and key == self._key and self.engine.idle():
            self.engine.resize(max_rows, budget)
            self.engine.refresh()
            return self.engine
        self.engine = Engine(
            model,
            tokenizer,
            max_rows=max_rows,
            step_tokens=ROLLOUT_STEP_TOKENS,
            kv_budget_bytes=budget,
            max_share=1.0,
            short_lane_tokens=SHORT_LANE_TOKENS,
            fast_paths=config.fast_paths,
            stop_token_ids=config.stop_token_ids,
            plan=self.engine.plan if self.engine is not None and key[:4] == self._key[:4] else None,
        )
        self._key = key
        return self.engine


def _rollouts(requests: list[EngineRequest], first_prompt: int, group: int, tokenizer: Any) -> Rollouts:
    """The finished ``requests`` (prompts ``first_prompt`` on) as :class:`Rollouts`, row ``i * G + j`` sample j of prompt i."""
    rows = [
        (request.token_ids[j], request.logprobs[j], request.finish_reasons[j], request.environment_masks[j], request.tool_calls[j])
        for request in requests
        for j in range(group)
    ]
    prompts = [request.prompt_ids for request in requests]
    temperatures = [request.temperature(j) for request in requests for j in range(group)]
    return rows_to_rollouts(prompts, rows, group, temperatures, tokenizer, first_prompt)


def rows_to_rollouts(
    prompts: Sequence[Sequence[int]], rows: list[tuple], group: int, temperatures: list[float], tokenizer: Any, first_prompt: int = 0
) -> Rollouts:
    """:class:`Rollouts` from each row's (token ids, log-probs, finish reason[, environment mask, tool calls]), row
    ``i * G + j`` sample j of prompt i (``prompts[i]``), each row at its own ``temperatures`` entry."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    token_ids = [row[0] for row in rows]
    count, width = len(rows), max(1, max(map(len, token_ids)))
    completion_ids = torch.full((count, width), pad_id, dtype=torch.long)
    mask = torch.zeros((count, width), dtype=torch.long)
    logprobs = torch.zeros((count, width), dtype=torch.float32)
    environment_mask = torch.zeros((count, width), dtype=torch.long)
    for k, (ids, values, _, *environment) in enumerate(rows):
        if n := len(ids):
            completion_ids[k, :n] = torch.tensor(ids)
            logprobs[k, :n] = torch.tensor(values)
            mask[k, :n] = 1
            if environment:
                environment_mask[k, :n] = torch.tensor(environment[0])
    return Rollouts(
        prompt_ids=[list(prompts[k // group]) for k in range(count)],
        completion_ids=completion_ids,
        completion_mask=mask,
        logprobs=logprobs,
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        finish_reasons=[row[2] for row in rows],
        texts=tokenizer.batch_decode(token_ids, skip_special_tokens=True),
        group_index=torch.arange(count) // group + first_prompt,
        sample_index=torch.arange(count) % group,
        pad_token_id=pad_id,
        environment_mask=environment_mask,
        tool_calls=[list(row[4]) if len(row) > 4 else [] for row in rows],
    )


def concat_rollouts(chunks: list[Rollouts]) -> Rollouts:
    """One :class:`Rollouts` from several, right-padding to the longest completion."""
    if len(chunks) == 1:
        return chunks[0]
    width = max(c.completion_ids.shape[1] for c in chunks)

    def cat(name: str, pad: float) -> torch.Tensor:
        parts = [getattr(c, name) for c in chunks]
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts])

    pad_id = chunks[0].pad_token_id
    return Rollouts(
        prompt_ids=[ids for c in chunks for ids in c.prompt_ids],
        completion_ids=cat("completion_ids", pad_id),
        completion_mask=cat("completion_mask", 0),
        logprobs=cat("logprobs", 0.0),
        temperatures=torch.cat([c.temperatures for c in chunks]),
        finish_reasons=[r for c in chunks for r in c.finish_reasons],
        texts=[t for c in chunks for t in c.texts],
        group_index=torch.cat([c.group_index for c in chunks]),
        sample_index=torch.cat([c.sample_index for c in chunks]),
        pad_token_id=pad_id,
        environment_mask=cat("environment_mask", 0),
        tool_calls=[calls for c in chunks for calls in c.tool_calls],
    )
