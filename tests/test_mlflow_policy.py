"""Registered policies are MLflow models: the training run logs the policy as a pyfunc with a signature
and an input example, the registry version points at it, ``mlflow.pyfunc.load_model`` answers a GSM8k
question through the champion alias, and ``mlflow models serve`` serves it over HTTP. The experiment
opens in the MLflow UI's model-training mode, without an empty Default experiment beside it."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlflow
import pytest

from resources import MLflowResource, StoredModel
from resources.mlflow_policy import QUESTION_EXAMPLE
from resources.tracking import CHAMPION, EXPERIMENT_KIND_TAG, MODEL_TRAINING, EvaluationRun
from rlvr.answers import extract_final_answer
from rlvr.tasks import GSM8K
from support.ports import free_port
from support.tiny_models import save_tiny_llama
from support.waiting import wait_for_http

pytestmark = pytest.mark.slow  # logs, loads and serves policies with MLflow


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A training run that logged the tiny policy, registered and promoted to champion (once for the module)."""
    tmp_path = tmp_path_factory.mktemp("registry")
    tiny_llama_dir = save_tiny_llama(tmp_path / "tiny")
    tracking = MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=str(tmp_path / "mlartifacts"))
    with tracking.start_run("grpo-v1-run-abcd1234") as run:
        run.log_policy(tiny_llama_dir, {"rlvr.policy_version": "v1"})
    trained = StoredModel("grpo_checkpoint", "v1", tiny_llama_dir, {"mlflow_run_id": run.run_id, "training_config": {"lr": 1e-6}})
    registry = tracking.registry()
    version = registry.register_trained(trained, EvaluationRun("e1", {}, {"trained.pass_at_1_strict": 0.5}))
    registry.record_decision(version, True, "first policy")
    return tracking, run.run_id, version


@pytest.fixture
def active(registered):
    """The ``mlflow`` module pointed at the store, as an MLflow user's session is; restored afterwards."""
    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    registered[0].activate()
    yield registered
    mlflow.set_tracking_uri(before[0])
    mlflow.set_registry_uri(before[1])


def test_the_experiment_opens_as_model_training_without_an_empty_default(registered):
    tracking = registered[0]
    client = tracking.client()
    assert client.get_experiment(tracking.experiment_id()).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    assert [e.name for e in client.search_experiments()] == ["rlvr-ops"]


def test_an_existing_experiment_gets_the_model_training_kind(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from mlflow.tracking import MlflowClient

    experiment_id = MlflowClient(uri).create_experiment("rlvr-ops")  # as an earlier version created it
    assert MLflowResource(tracking_uri=uri).experiment_id() == experiment_id
    assert MlflowClient(uri).get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING


def test_the_champion_is_an_mlflow_model_that_answers_a_gsm8k_question(active):
    tracking, run_id, version = active
    client = tracking.client()
    registered = client.get_model_version(tracking.registered_model, version)
    run = client.get_run(run_id)
    (output,) = run.outputs.model_outputs  # the policy in the run's Models column and the experiment's Logged models
    assert registered.source == client.get_logged_model(output.model_id).artifact_location
    assert json.loads(registered.tags["training_config"]) == {"lr": 1e-6}  # JSON, not a Python repr

    model = mlflow.pyfunc.load_model(f"models:/{tracking.registered_model}@{CHAMPION}")
    assert model.metadata.get_input_schema().input_names() == ["question", "task"]  # task: optional, the policy's first by default
    assert model.metadata.get_output_schema().input_names() == ["answer", "completion"]
    answers = model.predict(
        {"question": ["Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?"]}, params={"max_new_tokens": 8}
    )
    assert list(answers.columns) == ["answer", "completion"] and len(answers) == 1
    completion = answers["completion"][0]
    found = extract_final_answer(completion, "strict")
    assert answers["answer"][0] == (found.text if found else "")
    named = model.predict({"question": ["What is 6 times 7?"], "task": ["gsm8k"]}, params={"max_new_tokens": 8})
    assert named["answer"][0] == (GSM8K.parse(named["completion"][0]) or "")  # a policy recording no tasks is served as GSM8k
    with pytest.raises(Exception, match=r"\['math'\] are not among the policy's tasks: gsm8k"):
        model.predict({"question": ["What is 6 times 7?"], "task": ["math"]}, params={"max_new_tokens": 8})
    downloaded = Path(mlflow.artifacts.download_artifacts(f"models:/{tracking.registered_model}@{CHAMPION}"))
    assert QUESTION_EXAMPLE in (downloaded / "input_example.json").read_text()
    assert tracking.download_checkpoint(registered.source).joinpath("config.json").is_file()  # the bento asset's way to the weights


def test_mlflow_models_serve_answers_over_http(registered):
    tracking = registered[0]
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # the environment's uvicorn, as with the venv activated
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MLFLOW_TRACKING_URI": tracking.tracking_uri, "MLFLOW_REGISTRY_URI": tracking.tracking_uri}
    server = subprocess.Popen(
        [f"{bin_dir}/mlflow", "models", "serve", "-m", f"models:/{tracking.registered_model}@{CHAMPION}"]
        + ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/ping", server, "mlflow models serve", timeout_s=120)
        body = {"dataframe_records": [{"question": QUESTION_EXAMPLE}], "params": {"max_new_tokens": 8}}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            predictions = json.load(response)["predictions"]
        assert len(predictions) == 1 and set(predictions[0]) == {"answer", "completion"}
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
