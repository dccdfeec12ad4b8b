"""``bentos.admission.RequestGuard`` in-process, around a stand-in app: the way in without a model."""

from __future__ import annotations

from starlette.testclient import TestClient

from bentos.admission import RequestGuard, RequestSlots
from bentos.api_keys import Access, AccessConfig


def guarded(config: AccessConfig | None, reads: list | None = None, slots: RequestSlots | None = None) -> TestClient:
    """A TestClient of ``RequestGuard`` (``slots``, else 4 loaded ones; ``config``: its keys, None: not
    started) around an app answering 200 after reading the body; each ``receive`` the guard makes is
    counted in ``reads``."""

    async def stand_in(scope, receive, send):
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    if slots is None:
        slots = RequestSlots(4)
        slots.loaded = True
    access = Access()
    if config is not None:
        access.configure(config)
    guard = RequestGuard(stand_in, slots=slots, access=access)

    async def counting(scope, receive, send):
        async def counted():
            if reads is not None:
                reads.append(scope["path"])
            return await receive()

        await guard(scope, counted, send)

    return TestClient(counting)
