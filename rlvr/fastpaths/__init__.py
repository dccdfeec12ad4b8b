"""The engine's speed-ups, each behind one switch of :class:`FastPaths`.

Every speed-up computes what the plain path computes (tests hold each against it) and applies only
where :mod:`rlvr.fastpaths.eligibility` says so, the one place with those rules, asked once per engine
or training run by :func:`rlvr.fastpaths.plan.plan_backend`. The plain path is
always there: turn a switch off in the sampling or training config (``fast_paths``) to use it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class FastPaths:
    """One field per speed-up, all on by default (each still applies only where eligible)."""

    fused_decode: bool = True  # engine steps of Llama, Qwen2, Qwen3, Mistral with fused, packed weights (fused_decode)
    packed_linears: bool = True  # other models' CPU decode on oneDNN-packed weights (packed_linear)
    slot_attention: bool = True  # the continuous engine's float32 CPU decode attention, each row to its length (slot_attention)
    prompt_attention: bool = True  # a prompt chunk's CPU attention, each query over keys up to its position only (prompt_attention)
    layer_kernels: bool = True  # float32 / bf16 CPU fused decode steps' RMSNorm and rotary embedding, compiled (layer_kernels)
    linear_kernels: bool = True  # float32 (bf16 on AVX-512 BF16) CPU fused decode: linear layers through one compiled panel GEMM (linear_kernels)
    sampling_kernel: bool = True  # the engine's CPU sampling of rows without top-p, one compiled pass a row (sampling_kernel)
    float32_attention: bool = True  # bf16/fp16 attention on CPU computed in float32 (attention)
    unpadded_update: bool = True  # the update's per-token work skips completion padding (rlvr.grpo.unpadded)
    chunked_head: bool = True  # the output layer on real tokens only, in chunks (rlvr.grpo.head)
    keep_freed_memory: bool = True  # CPU training and generation keep freed memory in glibc's heap (heap)
    cuda_graphs: bool = True  # the engine's CUDA decode steps replayed as CUDA graphs per row bucket (rlvr.generation.cuda_graphs)

    @classmethod
    def coerce(cls, value: "FastPaths | dict | None") -> "FastPaths":
        """A FastPaths from itself, None (defaults) or a dict of switches (run config); unknown names raise."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, dict):
            raise TypeError(f"fast_paths must be a FastPaths or a dict of switches, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown fast_paths switch(es) {unknown}; known: {sorted(known)}")
        return cls(**value)


__all__ = ["FastPaths"]
