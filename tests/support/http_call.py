"""One HTTP request to a served policy, as the API-key and usage tests send them."""

import json
import urllib.error
import urllib.request

REQUEST_TIMEOUT_S = 120


def call(url: str, path: str, body=None, *, key: str | None = None, headers: dict | None = None, method: str | None = None):
    """(status, parsed body or text, headers) of one request to ``url + path``, ``Authorization: Bearer key`` when given."""
    data = None if body is None else json.dumps(body).encode()
    sent = {**({"Content-Type": "application/json"} if data else {}), **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data else "GET"), headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            status, text, got = resp.status, resp.read().decode(), resp.headers
    except urllib.error.HTTPError as err:
        status, text, got = err.code, err.read().decode(), err.headers
    try:
        return status, json.loads(text), got
    except ValueError:
        return status, text, got
