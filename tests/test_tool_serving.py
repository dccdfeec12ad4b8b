"""The Bento of a policy whose lineage says ``calculator``, served over real HTTP: the service reads the
environment from the checkpoint (nobody tells it), every endpoint runs the same tool loop as
training, the calculator's text is part of each answer and of its token budget, and a call the
calculator refuses (``9/0``) costs the completion an ``error``, never the request.

The policy is the scripted calculator Llama (``support.scripted_policies``): greedy from a chat prompt it
writes ``<<6*7=``, from a prompt ending in ``:`` it writes `` <<9/0=``, and after ``>>`` `` #### 42``.
Two servers: the continuous engine (batching) and whole passes (``generate_rollouts``)."""

from __future__ import annotations

import json

import pytest

from bentos.build import MODEL_VERSION_LABEL, build_bento, store_policy
from rlvr.chat import render_messages, with_instructions
from rlvr.environments import Calculator, ToolBudget
from rlvr.monitoring.traffic import read_traffic
from rlvr.policy import write_environment
from support.scripted_policies import GREEDY_WITH_CALCULATOR, save_calculator_llama
from support.served_bento import serving
from support.tiny_models import embedded_tokenizer

pytestmark = [
    pytest.mark.slow,  # serves Bentos over HTTP
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

QUESTION = "What is six times seven?"
ENVIRONMENT = Calculator(budget=ToolBudget(max_calls=2))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-bento")
    checkpoint = save_calculator_llama(root / "calc")
    write_environment(checkpoint, ENVIRONMENT)  # the lineage GRPO's export writes
    home = root / "bentoml"
    model_tag = store_policy(checkpoint, {MODEL_VERSION_LABEL: "calculator-policy/1"}, home=home)
    return build_bento(model_tag, home=home), model_tag, home


@pytest.fixture(scope="module", params=["continuous", "passes"])
def server(request, built, tmp_path_factory):
    with serving(built, tmp_path_factory.mktemp(request.param) / "server", batching=request.param == "continuous") as srv:
        yield srv


def test_solve_answers_with_the_policys_calculator(server):
    out = server.post_ok("/solve", {"question": QUESTION, "k": 1, "max_new_tokens": 32})
    assert out["environment"] == "calculator"
    assert out["reasoning"] == GREEDY_WITH_CALCULATOR and out["answer"] == "42"  # the calculator's "42>>" is in the text
    (call,) = out["tool_calls"]
    assert (call["index"], call["tool"], call["call"], call["result"], call["error"]) == (0, "calculator", "6*7", "42", None)
    generated = server.post_ok("/generate", {"prompt": QUESTION, "num_rollouts": 2, "temperature": 0.0, "max_new_tokens": 32})
    assert [r["text"] for r in generated["rollouts"]] == [GREEDY_WITH_CALCULATOR] * 2
    assert all([c["result"] for c in r["tool_calls"]] == ["42"] for r in generated["rollouts"])


def test_the_openai_endpoints_run_the_same_tool_loop(server):
    status, text = server.request(
        "/v1/chat/completions", {"model": "rlvr_policy", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32, "temperature": 0}
    )
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == GREEDY_WITH_CALCULATOR


def test_a_refused_call_costs_the_completion_an_error_not_the_request(server):
    """``9/0`` (the prompt ends in ':'): the calculator refuses, writes ``error>>``, the answer goes on."""
    status, text = server.request("/v1/completions", {"model": "rlvr_policy", "prompt": "Divide nine by zero. A:", "max_tokens": 32, "temperature": 0})
    assert status == 200, text
    assert json.loads(text)["choices"][0]["text"] == " <<9/0=error>> #### 42"
    server.assert_ready()


def test_the_token_budget_counts_the_calculators_tokens(server):
    """``<<6*7=`` is 5 policy tokens; with 6 the calculator's ``42>>`` is cut after its first token."""
    out = server.post_ok("/generate", {"prompt": QUESTION, "num_rollouts": 1, "temperature": 0.0, "max_new_tokens": 6})
    (rollout,) = out["rollouts"]
    assert rollout["completion_tokens"] == 6 and rollout["finish_reason"] == "length"
    assert rollout["text"] == "<<6*7=4"


def test_the_traffic_log_keeps_the_tool_calls(server):
    server.post_ok("/solve", {"question": f"{QUESTION} (logged)", "k": 1, "max_new_tokens": 32})
    (record,) = [r for r in read_traffic(server.traffic_dir).records if r["prompt"].endswith("(logged)")]
    assert [[c["call"] for c in calls] for calls in record["tool_calls"]] == [["6*7"]]


def test_a_chat_clients_system_message_gets_the_tool_instructions_the_policy_was_trained_with(server):
    tokenizer = embedded_tokenizer()
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    out = server.post_ok("/v1/chat/completions", {"model": "rlvr_policy", "messages": messages, "max_tokens": 8, "temperature": 0})

    def tokens(conversation) -> int:
        return len(tokenizer(render_messages(tokenizer, conversation), add_special_tokens=False).input_ids)

    served = with_instructions(messages, ENVIRONMENT)
    assert served[0]["content"] == "Answer briefly.\n\n" + ENVIRONMENT.instructions
    assert out["usage"]["prompt_tokens"] == tokens(served) > tokens(messages)
