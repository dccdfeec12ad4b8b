"""A Bento served with ``bentoml serve`` on loopback, for tests over real HTTP: the scripted tiny Llama's
Bento (built once per session, every package-index access made to fail), a server in its own process
group (killed on exit), a client for it, and readers of its metrics and traffic log."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.harness import ServedBento
from bentos.build import MODEL_VERSION_LABEL, build_bento, store_policy
from bentos.limits import MAX_NEW_TOKENS
from rlvr.monitoring.traffic import read_traffic
from support.scripted_policies import save_scripted_tiny_llama
from support.waiting import wait_for

READY_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120
PROBE_TIMEOUT_S = 2.0  # a probe slower than this during an attack is a frozen service
SHORT_TIMEOUT_S = 1  # a request timeout shorter than a LONG request (~3 s on the tiny model)
KV_CACHE_BUDGET_MIB = 4  # serving_batched's: ~16 rows of 1,000 tokens on the tiny model (256 bytes/token/row)
MAX_REQUESTS = 72  # serving_batched's request slots, running or queued: past the engine's 64 row slots
LINEAGE = {MODEL_VERSION_LABEL: "rlvr-gsm8k-policy/7", "mlflow_run_id": "0123abcd", "data_hash": "feedbeef"}
QUESTION = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?"
LONG = {"k": 8, "temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS}  # seconds of decoding on the tiny model


class Server:
    """A running ``bentoml serve``: its URL, traffic folder, Bento and process, and calls to it."""

    def __init__(self, url: str, traffic_dir: Path, built, model_tag: str, home: Path, log_path: Path, proc: subprocess.Popen):
        self.url, self.traffic_dir, self.built, self.model_tag, self.home = url, traffic_dir, built, model_tag, home
        self.log_path, self.proc = log_path, proc
        self.port = int(url.rsplit(":", 1)[1])

    def call(
        self,
        path: str,
        body=None,
        *,
        raw: bytes | None = None,
        method: str | None = None,
        content_type: str | None = "application/json",
        timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        """(status, body text, headers)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        method = method or ("POST" if data is not None else "GET")
        headers = {"Content-Type": content_type} if data is not None and content_type else {}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read().decode(), resp.headers
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(), err.headers

    def request(self, path: str, body=None, **kwargs) -> tuple[int, str]:
        status, text, _ = self.call(path, body, **kwargs)
        return status, text

    def post_ok(self, path: str, body: dict) -> dict:
        status, text = self.request(path, body)
        assert status == 200, text
        return json.loads(text)

    def metrics(self) -> str:
        status, text = self.request("/metrics")
        assert status == 200
        return text

    def is_ready(self, timeout_s: float = REQUEST_TIMEOUT_S) -> bool:
        """Whether /readyz answers 200 now."""
        try:
            return self.request("/readyz", timeout_s=timeout_s)[0] == 200
        except OSError:
            return False

    def assert_ready(self, within_s: float = 5.0) -> None:
        """Probes answer at once and a valid request is served within ``within_s``."""
        for probe in ("/healthz", "/readyz", "/metrics"):
            assert self.request(probe, timeout_s=PROBE_TIMEOUT_S)[0] == 200, probe
        started = time.monotonic()
        out = self.post_ok("/solve", {"question": QUESTION, "k": 1, "max_new_tokens": 8})
        assert out["k"] == 1 and time.monotonic() - started < within_s

    def open(self, path: str, body: bytes, *, send: int | None = None) -> socket.socket:
        """A raw client that sent the headers and the first ``send`` bytes of the body (all by default)."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=REQUEST_TIMEOUT_S)
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        sock.sendall(head + body[: len(body) if send is None else send])
        return sock


def metric_value(text: str, name: str, **labels) -> float:
    """The value of one series in Prometheus text format (0 when absent)."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(match.group(2))
    return 0.0


def traffic_records(server: Server, marker: str) -> list[dict]:
    """The server's traffic-log records whose prompt contains ``marker``."""
    return [r for r in read_traffic(server.traffic_dir).records if marker in r["prompt"]]


_BUILT: dict[str, tuple] = {}


def scripted_bento(tmp_path_factory) -> tuple:
    """(Bento, model tag, BentoML home): a Bento around the scripted tiny Llama (``save_scripted_tiny_llama``),
    built with every package-index access made to fail; once per test session."""
    if "bento" not in _BUILT:
        root = tmp_path_factory.mktemp("bento")
        home = root / "bentoml"
        checkpoint = save_scripted_tiny_llama(root / "tiny")
        offline = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "PIP_NO_INDEX": "1", "UV_OFFLINE": "1"}
        with pytest.MonkeyPatch.context() as mp:
            for key, value in offline.items():
                mp.setenv(key, value)
            model_tag = store_policy(checkpoint, LINEAGE, {"source": "scripted tiny llama"}, home=home)
            bento = build_bento(model_tag, labels={"mlflow_run_id": LINEAGE["mlflow_run_id"]}, home=home)
        _BUILT["bento"] = (bento, model_tag, home)
    return _BUILT["bento"]


@contextlib.contextmanager
def serving(built, folder: Path, batching: bool, env: dict[str, str] | None = None):
    """``bentoml serve`` of the Bento ``built`` (Bento, model tag, home) in its own process group, ready;
    the group is killed on exit (``bench.harness.ServedBento``, the benchmarks' server)."""
    bento, model_tag, home = built
    folder.mkdir()
    with ServedBento(bento.tag, home, folder / "traffic", batching, threads=1, log_path=folder / "serve.log", env=env, cwd=folder) as served:
        srv = Server(served.url, folder / "traffic", bento, model_tag, home, served.log_path, served.proc)

        def ready() -> bool:
            assert served.proc.poll() is None, f"bentoml serve exited:\n{served.log_tail()}"
            return srv.is_ready()

        wait_for(ready, READY_TIMEOUT_S, "bentoml serve to be ready", interval_s=0.5, details=served.log_tail)
        yield srv


def serving_batched(built, tmp_path_factory, name: str):
    """``serving`` with batching, a KV-cache budget of ``KV_CACHE_BUDGET_MIB``, ``MAX_REQUESTS`` request
    slots and an hour's request timeout: each module's main server."""
    env = {
        "RLVR_KV_CACHE_BUDGET_MIB": str(KV_CACHE_BUDGET_MIB),
        "RLVR_MAX_REQUESTS": str(MAX_REQUESTS),
        # an hour: every request slot fills with long requests that queue, none refused past the timeout
        "BENTOML_CONFIG_OPTIONS": "services.rlvr_policy.traffic.timeout=3600",
    }
    return serving(built, tmp_path_factory.mktemp(name) / "server", batching=True, env=env)
