"""rlvr-ops's images built with podman and run for real, as ``make container`` builds and runs them.

The policy image (the scripted tiny Llama's Bento from ``support.served_bento``, containerized by
deploy/container/build_images.py and started by run-policy.sh, which starts nothing without an API key):
its endpoints over real HTTP on the published 127.0.0.1 port (401 without the key), and each request's
traffic record, with its key's id, read on the host. The code-location image: its gRPC code server
answers ``dagster api grpc-health-check`` from the host, and its own HEALTHCHECK inside the container.
Slow (minutes: a Debian base image once, then each image's packages); skips, with the reason, where
rootful podman cannot run."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bentos.api_keys import derived_key_id
from bentos.build import MODEL_VERSION_LABEL, bentoml_env
from rlvr.answers import extract_final_answer
from rlvr.monitoring.traffic import read_traffic, traffic_row
from support.ports import free_port
from support.scripted_policies import GREEDY_COMPLETION
from support.served_bento import LINEAGE, QUESTION, Server, metric_value, scripted_bento
from support.waiting import wait_for

pytestmark = [
    pytest.mark.slow,  # builds and runs container images
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

ROOT = Path(__file__).resolve().parents[1]
CONTAINER_DIR = ROOT / "deploy" / "container"
BUILD_IMAGES = CONTAINER_DIR / "build_images.py"
RUN_POLICY = CONTAINER_DIR / "run-policy.sh"
NEEDED_TOOLS = ("podman", "runc", "debootstrap", "iptables")  # iptables: podman's published ports
BUILD_TIMEOUT_S = 1800
READY_TIMEOUT_S = 300  # the code server imports torch, transformers and every asset module
MODEL = LINEAGE[MODEL_VERSION_LABEL]
SERVICE_UID = 1034  # the image's `bentoml` user
API_KEY, METRICS_TOKEN = secrets.token_urlsafe(32), secrets.token_urlsafe(32)


class KeyedServer(Server):
    """``Server`` whose requests carry the container's API key (the metrics token to ``/metrics``)."""

    def call(self, path: str, body=None, *, raw=None, method=None, content_type="application/json", timeout_s: float = 120, key: str | None = None):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": content_type} if data is not None and content_type else {}
        key = key if key is not None else METRICS_TOKEN if path == "/metrics" else API_KEY
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data=data, method=method or ("POST" if data is not None else "GET"), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read().decode(), resp.headers
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(), err.headers


def _podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINER_DIR / "containers.conf")}


def _podman(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=_podman_env(), capture_output=True, text=True, timeout=timeout_s)


def _build(*args: str, env: dict[str, str]) -> str:
    """``build_images.py *args``; the image's tag. A failed build fails the test with the build's log."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(BUILD_IMAGES), *args], env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert result.returncode == 0, f"build_images.py {' '.join(args)} failed (exit {result.returncode}):\n{result.stderr[-6000:]}"
    print(f"built {result.stdout.strip()} in {time.monotonic() - started:.0f} s")
    return result.stdout.strip().splitlines()[-1]


def _logs(name: str) -> str:
    result = _podman("logs", name)
    return (result.stdout + result.stderr)[-4000:]


@pytest.fixture(scope="module")
def podman_ready() -> None:
    missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: apt-get install -y podman runc netavark aardvark-dns iptables debootstrap (.ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("the image builds use rootful podman and debootstrap: run as root")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return scripted_bento(tmp_path_factory)


@pytest.fixture(scope="module")
def policy_image(podman_ready, built):
    bento, _, home = built
    tag = f"localhost/rlvr-test-policy:{bento.tag.split(':', 1)[1]}"
    yield _build("policy", bento.tag, "--tag", tag, env={**bentoml_env(home), **_podman_env()})
    _podman("rmi", "--force", tag)


@pytest.fixture(scope="module")
def policy_container(policy_image, built, tmp_path_factory):
    """The policy image started as ``make container`` starts it (its key in a mode-600 file, as the Makefile
    makes it); its traffic folder is on this host."""
    bento, model_tag, home = built
    folder = tmp_path_factory.mktemp("policy-container")
    traffic, port, name = folder / "traffic", free_port(), f"rlvr-test-policy-{os.getpid()}"
    keys_file = folder / "api-key"
    keys_file.write_text(f"# made for the test\n{API_KEY}\n")
    keys_file.chmod(0o600)
    command = ["bash", str(RUN_POLICY), policy_image, str(traffic), str(port), name]
    env = {k: v for k, v in _podman_env().items() if not k.startswith(("RLVR_API_KEYS", "RLVR_ALLOW_UNAUTHENTICATED"))}
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no API key" in refused.stderr, refused.stderr  # nothing started without a key
    env.update(RLVR_API_KEYS_FILE=str(keys_file), RLVR_METRICS_TOKEN=METRICS_TOKEN)
    started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, f"run-policy.sh failed:\n{started.stderr}"
    try:
        server = KeyedServer(f"http://127.0.0.1:{port}", traffic, bento, model_tag, home, folder / "container.log", proc=None)

        def ready() -> bool:
            state = _podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running", f"the policy container is {state}:\n{_logs(name)}"
            return server.is_ready(timeout_s=5)

        wait_for(ready, READY_TIMEOUT_S, "/readyz to answer 200", interval_s=1, details=lambda: _logs(name))
        yield server
    finally:
        server.log_path.write_text(_logs(name))
        _podman("rm", "--force", "--time", "5", name)


def test_policy_image_is_cpu_and_keeps_no_build_input(policy_image):
    """torch is the CPU wheel from the wheelhouse; the build's CA bundle and uv settings were mounts only."""
    probe = "import torch; print(torch.__version__, torch.cuda.is_available())"
    script = f"id -u; python -c '{probe}'; cat /etc/uv/uv.toml; ls -A /run/rlvr-build/wheelhouse; sha256sum /etc/ssl/certs/ca-certificates.crt"
    result = _podman("run", "--rm", "--network", "none", "--entrypoint", "bash", policy_image, "-c", script)
    assert result.returncode == 0, result.stderr
    uid, torch_line, uv_config, *rest = result.stdout.splitlines()
    assert uid == str(SERVICE_UID)
    assert torch_line == "2.13.0+cpu False"
    assert uv_config.startswith("# empty:")  # the base image's placeholder, not the build's settings
    assert len(rest) == 1  # no wheel left behind
    base = _podman("run", "--rm", "--network", "none", "localhost/rlvr-base:bookworm-py311", "sha256sum", "/etc/ssl/certs/ca-certificates.crt")
    assert rest[0] == base.stdout.strip(), "the image's CA bundle is not the base image's: the build's bundle leaked into it"


