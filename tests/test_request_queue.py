"""Saturation without refusing what can be served (``bentos.admission``): past the engine's row slots a
request queues, and the guard refuses it (503, ``Retry-After``) only when its estimated start is past
the request timeout or every request slot, running or queued, is taken. In-process, around a stand-in app."""

from __future__ import annotations

import pytest

from bentos.admission import RequestSlots, max_requests_from_env, request_timeout_s
from bentos.api_keys import AccessConfig
from support.guard import guarded


def _slots(capacity: int = 4, wait_s: float = 0.0) -> RequestSlots:
    slots = RequestSlots(capacity)
    slots.loaded, slots.start_wait_s = True, lambda: wait_s
    return slots


def test_a_request_that_would_start_within_its_timeout_is_queued_not_refused():
    client = guarded(AccessConfig(), slots=_slots(wait_s=request_timeout_s() - 1))
    assert client.post("/solve", json={"question": "x"}).status_code == 200


def test_a_request_that_would_start_past_its_timeout_gets_503_with_retry_after():
    timeout_s = request_timeout_s()
    client = guarded(AccessConfig(), slots=_slots(wait_s=timeout_s + 40.2))
    out = client.post("/solve", json={"question": "x"})
    assert out.status_code == 503 and out.headers["retry-after"] == "41"  # when the queue ahead would let it start in time
    assert f"would start in about {timeout_s + 40:.0f} s, past the request timeout of {timeout_s:.0f} s" in out.json()["error"]
    openai = client.post("/v1/completions", json={"prompt": "x"})
    assert openai.status_code == 503 and openai.json()["error"]["code"] == "service_unavailable"


def test_refusing_past_the_timeout_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("RLVR_REFUSE_PAST_TIMEOUT", "0")
    client = guarded(AccessConfig(), slots=_slots(wait_s=request_timeout_s() + 100))
    assert client.post("/solve", json={"question": "x"}).status_code == 200


def test_every_request_slot_taken_gets_503_naming_them():
    slots = _slots(capacity=2)
    slots.in_flight = 2
    out = guarded(AccessConfig(), slots=slots).post("/solve", json={"question": "x"})
    assert out.status_code == 503 and out.headers["retry-after"] == "2"
    assert out.json()["error"] == "overloaded: all 2 request slots (running or queued) are taken"


@pytest.mark.parametrize("value", ["", "0", "-3", "many", "2.5"])
def test_a_bad_max_requests_setting_is_named(monkeypatch, value):
    monkeypatch.setenv("RLVR_MAX_REQUESTS", value)
    with pytest.raises(ValueError, match="RLVR_MAX_REQUESTS must be a whole number of requests, at least 1"):
        max_requests_from_env()
    monkeypatch.setenv("RLVR_MAX_REQUESTS", "12")
    assert max_requests_from_env() == 12
