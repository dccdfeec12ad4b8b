"""FastPaths: one switch per speed-up, carried by the sampling and training configs; the rules of
where each applies live in rlvr.fastpaths.eligibility."""

import pytest
import torch

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.eligibility import (
    output_head,
    use_float32_attention,
    use_fused_decode,
    use_keep_freed_memory,
    use_layer_kernels,
    use_packed_linears,
    use_slot_attention,
    use_unpadded_update,
)
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
    assert use_fused_decode(model, on) and use_unpadded_update(model, on, sharded=False)
    assert use_float32_attention(model, on) and use_keep_freed_memory(torch.device("cpu"), on)
    assert output_head(model, on) is model.lm_head
    assert use_packed_linears(model, on) == bool(torch.backends.mkldnn.is_available())
    assert not use_fused_decode(model, FastPaths(fused_decode=False))
    assert not use_packed_linears(model, FastPaths(packed_linears=False))
    assert not use_float32_attention(model, FastPaths(float32_attention=False))
    assert not use_keep_freed_memory(torch.device("cpu"), FastPaths(keep_freed_memory=False))
    assert output_head(model, FastPaths(chunked_head=False)) is None
    assert not use_unpadded_update(model, FastPaths(unpadded_update=False), sharded=False)
    assert not use_unpadded_update(model, FastPaths(chunked_head=False), sharded=False)  # it needs the head
    assert not use_unpadded_update(model, on, sharded=True)  # FSDP
    assert not use_keep_freed_memory(torch.device("meta"), on)


def test_the_float32_cpu_kernels_apply_where_their_rules_say():
    """slot_attention at up to two threads (SDPA runs rows and heads in parallel beyond; the kernel
    on one), layer_kernels at any thread count; neither for bf16 or with its switch off."""
    model, threads = tiny_llama(20), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert use_slot_attention(model, FastPaths()) and use_layer_kernels(model, FastPaths())
        assert not use_slot_attention(model, FastPaths(slot_attention=False))
        assert not use_layer_kernels(model, FastPaths(layer_kernels=False))
        model.to(torch.bfloat16)
        assert not use_slot_attention(model, FastPaths()) and not use_layer_kernels(model, FastPaths())
        model.float()
        torch.set_num_threads(3)
        assert not use_slot_attention(model, FastPaths())
        assert use_layer_kernels(model, FastPaths())
    finally:
        torch.set_num_threads(threads)


def test_models_outside_the_rules_take_the_plain_paths():
    sliding = tiny_qwen2(20, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    # the engine runs it (refusing requests longer than its window); the update's unpadded path does not
    assert use_fused_decode(sliding, FastPaths()) and not use_unpadded_update(sliding, FastPaths(), sharded=False)
    eager = tiny_llama(20)
    eager.set_attn_implementation("eager")
    assert not use_float32_attention(eager, FastPaths())
