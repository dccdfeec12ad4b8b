"""The one generation interface rollouts and evaluation call: prompts in; token ids, log-probs and finish
reasons out (:class:`~rlvr.generation.rollouts.Rollouts`); and the trainer's weights in after each update.

Two engines sit behind it, chosen once (``rlvr.generation.engines.choose_engine``) from
:class:`EngineConfig`: :class:`NativeGenerator` (one ``rlvr.generation.Engine`` on the trainer's own module
for the whole run) and ``rlvr.generation.vllm_engine.VllmGenerator`` (vLLM in process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch

from rlvr.generation.engines import ENGINE_SETTINGS, choose_engine
from rlvr.generation.rollouts import RolloutBackend, Rollouts, SamplingConfig, stream_rollouts
from rlvr.generation.stops import StopRule


@dataclass
class EngineConfig:
    """Which engine generates (``auto``: vLLM on CUDA where installed, else ours) and, for vLLM, how:
    ``tensor_parallel_size`` ranks share one model copy (models past one device; the ranks' count is a
    multiple of it), ``kv_cache_gib`` its KV cache (None: vLLM's default), ``compile`` its compiled
    steps (off: eager, a quicker start)."""

    engine: str = "auto"
    tensor_parallel_size: int = 1
    kv_cache_gib: float | None = None
    compile: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_SETTINGS:
            raise ValueError(f"rollout.engine must be one of {', '.join(ENGINE_SETTINGS)}, got {self.engine!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"rollout.kv_cache_gib must be > 0, got {self.kv_cache_gib}")


class Generator(Protocol):
    """What rollouts and evaluation generate through."""

    name: str

    def stream(
        self, prompts: list[str] | list[list[int]], num_samples: int, config: SamplingConfig, stops: Sequence[StopRule] | None = None
    ) -> Iterator[Rollouts]:
        """``num_samples`` completions of each prompt, in prompt order, in chunks (as ``stream_rollouts``)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the policy's updated weights (Hugging Face names) before the next generation."""
        ...


class NativeGenerator:
    """Our engine on ``model`` itself: the trainer updates the module in place, so there is nothing to load;
    one engine serves every call of the run (``RolloutBackend``), its runner repacking the weights where
    they changed."""

    name = "native"

    def __init__(self, model: Any, tokenizer: Any):
        self.model, self.tokenizer = model, tokenizer
        self.backend = RolloutBackend()

    def stream(
        self, prompts: list[str] | list[list[int]], num_samples: int, config: SamplingConfig, stops: Sequence[StopRule] | None = None
    ) -> Iterator[Rollouts]:
        return stream_rollouts(self.model, self.tokenizer, prompts, num_samples, config, stops, backend=self.backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing: the engine runs the module the trainer updates."""


def make_generator(config: EngineConfig, model: Any, tokenizer: Any, *, rank: int = 0, world_size: int = 1, seed: int = 0, tools: bool = False) -> Generator:
    """The generator ``config`` chooses for ``model`` on its device (logged). ``tools``: rows run tool
    episodes, which only our engine drives (``auto`` picks it; ``vllm`` is an error naming the setting)."""
    device = next(model.parameters()).device.type
    if tools and config.engine == "vllm":
        raise ValueError("rollout.engine vllm: tool-calling environments run on the native engine only")
    if tools or choose_engine(config.engine, device) == "native":
        return NativeGenerator(model, tokenizer)
    from rlvr.generation.vllm_engine import VllmGenerator

    return VllmGenerator.for_model(model, tokenizer, config, rank=rank, world_size=world_size, seed=seed)
