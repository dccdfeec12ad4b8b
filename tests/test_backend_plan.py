"""One backend plan, decided once (rlvr.fastpaths.plan): what runs for a model on a device under the
switches, read by the engine (and so the service), the update and SFT; the thread count comes first."""

import logging
import threading
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F

import rlvr.fastpaths.packed_linear as packed_linear
from rlvr.fastpaths import FastPaths, jit
from rlvr.fastpaths.fused_decode import FusedDecoder, gqa_attention
from rlvr.fastpaths.packed_linear import packing_dtypes
from rlvr.fastpaths.plan import FUSED_DECODER, MODEL_FORWARD, BackendPlan, plan_backend
from rlvr.generation import Engine, EngineRequest
from rlvr.generation.model_runner import ModelForward
from support.tiny_models import char_tokenizer, tiny_causal_lm, tiny_llama

ALL_OFF = FastPaths(**{f.name: False for f in fields(FastPaths)})
PACKS = pytest.mark.skipif(not packing_dtypes(), reason="PyTorch without oneDNN packs no weights")
PROMPTS = ["12+3=", "what is 7*8?", "a"]


def switches(plan: BackendPlan) -> dict[str, bool]:
    return {f.name: getattr(plan, f.name) for f in fields(plan) if isinstance(getattr(plan, f.name), bool)}


def test_a_llama_runs_the_fused_decoder_and_a_gpt2_its_own_forward_on_packed_linears():
    llama, gpt2 = tiny_causal_lm("llama", 50), tiny_causal_lm("gpt2", 50)
    plan = plan_backend(llama, FastPaths(), threads=1)
    assert plan.runner == FUSED_DECODER and not plan.packed_linears  # the fused decoder packs its own weights
    assert plan.chunked_head and plan.unpadded_update and plan.fast_attention and plan.keep_freed_memory
    assert plan.layer_kernels == plan.slot_attention == jit.available()
    assert not plan.cuda_graphs and not plan.float32_attention  # CPU, float32
    other = plan_backend(gpt2, FastPaths(), threads=1)
    assert other.runner == MODEL_FORWARD and other.packed_linears == bool(packing_dtypes())
    assert not other.layer_kernels and not other.chunked_head and not other.unpadded_update  # no fused decoder, no plain head
    assert (plan.device, plan.dtype, plan.threads) == ("cpu", "float32", 1)
    line = other.describe()
    assert "\n" not in line and line.startswith("cpu float32, 1 threads: model_forward;") and "packed_linears" in line


def test_cuda_graphs_follow_the_runner_and_cuda_devices_pack_nothing():
    llama, gpt2 = tiny_causal_lm("llama", 50), tiny_causal_lm("gpt2", 50)
    assert plan_backend(llama, FastPaths(), device="cuda").cuda_graphs
    assert not plan_backend(llama, FastPaths(fused_decode=False), device="cuda").cuda_graphs  # the model's forward: no graphs
    assert not plan_backend(llama, FastPaths(cuda_graphs=False), device="cuda").cuda_graphs
    on_cuda = plan_backend(gpt2, FastPaths(), device="cuda", dtype=torch.bfloat16)
    assert not on_cuda.cuda_graphs and not on_cuda.packed_linears and not on_cuda.slot_attention and not on_cuda.keep_freed_memory
    assert not on_cuda.float32_attention  # bf16 attention in float32 is for CPU only


def test_float32_attention_is_bf16_on_cpu_under_its_switch_and_gqa_attention_obeys_it():
    model = tiny_llama(50).to(torch.bfloat16)
    assert plan_backend(model, FastPaths()).float32_attention
    assert not plan_backend(model, FastPaths(float32_attention=False)).float32_attention
    torch.manual_seed(0)
    queries, keys, values = (torch.randn(2, 4, 1, 8, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(2, 1, 1, 1, dtype=torch.bool)
    low = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=0.3)
    high = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float(), attn_mask=mask, scale=0.3).to(torch.bfloat16)
    assert torch.equal(gqa_attention(queries, keys, values, mask, 0.3, upcast=False), low)
    assert torch.equal(gqa_attention(queries, keys, values, mask, 0.3, upcast=True), high)


def test_every_switch_off_plans_the_plain_path():
    model = tiny_llama(50)
    plan = plan_backend(model, ALL_OFF, threads=1)
    assert plan.runner == MODEL_FORWARD and not any(switches(plan).values())
    engine = Engine(model, char_tokenizer(), max_rows=2, kv_budget_bytes=2**22, fast_paths=ALL_OFF)
    assert not any(switches(engine.plan).values()) and engine.executor.graphed is None and not engine.executor.slot_kernel
    assert isinstance(engine.executor.runner, ModelForward) and engine.executor.runner.packed is None


