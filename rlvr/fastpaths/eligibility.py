"""Where each speed-up of :class:`~rlvr.fastpaths.FastPaths` applies: the rules, in one place.

A speed-up runs only when its switch is on and the model qualifies. Only
:func:`rlvr.fastpaths.plan.plan_backend` asks these rules, once per engine, training or SFT run; everything
else reads the :class:`~rlvr.fastpaths.plan.BackendPlan` it returns.
"""

from __future__ import annotations

from typing import Any

import torch

from rlvr.fastpaths import FastPaths, jit, linear_kernels, prompt_attention, sampling_kernel, slot_attention
from rlvr.fastpaths.attention import LOW_PRECISION
from rlvr.fastpaths.packed_linear import packing_dtypes

# architectures whose logits are exactly lm_head(last hidden state): no soft-capping or scaling
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "phi3"})


def plain_output_head(model: Any) -> Any:
    """The output layer (a bias-free ``nn.Linear``) when the model's logits are exactly
    ``lm_head(decoder(...).last_hidden_state)``, else None; callers then use the model's logits."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES or not hasattr(model, "get_decoder"):
        return None
    head = model.get_output_embeddings()
    return head if type(head) is torch.nn.Linear and head.bias is None else None


def attention_window(config: Any) -> int | None:
    """The model's sliding attention window, or None when every layer attends over the whole sequence."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return getattr(config, "sliding_window", None) if any(kind != "full_attention" for kind in layer_types) else None
    return getattr(config, "sliding_window", None)


def head_dim(config: Any) -> int | None:
    """The width of one attention head (``head_dim``, else hidden size / heads); None where the config has neither."""
    explicit = getattr(config, "head_dim", None)
    if explicit:
        return explicit
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if hidden and heads else None


FUSED_DECODE_MODELS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}


def use_fused_decode(model: Any, fast: FastPaths) -> bool:
    """The engine's steps through ``rlvr.fastpaths.fused_decode``: Llama, Qwen2, Qwen3 and Mistral causal
    LMs with SiLU MLPs whose projections are plain ``nn.Linear`` layers (and Qwen3's query/key norms plain
    RMSNorms), on any device."""
    config = getattr(model, "config", None)
    if not fast.fused_decode or FUSED_DECODE_MODELS.get(type(model).__name__) != getattr(config, "model_type", None):
        return False
    return getattr(config, "hidden_act", None) in ("silu", "swish") and _plain_layers(model)


