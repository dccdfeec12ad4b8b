"""Rollout engine: G sampled completions for each of many prompts, in one batched decode loop.

The loop is written out (no HF ``generate``) so that GRPO gets exactly what it needs, fast:

* each prompt is prefilled once (left-padded batch, attention mask, position ids, logits of the last
  position only) and its KV cache repeated for its G samples;
* decoding steps one token at a time with a per-row temperature (below ``GREEDY_BELOW_TEMPERATURE``,
  0 included: greedy) and top-p, writing
  keys and values into a cache preallocated for the whole token budget (no concatenation per
  step); on CPU, Llama-family models step through ``rlvr.fastpaths.fused_decode`` (fused, packed weights,
  a few large operations per layer), other models through their own forward with every linear
  layer on a weight packed once per rollout (``rlvr.fastpaths.packed_linear``) and, in bf16/fp16,
  ``rlvr.fastpaths.attention``'s float32 SDPA; finished rows are dropped from the batch (cache rows and
  per-row state are index-selected), so they stop costing compute;
* a row stops at an end token (``"eos"``), right after a completed ``#### <number>`` line
  (``"answer"``), once its text holds one of ``config.stop_strings`` (``"stop"``; the text is
  not cut), at the token budget (``"length"``), or when ``config.should_stop`` names its prompt
  (``"cancelled"``: a caller that no longer wants it); ``config.on_tokens`` sees every step's
  tokens as they are sampled (for callers that stream them);
* each sampled token's log-prob is recorded under the temperature-scaled softmax before top-p
  truncation (temperature 1 for greedy rows): GRPO's "old" log-probs, with no extra forward pass;
* with ``config.environment`` (tool calling: ``rlvr.environments``), each row's episode sees its
  policy tokens and may inject text: its tokens are fed to the row one per decode step instead of
  sampled ones (``rlvr.environments.driver``: the KV cache grows by them, no re-prefill), marked in
  ``Rollouts.environment_mask`` with log-prob 0, and never end the row; a stop token the episode
  answers keeps the row going. Tools run inline on this thread (a program up to its time budget):
  training batches wait for their slowest row anyway. Without an environment (or with ``SingleTurn``)
  nothing of this runs.

Sampling draws from one ``torch.Generator`` seeded from the config: same seed, same rollouts.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlvr.answers import is_well_formed
from rlvr.environments.base import Environment, ToolCall
from rlvr.environments.driver import EpisodeDriver, episode_drivers
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.attention import use_fast_attention
from rlvr.fastpaths.eligibility import use_float32_attention, use_packed_linears, use_static_decode
from rlvr.fastpaths.fused_decode import fused_decoder
from rlvr.fastpaths.packed_linear import packed_linears
from rlvr.fastpaths.static_decode import StaticDecoder, static_decoder

FINISH_REASONS = ("eos", "answer", "stop", "length", "cancelled")
GREEDY_BELOW_TEMPERATURE = 1e-5  # a lower temperature is greedy: logits / T would overflow float32 (NaN probabilities)
_TAIL_TOKENS = 48  # tokens decoded to check for a just-completed '#### <number>' line


@dataclass
class SamplingConfig:
    """How completions are sampled. ``temperatures`` is cycled over the G samples of a group."""

    max_new_tokens: int = 256
    temperatures: list[float] = field(default_factory=lambda: [1.0])
    top_p: float = 1.0
    stop_at_final_answer: bool = True
    seed: int = 0
    max_batch_rows: int | None = None  # rows per forward; prompts stream through in chunks
    stop_token_ids: list[int] | None = None  # default: eos, pad and <|im_end|> of the tokenizer
    should_stop: Callable[[int], bool] | None = None  # per decode step, per live prompt index: True ends its rows
    stop_strings: tuple[str, ...] = ()  # a row ends once its text holds one (finish reason "stop"; not cut)
    on_tokens: Callable[[list[int], list[int]], None] | None = None  # per decode step: the live rows and their new tokens
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


def generate_rollouts(model: Any, tokenizer: Any, prompts: list[str] | list[list[int]], num_samples: int = 1, config: SamplingConfig | None = None) -> Rollouts:
    """Sample ``num_samples`` completions for each prompt: texts, or token ids taken as they are
    (see the module docstring)."""
    return concat_rollouts(list(stream_rollouts(model, tokenizer, prompts, num_samples, config)))


def stream_rollouts(
    model: Any, tokenizer: Any, prompts: list[str] | list[list[int]], num_samples: int = 1, config: SamplingConfig | None = None
) -> Iterator[Rollouts]:
    """Like :func:`generate_rollouts`, yielding chunks of at most ``config.max_batch_rows`` rows.

    ``group_index`` counts prompts across chunks; a chunk holds at least one prompt's G samples.
    One generator serves all chunks, so the concatenated chunks are the same rollouts whatever
    the chunk size when sampling is greedy.
    """
    config = config or SamplingConfig()
    if num_samples < 1:
        raise ValueError("num_samples must be >= 1")
    if not prompts:
        raise ValueError("no prompts")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(config.seed)
    texts = sum(isinstance(p, str) for p in prompts)
    if texts not in (0, len(prompts)):
        raise ValueError("prompts are all texts or all token ids")
    encoded = tokenizer(list(prompts), add_special_tokens=False).input_ids if texts else [list(p) for p in prompts]
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("empty prompt")
    prompts_per_chunk = max(1, (config.max_batch_rows or len(encoded) * num_samples) // num_samples)
    for start in range(0, len(encoded), prompts_per_chunk):
        chunk_ids = encoded[start : start + prompts_per_chunk]
        chunk_config = config
        if config.should_stop is not None:  # the chunk's prompt i is prompt start + i of the call
            chunk_config = replace(chunk_config, should_stop=lambda i, start=start: config.should_stop(start + i))
        if config.on_tokens is not None:  # and its row r is row start * num_samples + r
            chunk_config = replace(chunk_config, on_tokens=lambda rows, tokens, base=start * num_samples: config.on_tokens([base + r for r in rows], tokens))
        chunk = _decode_chunk(model, tokenizer, chunk_ids, num_samples, chunk_config, generator)
        chunk.group_index += start
        yield chunk


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


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_p: float | torch.Tensor,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, their log-probs). ``top_p``: one for all rows or one
    per row; ``uniforms``: each row's draw in [0, 1) (the caller's own generators), else drawn from
    ``generator``.

    Row r samples from softmax(logits_r / T_r) truncated to its top-p nucleus, or takes the argmax
    when T_r < ``GREEDY_BELOW_TEMPERATURE`` (0 included: dividing by a tinier T overflows float32 into
    NaN probabilities). The log-prob is log softmax(logits_r / T_r)[token] before truncation (T_r = 1
    for greedy rows), matching what training recomputes.
    """
    greedy = temperatures < GREEDY_BELOW_TEMPERATURE
    scaled = logits.float() / logprob_temperatures(temperatures).unsqueeze(1)
    probs = torch.softmax(scaled, dim=-1)
    if greedy.all():
        tokens = probs.argmax(dim=-1)
    else:
        truncated = bool((torch.as_tensor(top_p) < 1.0).any())
        sampling_probs = _top_p_filter(probs, top_p) if truncated else probs
        tokens = _inverse_cdf_sample(sampling_probs, generator, uniforms)
        if greedy.any():
            tokens = torch.where(greedy, probs.argmax(dim=-1), tokens)
    return tokens, probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log()


