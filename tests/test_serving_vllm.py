"""The Bento served on vLLM's engine (``RLVR_ENGINE=vllm``) over real HTTP: ``/generate``, ``/solve`` and
``/v1/chat/completions`` (plain and streamed) answer, greedy text is the native engine's on the same weights
(``generate_rollouts``), a request over vLLM's context is a 400 naming the field, and the traffic log gets
its rows. The policy is the embedded one: vLLM's CPU attention takes no heads as small as the tiny test
models'. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import json

import openai
import pytest

from bentos.build import MODEL_VERSION_LABEL, build_bento, store_policy
from bentos.vllm_serving import VllmServingEngine
from rlvr.environments import make_environment
from rlvr.generation import SamplingConfig, generate_rollouts
from rlvr.generation.engines import vllm_missing
from rlvr.policy import load_policy, policy_environment
from rlvr.tasks import DEFAULT_TASK, get_task
from support.served_bento import LINEAGE, serving, traffic_records

if (missing := vllm_missing()) is not None:
    pytest.skip(missing, allow_module_level=True)

pytestmark = [
    pytest.mark.slow,  # serves a Bento over HTTP, on vLLM
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

MODEL = LINEAGE[MODEL_VERSION_LABEL]
KV_CACHE_BUDGET_MIB = 64  # vLLM's KV cache and context: 1,280 tokens of the embedded model in float32
NEW_TOKENS = 24
QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have now?"


@pytest.fixture(scope="module")
def built(embedded_policy, tmp_path_factory):
    """(Bento, model tag, BentoML home) of the embedded policy, built with every package-index access made to fail."""
    home = tmp_path_factory.mktemp("vllm_bento") / "bentoml"
    offline = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "PIP_NO_INDEX": "1", "UV_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in offline.items():
            mp.setenv(key, value)
        model_tag = store_policy(embedded_policy.path, LINEAGE, {"source": "embedded policy"}, home=home)
        return build_bento(model_tag, home=home), model_tag, home


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    env = {"RLVR_ENGINE": "vllm", "RLVR_KV_CACHE_BUDGET_MIB": str(KV_CACHE_BUDGET_MIB), "VLLM_LOGGING_LEVEL": "WARNING"}
    with serving(built, tmp_path_factory.mktemp("vllm") / "server", batching=True, env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def native(embedded_policy):
    """(model, tokenizer) of the same weights in this process, for the native engine."""
    model, tokenizer = load_policy(embedded_policy.path)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_service_says_it_runs_on_vllm(server):
    assert "; engine vllm;" in server.log_path.read_text()


def test_generate_and_solve_answer_and_are_logged(server):
    generated = server.post_ok("/generate", {"prompt": QUESTION, "num_rollouts": 2, "temperature": 1.0, "max_new_tokens": NEW_TOKENS})
    solved = server.post_ok("/solve", {"question": QUESTION, "k": 1, "max_new_tokens": NEW_TOKENS})
    rollouts = generated["rollouts"]
    assert len(rollouts) == 2 and all(r["text"] and 0 < r["completion_tokens"] <= NEW_TOKENS for r in rollouts), rollouts
    assert solved["k"] == 1 and solved["reasoning"], solved
    records = {r["request_id"]: r for r in traffic_records(server, QUESTION)}
    generate, solve = records[generated["request_id"]], records[solved["request_id"]]
    assert generate["endpoint"] == "/generate" and generate["completions"] == [r["text"] for r in rollouts]
    assert generate["finish_reasons"] == [r["finish_reason"] for r in rollouts]
    assert solve["status"] == 200 and solve["completions"] == [solved["reasoning"]]


def test_greedy_text_is_the_native_engines(server, client, native, embedded_policy):
    model, tokenizer = native
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(ids, add_special_tokens=False).input_ids
    served = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=NEW_TOKENS)
    expected = generate_rollouts(model, tokenizer, [ids], config=SamplingConfig(max_new_tokens=NEW_TOKENS, temperatures=[0.0]))
    assert served.choices[0].text == expected.texts[0]
    assert served.usage.completion_tokens == int(expected.completion_mask.sum())
    # /solve's greedy answer ends where the task's stop rule (answer lines) ends the native engine's
    task = get_task(DEFAULT_TASK)
    prompt = task.render_prompt(tokenizer, {"problem_id": "q", "question": QUESTION}, policy_environment(embedded_policy.path))
    solved = server.post_ok("/solve", {"question": QUESTION, "k": 1, "max_new_tokens": 64})
    expected = generate_rollouts(model, tokenizer, [prompt], config=SamplingConfig(max_new_tokens=64, temperatures=[0.0]), stops=[task.stop_rule])
    assert solved["reasoning"] == expected.texts[0]


def test_chat_plain_and_streamed_agree(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": NEW_TOKENS}
    whole = client.chat.completions.create(**body)
    text, chunks, reason = "", 0, None
    for chunk in client.chat.completions.create(**body, stream=True):
        chunks += 1
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    (choice,) = whole.choices
    assert choice.message.content and text == choice.message.content and reason == choice.finish_reason
    assert chunks > 3  # token by token


def test_a_request_over_vllms_context_is_a_400_naming_the_field(server):
    status, text = server.request("/generate", {"prompt": "word " * 700, "num_rollouts": 1, "max_new_tokens": 1000})
    assert status == 400, text
    (error,) = json.loads(text)["detail"]
    assert error["loc"] == ["max_new_tokens"] and "over the engine's context of" in error["msg"], error


def test_a_policy_that_calls_tools_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="RLVR_ENGINE=native"):
        VllmServingEngine(None, None, None, 0, environment=make_environment("calculator"))
