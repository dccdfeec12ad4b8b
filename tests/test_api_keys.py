"""API keys of the policy service (``bentos.api_keys``, enforced by ``bentos.admission.RequestGuard``).

The rules on their own first (parsing, the environment, the constant-time match, the token bucket),
then the guard in-process around a stand-in app (what one served configuration cannot show: an open
service, /metrics without a token of its own, a key checked before any byte of the body is read),
then ``test_bento_service``'s tiny Bento: refused by ``bentoml serve`` when its key setting holds no
key, and served once with keys, a metrics token and per-key limits: each route over real HTTP
without, with a wrong and with the right key, the ``openai`` client, lm-evaluation-harness, the
limits' 429s and the traffic log's key ids.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import secrets
import statistics
import subprocess
import time
from pathlib import Path

import duckdb
import openai
import pytest

from bentos import api_keys
from bentos.api_keys import AccessConfig, KeyLimits, KeyRing, TokenBucket, access_from_env, bearer_token, derived_key_id, parse_keys
from bentos.build import bentoml_cli, bentoml_env
from rlvr.monitoring.traffic import TRAFFIC_COLUMNS, TrafficLog, read_traffic, traffic_row
from support.guard import guarded
from support.http_call import REQUEST_TIMEOUT_S, call
from support.ports import free_port
from support.served_bento import QUESTION, metric_value, scripted_bento, serving
from support.waiting import wait_for

pytestmark = [  # raised inside BentoML 1.4.39 itself
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

ALICE, BARE, BOB, CAROL, METRICS = (secrets.token_urlsafe(32) for _ in range(5))
BARE_ID = derived_key_id(BARE)
RATE_PER_S, BURST, CONCURRENCY = 5, 40, 2


# ---------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------


def test_keys_are_id_secret_or_bare_separated_by_commas_or_lines():
    ring = parse_keys(f"alice:{ALICE}, {BARE}\n# a comment, with: colons\n\n  bob:{BOB}  ,", "RLVR_API_KEYS")
    assert ring.ids == ("alice", BARE_ID, "bob")
    assert ring.digests == tuple(hashlib.sha256(s.encode()).digest() for s in (ALICE, BARE, BOB))  # digests only
    assert re.fullmatch(r"key-[0-9a-f]{8}", BARE_ID)
    assert parse_keys("", "x").ids == ()


@pytest.mark.parametrize(
    "text, problem",
    [
        ("alice:short-secret", "key 1: 12 characters; a secret needs at least 16"),
        (f"alice:{ALICE}, bad id:{BOB}", "key 2: its id (before ':') must be"),
        (f"alice:{ALICE[:20]}#{ALICE[20:]}", "a secret may hold only"),
        (f"alice:{ALICE}\nalice:{BOB}", "key 2: the id 'alice' is taken by key 1"),
        (f"alice:{ALICE}\nbob:{ALICE}", "key 2: the same secret as key 1"),
    ],
)
def test_a_malformed_key_is_named_by_position_never_by_its_secret(text, problem):
    with pytest.raises(ValueError, match="^RLVR_API_KEYS: ") as err:
        parse_keys(text, "RLVR_API_KEYS")
    assert problem in str(err.value)
    assert ALICE[:16] not in str(err.value) and BOB[:16] not in str(err.value)


def test_keys_come_from_the_environment_and_a_file(tmp_path):
    assert access_from_env({}).keys is None  # nothing named: open
    assert "OPEN TO ANYONE" in access_from_env({}).summary()
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"# rotated keys\nbob:{BOB}\n")
    config = access_from_env({"RLVR_API_KEYS": f"alice:{ALICE}", "RLVR_API_KEYS_FILE": str(keys_file), "RLVR_METRICS_TOKEN": METRICS})
    assert config.keys.ids == ("alice", "bob") and config.metrics_token.match(METRICS.encode()) == "metrics"
    assert config.summary() == "API keys alice, bob; /metrics takes its own token; per key: no rate limit, no concurrency limit"
    assert ALICE not in config.summary() and BOB not in config.summary()
    with pytest.raises(ValueError, match=f"RLVR_API_KEYS_FILE={tmp_path / 'missing'}: cannot be read"):
        access_from_env({"RLVR_API_KEYS_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="'bob' is also in RLVR_API_KEYS"):
        access_from_env({"RLVR_API_KEYS": f"bob:{BOB}", "RLVR_API_KEYS_FILE": str(keys_file)})
    with pytest.raises(ValueError, match="RLVR_METRICS_TOKEN: 5 characters"):
        access_from_env({"RLVR_METRICS_TOKEN": "short"})


def test_keys_named_but_empty_refuse_to_start_unless_told_to_run_open(tmp_path):
    """A Secret or file left empty is a mistake, not a wish to serve anyone."""
    empty = tmp_path / "api-keys"
    empty.write_text("# no key yet\n")
    for env in ({"RLVR_API_KEYS": " "}, {"RLVR_API_KEYS_FILE": str(empty)}):
        with pytest.raises(ValueError, match="holds no key: set one, or RLVR_ALLOW_UNAUTHENTICATED=1"):
            access_from_env(env)
        assert access_from_env({**env, "RLVR_ALLOW_UNAUTHENTICATED": "1"}).keys is None


def test_limits_come_from_the_environment():
    assert access_from_env({}).limits == KeyLimits(None, 1, None)
    limits = access_from_env({"RLVR_RATE_PER_KEY": "2.5", "RLVR_CONCURRENCY_PER_KEY": "3"}).limits
    assert limits == KeyLimits(2.5, 3, 3)  # burst: a second's worth
    assert access_from_env({"RLVR_RATE_PER_KEY": "0.1", "RLVR_BURST_PER_KEY": "20"}).limits.burst == 20
    for env, problem in [
        ({"RLVR_RATE_PER_KEY": "-1"}, "RLVR_RATE_PER_KEY must be a number of at least 0.001; got '-1'"),
        ({"RLVR_RATE_PER_KEY": "inf"}, "RLVR_RATE_PER_KEY must be a number"),
        ({"RLVR_CONCURRENCY_PER_KEY": "1.5"}, "RLVR_CONCURRENCY_PER_KEY must be a whole number of at least 1"),
        ({"RLVR_BURST_PER_KEY": "4"}, "RLVR_BURST_PER_KEY is set without RLVR_RATE_PER_KEY"),
    ]:
        with pytest.raises(ValueError, match=problem.replace(".", r"\.")):
            access_from_env(env)


def test_the_match_compares_every_key_in_constant_time_by_construction(monkeypatch):
    """Whichever key matches, or none, ``hmac.compare_digest`` runs once per key on two 32-byte digests:
    no early exit, and no comparison of the presented key itself (its length or a shared prefix)."""
    ring = parse_keys(",".join(f"k{i}:{secrets.token_urlsafe(32)}" for i in range(5)), "keys")
    compared = []
    real = api_keys.hmac.compare_digest
    monkeypatch.setattr(api_keys.hmac, "compare_digest", lambda a, b: compared.append((len(a), len(b))) or real(a, b))
    secret = ALICE
    ring = KeyRing((*ring.ids, "alice"), (*ring.digests, hashlib.sha256(secret.encode()).digest()))
    for presented, expected in [(secret, "alice"), (secret[:-1] + "x", None), ("y" * 200, None), ("", None)]:
        compared.clear()
        assert ring.match(presented.encode()) == expected
        assert compared == [(32, 32)] * 6


def test_bearer_token_is_read_from_one_authorization_header_only():
    assert bearer_token([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_token([(b"authorization", b"bearer  abc ")]) == b"abc"
    for headers in (
        [],
        [(b"authorization", b"Basic YWxpY2U6cHc=")],
        [(b"authorization", b"Bearer ")],
        [(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")],
        [(b"cookie", b"api_key=abc"), (b"x-api-key", b"abc")],
    ):
        assert bearer_token(headers) is None, headers


def test_token_bucket_lets_a_burst_through_then_the_rate():
    now = [100.0]
    bucket = TokenBucket(rate_per_s=2.0, burst=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [0.0] * 3
    assert bucket.take() == pytest.approx(0.5)  # the next token in half a second
    now[0] += 0.5
    assert bucket.take() == 0.0 and bucket.take() == pytest.approx(0.5)
    now[0] += 60  # saves up no more than the burst
    assert [bucket.take() for _ in range(4)][-1] == pytest.approx(0.5)


def test_an_older_serving_traffic_table_gains_the_key_id_column(tmp_path):
    """A log without key ids (an open service, an older one) and a table made before the column are read."""
    from resources.warehouse import SCHEMAS, Warehouse

    folder, database = tmp_path / "traffic", tmp_path / "rlvr.duckdb"
    before_the_column = re.sub(r", api_key_id VARCHAR,.*\)$", ")", SCHEMAS["serving_traffic"], flags=re.DOTALL)  # and the usage columns
    assert "api_key_id" not in before_the_column and before_the_column.endswith("source_offset BIGINT)")
    with duckdb.connect(str(database)) as conn:
        conn.execute(before_the_column)
        conn.execute("INSERT INTO serving_traffic (record_id, endpoint) VALUES ('old@0', '/solve')")
    log = TrafficLog(folder)
    log.append({"timestamp": "2026-01-02T00:00:00+00:00", "request_id": "a", "endpoint": "/solve", "status": 200, "api_key_id": "alice"})
    log.append({"timestamp": "2026-01-02T00:00:01+00:00", "request_id": "b", "endpoint": "/solve", "status": 200})
    batch = read_traffic(folder)
    assert [traffic_row(r)["api_key_id"] for r in batch.records] == ["alice", None]
    assert TRAFFIC_COLUMNS[-4:] == ("api_key_id", "prompt_tokens", "generated_tokens", "compute_s")  # the table's order
    warehouse = Warehouse(database=str(database), publish_snapshot=False)
    assert warehouse.ingest_traffic(batch) == 2
    rows = warehouse.query("SELECT coalesce(api_key_id, '-') AS key_id FROM serving_traffic ORDER BY request_id NULLS FIRST")
    assert rows["key_id"].tolist() == ["-", "alice", "-"]


# ---------------------------------------------------------------------------------------------
# The guard in-process, around a stand-in app
# ---------------------------------------------------------------------------------------------


def _keyed(metrics_token: bool) -> AccessConfig:
    return AccessConfig(parse_keys(f"alice:{ALICE}", "keys"), parse_keys(METRICS, "metrics") if metrics_token else None)


def test_a_request_without_the_key_is_refused_before_its_body_is_read():
    reads = []
    client = guarded(_keyed(metrics_token=False), reads)
    out = client.post("/solve", json={"question": "x" * 1000}, headers={"Authorization": f"Bearer {ALICE[:-1]}x"})
    assert out.status_code == 401 and out.json() == {"error": "incorrect API key"} and reads == []
    assert out.headers["www-authenticate"] == 'Bearer error="invalid_token"' and out.headers["connection"] == "close"
    assert client.post("/solve", json={"question": "x"}, headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
    assert reads and set(reads) == {"/solve"}


def test_metrics_takes_the_keys_when_it_has_no_token_of_its_own():
    client = guarded(_keyed(metrics_token=False))
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
    client = guarded(_keyed(metrics_token=True))
    assert client.get("/metrics", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {METRICS}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {METRICS}"}).status_code == 401  # the token opens /metrics only


def test_an_open_service_answers_anyone_and_one_not_started_no_one():
    open_client = guarded(AccessConfig())
    assert open_client.post("/solve", json={}).status_code == 200 and open_client.get("/metrics").status_code == 200
    starting = guarded(None).get("/v1/models")
    assert starting.status_code == 503 and starting.headers["retry-after"] == "2"
    assert starting.json()["error"]["code"] == "service_unavailable"
    assert guarded(None).get("/readyz").status_code == 200  # probes never wait on keys


# ---------------------------------------------------------------------------------------------
# The served Bento with keys
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return scripted_bento(tmp_path_factory)


@pytest.mark.slow  # serves a Bento over HTTP
def test_a_served_bento_whose_keys_setting_holds_no_key_does_not_start(built, tmp_path):
    """``bentoml serve`` stops at once, its output naming the setting (not only BentoML's import error)."""
    bento, _, home = built
    env = {k: v for k, v in bentoml_env(home).items() if k not in ("RLVR_API_KEYS_FILE", "RLVR_ALLOW_UNAUTHENTICATED")}
    env.update(RLVR_TRAFFIC_DIR=str(tmp_path / "traffic"), OMP_NUM_THREADS="1", RLVR_API_KEYS=" , ")
    served = subprocess.run(
        [bentoml_cli(), "serve", bento.tag, "--port", str(free_port()), "--host", "127.0.0.1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=REQUEST_TIMEOUT_S,
        start_new_session=True,
    )
    assert served.returncode != 0
    assert "RLVR_API_KEYS holds no key: set one, or RLVR_ALLOW_UNAUTHENTICATED=1" in served.stdout + served.stderr


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed")
    keys_file = folder / "api-keys"
    keys_file.write_text(f"# the keys of bob and carol\nbob:{BOB}\n\ncarol:{CAROL}\n")
    env = {
        "RLVR_API_KEYS": f"alice:{ALICE},{BARE}",
        "RLVR_API_KEYS_FILE": str(keys_file),
        "RLVR_METRICS_TOKEN": METRICS,
        "RLVR_RATE_PER_KEY": str(RATE_PER_S),
        "RLVR_BURST_PER_KEY": str(BURST),
        "RLVR_CONCURRENCY_PER_KEY": str(CONCURRENCY),
        "RLVR_KV_CACHE_BUDGET_MIB": "4",
    }
    with serving(built, folder / "server", batching=True, env=env) as srv:
        yield srv


def _call(server, path: str, body=None, *, key: str | None = None, headers: dict | None = None, method: str | None = None):
    """(status, parsed body or text, headers) of one request to ``server``."""
    return call(server.url, path, body, key=key, headers=headers, method=method)


def _metrics(server) -> str:
    status, text, _ = _call(server, "/metrics", key=METRICS)
    assert status == 200
    return text


def _route_calls(marker: str) -> list[tuple[str, str, dict | None, bool]]:
    """(method, path, body, OpenAI-shaped errors) of every model route."""
    model = "rlvr_policy"
    return [
        ("POST", "/generate", {"prompt": f"{QUESTION} ({marker})", "num_rollouts": 1, "max_new_tokens": 4}, False),
        ("POST", "/solve", {"question": f"{QUESTION} ({marker})", "k": 1, "max_new_tokens": 4}, False),
        ("POST", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": marker}], "max_tokens": 4}, True),
        ("POST", "/v1/completions", {"model": model, "prompt": marker, "max_tokens": 4}, True),
        ("GET", "/v1/models", None, True),
        ("POST", "/tokenize", {"prompt": marker}, True),
        ("POST", "/detokenize", {"tokens": [1, 2]}, True),
        ("GET", "/tokenizer_info", None, True),
    ]


@pytest.mark.slow  # serves a Bento over HTTP
def test_every_model_route_answers_the_right_key_only(server):
    wrong = ALICE[:-1] + ("A" if ALICE[-1] != "A" else "B")
    for method, path, body, openai_shaped in _route_calls("routes"):
        refused = {
            "no key": _call(server, path, body, method=method),
            "a wrong key": _call(server, path, body, key=wrong, method=method),
            "another scheme": _call(server, path, body, headers={"Authorization": f"Basic {ALICE}"}, method=method),
            "the key in the query": _call(server, f"{path}?api_key={ALICE}&key={ALICE}", body, method=method),
            "the key in a cookie": _call(server, path, body, headers={"Cookie": f"api_key={ALICE}; key={ALICE}"}, method=method),
        }
        for how, (status, out, headers) in refused.items():
            assert status == 401, (path, how, out)
            assert headers["WWW-Authenticate"].startswith("Bearer"), (path, how)
            if openai_shaped:
                assert out["error"]["code"] == "invalid_api_key" and out["error"]["type"] == "invalid_request_error", (path, how, out)
            else:
                assert set(out) == {"error"} and isinstance(out["error"], str), (path, how, out)
        for key in (ALICE, BARE):
            status, out, _ = _call(server, path, body, key=key, method=method)
            assert status == 200, (path, out)
    # Nothing but the probes is open: the documentation and an unknown path take the key too.
    for path in ("/docs.json", "/", "/no-such-route"):
        assert _call(server, path)[0] == 401, path
    assert _call(server, "/docs.json", key=ALICE)[0] == 200


@pytest.mark.slow  # serves a Bento over HTTP
def test_probes_are_open_and_metrics_takes_its_own_token(server):
    for probe in ("/livez", "/healthz", "/readyz"):
        assert _call(server, probe)[0] == 200, probe
    assert _call(server, "/solve", {"question": "x", "k": 1, "max_new_tokens": 1})[0] == 401
    assert _call(server, "/metrics")[0] == 401
    assert _call(server, "/metrics", key=ALICE)[0] == 401  # an API key does not open /metrics once it has a token
    text = _metrics(server)
    assert metric_value(text, "rlvr_requests_total", endpoint="/solve", status="401") >= 1  # refusals are counted


@pytest.mark.slow  # serves a Bento over HTTP
def test_a_wrong_key_sharing_a_long_prefix_is_refused_like_any_other(server):
    """The HTTP sanity check of the constant-time match: the same answer, and no time difference beyond
    noise between a wrong key that shares all but its last character with the real one and one sharing
    nothing (medians of interleaved requests on one connection)."""
    near = ALICE[:-1] + ("A" if ALICE[-1] != "A" else "B")
    far = secrets.token_urlsafe(32)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    times = {near: [], far: []}
    answers = {near: set(), far: set()}
    try:
        for _ in range(150):
            for key in (near, far):
                started = time.perf_counter()
                conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
                response = conn.getresponse()
                body = response.read()
                times[key].append(time.perf_counter() - started)
                answers[key].add((response.status, body))
    finally:
        conn.close()
    assert answers[near] == answers[far] and len(answers[near]) == 1 and next(iter(answers[near]))[0] == 401
    near_s, far_s = statistics.median(times[near]), statistics.median(times[far])
    assert abs(near_s - far_s) < max(0.002, 0.3 * min(near_s, far_s)), (near_s, far_s)


@pytest.mark.slow  # serves a Bento over HTTP
def test_the_openai_client_works_with_its_api_key_and_fails_with_another(server):
    for key in (ALICE, BARE):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
        (model,) = client.models.list().data
        out = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "openai client"}], temperature=0, max_tokens=8)
        assert out.choices[0].message.content
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key=secrets.token_urlsafe(32), max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.completions.create(model=model.id, prompt="x", max_tokens=1)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