def test_the_engine_follows_a_plan_it_is_given():
    model = tiny_llama(50)
    given = plan_backend(model, FastPaths(fused_decode=False, packed_linears=False, slot_attention=False))
    engine = Engine(model, char_tokenizer(), max_rows=2, kv_budget_bytes=2**22, plan=given)  # its fast_paths (defaults) unused
    assert engine.plan is given and isinstance(engine.executor.runner, ModelForward) and not engine.executor.slot_kernel
    assert isinstance(Engine(model, char_tokenizer(), max_rows=2, kv_budget_bytes=2**22).executor.runner, FusedDecoder)


def _greedy(engine: Engine, tokenizer) -> list[list[int]]:
    requests = [EngineRequest(tokenizer(p).input_ids, 2, (0.0,), 8) for p in PROMPTS]
    with torch.inference_mode():
        list(engine.run_requests(requests))
    return [ids for q in requests for ids in q.token_ids]


@PACKS
def test_the_service_engine_decodes_a_gpt2_on_packed_linears(monkeypatch):
    """The Engine as bentos.serving_engine builds it (no switches, no plan): the plan packs the GPT-2's
    linears in the runner, every forward runs on them, and the tokens are the unpacked engine's."""
    tokenizer = char_tokenizer()
    model = tiny_causal_lm("gpt2", len(tokenizer), seed=3).requires_grad_(False)
    packed_calls = []
    forward = packed_linear._packed_forward
    monkeypatch.setattr(packed_linear, "_packed_forward", lambda *args: packed_calls.append(1) or forward(*args))
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=2**24, max_requests=None)
    assert engine.plan.packed_linears and engine.executor.runner.packed is not None
    served = _greedy(engine, tokenizer)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and len(packed_calls) >= len(linears)  # at least one forward's worth of packed layers
    assert all("forward" not in vars(m) for m in linears)  # restored after each step
    plain = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=2**24, fast_paths=FastPaths(packed_linears=False))
    calls = len(packed_calls)
    assert _greedy(plain, tokenizer) == served and len(packed_calls) == calls


@pytest.mark.skipif(not jit.available(), reason="slot attention needs numba")
@pytest.mark.parametrize(("requested", "slot"), [(1, True), (3, False)])
def test_slot_attention_is_decided_at_the_tuned_thread_count(monkeypatch, requested, slot):
    """The engine tunes its thread's torch threads before planning: the plan sees the tuned count, not
    the count the thread had before (here 4 threads, tuned to ``$RLVR_THREADS``)."""
    monkeypatch.setenv("RLVR_THREADS", str(requested))
    model, tokenizer, before = tiny_llama(50), char_tokenizer(), torch.get_num_threads()
    plans = []

    def build() -> None:  # a fresh thread: its own thread policy, tuned at the engine's start
        torch.set_num_threads(4 if slot else 1)
        plans.append(Engine(model, tokenizer, max_rows=2, kv_budget_bytes=2**22).plan)

    try:
        thread = threading.Thread(target=build)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert len(plans) == 1 and plans[0].threads == requested and plans[0].slot_attention is slot


@pytest.mark.parametrize(("avx512_bf16", "amx", "resolved"), [(True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")])
def test_auto_compute_dtype_is_bf16_exactly_on_a_cpu_with_native_bf16_and_an_explicit_one_wins(monkeypatch, caplog, avx512_bf16, amx, resolved):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    model = tiny_llama(50)
    with caplog.at_level(logging.INFO, logger="rlvr.fastpaths"):
        plan = plan_backend(model, FastPaths(), dtype=torch.float32, threads=1, compute_dtype="auto")
    assert (plan.dtype, plan.compute_dtype) == ("float32", resolved)
    native = "native" if resolved == "bfloat16" else "no native"
    assert [r.getMessage() for r in caplog.records] == [f"compute_dtype auto: {resolved} on this cpu ({native} bf16; set compute_dtype to choose)"]
    assert ("float32 weights, bfloat16 compute, 1 threads:" in plan.describe()) == (resolved == "bfloat16")
    for explicit in ("float32", "bfloat16"):
        assert plan_backend(model, FastPaths(), compute_dtype=explicit).compute_dtype == explicit
    assert plan_backend(model, FastPaths()).compute_dtype == "float32"  # an engine computes in its weights' dtype
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        plan_backend(model, FastPaths(), compute_dtype="float16")


def test_auto_compute_dtype_on_cuda_follows_the_gpus_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, resolved in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, supported=supported: supported)
        assert plan_backend(tiny_llama(50), FastPaths(), device="cuda", dtype=torch.float32, compute_dtype="auto").compute_dtype == resolved
