"""What runs, decided once: the :class:`BackendPlan` of a model on a device under the ``FastPaths`` switches.

:func:`plan_backend` asks the rules of :mod:`rlvr.fastpaths.eligibility` once, when an engine, a GRPO
training or an SFT run starts; the engine (and so the service, which builds one), the update's scorer
and the trainers read the plan's fields from then on and never ask the rules again. Decide the thread
count before planning (the engine calls ``tune_threads`` first): slot attention depends on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from rlvr.fastpaths import FastPaths, eligibility

logger = logging.getLogger("rlvr.fastpaths")

FUSED_DECODER = "fused_decoder"  # rlvr.fastpaths.fused_decode: the Llama-family math on packed weights
MODEL_FORWARD = "model_forward"  # the model's own forward (rlvr.generation.model_runner.ModelForward)


@dataclass(frozen=True)
class BackendPlan:
    """The backend one model runs on: the engine's decode runner and kernels, and the update's paths."""

    device: str  # where the model runs: "cpu", "cuda", ...
    dtype: str  # its weights' dtype: "float32", "bfloat16", ...
    compute_dtype: str  # the forwards' dtype: the weights' for an engine; training's resolved compute_dtype
    threads: int  # torch threads the plan was decided at
    runner: str  # the engine's decode runner: FUSED_DECODER or MODEL_FORWARD
    layer_kernels: bool  # the fused decoder's RMSNorms and rotary through rlvr.fastpaths.layer_kernels
    linear_kernels: bool  # the fused decoder's linear layers through rlvr.fastpaths.linear_kernels
    sampling_kernel: bool  # the engine samples rows without top-p through rlvr.fastpaths.sampling_kernel
    packed_linears: bool  # the model's own forward on oneDNN-packed linear weights
    slot_attention: bool  # the engine's decode attention through rlvr.fastpaths.slot_attention
    prompt_attention: bool  # the engine's prompt-chunk attention through rlvr.fastpaths.prompt_attention
    float32_attention: bool  # the engine's attention (gqa_attention) in float32 for bf16/fp16 on CPU
    fast_attention: bool  # the model's SDPA attention as rlvr_sdpa (rlvr.fastpaths.attention.use_fast_attention)
    cuda_graphs: bool  # the engine's decode-only steps replayed from CUDA graphs
    keep_freed_memory: bool  # training and the engine keep freed memory in glibc's heap (rlvr.fastpaths.heap)
    chunked_head: bool  # the update applies the output layer itself, on real tokens only
    unpadded_update: bool  # the update's completions skip their padding (rlvr.grpo.unpadded)

    @property
    def fused(self) -> bool:
        return self.runner == FUSED_DECODER

    def describe(self) -> str:
        """One line: device, dtype (and the compute dtype when it differs) and threads, the runner, then the
        speed-ups on and off."""
        flags = [f.name for f in fields(self) if f.type in ("bool", bool)]
        on = [name for name in flags if getattr(self, name)]
        off = [name for name in flags if not getattr(self, name)]
        dtypes = self.dtype if self.compute_dtype == self.dtype else f"{self.dtype} weights, {self.compute_dtype} compute"
        return f"{self.device} {dtypes}, {self.threads} threads: {self.runner}; on: {', '.join(on) or '-'}; off: {', '.join(off) or '-'}"


def plan_backend(
    model: Any,
    fast_paths: FastPaths | dict | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    threads: int | None = None,
    sharded: bool = False,
    compute_dtype: str | None = None,
) -> BackendPlan:
    """The :class:`BackendPlan` of ``model`` run on ``device`` in ``dtype`` (default: its parameters') at
    ``threads`` torch threads (default: the calling thread's now), under ``fast_paths`` (default: all on);
    ``sharded``: its update runs under FSDP; ``compute_dtype``: a training config's ("auto", "float32",
    "bfloat16"; default: ``dtype``), "auto" resolved here by :func:`~rlvr.fastpaths.eligibility.native_bf16`."""
    fast = FastPaths.coerce(fast_paths)
    parameter = next(model.parameters())
    device = torch.device(device) if device is not None else parameter.device
    dtype = dtype or parameter.dtype
    threads = threads or torch.get_num_threads()
    fused = eligibility.use_fused_decode(model, fast)
    weights = str(dtype).removeprefix("torch.")
    return BackendPlan(
        device=device.type,
        dtype=weights,
        compute_dtype=weights if compute_dtype is None else _resolved_compute_dtype(compute_dtype, device),
        threads=threads,
        runner=FUSED_DECODER if fused else MODEL_FORWARD,
        layer_kernels=eligibility.use_layer_kernels(fast, device, dtype, fused),
        linear_kernels=eligibility.use_linear_kernels(fast, device, dtype, fused),
        sampling_kernel=eligibility.use_sampling_kernel(fast, device),
        packed_linears=eligibility.use_packed_linears(fast, device, fused),
        slot_attention=eligibility.use_slot_attention(fast, device, dtype, threads),
        prompt_attention=eligibility.use_prompt_attention(fast, device, dtype, eligibility.head_dim(model.config)),
        float32_attention=eligibility.use_float32_attention(fast, device, dtype),
        fast_attention=eligibility.use_rlvr_sdpa(model, fast),
        cuda_graphs=eligibility.use_cuda_graphs(model, fast, device, fused),
        keep_freed_memory=eligibility.use_keep_freed_memory(device, fast),
        chunked_head=eligibility.output_head(model, fast) is not None,
        unpadded_update=eligibility.use_unpadded_update(model, fast, sharded),
    )


def _resolved_compute_dtype(requested: str, device: torch.device) -> str:
    resolved = eligibility.training_compute_dtype(requested, device)
    if requested == "auto":
        native = "native bf16" if eligibility.native_bf16(device) else "no native bf16"
        logger.info("compute_dtype auto: %s on this %s (%s; set compute_dtype to choose)", resolved, device.type, native)
    return resolved


_LOGGED: set[tuple[str, str]] = set()


def log_plan(plan: BackendPlan, purpose: str) -> None:
    """Log ``plan`` at the start of ``purpose`` (an engine, GRPO training, SFT): at INFO the first time
    this process sees that plan for that purpose (rollouts build an engine per call), else at DEBUG."""
    key = (purpose, plan.describe())
    level = logging.DEBUG if key in _LOGGED else logging.INFO
    _LOGGED.add(key)
    logger.log(level, "backend for %s: %s", purpose, key[1])
