"""A prompt chunk's CPU attention (rlvr.fastpaths.prompt_attention): SDPA's causal result, each query
reading keys up to its own position only, used by the engine where its plan says and equal to SDPA there."""

import pytest
import torch
import torch.nn.functional as F

import rlvr.generation.executor as executor_module
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths import prompt_attention as prompt_attention_module
from rlvr.fastpaths.plan import plan_backend
from rlvr.fastpaths.prompt_attention import prompt_attention
from rlvr.generation import Engine, EngineRequest
from support.tiny_models import char_tokenizer, tiny_llama

built = pytest.mark.skipif(not prompt_attention_module.cpp_built(), reason="no C++ kernel here (no compiler, or its build failed: logged)")


def causal_sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, begin: int, scale: float) -> torch.Tensor:
    """Query t at position begin + t over keys 0 .. begin + t: SDPA with an explicit mask, [tokens, heads x dim]."""
    tokens = len(queries)
    mask = torch.arange(keys.shape[1])[None, :] <= torch.arange(begin, begin + tokens)[:, None]
    out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(tokens, -1)


@built
@pytest.mark.parametrize(
    "tokens, begin, heads, kv_heads, head_dim",
    [(300, 0, 9, 3, 64), (1, 0, 4, 2, 16), (45, 260, 9, 3, 64), (1, 200, 6, 2, 64), (130, 7, 4, 4, 128), (33, 3, 8, 2, 96), (70, 0, 12, 3, 16)],
)
def test_each_query_attends_up_to_its_own_position_as_causal_sdpa(tokens, begin, heads, kv_heads, head_dim):
    """First chunks and later ones (queries after ``begin`` cached positions), single tokens, query groups
    of 1 to 4 per KV head, head widths 16 to 128, blocks cut anywhere; queries a view of a wider tensor and
    keys transposed views, as the engine passes them; keys past the last query hold NaN, which nothing reads."""
    torch.manual_seed(0)
    queries = (torch.randn(tokens, heads + 2 * kv_heads, head_dim) * 2)[:, :heads]
    keys = torch.randn(begin + tokens + 5, kv_heads, head_dim).transpose(0, 1) * 2
    values = torch.randn(kv_heads, begin + tokens + 5, head_dim)
    keys[:, begin + tokens :] = values[:, begin + tokens :] = float("nan")
    got = prompt_attention(queries, keys, values, begin, 0.125)
    expected = causal_sdpa(queries, keys[:, : begin + tokens], values[:, : begin + tokens], begin, 0.125)
    assert got.shape == (tokens, heads * head_dim) and not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@built
def test_head_vectors_laid_out_across_memory_are_taken_too():
    """Queries, keys and values whose head dimension is not the innermost in memory give SDPA's result."""
    torch.manual_seed(1)
    queries = torch.randn(32, 4, 20).permute(2, 1, 0)  # [20 tokens, 4 heads, 32], head vectors strided
    keys, values = torch.randn(32, 30, 2).permute(2, 1, 0), torch.randn(32, 30, 2).permute(2, 1, 0)
    got = prompt_attention(queries, keys, values, 10, 0.2)
    torch.testing.assert_close(got, causal_sdpa(queries, keys, values, 10, 0.2), atol=2e-5, rtol=1e-5)


@built
def test_it_refuses_what_it_cannot_compute_by_name():
    queries, keys = torch.zeros(4, 2, 16), torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match="float32 q, k, v and out"):
        prompt_attention(queries.bfloat16(), keys.bfloat16(), keys.bfloat16(), 0, 1.0)
    with pytest.raises(RuntimeError, match="head dim a multiple of 16"):
        prompt_attention(torch.zeros(4, 2, 8), torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), 0, 1.0)
    with pytest.raises(RuntimeError, match="every query's position within the keys"):
        prompt_attention(queries, keys, keys, 1, 1.0)


def test_the_plan_takes_it_where_its_rule_says():
    """On a CPU in float32, and in bf16 where attention runs in float32; not with its switch off, not for
    bf16 attention in bf16, not on CUDA, not for heads whose width is not a multiple of 16."""
    model = tiny_llama(20)  # heads 16 wide
    assert plan_backend(model).prompt_attention == prompt_attention_module.cpp_built()
    assert not plan_backend(model, FastPaths(prompt_attention=False)).prompt_attention
    assert not plan_backend(model, device="cuda").prompt_attention
    assert plan_backend(model, dtype=torch.bfloat16).prompt_attention == prompt_attention_module.cpp_built()
    assert not plan_backend(model, FastPaths(float32_attention=False), dtype=torch.bfloat16).prompt_attention
    assert not plan_backend(tiny_llama(20, hidden_size=32)).prompt_attention  # heads 8 wide


@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_prefills_through_it_as_through_sdpa(dtype, monkeypatch):
    """Prompts cut into chunks of 8 tokens (later chunks attend over the earlier ones): the engine's prefill
    calls the kernel for every chunk, and its greedy tokens and log-probs are those of the same engine with
    prompt attention off (SDPA; in bf16 both attend in float32)."""
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0).to(dtype).requires_grad_(False)
    begins = []
    monkeypatch.setattr(executor_module, "prompt_attention", lambda *args: begins.append(args[3]) or prompt_attention(*args))

    def greedy(fast_paths: FastPaths) -> tuple[list[list[int]], list[float]]:
        engine = Engine(model, tokenizer, max_rows=4, step_tokens=8, kv_budget_bytes=2**24, fast_paths=fast_paths, prefix_cache_bytes=0)
        requests = [EngineRequest(tokenizer(p).input_ids, 1, (0.0,), 10) for p in ("what is 12+30?", "7", "x" * 40)]
        with torch.inference_mode():
            list(engine.run_requests(requests))
        return [q.token_ids[0] for q in requests], [lp for q in requests for lp in q.logprobs[0]]

    tokens, logprobs = greedy(FastPaths())
    assert 0 in begins and max(begins) >= 32  # first chunks and later ones
    begins.clear()
    expected_tokens, expected_logprobs = greedy(FastPaths(prompt_attention=False))
    assert not begins and tokens == expected_tokens
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=tolerance, rtol=0)