def logprob_temperatures(temperatures: torch.Tensor) -> torch.Tensor:
    """The temperature each row's log-probs are taken at: its own, 1 for a greedy row (below
    ``GREEDY_BELOW_TEMPERATURE``). The sampler and every recomputation of its log-probs use this."""
    return torch.where(temperatures < GREEDY_BELOW_TEMPERATURE, 1.0, temperatures)


def is_greedy(temperature: float) -> bool:
    """Whether a row at ``temperature`` decodes greedily (see :func:`sample_tokens`)."""
    return temperature < GREEDY_BELOW_TEMPERATURE


def _inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row from unnormalized ``probs`` (many times faster than ``torch.multinomial`` on CPU).

    Zero-probability tokens are never drawn, so the sampled token's log-prob is finite.
    """
    cdf = probs.cumsum(dim=-1)
    if uniforms is None:
        uniforms = torch.rand((probs.shape[0],), generator=generator, device=probs.device)
    u = uniforms.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _top_p_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row outside the smallest set of tokens whose mass reaches ``top_p`` (its own, per row)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    threshold = top_p.unsqueeze(1) if isinstance(top_p, torch.Tensor) else top_p
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= threshold  # mass before this token already enough
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _decode_chunk(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    num_samples: int,
    config: SamplingConfig,
    generator: torch.Generator,
) -> Rollouts:
    rows, fast = len(prompt_ids) * num_samples, config.fast_paths
    with torch.inference_mode():
        packing = contextlib.nullcontext()
        if use_static_decode(model, fast):  # CUDA: fixed-shape steps replayed as CUDA graphs
            decode_step = static_decoder(model, rows, max(len(ids) for ids in prompt_ids) + config.max_new_tokens, graphs=True)
        elif fused := fused_decoder(model, rows, fast):
            decode_step = fused
        else:
            decode_step = partial(_model_decode_step, model)
            packing = packed_linears(model, rows) if use_packed_linears(model, fast) else packing
        with packing:
            rollouts = _decode_loop(model, tokenizer, prompt_ids, num_samples, config, generator, decode_step)
    for name in ("completion_ids", "completion_mask", "logprobs", "environment_mask", "temperatures", "group_index", "sample_index"):
        setattr(rollouts, name, getattr(rollouts, name).clone())  # inference tensors -> ordinary tensors
    return rollouts


def _decode_loop(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    num_samples: int,
    config: SamplingConfig,
    generator: torch.Generator,
    decode_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache], torch.Tensor] | StaticDecoder,
) -> Rollouts:
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = torch.tensor(sorted(_stop_token_ids(model, tokenizer, config)), device=device)
    newlines = _newline_counts(tokenizer, model).to(device) if config.stop_at_final_answer else None
    # tokens decoded to find a stop string: each token holds at least one byte
    stop_window = max(len(s.encode()) for s in config.stop_strings) + 1 if config.stop_strings else 0
    num_prompts, group = len(prompt_ids), num_samples
    num_rows, budget = num_prompts * group, config.max_new_tokens

    # Prefill each prompt once (left-padded), then give every sample its own copy of the cache.
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((num_prompts, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num_prompts, width), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_(min=0)
    # bf16 SDPA on CPU is slow on the preallocated cache's strided views
    use_fast_attention(model, use_float32_attention(model, config.fast_paths))
    cache = DynamicCache(config=model.config)
    logits = last_position_logits(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache)
    if group > 1:
        cache.batch_repeat_interleave(group)
        logits = logits.repeat_interleave(group, dim=0)
        attention_mask = attention_mask.repeat_interleave(group, dim=0)
    if isinstance(decode_step, StaticDecoder):
        cache = decode_step.adopt(cache)  # its fixed buffers hold the cache from here on
    else:
        preallocate(cache, extra=budget)
    next_position = position_ids[:, -1].repeat_interleave(group) + 1

    sample_index = torch.arange(num_rows) % group
    temps_cycle = torch.tensor(config.temperatures, dtype=torch.float32)
    temperatures = temps_cycle[sample_index % len(temps_cycle)]
    row_temps = temperatures.to(device)
    rows = torch.arange(num_rows, device=device)  # original row of each live batch row
    tokens_out = torch.full((num_rows, budget), pad_id, dtype=torch.long, device=device)
    logprobs_out = torch.zeros((num_rows, budget), dtype=torch.float32, device=device)
    lengths = torch.full((num_rows,), budget, dtype=torch.long)
    finish = ["length"] * num_rows
    drivers = episode_drivers(config.environment, tokenizer, num_rows)  # None: no per-token episode work
    environment_out = torch.zeros((num_rows, budget), dtype=torch.long) if drivers is not None else None

    for t in range(budget):
        tokens, logprobs = sample_tokens(logits, row_temps, config.top_p, generator)
        if drivers is not None:
            forced = _force_tokens(drivers, rows, tokens, logprobs, environment_out, t)
        tokens_out[rows, t] = tokens
        logprobs_out[rows, t] = logprobs
        if config.on_tokens is not None:
            config.on_tokens(rows.tolist(), tokens.tolist())
        done = torch.isin(tokens, stop_ids)
        if newlines is not None:
            done = _mark_answers(tokenizer, tokens_out, rows, tokens, done, newlines, t, finish)
        else:
            for i in done.nonzero().flatten().tolist():
                finish[int(rows[i])] = "eos"
        if config.stop_strings:
            done = _stop_at_strings(tokenizer, tokens_out, rows, done, config.stop_strings, stop_window, t, finish)
        if drivers is not None:
            done = _observe_episodes(drivers, rows, tokens, stop_ids, forced, done, finish, observe=t < budget - 1)
        if config.should_stop is not None:
            done = _stop_cancelled(config.should_stop, rows, group, done, finish)
        if t == budget - 1:
            break
        if done.any():
            finished = rows[done].cpu()
            lengths[finished] = t + 1
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            rows, tokens, row_temps = rows[keep], tokens[keep], row_temps[keep]
            attention_mask, next_position = attention_mask[keep], next_position[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
        logits = decode_step(tokens, next_position, attention_mask, cache)
        next_position = next_position + 1

    width = int(lengths.max())
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    completion_ids = tokens_out[:, :width].cpu().masked_fill(mask == 0, pad_id)
    logprobs = logprobs_out[:, :width].cpu() * mask
    environment_mask = environment_out[:, :width] * mask if environment_out is not None else torch.zeros_like(mask)
    texts = tokenizer.batch_decode([ids[:n].tolist() for ids, n in zip(completion_ids, lengths.tolist())], skip_special_tokens=True)
    return Rollouts(
        prompt_ids=[list(prompt_ids[i // group]) for i in range(num_rows)],
        completion_ids=completion_ids,
        completion_mask=mask,
        logprobs=logprobs,
        temperatures=temperatures,
        finish_reasons=finish,
        texts=texts,
        group_index=torch.arange(num_rows) // group,
        sample_index=sample_index,
        pad_token_id=pad_id,
        environment_mask=environment_mask,
        tool_calls=[d.calls for d in drivers] if drivers is not None else None,
    )


def _force_tokens(
    drivers: list[EpisodeDriver], rows: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, environment_out: torch.Tensor, t: int
) -> torch.Tensor:
    """Replace the sampled token of each live row with an injection queued by the next token the
    environment writes (log-prob 0, marked at step ``t``); returns which live rows were forced."""
    forced = torch.zeros(len(rows), dtype=torch.bool)
    live, written = [], []
    for i, row in enumerate(rows.tolist()):
        token = drivers[row].next_forced()
        if token is not None:
            live.append(i)
            written.append(token)
            environment_out[row, t] = 1
    if live:
        forced[live] = True
        index = torch.tensor(live, device=tokens.device)
        tokens[index] = torch.tensor(written, device=tokens.device)
        logprobs[index] = 0.0
    return forced


def _observe_episodes(
    drivers: list[EpisodeDriver],
    rows: torch.Tensor,
    tokens: torch.Tensor,
    stop_ids: torch.Tensor,
    forced: torch.Tensor,
    done: torch.Tensor,
    finish: list[str],
    observe: bool,
) -> torch.Tensor:
    """Show each episode its row's policy token (when ``observe``: budget is left for an answer);
    ``done`` less the rows the environment keeps going: forced rows and rows it just answered."""
    keep = forced.clone()
    if observe:
        ended = torch.isin(tokens, stop_ids).tolist()
        for i, (row, token) in enumerate(zip(rows.tolist(), tokens.tolist())):
            if not forced[i] and drivers[row].observe(token, ended[i]):
                keep[i] = True
    keep = keep.to(done.device)
    if not (done & keep).any():
        return done
    for i in (done & keep).nonzero().flatten().tolist():
        finish[int(rows[i])] = "length"
    return done & ~keep


def last_position_logits(model: Any, **inputs: Any) -> torch.Tensor:
    """The logits at the last position of each row, [rows, vocabulary] (the cache is updated)."""
    return model(**inputs, use_cache=True, logits_to_keep=1).logits[:, -1]


def _model_decode_step(model: Any, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """One decode step through the model's own forward (for models :func:`fused_decoder` does not take)."""
    return last_position_logits(
        model,
        input_ids=tokens.unsqueeze(1),
        attention_mask=attention_mask,
        position_ids=positions.unsqueeze(1),
        past_key_values=cache,
    )


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room to grow: an update
    writes into the buffer instead of concatenating the whole cache again."""

    def __init__(self, layer: DynamicLayer, extra: int):
        super().__init__()
        self.dtype, self.device, self.is_initialized = layer.dtype, layer.device, True
        self.length = layer.keys.shape[-2]
        self._buffers = [self._with_room(t, self.length + extra) for t in (layer.keys, layer.values)]
        self._set_views()

    @staticmethod
    def _with_room(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
        buffer = tensor.new_empty((*tensor.shape[:-2], capacity, tensor.shape[-1]))
        buffer[..., : tensor.shape[-2], :] = tensor
        return buffer

    def _set_views(self) -> None:
        self.keys, self.values = (b[..., : self.length, :] for b in self._buffers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        end = self.length + key_states.shape[-2]
        if end > self._buffers[0].shape[-2]:  # out of room: double it
            self._buffers = [self._with_room(b[..., : self.length, :], 2 * end) for b in self._buffers]
        self._buffers[0][..., self.length : end, :] = key_states
        self._buffers[1][..., self.length : end, :] = value_states
        self.length = end
        self._set_views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._buffers = [b[indices] for b in self._buffers]
        self._set_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._buffers = [b.repeat_interleave(repeats, dim=0) for b in self._buffers]
        self._set_views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a preallocated cache layer is not cropped")

    def reset(self) -> None:
        raise NotImplementedError("a preallocated cache layer is not reset")


def preallocate(cache: DynamicCache, extra: int) -> None:
    """Give each filled full-attention layer of ``cache`` room for ``extra`` more positions
    (sliding-window and other special layers are left as they are)."""
    cache.layers = [PreallocatedLayer(layer, extra) if type(layer) is DynamicLayer and layer.is_initialized else layer for layer in cache.layers]


def _mark_answers(
    tokenizer: Any,
    tokens_out: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    done: torch.Tensor,
    newlines: torch.Tensor,
    t: int,
    finish: list[str],
) -> torch.Tensor:
    """Finish reasons for this step; rows that just completed a ``#### <number>`` line are done.

    Only rows whose new token holds a newline (or ends the text) are decoded, and only their tail.
    """
    counts = newlines[tokens]
    check = (counts > 0) | done
    if not check.any():
        return done
    done = done.clone()
    start = max(0, t + 1 - _TAIL_TOKENS)
    for i in check.nonzero().flatten().tolist():
        row = int(rows[i])
        if done[i]:  # an end token: did it close an answer line?
            tail = tokenizer.decode(tokens_out[row, start:t].tolist())
            finish[row] = "answer" if is_well_formed(tail.rsplit("\n", 1)[-1]) else "eos"
            continue
        lines = tokenizer.decode(tokens_out[row, start : t + 1].tolist()).split("\n")
        closed = lines[-1 - int(counts[i]) : -1]  # the lines this token's newlines terminated
        if any(is_well_formed(line) for line in closed):
            finish[row] = "answer"
            done[i] = True
    return done


def _stop_at_strings(
    tokenizer: Any,
    tokens_out: torch.Tensor,
    rows: torch.Tensor,
    done: torch.Tensor,
    stop_strings: tuple[str, ...],
    window: int,
    t: int,
    finish: list[str],
) -> torch.Tensor:
    """``done`` plus the live rows whose text now holds a stop string (finish reason ``"stop"``): the
    last ``window`` tokens of each are decoded, as the completion's text is (special tokens skipped)."""
    live = (~done).nonzero().flatten()
    if live.numel() == 0:
        return done
    tails = tokenizer.batch_decode(tokens_out[rows[live], max(0, t + 1 - window) : t + 1].tolist(), skip_special_tokens=True)
    hits = [i for i, tail in zip(live.tolist(), tails) if any(s in tail for s in stop_strings)]
    if not hits:
        return done
    done = done.clone()
    for i in hits:
        done[i] = True
        finish[int(rows[i])] = "stop"
    return done


