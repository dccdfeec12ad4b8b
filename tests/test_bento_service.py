"""The policy service end to end: a Bento built offline around a tiny random Llama, served with
``bentoml serve`` on loopback, every endpoint called over real HTTP.

One server for the module (building and starting it takes most of the time); it runs in its own
process group, which is killed at the end whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import save_tiny_llama

from bentos.build import MODEL_VERSION_LABEL, bentoml_cli, bentoml_env, build_bento, store_policy
from bentos.schemas import MAX_BODY_BYTES, MAX_PROMPT_CHARS
from rlvr.answers import extract_final_answer
from rlvr.settings import Settings
from rlvr.evaluation import majority_vote
from rlvr.traffic import read_traffic

pytestmark = [  # raised inside BentoML 1.4.39 itself
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

READY_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120
LINEAGE = {MODEL_VERSION_LABEL: "rlvr-gsm8k-policy/7", "mlflow_run_id": "0123abcd", "data_hash": "feedbeef"}
QUESTION = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, traffic_dir: Path, built, model_tag: str, home: Path):
        self.url, self.traffic_dir, self.built, self.model_tag, self.home = url, traffic_dir, built, model_tag, home

    def request(self, path: str, body=None, *, raw: bytes | None = None, method: str | None = None,
                content_type: str = "application/json") -> tuple[int, str]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        method = method or ("POST" if data is not None else "GET")
        headers = {"Content-Type": content_type} if data is not None else {}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def post_ok(self, path: str, body: dict) -> dict:
        status, text = self.request(path, body)
        assert status == 200, text
        return json.loads(text)

    def metrics(self) -> str:
        status, text = self.request("/metrics")
        assert status == 200
        return text


def _metric(text: str, name: str, **labels) -> float:
    """The value of one series in Prometheus text format (0 when absent)."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(match.group(2))
    return 0.0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A Bento around a tiny random Llama, built with every package-index access made to fail."""
    root = tmp_path_factory.mktemp("bento")
    home = root / "bentoml"
    checkpoint = save_tiny_llama(root / "tiny")
    offline = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "PIP_NO_INDEX": "1",
               "UV_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in offline.items():
            mp.setenv(key, value)
        model_tag = store_policy(checkpoint, LINEAGE, {"source": "tiny random llama"}, home=home)
        bento = build_bento(model_tag, labels={"mlflow_run_id": LINEAGE["mlflow_run_id"]}, home=home)
    return bento, model_tag, home


@contextlib.contextmanager
def serving(built, folder: Path, batching: bool):
    """``bentoml serve`` of the Bento in its own process group, ready; the group is killed on exit."""
    bento, model_tag, home = built
    folder.mkdir()
    port, log_path = _free_port(), folder / "serve.log"
    env = {**bentoml_env(home), "RLVR_TRAFFIC_DIR": str(folder / "traffic"),
           "RLVR_BATCHING": "1" if batching else "0", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([bentoml_cli(), "serve", bento.tag, "--port", str(port), "--host", "127.0.0.1"],
                                env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            srv = Server(f"http://127.0.0.1:{port}", folder / "traffic", bento, model_tag, home)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                assert proc.poll() is None, f"bentoml serve exited:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
                try:
                    if srv.request("/readyz")[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            yield srv
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=20)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    with serving(built, tmp_path_factory.mktemp("batched") / "server", batching=True) as srv:
        yield srv


# ---------------------------------------------------------------------------------------------
# The Bento
# ---------------------------------------------------------------------------------------------


def test_bento_packs_the_model_with_its_lineage_and_a_dockerfile(built):
    bento, model_tag, home = built
    assert bento.tag.startswith("rlvr_policy:") and bento.path.is_dir()
    info = yaml.safe_load((bento.path / "bento.yaml").read_text())
    assert info["args"]["model_tag"] == model_tag
    assert [m["tag"] for m in info["services"][0]["models"]] == [model_tag]
    assert info["labels"]["mlflow_run_id"] == LINEAGE["mlflow_run_id"]
    model_dir = home / "models" / Path(*model_tag.split(":"))
    assert yaml.safe_load((model_dir / "model.yaml").read_text())["labels"] == LINEAGE
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    model_bytes = sum(f.stat().st_size for f in model_dir.rglob("*") if f.is_file())
    assert bento.size_bytes > model_bytes
    assert (bento.path / "env/docker/Dockerfile").is_file()
    assert (bento.path / "src/rlvr/rollout.py").is_file() and (bento.path / "src/bentos/service.py").is_file()
    assert not (bento.path / "src/tests").exists()
    # Nothing was locked against an index: requirements are the bentofile's pins.
    python_env = bento.path / "env/python"
    assert not (python_env / "requirements.lock.txt").exists()
    assert "torch==2.13.0" in (python_env / "requirements.txt").read_text().splitlines()
    assert bento.serve_command.startswith(f"BENTOML_HOME={home} RLVR_HOME=/")
    assert bento.serve_command.endswith(f" bentoml serve {bento.tag} --port 3000")


def test_store_policy_rejects_a_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        store_policy(tmp_path, {}, {}, home=tmp_path / "bentoml")


def test_traffic_folder_must_be_absolute(monkeypatch, tmp_path):
    monkeypatch.delenv("RLVR_TRAFFIC_DIR", raising=False)
    monkeypatch.setenv("RLVR_HOME", str(tmp_path))
    assert Settings.from_env(require_absolute=True).traffic_dir == tmp_path / "traffic"
    monkeypatch.setenv("RLVR_TRAFFIC_DIR", "relative/traffic")  # would land inside the Bento's folder
    with pytest.raises(ValueError, match="RLVR_TRAFFIC_DIR must be an absolute path"):
        Settings.from_env(require_absolute=True)
    monkeypatch.delenv("RLVR_TRAFFIC_DIR")
    monkeypatch.delenv("RLVR_HOME")
    with pytest.raises(ValueError, match="set RLVR_HOME"):
        Settings.from_env(require_absolute=True)


def test_monitoring_reads_the_folder_the_service_writes(monkeypatch, tmp_path):
    """One resolver: RLVR_TRAFFIC_DIR moves the service's logs and the monitoring's reads together."""
    from dagster import RunRequest, build_sensor_context

    from rlvr.traffic import FILE_PREFIX, FILE_SUFFIX
    from rlvr_assets.monitoring import TrafficConfig
    from sensors.traffic import traffic_sensor

    monkeypatch.setenv("RLVR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLVR_TRAFFIC_DIR", str(tmp_path / "elsewhere"))
    assert Settings.from_env(require_absolute=True).traffic_dir == tmp_path / "elsewhere"
    assert Path(TrafficConfig().folder) == tmp_path / "elsewhere"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / f"{FILE_PREFIX}x{FILE_SUFFIX}").write_text("{}\n")
    assert isinstance(traffic_sensor(build_sensor_context()), RunRequest)


# ---------------------------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------------------------


def test_health_and_readiness(server):
    assert server.request("/healthz")[0] == 200
    assert server.request("/readyz")[0] == 200


def test_generate_with_ground_truth_scores_every_rollout(server):
    body = {"prompt": QUESTION, "num_rollouts": 3, "temperature": [0.0, 1.2], "max_new_tokens": 12,
            "ground_truth": "72", "reward": "gsm8k"}
    out = server.post_ok("/generate", body)
    assert out["model_version"] == LINEAGE[MODEL_VERSION_LABEL] and out["reward"] == "gsm8k"
    rollouts = out["rollouts"]
    assert [r["temperature"] for r in rollouts] == [0.0, 1.2, 0.0]  # the list cycled over the rollouts
    rewards = [r["reward"] for r in rollouts]
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert out["best_reward"] == max(rewards) and out["best_index"] == rewards.index(max(rewards))
    assert math.isclose(out["mean_reward"], sum(rewards) / len(rewards))
    assert out["best_response"] == rollouts[out["best_index"]]["text"]
    for r in rollouts:
        assert 1 <= r["completion_tokens"] <= 12 and r["finish_reason"] in ("eos", "answer", "length")
        found = extract_final_answer(r["text"], "strict")
        assert r["answer"] == (found.text if found else None)
    assert (out["answer"], out["vote_share"]) == majority_vote([r["answer"] for r in rollouts])
    assert rollouts[0]["text"] == rollouts[2]["text"]  # both greedy


def test_generate_without_ground_truth_has_no_rewards(server):
    out = server.post_ok("/generate", {"prompt": QUESTION, "num_rollouts": 2, "max_new_tokens": 6})
    assert len(out["rollouts"]) == 2 and out["reward"] is None
    assert out["best_reward"] is None and out["mean_reward"] is None
    assert all(r["reward"] is None for r in out["rollouts"])


def test_solve_greedy_is_deterministic(server):
    body = {"question": QUESTION, "k": 1, "max_new_tokens": 16}
    first, second = server.post_ok("/solve", body), server.post_ok("/solve", body)
    assert first["k"] == 1 and len(first["answers"]) == 1
    assert (first["answer"], first["reasoning"]) == (second["answer"], second["reasoning"])
    assert first["vote_share"] == (1.0 if first["answer"] is not None else 0.0)


def test_solve_votes_over_k_samples(server):
    out = server.post_ok("/solve", {"question": QUESTION, "k": 3, "temperature": 1.0, "max_new_tokens": 12})
    assert out["k"] == 3 and len(out["answers"]) == 3
    assert 0.0 <= out["vote_share"] <= 1.0
    assert (out["answer"], out["vote_share"]) == majority_vote(out["answers"])
    if out["answer"] is not None:
        assert extract_final_answer(out["reasoning"], "strict").text == out["answer"]


def test_metrics_count_requests_rollouts_and_votes(server):
    before = server.metrics()
    server.post_ok("/solve", {"question": QUESTION, "k": 2, "max_new_tokens": 4})
    assert server.request("/solve", {"question": ""})[0] == 400
    after = server.metrics()
    for name, kind in (("rlvr_requests_total", "counter"), ("rlvr_rollouts_generated_total", "counter"),
                       ("rlvr_reward", "histogram"), ("rlvr_vote_share", "histogram"),
                       ("rlvr_generation_seconds", "histogram")):
        assert f"# TYPE {name} {kind}" in after, name

    def delta(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("rlvr_requests_total", endpoint="/solve", status="200") == 1
    assert delta("rlvr_requests_total", endpoint="/solve", status="400") == 1
    assert delta("rlvr_rollouts_generated_total") == 2
    assert delta("rlvr_vote_share_count") == 1
    assert delta("rlvr_generation_seconds_count") >= 1
    assert _metric(after, "rlvr_reward_count") > 0  # from the /generate test with ground truth
    assert _metric(after, "bentoml_service_request_total", endpoint="/solve", http_response_code="200") > 0
    assert "bentoml_service_request_duration_seconds_bucket" in after


def test_every_answered_request_is_in_the_traffic_log(server):
    out = server.post_ok("/generate", {"prompt": "What is 6 times 7?", "num_rollouts": 2, "max_new_tokens": 5,
                                       "ground_truth": 42})
    records = {r["request_id"]: r for r in read_traffic(server.traffic_dir).records}
    record = records[out["request_id"]]
    assert record["endpoint"] == "/generate" and record["status"] == 200
    assert record["model_version"] == LINEAGE[MODEL_VERSION_LABEL] and record["model_tag"] == server.model_tag
    assert record["prompt"] == "What is 6 times 7?" and record["ground_truth"] == "42"
    assert record["answers"] == [r["answer"] for r in out["rollouts"]]
    assert record["rewards"] == [r["reward"] for r in out["rollouts"]]
    assert record["vote_share"] == out["vote_share"] and record["latency_s"] > 0
    assert record["completions"] == [r["text"] for r in out["rollouts"]]
    assert "T" in record["timestamp"] and record["params"]["num_rollouts"] == 2
    solves = [r for r in records.values() if r["endpoint"] == "/solve"]
    assert solves and all({"answers", "answer", "vote_share", "latency_s"} <= r.keys() for r in solves)


# ---------------------------------------------------------------------------------------------
# Hostile and malformed requests
# ---------------------------------------------------------------------------------------------

HOSTILE = [
    # (path, raw body, field the error must name)
    ("/generate", b"{not json", "Invalid JSON"),
    ("/generate", b"", "prompt"),
    ("/generate", b"{}", "prompt"),
    ("/generate", b"[1, 2]", "object"),
    ("/generate", b'{"prompt": "   "}', "prompt"),
    ("/generate", json.dumps({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}).encode(), "prompt"),
    ("/generate", b'{"prompt": 123}', "prompt"),
    ("/generate", b'{"prompt": "hi", "num_rollouts": 10000}', "num_rollouts"),
    ("/generate", b'{"prompt": "hi", "num_rollouts": 0}', "num_rollouts"),
    ("/generate", b'{"prompt": "hi", "num_rollouts": "4"}', "num_rollouts"),
    ("/generate", b'{"prompt": "hi", "num_rollouts": true}', "num_rollouts"),
    ("/generate", b'{"prompt": "hi", "temperature": -0.5}', "temperature"),
    ("/generate", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/generate", b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/generate", b'{"prompt": "hi", "temperature": 2.5}', "temperature"),
    ("/generate", b'{"prompt": "hi", "num_rollouts": 2, "temperature": [0.1, 0.2, 0.3]}', "temperature"),
    ("/generate", b'{"prompt": "hi", "temperature": []}', "temperature"),
    ("/generate", b'{"prompt": "hi", "max_new_tokens": 0}', "max_new_tokens"),
    ("/generate", b'{"prompt": "hi", "max_new_tokens": 1000000}', "max_new_tokens"),
    ("/generate", b'{"prompt": "hi", "top_p": 0}', "top_p"),
    ("/generate", b'{"prompt": "hi", "ground_truth": "1", "reward": "code_execution"}', "reward"),
    ("/generate", b'{"prompt": "hi", "reward": "no_such_reward"}', "reward"),
    ("/generate", b'{"prompt": "hi", "ground_truth": ""}', "ground_truth"),
    ("/generate", b'{"prompt": "hi", "num_rolouts": 2}', "num_rolouts"),
    ("/solve", b'{"question": "hi", "k": 0}', "k"),
    ("/solve", b'{"question": "hi", "k": 17}', "k"),
    ("/solve", b'{"question": "hi", "k": 2.5}', "k"),
    ("/solve", b'{"k": 3}', "question"),
    ("/internal/rollouts",
     b'[{"question": "hi", "num_samples": 1, "temperatures": [0], "max_new_tokens": 2, "token": "guess"}]', "token"),
]


@pytest.mark.parametrize(("path", "raw", "field"), HOSTILE, ids=[f"{p}:{r[:40]!r}" for p, r, _ in HOSTILE])
def test_malformed_request_gets_400_naming_the_field(server, path, raw, field):
    status, text = server.request(path, raw=raw)
    assert status == 400, text
    assert field in text


def test_oversized_bodies_and_odd_requests_get_4xx_and_the_server_keeps_serving(server):
    huge = json.dumps({"prompt": "y" * (2 * MAX_BODY_BYTES)}).encode()
    status, text = server.request("/generate", raw=huge)
    assert status == 413 and "body" in text
    assert server.request("/generate", raw=b'{"prompt": "hi"}', content_type="application/vnd.bentoml+pickle")[0] == 415
    assert server.request("/generate", method="GET")[0] == 405
    assert server.request("/no/such/route", {"prompt": "hi"})[0] == 404
    assert server.request("/healthz")[0] == 200
    out = server.post_ok("/solve", {"question": QUESTION, "k": 1, "max_new_tokens": 3})
    assert out["k"] == 1


def test_concurrent_mixed_requests_are_batched_and_all_answered(server):
    def call(i: int) -> tuple[dict, dict]:
        if i % 2:
            body = {"prompt": f"{QUESTION} ({i})", "num_rollouts": 2, "max_new_tokens": 24, "temperature": 0.9}
            return body, server.post_ok("/generate", body)
        body = {"question": f"{QUESTION} [{i}]", "k": 2, "max_new_tokens": 16}
        return body, server.post_ok("/solve", body)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    for body, out in results:
        if "prompt" in body:
            assert len(out["rollouts"]) == 2 and all(r["completion_tokens"] <= 24 for r in out["rollouts"])
        else:
            assert len(out["answers"]) == 2
    ids = {out["request_id"] for _, out in results}
    records = [r for r in read_traffic(server.traffic_dir).records if r["request_id"] in ids]
    assert len(records) == 8 and all(r["status"] == 200 for r in records)
    assert max(r["batch_requests"] for r in records) > 1, "no two concurrent requests shared a generation pass"
    assert _metric(server.metrics(), "bentoml_service_adaptive_batch_size_count", method_name="rollouts") > 0


def test_without_batching_each_request_gets_its_own_pass(built, tmp_path):
    with serving(built, tmp_path / "server", batching=False) as srv:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: srv.post_ok("/solve", {"question": f"{QUESTION} {i}", "k": 2,
                                                                  "max_new_tokens": 16}), range(4)))
        records = read_traffic(srv.traffic_dir).records
        assert sorted(r["request_id"] for r in records) == sorted(o["request_id"] for o in outs)
        assert all(r["batch_requests"] == 1 and r["batching"] is False for r in records)
