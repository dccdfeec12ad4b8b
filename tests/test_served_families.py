"""Bentos of other model families serve through the one engine: a tiny Qwen3 and a tiny GPT-2 (the
embedded model's tokenizer) answer concurrent greedy requests with ``model.generate``'s tokens, and
their requests share engine steps."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bentos.build import build_bento, store_policy
from rlvr import policy
from support.served_bento import metric_value, serving
from support.tiny_models import embedded_tokenizer, tiny_causal_lm, token_ids_of

pytestmark = [
    pytest.mark.slow,  # serves Bentos over HTTP
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

PROMPTS = ["Natalia sold clips to 48 of her friends.", "What is 7 times 8?", "Count: one two three", "x" * 60]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3", "gpt2"])
def served(request, tmp_path_factory):
    tokenizer = embedded_tokenizer()
    model = tiny_causal_lm(request.param, len(tokenizer), seed=3, token_ids=token_ids_of(tokenizer), max_position_embeddings=2048)
    root = tmp_path_factory.mktemp(request.param)
    policy.export_checkpoint(model, tokenizer, root / "checkpoint")
    home = root / "bentoml"
    lineage = {"rlvr/model_version": f"tiny-{request.param}/1"}
    tag = store_policy(root / "checkpoint", lineage, {"source": f"tiny {request.param}"}, home=home)
    bento = build_bento(tag, labels={}, home=home)
    with serving((bento, tag, home), root / "server", batching=True) as server:
        yield server, model, tokenizer


def _completion(server, model_id: str, ids: list[int]) -> dict:
    body = json.dumps({"model": model_id, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_concurrent_greedy_requests_get_generates_tokens_and_share_steps(served):
    server, model, tokenizer = served
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as response:
        model_id = json.load(response)["data"][0]["id"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda ids: _completion(server, model_id, ids), prompts * 2))
    for ids, answer in zip(prompts * 2, answers):
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        expected = out[0, len(ids) :].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        assert answer["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert answer["usage"]["completion_tokens"] == len(expected)
    metrics = server.metrics()
    assert metric_value(metrics, "rlvr_pass_requests_sum") > metric_value(metrics, "rlvr_pass_requests_count")  # requests shared steps