def _plain_layers(model: Any) -> bool:
    linears = [model.lm_head]
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if getattr(attention, "q_norm", None) is not None and not _plain_rms_norms(attention):
            return False
        linears += [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return all(type(linear) is torch.nn.Linear for linear in linears)


def _plain_rms_norms(attention: Any) -> bool:
    return all(hasattr(norm, "variance_epsilon") and hasattr(norm, "weight") for norm in (attention.q_norm, attention.k_norm))


SLOT_ATTENTION_MAX_THREADS = 2  # measured faster than SDPA at 1 and 2 threads; beyond, not measured (SDPA runs rows and heads in parallel)


def use_slot_attention(fast: FastPaths, device: torch.device, dtype: torch.dtype, threads: int) -> bool:
    """The continuous engine's decode attention through ``rlvr.fastpaths.slot_attention``, at most
    ``SLOT_ATTENTION_MAX_THREADS`` PyTorch ``threads``: float32 on CPU, numba importable (its kernel where
    the C++ one does not build); or bf16 on CPU with attention in float32 (``float32_attention``) and the C++
    kernel built."""
    if not (fast.slot_attention and threads <= SLOT_ATTENTION_MAX_THREADS):
        return False
    if dtype == torch.bfloat16:
        return use_float32_attention(fast, device, dtype) and slot_attention.cpp_built()
    return _numba_cpu_kernels(device, dtype)


def use_prompt_attention(fast: FastPaths, device: torch.device, dtype: torch.dtype, width: int | None) -> bool:
    """A prompt chunk's causal attention through ``rlvr.fastpaths.prompt_attention``: on CPU, in float32 (bf16
    / fp16 where attention runs in float32, ``float32_attention``), heads ``width`` a multiple of 16 wide, the
    C++ kernel built (at the first ask)."""
    if not (fast.prompt_attention and device.type == "cpu" and width and width % 16 == 0):
        return False
    return (dtype == torch.float32 or use_float32_attention(fast, device, dtype)) and prompt_attention.cpp_built()


def use_layer_kernels(fast: FastPaths, device: torch.device, dtype: torch.dtype, fused: bool) -> bool:
    """The fused decoder's (``fused``: the runner) RMSNorms and rotary embeddings through
    ``rlvr.fastpaths.layer_kernels``: float32 or bf16 on CPU, numba importable (a few rows' work: one thread
    serves any thread count)."""
    return fast.layer_kernels and fused and _numba_cpu_kernels(device, dtype, (torch.float32, torch.bfloat16))


def use_linear_kernels(fast: FastPaths, device: torch.device, dtype: torch.dtype, fused: bool) -> bool:
    """The fused decoder's (``fused``: the runner) linear layers through ``rlvr.fastpaths.linear_kernels``:
    float32 on CPU, or bf16 on a CPU with AVX-512 BF16, the kernel built here (a C++ compiler; built at the
    first ask)."""
    return fast.linear_kernels and fused and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and linear_kernels.available(dtype)


def use_sampling_kernel(fast: FastPaths, device: torch.device) -> bool:
    """The engine's sampling of rows without top-p through ``rlvr.fastpaths.sampling_kernel``: on CPU, the
    kernel built here (a C++ compiler; built at the first ask)."""
    return fast.sampling_kernel and device.type == "cpu" and sampling_kernel.available()


def _numba_cpu_kernels(device: torch.device, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """numba's kernels for ``dtype`` on ``device``: numba importable, a CPU, one of the kernel's ``dtypes``."""
    return jit.available() and device.type == "cpu" and dtype in dtypes


STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at load time


def use_cuda_graphs(model: Any, fast: FastPaths, device: torch.device, fused: bool) -> bool:
    """The engine's decode-only steps replayed from CUDA graphs (``rlvr.generation.cuda_graphs``): on CUDA,
    when the runner is the fused decoder (``fused``) and the rotary frequencies do not change with the
    sequence length."""
    if not (fast.cuda_graphs and device.type == "cuda" and fused):
        return False
    return getattr(model.model.rotary_emb, "rope_type", "default") in STATIC_ROPE_TYPES


def use_packed_linears(fast: FastPaths, device: torch.device, fused: bool) -> bool:
    """Decode steps of models outside the fused decoder (``fused``: the runner) on packed weights: CPU,
    with oneDNN (layers of other dtypes stay plain)."""
    return fast.packed_linears and not fused and device.type == "cpu" and bool(packing_dtypes())


def use_rlvr_sdpa(model: Any, fast: FastPaths) -> bool:
    """``rlvr_sdpa`` (float32 attention for bf16/fp16 on CPU, plain SDPA elsewhere) for models that use SDPA."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return fast.float32_attention and implementation in ("sdpa", "rlvr_sdpa")


def use_float32_attention(fast: FastPaths, device: torch.device, dtype: torch.dtype) -> bool:
    """The engine's own attention (``fused_decode.gqa_attention``) in float32: bf16/fp16 on CPU."""
    return fast.float32_attention and device.type == "cpu" and dtype in LOW_PRECISION


def use_keep_freed_memory(device: torch.device, fast: FastPaths) -> bool:
    """glibc keeps freed temporaries (an update's, an engine step's) for the next step: on CPU."""
    return fast.keep_freed_memory and device.type == "cpu"


def output_head(model: Any, fast: FastPaths) -> Any:
    """The output layer the update applies itself (chunked, real tokens only), or None: the model's logits."""
    return plain_output_head(model) if fast.chunked_head else None


def use_unpadded_update(model: Any, fast: FastPaths, sharded: bool) -> bool:
    """Completions' per-token work without padding (``rlvr.grpo.unpadded``: the model's own modules over
    real tokens): models with a plain head whose every layer attends over the whole sequence, unsharded."""
    return fast.unpadded_update and not sharded and output_head(model, fast) is not None and attention_window(model.config) is None


COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # a training config's compute_dtype


def native_bf16(device: torch.device) -> bool:
    """bfloat16 arithmetic in hardware, as torch reports it: a CUDA GPU with bf16 support, or a CPU
    with AVX-512 BF16 or AMX instructions."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return any(getattr(torch.cpu, query, lambda: False)() for query in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def training_compute_dtype(requested: str, device: torch.device) -> str:
    """The dtype training computes in: ``requested`` ("float32" or "bfloat16"), or for "auto" bfloat16
    where :func:`native_bf16` (mixed precision: float32 weights, bf16 forwards and rollouts) and float32
    elsewhere."""
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {requested!r}")
    if requested != "auto":
        return requested
    return "bfloat16" if native_bf16(device) else "float32"
