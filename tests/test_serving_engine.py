"""The served engine shares the model fairly and says when it cannot: a short request is answered within
seconds while maximum-cost ones run, ``/readyz`` is 503 while a new request would wait past its bound to
start, 200 again once it would not, and a request the engine's measured speed cannot finish within the
request timeout is refused up front. The scripted Bento (``support.served_bento``), served once more with a
0.5 s start-wait bound (and once with a 1 s request timeout)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.served_bento import KV_CACHE_BUDGET_MIB, LONG, QUESTION, SHORT_TIMEOUT_S, metric_value, scripted_bento, serving, traffic_records
from support.waiting import wait_for

pytestmark = [
    pytest.mark.slow,  # serves a Bento over HTTP
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.PydanticDeprecatedSince211"),
]

START_WAIT_BOUND_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    built = scripted_bento(tmp_path_factory)
    env = {"RLVR_KV_CACHE_BUDGET_MIB": str(KV_CACHE_BUDGET_MIB), "RLVR_READY_START_WAIT_S": str(START_WAIT_BOUND_S)}
    with serving(built, tmp_path_factory.mktemp("engine") / "server", batching=True, env=env) as srv:
        yield srv


def test_short_requests_are_answered_within_seconds_while_maximum_cost_ones_run(server):
    """Two requests at the KV budget's limit (k=8 x 1,024 tokens) and, meanwhile, greedy k=1 requests
    one after another: each short one is answered in a fraction of a long one's time, beside them."""
    long_body = {"question": f"{QUESTION} [long]", **LONG}
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        longs = [pool.submit(server.post_ok, "/solve", long_body) for _ in range(2)]
        short_s = []
        while not all(f.done() for f in longs) and len(short_s) < 5:
            asked = time.monotonic()
            out = server.post_ok("/solve", {"question": f"{QUESTION} [{len(short_s)}]", "k": 1, "max_new_tokens": 16})
            short_s.append(time.monotonic() - asked)
            assert out["k"] == 1
        assert all(len(f.result()["answers"]) == 8 for f in longs)
        long_s = time.monotonic() - started
    assert len(short_s) >= 2 and max(short_s) < long_s / 3, (short_s, long_s)
    metrics = server.metrics()
    assert metric_value(metrics, "rlvr_pass_requests_sum") > metric_value(metrics, "rlvr_pass_requests_count")  # shared steps
    # every /solve prompt starts with the same chat template and system prompt: later ones are not prefilled again
    assert 0 < metric_value(metrics, "rlvr_prompt_tokens_cached_total") < metric_value(metrics, "rlvr_prompt_tokens_total")


def test_readyz_is_503_while_a_new_request_would_wait_past_its_bound_and_200_after(server):
    body = json.dumps({"question": f"{QUESTION} [backlog]", **LONG}).encode()
    backlog = [server.open("/solve", body) for _ in range(6)]  # more than the KV budget runs at once
    try:
        wait_for(lambda: server.request("/readyz", timeout_s=2)[0] == 503, 20, "/readyz to say 503 under the backlog", interval_s=0.1)
        assert metric_value(server.metrics(), "rlvr_start_wait_estimate_seconds") > START_WAIT_BOUND_S
    finally:
        for sock in backlog:
            sock.close()  # hung up: their rows stop at the next step
    wait_for(lambda: server.request("/readyz", timeout_s=2)[0] == 200, 20, "ready again after the backlog left", interval_s=0.1)
    server.assert_ready()


def test_a_request_that_would_finish_past_the_timeout_gets_503_with_retry_after(server):
    """Long requests, one after another, queue until the next would start and run past the request
    timeout (300 s): that one is a 503 with Retry-After and the estimate at once, on either API, instead
    of a wait that would end in a 504. Once they leave, the service is ready again."""
    body = json.dumps({"question": f"{QUESTION} [flood]", **LONG}).encode()
    flood, refusal = [], None
    try:
        while refusal is None and len(flood) < 200:
            flood.append(server.open("/solve", body))
            flood[-1].settimeout(0.2)
            try:
                refusal = flood[-1].recv(65536).decode()
            except TimeoutError:
                pass  # queued
        assert refusal is not None, "200 long requests queued without one refused"
        flood[-1].settimeout(5)
        while "\r\n\r\n" not in refusal or len(refusal.partition("\r\n\r\n")[2]) < int(re.search(r"(?im)^content-length: *(\d+)", refusal)[1]):
            refusal += flood[-1].recv(65536).decode()  # the rest of the response
        head, _, payload = refusal.partition("\r\n\r\n")
        retry_after = re.search(r"(?im)^retry-after: *(\d+)", head)
        assert head.startswith("HTTP/1.1 503") and retry_after and int(retry_after[1]) >= 2, refusal
        # the handler's (start plus run) or, when a burst between two steps moved the start past it, the door's
        timing = r"(this request would start in about \d+ s and run about \d+ s|a new request would start in about \d+ s)"
        assert re.fullmatch(rf"overloaded: {timing}, past the request timeout of 300 s", json.loads(payload)["error"])
        assert len(flood) > 2  # the first ones were queued, not refused
        completion = {"prompt": QUESTION, "n": LONG["k"], "max_tokens": LONG["max_new_tokens"], "temperature": 1.0}
        status, text, headers = server.call("/v1/completions", completion)
        assert status == 503 and json.loads(text)["error"]["code"] == "service_unavailable" and int(headers["Retry-After"]) >= 2, text
    finally:
        for sock in flood:
            sock.close()
    wait_for(lambda: server.request("/readyz", timeout_s=2)[0] == 200, 30, "ready again after the flood left", interval_s=0.1)
    assert server.post_ok("/solve", {"question": QUESTION, "k": 1, "max_new_tokens": 4})["k"] == 1


def test_a_request_its_measured_speed_cannot_finish_in_time_is_refused_up_front(tmp_path_factory):
    """With a 1 s request timeout, k=8 x 1,024 new tokens (seconds of decoding) is a 400 naming
    ``max_new_tokens`` and the timeout, before any work; a small request still runs."""
    built = scripted_bento(tmp_path_factory)
    env = {"BENTOML_CONFIG_OPTIONS": f"services.rlvr_policy.traffic.timeout={SHORT_TIMEOUT_S}"}
    with serving(built, tmp_path_factory.mktemp("timeout") / "server", batching=True, env=env) as server:
        status, text = server.request("/solve", {"question": f"{QUESTION} [too long]", **LONG})
        assert status == 400, text
        assert "max_new_tokens" in text and "request timeout" in text and "measured" in text
        assert not traffic_records(server, "[too long]")  # refused before generation: no traffic record
        assert server.post_ok("/solve", {"question": QUESTION, "k": 1, "max_new_tokens": 8})["k"] == 1
