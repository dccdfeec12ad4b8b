"""Decode-only steps from CUDA graphs per row bucket (rlvr.generation.cuda_graphs): the bucketed fixed-shape
step gives the engine's completions for every row count; on CUDA, replayed graphs equal eager steps."""

import pytest
import torch

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.plan import plan_backend
from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts
from rlvr.generation.cuda_graphs import BUCKETS, GraphedDecode, row_bucket
from support.tiny_models import char_tokenizer, tiny_causal_lm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graph capture and replay)")
PROMPTS = ["what is 12+30?", "7", "count: a b c d e f", "x" * 40, "1+1", "zz top", "9*9=", "hello there"]


def test_a_bucket_holds_its_rows():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 512)] == [1, 2, 4, 8, 8, 16, 512] and row_bucket(513) is None
    assert all(b in BUCKETS for b in map(row_bucket, range(1, 513)))


def _completions(model, tokenizer, rows: int, graphed: bool, device: str = "cpu") -> list[list[int]]:
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=2048, kv_budget_bytes=2**24)  # every prompt prefilled at once
    engine.stops.stop_ids = set()  # every row runs to its budget: each step has them all
    if graphed:
        engine.executor.graphed = GraphedDecode(engine.executor.runner, engine.executor.device, graphs=device == "cuda")
        steps = []
        step = engine.executor.graphed.step
        engine.executor.graphed.step = lambda *args: steps.append(len(args[1])) or step(*args)
    prompts = (PROMPTS * 2)[:rows]
    requests = [EngineRequest(tokenizer(p).input_ids, 1, (0.0,), 10) for p in prompts]
    with torch.inference_mode():
        list(engine.run_requests(requests))
    if graphed:
        assert steps and set(steps) >= {rows}  # decode-only steps went through the bucketed step
    return [ids for q in requests for ids in q.token_ids]


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_bucketed_step_gives_the_engines_completions(family, rows):
    """Rows of different lengths padded to their bucket: each row's tokens are what the engine's own step gives."""
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(family, len(tokenizer), seed=1).requires_grad_(False)
    assert _completions(model, tokenizer, rows, graphed=True) == _completions(model, tokenizer, rows, graphed=False)


@CUDA
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_replayed_graphs_equal_eager_steps_for_every_bucket(rows):
    tokenizer = char_tokenizer()
    model = tiny_causal_lm("llama", len(tokenizer), seed=1).requires_grad_(False).cuda()
    assert plan_backend(model, FastPaths()).cuda_graphs and not plan_backend(model, FastPaths(cuda_graphs=False)).cuda_graphs
    assert _completions(model, tokenizer, rows, graphed=True, device="cuda") == _completions(model, tokenizer, rows, graphed=False)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_cuda_rollouts_with_graphs_equal_them_without(dtype):
    tokenizer = char_tokenizer()
    model = tiny_causal_lm("qwen2", len(tokenizer), seed=2).to("cuda", dtype).requires_grad_(False)
    config = SamplingConfig(max_new_tokens=16, temperatures=[0.0])
    graphed = generate_rollouts(model, tokenizer, PROMPTS, 2, config)
    eager = generate_rollouts(model, tokenizer, PROMPTS, 2, SamplingConfig(**{**vars(config), "fast_paths": FastPaths(cuda_graphs=False)}))
    agree = (graphed.completion_ids == eager.completion_ids).float().mean()
    assert agree > (0.999 if dtype == torch.float32 else 0.9)  # bf16: different kernels may flip a near tie
