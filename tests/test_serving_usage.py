"""Serving usage per API key: each request's tokens and compute seconds in the traffic log, ``serving_traffic``
and ``/metrics``, and the daily token quota (``bentos.api_keys``, enforced by ``bentos.admission.RequestGuard``).

The rules on their own first (the settings, the UTC day, the quota's refusal, today's tokens read back from the
log), then the tiny scripted Bento served with two keys: alice with a quota smaller than one request, bob with
the default one; each route over real HTTP, the 429s, the warehouse's per-key daily totals, and a restarted
server that still refuses alice.
"""

from __future__ import annotations

import re
import secrets
import time
from datetime import datetime, timezone

import pytest

from bentos.api_keys import Access, AccessConfig, Caller, DailyTokens, KeyLimits, access_from_env, parse_keys, seconds_to_utc_midnight
from rlvr.monitoring.traffic import TrafficLog, read_traffic, request_tokens, tokens_by_key, traffic_row
from support.http_call import call
from support.served_bento import QUESTION, metric_value, scripted_bento, serving

pytestmark = [  # raised inside BentoML 1.4.39 itself
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

ALICE, BOB, METRICS = (secrets.token_urlsafe(32) for _ in range(3))
ALICE_DAILY_TOKENS = 20  # fewer than one /solve request's prompt in the chat template
DEFAULT_DAILY_TOKENS = 1_000_000
NOON = datetime(2026, 3, 4, 12, 0, tzinfo=timezone.utc).timestamp()


# ---------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------


def test_the_daily_token_quota_comes_from_the_environment():
    keys = {"RLVR_API_KEYS": f"alice:{ALICE},bob:{BOB}"}
    assert access_from_env(keys).limits.daily_tokens_of("alice") is None
    limits = access_from_env({**keys, "RLVR_DAILY_TOKENS_PER_KEY": "5000", "RLVR_DAILY_TOKENS_BY_KEY": " alice=20 "}).limits
    assert (limits.daily_tokens_of("alice"), limits.daily_tokens_of("bob"), limits.daily_tokens_of(None)) == (20, 5000, None)
    only_alice = access_from_env({**keys, "RLVR_DAILY_TOKENS_BY_KEY": "alice=20"})
    assert only_alice.limits.daily_tokens_of("bob") is None
    assert only_alice.summary().endswith("no daily token quota, alice 20")
    for env, problem in [
        ({"RLVR_DAILY_TOKENS_PER_KEY": "0"}, "RLVR_DAILY_TOKENS_PER_KEY must be a whole number of at least 1; got '0'"),
        ({"RLVR_DAILY_TOKENS_PER_KEY": "1e6"}, "RLVR_DAILY_TOKENS_PER_KEY must be a whole number"),
        ({"RLVR_DAILY_TOKENS_BY_KEY": "alice:20"}, "RLVR_DAILY_TOKENS_BY_KEY: each entry must be id=tokens"),
        ({"RLVR_DAILY_TOKENS_BY_KEY": "alice=20,alice=30"}, "each id once; got 'alice=30'"),
        ({"RLVR_DAILY_TOKENS_BY_KEY": "carol=20"}, "RLVR_DAILY_TOKENS_BY_KEY: 'carol' is not the id of a configured key"),
    ]:
        with pytest.raises(ValueError, match=problem.replace(".", r"\.")):
            access_from_env({**keys, **env})


def test_daily_tokens_start_again_at_each_utc_midnight():
    now = [NOON]
    tokens = DailyTokens(clock=lambda: now[0])
    tokens.add("alice", 30)
    tokens.add("alice", 12)
    tokens.add(None, 5)
    assert (tokens.used_today("alice"), tokens.used_today("bob"), tokens.used_today(None)) == (42, 0, 5)
    tokens.restore("2026-03-03", {"alice": 1000})  # yesterday's log: not today's usage
    assert tokens.used_today("alice") == 42
    tokens.restore("2026-03-04", {"alice": 8})
    assert tokens.used_today("alice") == 50
    now[0] += 12 * 3600 - 1  # 23:59:59 UTC
    assert tokens.used_today("alice") == 50 and seconds_to_utc_midnight(now[0]) == 1
    now[0] += 1
    assert tokens.used_today("alice") == 0 and tokens.today() == "2026-03-05"
    assert seconds_to_utc_midnight(now[0]) == 24 * 3600
    assert seconds_to_utc_midnight(NOON + 0.25) == 12 * 3600  # whole seconds, rounded up


def test_a_key_past_its_quota_is_refused_until_utc_midnight_and_others_are_not():
    limits = KeyLimits(daily_tokens=100, daily_tokens_by_key=(("alice", 10),))
    access = Access(tokens_today=DailyTokens(clock=lambda: NOON + 30))
    access.configure(AccessConfig(parse_keys(f"alice:{ALICE},bob:{BOB}", "keys"), None, limits))
    assert access.over_quota(Caller("alice")) is None
    access.tokens_today.add("alice", 10)
    access.tokens_today.add("bob", 99)
    refusal = access.over_quota(Caller("alice"))
    assert (refusal.status, refusal.code, refusal.retry_after_s) == (429, "insufficient_quota", 12 * 3600 - 30)
    assert refusal.detail == {"daily_token_quota": 10, "tokens_used_today": 10, "resets_at": "2026-03-05T00:00:00Z"}
    assert "10 of 10 tokens used today (UTC)" in refusal.message and "2026-03-05T00:00:00Z" in refusal.message
    assert access.over_quota(Caller("bob")) is None
    assert access.over_quota(Caller(None)) is None  # an open service meters no one


def test_todays_tokens_are_read_back_from_the_log_of_that_day(tmp_path):
    """Prompt + generated tokens of requests answered 200, by key; other days, other statuses, older
    records without usage and a line still being written are left out."""
    now = [NOON]
    log = TrafficLog(tmp_path, clock=lambda: int(now[0] * 1e9))
    usage = {"prompt_tokens": 30, "generated_tokens": 12, "compute_s": 0.5}
    log.append({"status": 200, "api_key_id": "alice", **usage})
    log.append({"status": 200, "api_key_id": "alice", **usage, "generated_tokens": 8})
    log.append({"status": 200, "api_key_id": None, **usage})
    log.append({"status": 504, "api_key_id": "alice", "error": "timed out"})
    log.append({"status": 200, "api_key_id": "bob"})  # written before records held their usage
    now[0] += 24 * 3600
    log.append({"status": 200, "api_key_id": "alice", **usage})  # the next day
    assert tokens_by_key(tmp_path, "2026-03-04") == {"alice": 80, None: 42}
    assert tokens_by_key(tmp_path, "2026-03-05") == {"alice": 42}
    with next(tmp_path.glob("traffic-20260305T*")).open("a") as f:
        f.write('{"status": 200, "api_key_id": "alice", "prompt_tokens": 5, "generated_tokens": 1')
    assert tokens_by_key(tmp_path, "2026-03-05") == {"alice": 42}
    rows = [traffic_row(r) for r in read_traffic(tmp_path, day="2026-03-04").records]
    assert [(r["prompt_tokens"], r["generated_tokens"], r["compute_s"]) for r in rows] == [
        (30, 12, 0.5),
        (30, 8, 0.5),
        (30, 12, 0.5),
        (None, None, None),
        (None, None, None),
    ]
    assert request_tokens({"status": 200, "prompt_tokens": True, "generated_tokens": 1}) is None  # not a count


# ---------------------------------------------------------------------------------------------
# The served Bento with keys and quotas
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return scripted_bento(tmp_path_factory)


KEYED_ENV = {
    "RLVR_API_KEYS": f"alice:{ALICE},bob:{BOB}",
    "RLVR_METRICS_TOKEN": METRICS,
    "RLVR_DAILY_TOKENS_PER_KEY": str(DEFAULT_DAILY_TOKENS),
    "RLVR_DAILY_TOKENS_BY_KEY": f"alice={ALICE_DAILY_TOKENS}",
    "RLVR_KV_CACHE_BUDGET_MIB": "4",
}


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    with serving(built, tmp_path_factory.mktemp("usage") / "server", batching=True, env=KEYED_ENV) as srv:
        yield srv


_call = call


def _metrics(url: str) -> str:
    status, text, _ = _call(url, "/metrics", key=METRICS)
    assert status == 200
    return text


def _requests(marker: str) -> dict[str, dict]:
    model = "rlvr_policy"
    return {
        "/generate": {"prompt": f"{QUESTION} ({marker})", "num_rollouts": 2, "max_new_tokens": 4},
        "/solve": {"question": f"{QUESTION} ({marker})", "k": 2, "max_new_tokens": 3},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": f"chat ({marker})"}], "max_tokens": 4, "n": 2},
        "/v1/completions": {"model": model, "prompt": [f"one ({marker})", f"two ({marker})"], "max_tokens": 3},
    }


@pytest.mark.slow  # serves a Bento over HTTP
def test_each_route_records_its_tokens_and_compute_seconds_per_key(server):
    before = _metrics(server.url)
    answers = {}
    for path, body in _requests("usage").items():
        status, out, _ = _call(server.url, path, body, key=BOB)
        assert status == 200, (path, out)
        answers[path] = out
    records = {r["endpoint"]: r for r in read_traffic(server.traffic_dir).records if "(usage)" in r["prompt"]}
    assert set(records) == set(answers)
    for path, record in records.items():
        assert record["api_key_id"] == "bob" and record["status"] == 200
        assert record["generated_tokens"] == sum(record["completion_tokens"]) > 0, path
        assert record["prompt_tokens"] > 0 and 0 < record["compute_s"] <= record["latency_s"], path
        row = traffic_row(record)
        assert (row["prompt_tokens"], row["generated_tokens"], row["compute_s"]) == (record["prompt_tokens"], record["generated_tokens"], record["compute_s"])
    assert records["/generate"]["generated_tokens"] == sum(r["completion_tokens"] for r in answers["/generate"]["rollouts"])
    for path in ("/v1/chat/completions", "/v1/completions"):  # what the client was told it used
        usage = answers[path]["usage"]
        assert (records[path]["prompt_tokens"], records[path]["generated_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"]), path
    after = _metrics(server.url)

    def delta(name: str) -> float:
        return metric_value(after, name, api_key_id="bob") - metric_value(before, name, api_key_id="bob")

    assert delta("rlvr_key_prompt_tokens_total") == sum(r["prompt_tokens"] for r in records.values())
    assert delta("rlvr_key_completion_tokens_total") == sum(r["generated_tokens"] for r in records.values())
    assert delta("rlvr_key_compute_seconds_total") == pytest.approx(sum(r["compute_s"] for r in records.values()), abs=1e-3)
    labels = {line.split('api_key_id="')[1].split('"')[0] for line in after.splitlines() if line.startswith("rlvr_key_")}
    assert labels <= {"alice", "bob"}  # configured key ids only


def _assert_alice_is_refused(url: str) -> None:
    status, out, headers = _call(url, "/solve", {"question": "quota", "k": 1, "max_new_tokens": 1}, key=ALICE)
    assert status == 429, out
    assert set(out) == {"error", "daily_token_quota", "tokens_used_today", "resets_at"}
    assert out["daily_token_quota"] == ALICE_DAILY_TOKENS and out["tokens_used_today"] >= ALICE_DAILY_TOKENS
    midnight = datetime.fromisoformat(out["resets_at"].replace("Z", "+00:00"))
    assert midnight.time() == datetime.min.time() and midnight.tzinfo is not None
    assert abs(int(headers["Retry-After"]) - (midnight.timestamp() - time.time())) < 60
    chat = {"model": "rlvr_policy", "messages": [{"role": "user", "content": "quota"}], "max_tokens": 1}
    status, out, headers = _call(url, "/v1/chat/completions", chat, key=ALICE)
    assert status == 429 and out["error"]["code"] == "insufficient_quota" and out["error"]["type"] == "invalid_request_error"
    assert f"of {ALICE_DAILY_TOKENS} tokens used today" in out["error"]["message"] and int(headers["Retry-After"]) >= 1
    assert _call(url, "/tokenize", {"prompt": "quota"}, key=ALICE)[0] == 200  # generating routes only
    assert _call(url, "/solve", {"question": "quota", "k": 1, "max_new_tokens": 1}, key=BOB)[0] == 200


@pytest.mark.slow  # serves a Bento over HTTP
def test_a_key_past_its_daily_quota_gets_429_until_midnight_and_another_key_is_served(server):
    status, out, _ = _call(server.url, "/solve", {"question": f"{QUESTION} (quota)", "k": 1, "max_new_tokens": 2}, key=ALICE)
    assert status == 200, out  # admitted with nothing used today; its prompt alone is past the quota
    refused_before = [r for r in read_traffic(server.traffic_dir).records if r["api_key_id"] == "alice"]
    _assert_alice_is_refused(server.url)
    assert [r for r in read_traffic(server.traffic_dir).records if r["api_key_id"] == "alice"] == refused_before  # refused before any work
    metrics = _metrics(server.url)
    assert metric_value(metrics, "rlvr_requests_total", endpoint="/solve", status="429") >= 1
    assert metric_value(metrics, "rlvr_key_prompt_tokens_total", api_key_id="alice") == refused_before[0]["prompt_tokens"]


@pytest.mark.slow  # serves a Bento over HTTP
def test_usage_per_key_and_day_adds_up_in_the_warehouse(server, tmp_path):
    from resources.warehouse import Warehouse

    for key in (ALICE, BOB):  # alice: served, or refused once her quota is used
        assert _call(server.url, "/solve", {"question": "anything", "k": 1, "max_new_tokens": 1}, key=key)[0] in (200, 429)
    batch = read_traffic(server.traffic_dir)
    warehouse = Warehouse(database=str(tmp_path / "rlvr.duckdb"), publish_snapshot=False)
    assert warehouse.ingest_traffic(batch) == len(batch.records)
    totals = warehouse.query(
        "SELECT api_key_id, strftime(timezone('UTC', \"timestamp\"), '%Y-%m-%d') AS day, count(*) AS requests, "
        "sum(prompt_tokens) AS prompt_tokens, sum(generated_tokens) AS generated_tokens, sum(compute_s) AS compute_s "
        "FROM serving_traffic WHERE status = 200 GROUP BY ALL ORDER BY api_key_id, day"
    )
    expected: dict[tuple, list] = {}
    for record in batch.records:
        if record["status"] == 200:
            day = datetime.fromisoformat(record["timestamp"]).astimezone(timezone.utc).date().isoformat()
            sums = expected.setdefault((record["api_key_id"], day), [0, 0, 0, 0.0])
            for i, value in enumerate((1, record["prompt_tokens"], record["generated_tokens"], record["compute_s"])):
                sums[i] += value
    got = {(r.api_key_id, r.day): [r.requests, r.prompt_tokens, r.generated_tokens, r.compute_s] for r in totals.itertuples()}
    assert set(got) == set(expected) and {key for key, _ in got} == {"alice", "bob"}
    for group, sums in expected.items():
        assert got[group][:3] == sums[:3] and got[group][3] == pytest.approx(sums[3]), group
    tokens = dict(zip(totals["api_key_id"], totals["prompt_tokens"] + totals["generated_tokens"]))
    assert tokens["alice"] >= ALICE_DAILY_TOKENS  # what refused her


@pytest.mark.slow  # serves a Bento over HTTP (twice)
def test_a_restarted_service_restores_todays_usage_from_its_log(server, built, tmp_path):
    _call(server.url, "/solve", {"question": f"{QUESTION} (restart)", "k": 1, "max_new_tokens": 1}, key=ALICE)  # used up either way
    env = {**KEYED_ENV, "RLVR_TRAFFIC_DIR": str(server.traffic_dir)}  # the first server's log
    with serving(built, tmp_path / "restarted", batching=True, env=env) as restarted:
        _assert_alice_is_refused(restarted.url)
        assert re.search(r"daily token quotas: \d+ tokens of [12] keys used today", restarted.log_path.read_text())
