"""One engine for every causal LM: greedy completions equal ``model.generate``'s for Llama, Qwen2, Qwen3,
Mistral and GPT-2, alone and batched beside other requests; a seed samples the same tokens through
training's call and through a served request."""

import pytest
import torch

from rlvr.fastpaths.fused_decode import FusedDecoder
from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts
from rlvr.generation.model_runner import ModelForward, model_runner
from support.tiny_models import FAMILIES, char_tokenizer, tiny_causal_lm

PROMPTS = ["12+3=", "what is 7*8?", "a", "count: a b c d e f g h"]
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tokenizer):
    return tiny_causal_lm(request.param, len(tokenizer), seed=4).requires_grad_(False)


def generated(model, tokenizer, prompt: str) -> list[int]:
    """``model.generate``'s greedy tokens after ``prompt``, up to and including an end token."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
    return out[: out.index(1) + 1] if 1 in out else out


def test_the_runner_is_the_fused_decoder_for_llama_family_models_else_the_models_forward(model):
    runner = model_runner(model, 8)
    fused = model.config.model_type in ("llama", "qwen2", "qwen3", "mistral")
    assert isinstance(runner, FusedDecoder if fused else ModelForward)


def test_greedy_rollouts_equal_generate(model, tokenizer):
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, temperatures=[0.0])
    rollouts = generate_rollouts(model, tokenizer, PROMPTS, 1, config)
    assert rollouts.completion_token_lists() == [generated(model, tokenizer, p) for p in PROMPTS]


def test_a_request_alone_and_beside_others_completes_as_generate_does(model, tokenizer):
    """Requests joining at different steps into a 3-row batch, prompts prefilled in 4-token chunks."""
    engine = Engine(model, tokenizer, max_rows=3, step_tokens=4, kv_budget_bytes=2**24)
    requests = [EngineRequest(tokenizer(p).input_ids, 2, (0.0,), NEW_TOKENS) for p in PROMPTS]
    arrivals = {0: requests[:1], 3: requests[1:3], 6: requests[3:]}
    with torch.inference_mode():
        for step in range(500):
            for request in arrivals.get(step, []):
                engine.submit(request)
            engine.take_submissions()
            engine.step()
            if step > 6 and all(q.done_s is not None for q in requests):
                break
    assert max(q.max_neighbours for q in requests) > 1
    for prompt, request in zip(PROMPTS, requests):
        assert request.token_ids == [generated(model, tokenizer, prompt)] * 2


def test_one_seed_samples_the_same_tokens_in_training_and_in_serving(model, tokenizer):
    """Training's call (``generate_rollouts``, prompt 0 of the call) and a served request with the same seed."""
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, temperatures=[1.0], top_p=0.9, seed=11)
    trained = generate_rollouts(model, tokenizer, PROMPTS[:1], 3, config).completion_token_lists()
    engine = Engine(model, tokenizer, max_rows=8, kv_budget_bytes=2**24)
    served = EngineRequest(tokenizer(PROMPTS[0]).input_ids, 3, (1.0,), NEW_TOKENS, top_p=0.9, seed=11)
    crowd = [EngineRequest(tokenizer(p).input_ids, 2, (1.0,), NEW_TOKENS, seed=5) for p in PROMPTS[1:]]
    with torch.inference_mode():
        list(engine.run_requests([*crowd, served]))
    assert served.token_ids == trained and len(set(map(tuple, trained))) > 1
