"""A header timeout for the HTTP server BentoML runs (uvicorn): a connection whose request headers are
not complete ``HEADER_TIMEOUT_S`` after it opened (or after its last response) is closed.

Uvicorn has no such timeout (its keep-alive timer stops at the first byte of a request), and an ASGI
middleware sees a request only once its headers are in, so a client sending part of its headers and
stopping would hold its connection forever. BentoML builds its ``uvicorn.Config`` with ``http="auto"``,
which uvicorn resolves to ``uvicorn.protocols.http.auto.AutoHTTPProtocol`` when the server starts:
:func:`install` replaces that name with a subclass that keeps the timer, before the worker's server
starts (the service module calls it on import).
"""

from __future__ import annotations

import asyncio

HEADER_TIMEOUT_S = 5.0


def with_header_timeout(protocol: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP ``protocol`` closing a connection whose request has not begun (its
    headers complete: uvicorn starts a new request cycle) within ``timeout_s`` of the timer's start."""

    class HeaderTimeoutProtocol(protocol):
        header_timeout_s = timeout_s

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request's headers, on a kept-alive connection

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue, self.cycle)

        def _headers_overdue(self, cycle_then) -> None:
            if self.cycle is cycle_then and not self.transport.is_closing():  # no request has begun since
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeoutProtocol


def install(timeout_s: float = HEADER_TIMEOUT_S) -> None:
    """Make uvicorn's automatic HTTP protocol the header-timed one (once per process)."""
    from uvicorn.protocols.http import auto

    if not getattr(auto.AutoHTTPProtocol, "header_timeout_s", None):
        auto.AutoHTTPProtocol = with_header_timeout(auto.AutoHTTPProtocol, timeout_s)
