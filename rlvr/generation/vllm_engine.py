"""vLLM's engine as a library: the settings one model's vLLM engine starts with, for rollouts and for the
service alike, and its in-process model runner (where the trainer's weights are loaded after each update).

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the trainer reaches its runner's
``reload_weights`` directly, with no copy through disk or a socket. Its log-probs are taken after the
temperature (``logprobs_mode="processed_logprobs"``), as ours are; with ``top_p`` < 1 they are over
the nucleus, where ours are before the cut.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch


@dataclass(frozen=True)
class VllmSettings:
    """How one vLLM engine is started. ``kv_cache_bytes``: its KV cache (None: vLLM's own default, a share
    of GPU memory or 4 GiB of CPU memory); ``tensor_parallel_size``: devices per model copy, for models past
    one device (the copies are the training ranks' groups)."""

    model_dir: str
    dtype: str = "auto"  # "float32", "bfloat16", ... ("auto": the checkpoint's)
    max_model_len: int | None = None
    seed: int = 0
    kv_cache_bytes: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True: no compilation or CUDA graphs (quicker start, slower steps)

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``vllm.LLM`` / ``vllm.EngineArgs`` for these settings."""
        kwargs: dict[str, Any] = dict(
            model=str(Path(self.model_dir)),
            dtype=self.dtype,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_bytes)
        return kwargs


def engine_runner(llm_engine: Any) -> Any:
    """The model runner of an in-process vLLM ``LLMEngine``: its ``reload_weights`` takes weights under their
    Hugging Face names and redoes the backend's processing (packing, fusing) in place."""
    return llm_engine.model_executor.driver_worker.worker.model_runner


class VllmGenerator:
    """Rollouts from vLLM (``rlvr.generation.generator.Generator``): each row one vLLM request (its own
    temperature and seed, from (seed, prompt, sample) as ours), finished by our stop rules over its tokens,
    so finish reasons and lengths mean what they mean natively; the trainer's weights loaded in process."""

    name = "vllm"

    def __init__(self, llm: Any, tokenizer: Any, stop_token_ids: set[int], checker: Any, group: Any = None):
        self.llm, self.tokenizer, self.stop_token_ids, self.checker = llm, tokenizer, stop_token_ids, checker
        self.group = group  # the process group of the ranks sharing this model copy (tensor parallel), or None

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, config: Any, *, rank: int = 0, world_size: int = 1, seed: int = 0) -> "VllmGenerator":
        """vLLM on ``model`` as it is now: written once to a scratch folder (weights, config, tokenizer) that vLLM
        starts from; later updates reach it in memory (:meth:`load_weights`). ``config``: the run's
        ``EngineConfig``; ranks in groups of its ``tensor_parallel_size``."""
        import tempfile

        from rlvr.generation.stops import StopChecker

        tp = config.tensor_parallel_size
        if world_size % tp:
            raise ValueError(f"rollout.tensor_parallel_size {tp} does not divide the {world_size} training processes")
        scratch = tempfile.mkdtemp(prefix="rlvr-vllm-")
        save_hf(model, scratch)
        tokenizer.save_pretrained(scratch)
        settings = VllmSettings(
            model_dir=scratch,
            dtype=str(model.dtype).removeprefix("torch."),
            seed=seed + rank // tp,  # one seed per model copy (its ranks share it)
            kv_cache_bytes=int(config.kv_cache_gib * 2**30) if config.kv_cache_gib else None,
            tensor_parallel_size=tp,
            enforce_eager=not config.compile,
        )
        llm = start_llm(settings, external_launcher=world_size > 1)
        shutil.rmtree(scratch, ignore_errors=True)
        checker = StopChecker(model, tokenizer)
        group = torch.distributed.new_subgroups(group_size=tp)[0] if tp > 1 else None
        return cls(llm, tokenizer, checker.stop_ids, checker, group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's weights (Hugging Face names) into vLLM's model; its cached prefixes go."""
        engine_runner(self.llm.llm_engine).reload_weights(weights_iterator=weights)
        self.llm.reset_prefix_cache()

    def stream(self, prompts: Any, num_samples: int, config: Any, stops: Any = None) -> Iterator[Any]:
        """``num_samples`` completions per prompt (``rlvr.generation.rollouts.stream_rollouts``'s contract;
        one chunk: vLLM schedules every row at once). Tool environments run on the native engine only."""
        from rlvr.environments.driver import drives_episodes
        from rlvr.generation.rollouts import encode_prompts, rows_to_rollouts
        from rlvr.generation.sampler import row_seed

        if drives_episodes(config.environment):
            raise ValueError("tool-calling environments run on the native engine: set rollout.engine to native")
        encoded, rules = encode_prompts(self.tokenizer, prompts, num_samples, config, stops)
        stop_ids = sorted(self.stop_token_ids if config.stop_token_ids is None else {int(i) for i in config.stop_token_ids})
        inputs, params = [], []
        for i, ids in enumerate(encoded):
            for j in range(num_samples):
                temperature = config.temperatures[j % len(config.temperatures)]
                inputs.append({"prompt_token_ids": ids})
                seed = row_seed(config.seed, i, j, temperature)
                params.append(
                    sampling_params(temperature, config.top_p, seed, config.max_new_tokens, stop_ids, rules[i].strings, detokenize=bool(rules[i].strings))
                )
        outputs = self._generate(inputs, params)
        rows = [self._row(output.outputs[0], config.max_new_tokens, rules[k // num_samples]) for k, output in enumerate(outputs)]
        temperatures = [config.temperatures[k % num_samples % len(config.temperatures)] for k in range(len(rows))]
        yield rows_to_rollouts(encoded, rows, num_samples, temperatures, self.tokenizer)

    def _generate(self, inputs: list[dict], params: list[Any]) -> list[Any]:
        """vLLM's outputs of this rank's requests. Ranks sharing a model copy all submit the same requests
        (vLLM's tensor parallelism): each gathers its group's, and keeps its own outputs."""
        if self.group is None:
            return self.llm.generate(inputs, params, use_tqdm=False)
        parts: list[Any] = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(parts, (inputs, params), group=self.group)
        mine = torch.distributed.get_rank(self.group)
        start = sum(len(part[0]) for part in parts[:mine])
        outputs = self.llm.generate([i for part in parts for i in part[0]], [p for part in parts for p in part[1]], use_tqdm=False)
        return outputs[start : start + len(inputs)]

    def _row(self, completion: Any, max_new_tokens: int, rule: Any) -> tuple[list[int], list[float], str]:
        """A row's tokens, log-probs and finish reason, cut where our stop rules end it."""
        ids = list(completion.token_ids)
        logprobs = [entry[token].logprob for token, entry in zip(ids, completion.logprobs or [])]
        seen: list[int] = []
        for token in ids:
            seen.append(token)
            if (reason := self.checker.finish_reason(seen, max_new_tokens, rule)) is not None:
                return seen, logprobs[: len(seen)], reason
        return ids, logprobs, "stop" if completion.finish_reason == "stop" else "length"


def start_llm(settings: VllmSettings, *, external_launcher: bool = False) -> Any:
    """``vllm.LLM`` in this process on ``settings`` (under torchrun, ``external_launcher``: each rank holds its
    share of a model copy, as the training launcher started them)."""
    kwargs = settings.engine_kwargs()
    if external_launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    with starting_vllm():
        from vllm import LLM

        return LLM(**kwargs)


@contextlib.contextmanager
def starting_vllm() -> Iterator[None]:
    """Around the start of a vLLM engine in this process: its engine core kept here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); llvmlite's
    library handle (numba's, which our CPU kernels load) made safe for the scan vLLM's CPU worker makes of every
    module's objects (it answers ``__dict__`` with a foreign function); and ``torch.set_num_threads``, which
    that worker swaps for a no-op process-wide, given back."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None and hasattr(getattr(ffi, "lib", None), "_fntab"):
        ffi.lib._fntab.setdefault("__dict__", {})
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def sampling_params(
    temperature: float, top_p: float, seed: int | None, max_tokens: int, stop_token_ids: list[int], stop_strings: tuple[str, ...], **extra: Any
) -> Any:
    """vLLM's sampling parameters of one row as ours samples it: greedy below ``GREEDY_BELOW_TEMPERATURE``,
    else seeded (``seed``: the row's, ``rlvr.generation.sampler.row_seed``); stop strings kept in the text (our stop rules
    end the row); the sampled token's log-prob. ``extra``: more of ``SamplingParams``' fields."""
    from vllm import SamplingParams

    from rlvr.generation.sampler import is_greedy

    greedy = is_greedy(temperature)
    return SamplingParams(
        n=1,
        temperature=0.0 if greedy else temperature,
        top_p=1.0 if greedy else top_p,
        seed=seed,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=not stop_token_ids,
        stop=list(stop_strings) or None,
        include_stop_str_in_output=True,
        logprobs=0,
        **extra,
    )


def save_hf(model: Any, folder: str) -> None:
    """``model`` (LoRA adapters merged in) as a Hugging Face checkpoint in ``folder``."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    save_file({name: tensor.contiguous() for name, tensor in hf_weights(model)}, f"{folder}/model.safetensors", metadata={"format": "pt"})


def hf_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights under their Hugging Face names, LoRA adapters merged in (peft models)."""
    if hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter"):
        model.merge_adapter()
        try:
            prefix = "base_model.model."
            merged = [
                (name.removeprefix(prefix).replace(".base_layer.", "."), param.detach())
                for name, param in model.named_parameters()
                if "lora_" not in name and "modules_to_save" not in name
            ]
            yield from [(name, tensor.clone()) for name, tensor in merged]
        finally:
            model.unmerge_adapter()
        return
    for name, param in model.named_parameters():
        yield name, param.detach()