def test_policy_container_serves_over_the_published_port_and_logs_to_the_host(policy_container):
    server = policy_container
    for probe in ("/healthz", "/readyz"):
        assert server.request(probe, timeout_s=5, key="")[0] == 200, probe  # probes take no key
    for path in ("/solve", "/v1/models", "/metrics"):
        assert server.request(path, key="")[0] == 401, path
    assert server.request("/metrics", key=API_KEY)[0] == 401  # /metrics takes its own token
    marker = f"container-{os.getpid()}"
    solved = server.post_ok("/solve", {"question": f"{QUESTION} ({marker})", "k": 1, "max_new_tokens": 16})
    assert solved["k"] == 1 and solved["model_version"] == MODEL
    assert solved["answer"] == extract_final_answer(GREEDY_COMPLETION)
    messages = [{"role": "user", "content": f"What is 2 cubed? ({marker})"}]
    chat = server.post_ok("/v1/chat/completions", {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16})
    assert chat["choices"][0]["message"]["content"] == GREEDY_COMPLETION and chat["model"] == MODEL

    metrics = server.metrics()
    assert metric_value(metrics, "rlvr_requests_total", endpoint="/solve", status="200") >= 1
    assert metric_value(metrics, "rlvr_requests_total", endpoint="/v1/chat/completions", status="200") >= 1

    # The container wrote into the host folder, as its own user; the project's reader reads it here.
    records = {r["request_id"]: r for r in read_traffic(server.traffic_dir).records}
    solve_record, chat_record = records[solved["request_id"]], records[chat["id"]]
    assert (solve_record["endpoint"], solve_record["status"], solve_record["model_version"]) == ("/solve", 200, MODEL)
    assert solve_record["api_key_id"] == chat_record["api_key_id"] == derived_key_id(API_KEY)
    assert marker in solve_record["prompt"] and solve_record["answer"] == solved["answer"]
    assert (chat_record["endpoint"], chat_record["status"], chat_record["messages"]) == ("/v1/chat/completions", 200, messages)
    assert traffic_row(chat_record)["endpoint"] == "/v1/chat/completions"  # what serving_traffic ingests
    log_files = list(server.traffic_dir.glob("traffic-*.jsonl"))
    assert log_files and all(f.stat().st_uid == SERVICE_UID for f in log_files)


@pytest.fixture(scope="module")
def code_location_container(podman_ready, tmp_path_factory):
    tag = "localhost/rlvr-test-code-location:latest"
    _build("code-location", "--tag", tag, env=_podman_env())
    port, name = free_port(), f"rlvr-test-code-location-{os.getpid()}"
    started = _podman("run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:4000", tag)
    assert started.returncode == 0, started.stderr
    try:
        yield tag, name, port
    finally:
        _podman("rm", "--force", "--time", "5", name)
        _podman("rmi", "--force", tag)


def test_code_location_answers_the_grpc_health_check(code_location_container):
    tag, name, port = code_location_container
    dagster = str(Path(sys.executable).with_name("dagster"))

    def healthy() -> subprocess.CompletedProcess | None:  # checked from this host, through the published loopback port
        check = subprocess.run([dagster, "api", "grpc-health-check", "-h", "127.0.0.1", "-p", str(port)], capture_output=True, text=True, timeout=60)
        state = _podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
        assert check.returncode == 0 or state == "running", f"the code-location container is {state}:\n{_logs(name)}"
        return check if check.returncode == 0 else None

    wait_for(healthy, READY_TIMEOUT_S, "a healthy gRPC server", interval_s=2, details=lambda: _logs(name))
    # The image's own HEALTHCHECK command, inside the container; the same check on a dead port fails.
    healthcheck = json.loads(_podman("image", "inspect", "--format", "{{json .Config.Healthcheck}}", tag).stdout)
    command = healthcheck["Test"]
    assert command[0] == "CMD" and command[1:4] == ["dagster", "api", "grpc-health-check"], healthcheck
    inside = _podman("exec", name, *command[1:])
    assert inside.returncode == 0, inside.stdout + inside.stderr
    dead_port = [*command[1:-1], "4001"]
    assert _podman("exec", name, *dead_port).returncode != 0


def test_policy_container_is_reachable_only_on_loopback(policy_container):
    """The port is published on 127.0.0.1 only: a request to another address of this host is refused."""
    port = policy_container.port
    addresses = {line.split()[3].split("/")[0] for line in subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout.splitlines()}
    others = sorted(a for a in addresses if not a.startswith("127.") and not a.startswith("10.88."))
    if not others:
        pytest.skip("this host has no non-loopback IPv4 address to try")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{others[0]}:{port}/readyz", timeout=5)
