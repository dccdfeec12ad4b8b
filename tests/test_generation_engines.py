"""Which engine generates (one setting, chosen once) and how a run past one device reaches vLLM: the
training launcher's torchrun command, and each rank's vLLM settings (tensor parallel groups, seeds)."""

from __future__ import annotations

import pytest
import torch

import rlvr.generation.vllm_engine as vllm_engine
from resources.launcher import TrainingLauncher
from rlvr.generation.engines import choose_engine, vllm_missing
from rlvr.generation.generator import EngineConfig, NativeGenerator, make_generator
from rlvr.grpo import GRPOConfig
from support.tiny_models import char_tokenizer, tiny_llama


def test_auto_is_ours_on_a_cpu_and_vllm_on_cuda_where_installed():
    assert choose_engine("auto", "cpu") == "native"
    assert choose_engine("native", "cuda") == "native"
    assert choose_engine("auto", "cuda") == ("native" if vllm_missing() else "vllm")


def test_a_bad_engine_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="engine must be one of auto, native, vllm"):
        choose_engine("vlm", "cpu")
    with pytest.raises(ValueError, match="rollout.engine must be one of"):
        EngineConfig(engine="trt")
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="with fsdp"):
        GRPOConfig(rollout={"engine": "vllm"}, fsdp=True)


def test_vllm_asked_for_where_it_is_missing_says_why(monkeypatch):
    monkeypatch.setattr("rlvr.generation.engines.vllm_missing", lambda: "vLLM is not installed (pip install ...)")
    with pytest.raises(ValueError, match="engine 'vllm' was asked for, but vLLM is not installed"):
        choose_engine("vllm", "cpu")
    assert choose_engine("auto", "cuda") == "native"


def test_tool_episodes_run_on_our_engine():
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer))
    assert isinstance(make_generator(EngineConfig(), model, tokenizer, tools=True), NativeGenerator)
    with pytest.raises(ValueError, match="tool-calling environments run on the native engine"):
        make_generator(EngineConfig(engine="vllm"), model, tokenizer, tools=True)


def test_a_multi_gpu_run_renders_as_torchrun_and_its_settings_reach_vllm(monkeypatch):
    """Four ranks, two per model copy: torchrun starts four workers; each rank's vLLM gets tensor parallel 2
    under torchrun's processes (external launcher), one seed per copy, and its group of two."""
    assert TrainingLauncher(python="/py").command(4)[3:5] == ["--standalone", "--nproc_per_node=4"]
    started, groups = [], []
    monkeypatch.setattr(vllm_engine, "start_llm", lambda settings, external_launcher: started.append((settings, external_launcher)) or object())
    monkeypatch.setattr(torch.distributed, "new_subgroups", lambda group_size: groups.append(group_size) or ("group", []))
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), hidden_size=128)
    config = EngineConfig(engine="vllm", tensor_parallel_size=2, kv_cache_gib=20)
    for rank in range(4):
        generator = vllm_engine.VllmGenerator.for_model(model, tokenizer, config, rank=rank, world_size=4, seed=7)
        assert generator.group == "group"
    assert [s.tensor_parallel_size for s, _ in started] == [2] * 4 and all(external for _, external in started)
    assert [s.seed for s, _ in started] == [7, 7, 8, 8]
    assert started[0][0].engine_kwargs()["kv_cache_memory_bytes"] == 20 * 2**30
    assert started[0][0].engine_kwargs()["dtype"] == "float32"
    assert groups == [2] * 4
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the 3 training processes"):
        vllm_engine.VllmGenerator.for_model(model, tokenizer, config, rank=0, world_size=3)
