"""The executor: a step's plan run as one forward over a flat batch, and the rows' next tokens sampled.

:meth:`StepExecutor.execute` takes the scheduler's :class:`~rlvr.generation.scheduler.StepPlan` (plain
data: every lane's rows, one token each, and the prompt chunks), flattens it so the weights are read once
per step, with each segment's attention where its keys live (a lane's slots, a prompt's cache), samples
the live rows and a whole prompt's rows' first tokens (each row from its own generator, kept here by
row) and returns a :class:`~rlvr.generation.scheduler.StepOutput`; the scheduler's side applies it. A
decode-only step of one lane runs from a CUDA graph where the plan built them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache

from rlvr.fastpaths.fused_decode import Attend, cached_attention, gqa_attention
from rlvr.fastpaths.plan import BackendPlan
from rlvr.fastpaths.prompt_attention import prompt_attention
from rlvr.fastpaths.slot_attention import prompt_slots, slot_attention
from rlvr.generation.cuda_graphs import GraphedDecode
from rlvr.generation.kv_cache import SlotCache
from rlvr.generation.model_runner import model_runner
from rlvr.generation.request import RowSampling
from rlvr.generation.sampler import draw_uniforms, sample_tokens
from rlvr.generation.scheduler import LaneOutput, PrefillOutput, StepOutput, StepPlan


class StepExecutor:
    """Runs step plans on ``model`` with what ``plan`` (the backend plan) chose: the runner (packed
    linears where it says), slot attention, CUDA graphs per row bucket."""

    def __init__(self, model: Any, max_rows: int, plan: BackendPlan):
        self.plan = plan
        self.runner = model_runner(model, max_rows, plan)  # packs the linear layers where the plan says so
        self.device = next(model.parameters()).device
        self.graphed = GraphedDecode(self.runner, self.device, graphs=True, float32_attention=plan.float32_attention) if plan.cuda_graphs else None
        self.slot_kernel = plan.slot_attention  # decode attention to each row's own length
        self.generators: dict[tuple[int, int], torch.Generator] = {}  # each sampling row's, by (request id, sample)

    def execute(self, plan: StepPlan, lane_caches: list[SlotCache], prompt_caches: dict[int, DynamicCache]) -> StepOutput:
        """One forward over ``plan``: each lane's rows write their keys and values into its slots
        (``lane_caches``, by lane index) at their positions, each chunk's keys join its prompt's cache
        (``prompt_caches``, by request id); then the live rows' next tokens are sampled, and where a prompt
        is whole, its rows' first tokens. Advancing the rows' lengths is
        the caller's (parked rows ride along, their outputs dropped)."""
        self.forget(plan.finished)
        if self.graphed is not None and not plan.prefill and (graphed := self._graphed_step(plan, lane_caches)) is not None:
            return graphed
        tokens, positions, segments, logits_at = [], [], [], []
        for step in plan.decode:
            start, cache = sum(map(len, tokens)), lane_caches[step.lane]
            lane_positions = torch.tensor(step.positions)
            cache.step_length = max(step.positions) + 1
            tokens.append(torch.tensor(step.tokens))
            positions.append(lane_positions)
            attend = _slot_attention(cache, lane_positions, self.device, self.slot_kernel, self.plan.float32_attention, step.prompts)
            segments.append((start, start + len(step.tokens), attend))
            logits_at += [start + i for i in step.live]
        for chunk in plan.prefill:
            start, begin, end = sum(map(len, tokens)), chunk.begin, chunk.end
            tokens.append(torch.tensor(chunk.tokens))
            positions.append(torch.arange(begin, end))
            attend = _prompt_attention(prompt_caches[chunk.request_id], begin, end, self.device, self.plan.prompt_attention, self.plan.float32_attention)
            segments.append((start, start + end - begin, attend))
            logits_at.append(start + end - begin - 1)
        if not segments:
            return StepOutput()
        logits = self.runner.forward(
            torch.cat(tokens).to(self.device), torch.cat(positions).to(self.device), _segmented(segments), torch.tensor(logits_at, device=self.device)
        )
        output, offset = StepOutput(tokens=sum(map(len, tokens))), 0
        for step in plan.decode:
            output.decode.append(LaneOutput(step.lane, step.live, *self._sample(logits[offset : offset + len(step.live)], step.sampling)))
            offset += len(step.live)
        for k, chunk in enumerate(plan.prefill):  # a whole prompt: each of its rows' first token
            first = self._sample(logits[offset + k].expand(len(chunk.sampling), -1), chunk.sampling) if chunk.last else ([], [])
            output.prefill.append(PrefillOutput(chunk.request_id, chunk.end, *first))
        return output

    def _graphed_step(self, plan: StepPlan, lane_caches: list[SlotCache]) -> StepOutput | None:
        """A decode-only step of the one lane with rows, none parked, from a CUDA graph; None where it does not fit."""
        if len(plan.decode) != 1:
            return None
        step = plan.decode[0]
        cache, rows = lane_caches[step.lane], len(step.tokens)
        if len(step.live) != rows or not self.graphed.fits(cache, rows):
            return None
        logits = self.graphed.step(cache, torch.tensor(step.tokens).to(self.device), torch.tensor(step.positions).to(self.device))
        return StepOutput(decode=[LaneOutput(step.lane, step.live, *self._sample(logits, step.sampling))], tokens=rows)

    def _sample(self, logits: torch.Tensor, rows: Sequence[RowSampling]) -> tuple[list[int], list[float]]:
        """Each row's next token and its log-prob, drawn from its own generator (made from its seed the first
        time its key is seen, kept until its request is done) at its temperature and top-p."""
        temperatures = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
        uniforms = draw_uniforms([self._generator(r) for r in rows])
        tokens, logprobs = sample_tokens(
            logits, temperatures.to(logits.device), top_p.to(logits.device), None, uniforms.to(logits.device), compiled=self.plan.sampling_kernel
        )
        return tokens.tolist(), logprobs.tolist()

    def forget(self, request_ids: list[int]) -> None:
        """Let go of the generators of the rows of ``request_ids`` (done)."""
        if request_ids and self.generators:
            done = set(request_ids)
            for key in [key for key in self.generators if key[0] in done]:
                del self.generators[key]

    def _generator(self, row: RowSampling) -> torch.Generator | None:
        if row.seed is None:
            return None
        generator = self.generators.get(row.key)
        if generator is None:
            generator = self.generators[row.key] = torch.Generator().manual_seed(row.seed)
        return generator


