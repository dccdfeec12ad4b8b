"""One generation engine for training rollouts, evaluation and serving.

Parts, as vLLM's v1 engine separates them: the engine (``engine``), its requests (``request``), the
scheduler and its KV budget (``scheduler``), the executor that runs a step's plan (``executor``: the model
runner, ``model_runner``, and the sampler, ``sampler``), the output processor (``outputs``: stops, ``stops``,
and tool episodes), the KV cache (``kv_cache``, ``prefix_cache``), and the rollout call training and
evaluation make (``rollouts``).
"""

from rlvr.generation.engine import Engine
from rlvr.generation.kv_cache import kv_cache_bytes_per_token
from rlvr.generation.request import EngineRequest
from rlvr.generation.rollouts import Rollouts, SamplingConfig, concat_rollouts, generate_rollouts, stream_rollouts
from rlvr.generation.sampler import is_greedy, logprob_temperatures, sample_tokens
from rlvr.generation.scoring import TokenScores, score_tokens
from rlvr.generation.stops import NO_STOP_RULE, StopRule

__all__ = [
    "Engine",
    "EngineRequest",
    "NO_STOP_RULE",
    "Rollouts",
    "SamplingConfig",
    "StopRule",
    "TokenScores",
    "concat_rollouts",
    "generate_rollouts",
    "is_greedy",
    "kv_cache_bytes_per_token",
    "logprob_temperatures",
    "sample_tokens",
    "score_tokens",
    "stream_rollouts",
]