def _stop_cancelled(should_stop: Callable[[int], bool], rows: torch.Tensor, group: int, done: torch.Tensor, finish: list[str]) -> torch.Tensor:
    """``done`` plus the live rows of every prompt ``should_stop`` names (finish reason ``"cancelled"``)."""
    prompts = (rows // group).tolist()
    stopped = {p for p in set(prompts) if should_stop(p)}
    if not stopped:
        return done
    done = done.clone()
    for i, p in enumerate(prompts):
        if p in stopped and not done[i]:
            done[i] = True
            finish[int(rows[i])] = "cancelled"
    return done


def _stop_token_ids(model: Any, tokenizer: Any, config: SamplingConfig) -> set[int]:
    if config.stop_token_ids is not None:
        return set(config.stop_token_ids)
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return {int(i) for i in ids if i is not None}


_NEWLINE_TABLES: dict[int, tuple[Any, torch.Tensor]] = {}


def _newline_counts(tokenizer: Any, model: Any) -> torch.Tensor:
    """Number of newlines in each token's text, over the model's vocabulary (cached per tokenizer)."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    cached = _NEWLINE_TABLES.get(id(tokenizer))
    if cached is not None and cached[0]() is tokenizer and len(cached[1]) == vocab_size:
        return cached[1]
    known = min(len(tokenizer), vocab_size)
    texts = tokenizer.batch_decode([[i] for i in range(known)])
    counts = torch.zeros(vocab_size, dtype=torch.long)
    counts[:known] = torch.tensor([text.count("\n") for text in texts])
    _NEWLINE_TABLES[id(tokenizer)] = (weakref.ref(tokenizer), counts)
    return counts


@dataclass
class TokenScores:
    """One sequence scored by the model: each token's log-prob after its prefix (from the second token
    on), and the ``top_k`` most likely tokens at each of those positions with their log-probs."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def score_tokens(model: Any, sequences: list[list[int]], temperatures: list[float], top_k: int = 0, positions_per_chunk: int = 256) -> list[TokenScores]:
    """Score each sequence in one forward pass (``temperatures``: one per sequence; a greedy one scores at
    1, as :func:`sample_tokens` records): what serving's prompt log-probs (``echo``) and alternatives
    (``logprobs: k``) read. The vocabulary projection runs ``positions_per_chunk`` positions at a time,
    so a long prompt never holds its whole [positions, vocabulary] logits."""
    device = next(model.parameters()).device
    head, scores = model.get_output_embeddings(), []
    with torch.inference_mode():
        for ids, temperature in zip(sequences, temperatures):
            scale = float(logprob_temperatures(torch.tensor([float(temperature)]))[0])
            hidden = model.get_decoder()(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0, :-1]
            targets = torch.tensor(ids[1:], device=device)
            logprobs, top_ids, top_logprobs = [], [], []
            for start in range(0, hidden.shape[0], positions_per_chunk):
                part = torch.log_softmax(head(hidden[start : start + positions_per_chunk]).float() / scale, dim=-1)
                logprobs += part.gather(1, targets[start : start + positions_per_chunk, None]).squeeze(1).tolist()
                if top_k:
                    values, indices = part.topk(top_k, dim=-1)
                    top_ids += indices.tolist()
                    top_logprobs += values.tolist()
            scores.append(TokenScores(logprobs, top_ids, top_logprobs))
    return scores