LM_EVAL_TASK = """task: keyed_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{question}}}}\\n"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["Q:"]
  do_sample: false
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow  # serves a Bento over HTTP
def test_lm_eval_local_completions_runs_with_the_api_key(server, tmp_path, monkeypatch):
    """lm-eval sends ``OPENAI_API_KEY`` with its completions and ``auth_token`` to the remote tokenizer."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (requirements.lock pins it)")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "keyed.jsonl"
    data.write_text("".join(json.dumps({"question": f"lm-eval {i}?", "answer": "2"}) + "\n" for i in range(2)))
    (tmp_path / "keyed.yaml").write_text(LM_EVAL_TASK.format(data=data))
    monkeypatch.setenv("OPENAI_API_KEY", ALICE)
    before = _metrics(server)
    out = simple_evaluate(
        model="local-completions",
        model_args={"model": "rlvr_policy", "base_url": f"{server.url}/v1/completions", "auth_token": ALICE, "max_retries": 1, "timeout": 120},
        tasks=["keyed_generation"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    assert len(out["samples"]["keyed_generation"]) == 2
    after = _metrics(server)
    for endpoint in ("/tokenize", "/v1/completions"):
        served = [metric_value(text, "rlvr_requests_total", endpoint=endpoint, status="200") for text in (before, after)]
        assert served[1] > served[0], endpoint
    records = [r for r in read_traffic(server.traffic_dir).records if r["prompt"].startswith("Q: lm-eval")]
    assert records and {r["api_key_id"] for r in records} == {"alice"}


@pytest.mark.slow  # serves a Bento over HTTP
def test_a_key_past_its_rate_gets_429_with_retry_after_in_each_shape(server):
    """bob's burst, then 429 (OpenAI's shape on /tokenizer_info, the native one on /solve); alice is not held up."""
    started, admitted = time.monotonic(), 0
    while True:
        status, out, headers = _call(server, "/tokenizer_info", key=BOB)
        if status != 200:
            break
        admitted += 1
        assert admitted <= BURST + RATE_PER_S * (time.monotonic() - started) + 1, "no 429 past the burst and the rate"
    assert status == 429 and admitted >= BURST
    assert out["error"]["code"] == "rate_limit_exceeded" and int(headers["Retry-After"]) >= 1
    status, out, headers = _call(server, "/solve", {"question": "x", "k": 1, "max_new_tokens": 1}, key=BOB)
    assert status == 429 and set(out) == {"error"} and "rate limit" in out["error"] and int(headers["Retry-After"]) >= 1
    assert _call(server, "/tokenizer_info", key=ALICE)[0] == 200
    wait_for(lambda: _call(server, "/tokenizer_info", key=BOB)[0] != 429, 10, "bob's bucket to refill")  # a token again within 1 / rate


def _open_stream(server, key: str) -> http.client.HTTPConnection:
    """A /v1/completions stream of many sampled tokens, its response started (so it holds its slots); not read."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    body = {"model": "rlvr_policy", "prompt": "stream", "max_tokens": 1024, "temperature": 1.0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    assert conn.getresponse().status == 200
    return conn


@pytest.mark.slow  # serves a Bento over HTTP
def test_a_key_past_its_share_of_the_engine_gets_429_and_others_are_served(server):
    streams = [_open_stream(server, CAROL) for _ in range(CONCURRENCY)]
    try:
        status, out, headers = _call(server, "/v1/completions", {"model": "rlvr_policy", "prompt": "x", "max_tokens": 1}, key=CAROL)
        assert status == 429 and out["error"]["code"] == "rate_limit_exceeded" and headers["Retry-After"] == "2", out
        assert f"{CONCURRENCY} requests in progress" in out["error"]["message"]
        status, out, headers = _call(server, "/generate", {"prompt": "x", "num_rollouts": 1, "max_new_tokens": 1}, key=CAROL)
        assert status == 429 and set(out) == {"error"} and headers["Retry-After"] == "2"
        assert _call(server, "/solve", {"question": "x", "k": 1, "max_new_tokens": 1}, key=ALICE)[0] == 200
    finally:
        for conn in streams:
            conn.close()  # the client hangs up: its rows stop and its slots free
    solve = {"question": "x", "k": 1, "max_new_tokens": 1}
    assert wait_for(lambda: (got := _call(server, "/solve", solve, key=CAROL)[0]) != 429 and got, 30, "carol's share to come back", 0.1) == 200


@pytest.mark.slow  # serves a Bento over HTTP
def test_traffic_log_holds_key_ids_never_keys(server):
    records = [r for r in read_traffic(server.traffic_dir).records if "(routes)" in r["prompt"] or r["prompt"] == "routes"]
    assert {r["endpoint"] for r in records} == {"/generate", "/solve", "/v1/chat/completions", "/v1/completions"}
    assert {r["api_key_id"] for r in records} == {"alice", BARE_ID}
    assert {traffic_row(r)["api_key_id"] for r in records} == {"alice", BARE_ID}
    written = b"".join(path.read_bytes() for path in Path(server.traffic_dir).glob("traffic-*.jsonl"))
    logged = server.log_path.read_text()
    for secret in (ALICE, BARE, BOB, CAROL, METRICS):
        assert secret.encode() not in written and secret not in logged
    assert f"API keys alice, {BARE_ID}, bob, carol; /metrics takes its own token" in logged
