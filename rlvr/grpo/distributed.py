"""Running GRPO on one process or several (``torchrun`` / ``accelerate launch``).

Each rank generates for its own share of a step's prompts (all G samples of a prompt stay on one
rank, so group statistics are local), DDP averages gradients, metrics are gathered. Without the
torchrun environment variables everything here is a no-op on a single process.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: its rank among ``world_size`` and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device | str | None = None, timeout_s: float = 1800) -> DistributedContext:
    """Join the process group described by torchrun's RANK / WORLD_SIZE / LOCAL_RANK (gloo on CPU,
    nccl on CUDA); a plain single-process context when WORLD_SIZE is unset or 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1:
        return DistributedContext(device=torch.device(device or "cpu"))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def wrap_model(model: torch.nn.Module, ctx: DistributedContext, fsdp: bool = False, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """DDP around ``model`` (its submodules stay usable unwrapped, for generation); FSDP2 on
    request, computing in ``param_dtype`` when given."""
    if not ctx.enabled:
        return model
    if fsdp:
        return _fully_shard(model, param_dtype)
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def shard_for_rank(items: Sequence[Any], ctx: DistributedContext) -> tuple[int, list[Any]]:
    """This rank's contiguous share of ``items`` and the index of its first item."""
    per_rank, extra = divmod(len(items), ctx.world_size)
    start = ctx.rank * per_rank + min(ctx.rank, extra)
    stop = start + per_rank + (1 if ctx.rank < extra else 0)
    return start, list(items[start:stop])


def all_reduce_sum(values: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """Element-wise sum over ranks (a copy on every rank)."""
    if not ctx.enabled:
        return values
    total = values.to(ctx.device, copy=True)
    dist.all_reduce(total)
    return total.to(values.device)


def all_gather_objects(obj: Any, ctx: DistributedContext) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    if not ctx.enabled:
        return [obj]
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier(ctx: DistributedContext) -> None:
    if ctx.enabled:
        dist.barrier()


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Accumulate gradients locally (``enabled=False``) or all-reduce them in this backward."""
    if hasattr(model, "no_sync") and not enabled:  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


# --- FSDP2 (GPU only; not exercised by the CPU test suite) ------------------------------------


def _fully_shard(model: torch.nn.Module, param_dtype: torch.dtype | None) -> torch.nn.Module:
    """Shard every decoder layer, then the root, with FSDP2 ``fully_shard`` (in place); fp32
    master weights and gradient reduction, compute in ``param_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Keep FSDP2 parameters unsharded while generating: decoding runs a data-dependent number
    of forwards per rank (finished rows drop out), which per-forward all-gathers cannot allow."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield
        return
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and "DecoderLayer" in type(module[0]).__name__:
            return list(module)
    return []
