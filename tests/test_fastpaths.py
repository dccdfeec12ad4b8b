"""FastPaths: one switch per speed-up, carried by the sampling and training configs; the rules of
where each applies live in rlvr.fastpaths.eligibility, asked through rlvr.fastpaths.plan.plan_backend."""

import pytest
import torch

from rlvr.fastpaths import FastPaths, slot_attention
from rlvr.fastpaths.eligibility import output_head
from rlvr.fastpaths.plan import FUSED_DECODER, plan_backend
from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig
from support.tiny_models import tiny_llama, tiny_qwen2


def test_switches_come_from_run_config_dicts_and_unknown_names_are_refused():
    assert FastPaths.coerce({"fused_decode": False}) == FastPaths(fused_decode=False)
    assert FastPaths.coerce(None) == FastPaths()
    with pytest.raises(ValueError, match=r"unknown fast_paths switch\(es\) \['fused'\]"):
        FastPaths.coerce({"fused": False})
    with pytest.raises(TypeError, match="fast_paths must be"):
        FastPaths.coerce(["fused_decode"])
    assert SamplingConfig(fast_paths={"packed_linears": False}).fast_paths == FastPaths(packed_linears=False)


def test_the_training_config_governs_its_rollouts():
    config = GRPOConfig(fast_paths={"fused_decode": False})
    assert config.sampling.fast_paths == FastPaths(fused_decode=False)
    with pytest.raises(ValueError, match="set fast_paths on the GRPOConfig"):
        GRPOConfig(sampling=SamplingConfig(fast_paths=FastPaths(fused_decode=False)))


def test_training_refuses_greedy_rows():
    with pytest.raises(ValueError, match=r"temperatures \[0.0, 1.0\] holds 0: a greedy row is not a sample"):
        GRPOConfig(sampling={"temperatures": [0.0, 1.0]})
    assert SamplingConfig(temperatures=[0.0]).temperatures == [0.0]  # evaluation and serving keep greedy


def test_each_switch_turns_its_speed_up_off_where_it_would_apply():
    model, on = tiny_llama(20), FastPaths()
    plan = plan_backend(model, on)
    assert plan.runner == FUSED_DECODER and plan.unpadded_update and plan.chunked_head
    assert plan.fast_attention and plan.keep_freed_memory
    assert output_head(model, on) is model.lm_head
    # the fused decoder packs its own weights: the model's linears are packed only outside it
    assert not plan.packed_linears
    unfused = plan_backend(model, FastPaths(fused_decode=False))
    assert unfused.runner != FUSED_DECODER and unfused.packed_linears == bool(torch.backends.mkldnn.is_available())
    assert not plan_backend(model, FastPaths(fused_decode=False, packed_linears=False)).packed_linears
    assert not plan_backend(model, FastPaths(float32_attention=False)).fast_attention
    assert not plan_backend(model, FastPaths(keep_freed_memory=False)).keep_freed_memory
    assert output_head(model, FastPaths(chunked_head=False)) is None
    assert not plan_backend(model, FastPaths(chunked_head=False)).chunked_head
    assert not plan_backend(model, FastPaths(unpadded_update=False)).unpadded_update
    assert not plan_backend(model, FastPaths(chunked_head=False)).unpadded_update  # it needs the head
    assert not plan_backend(model, on, sharded=True).unpadded_update  # FSDP
    assert not plan_backend(model, on, device="meta").keep_freed_memory


def test_the_float32_cpu_kernels_apply_where_their_rules_say():
    """slot_attention at up to two threads (SDPA runs rows and heads in parallel beyond; the kernel
    on one), layer_kernels at any thread count; neither with its switch off; for bf16, slot_attention
    only through the C++ kernel with attention in float32, layer_kernels as for float32."""
    model, threads = tiny_llama(20), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        plan = plan_backend(model, FastPaths())
        assert plan.slot_attention and plan.layer_kernels
        assert not plan_backend(model, FastPaths(slot_attention=False)).slot_attention
        assert not plan_backend(model, FastPaths(layer_kernels=False)).layer_kernels
        model.to(torch.bfloat16)
        plan = plan_backend(model, FastPaths())
        assert plan.slot_attention == slot_attention.cpp_built() and plan.layer_kernels
        assert not plan_backend(model, FastPaths(float32_attention=False)).slot_attention
        model.float()
        torch.set_num_threads(3)
        plan = plan_backend(model, FastPaths())
        assert not plan.slot_attention
        assert plan.layer_kernels
    finally:
        torch.set_num_threads(threads)


def test_models_outside_the_rules_take_the_plain_paths():
    sliding = tiny_qwen2(20, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    # the engine runs it (refusing requests longer than its window); the update's unpadded path does not
    plan = plan_backend(sliding, FastPaths())
    assert plan.runner == FUSED_DECODER and not plan.unpadded_update
    eager = tiny_llama(20)
    eager.set_attn_implementation("eager")
    assert not plan_backend(eager, FastPaths()).fast_attention