def _slot_attention(
    cache: SlotCache, positions: torch.Tensor, device: torch.device, kernel: bool, upcast: bool, prompts: Sequence[tuple[int, int]] = ()
) -> Attend:
    """A lane's decode attention: each row's new key and value go into its slot at its position, and
    its query attends over its slot up to there (``kernel``: through ``rlvr.fastpaths.slot_attention``,
    which writes them and reads each slot to that position only, in float32, a request's prompt from one
    slot for all its rows (``prompts``: each row's (slot, prompt length)); else SDPA over the lane's
    longest row, masked; ``upcast``: in float32 for bf16 / fp16)."""
    if kernel:
        shared = prompt_slots(prompts) if prompts else None

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
            layer = cache.layers[index]
            return slot_attention(queries, keys, values, layer.keys, layer.values, positions, scaling, shared).to(queries.dtype)

        return attend
    key_mask = (torch.arange(cache.step_length).unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]
    return cached_attention(cache, None if bool(key_mask.all()) else key_mask.to(device), upcast)


def _prompt_attention(cache: DynamicCache, begin: int, end: int, device: torch.device, kernel: bool, upcast: bool) -> Attend:
    """A prompt chunk's attention (positions ``begin`` .. ``end`` - 1): its keys and values are appended
    to the prompt's cache, each query attends causally over the prompt so far (``kernel``: through
    ``rlvr.fastpaths.prompt_attention``, in float32, each query's keys up to its position only; else SDPA, a
    first chunk without a mask so that it skips the blocks above the diagonal; ``upcast``: in float32 for
    bf16 / fp16)."""

    def append(index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.layers[index].update(keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0))

    if kernel:

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
            keys, values = append(index, keys, values)
            return prompt_attention(queries.float(), keys[0].float(), values[0].float(), begin, scaling).to(queries.dtype)

        return attend
    first = begin == 0
    mask = None if first else (torch.arange(end).unsqueeze(0) <= torch.arange(begin, end).unsqueeze(1)).to(device)  # [chunk, end]

    def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        keys, values = append(index, keys, values)
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
