"""The gateway's connections, bounded before any request is read: how many at once, how
many from one address (before authentication: a caller without a key counts too), and
how long a connection may take to send a request's headers.

uvicorn alone holds a connection that sends half a request line for ever, and its
`limit_concurrency` only answers once a whole request came in, so 1,100 connections
that each send `GET /heal` and stop exhaust the process's open files and every other
caller gets "Server disconnected". `guarded_protocol(options)` is uvicorn's h11
protocol with three guards:

* past `max_connections` open connections, or `max_connections_per_address` from one
  client address, a new connection is answered 503 and closed at once;
* a connection has `header_timeout_s` from its first byte (or from its opening) to send
  a request's headers, whether first or the next on a kept-alive connection; past it,
  it is closed (uvicorn's `timeout_keep_alive` closes it when it sends nothing at all);
* header bytes are bounded by h11's `max_incomplete_event_size` (uvicorn's
  `h11_max_incomplete_event_size`), past which the request is a 400.

Bodies are bounded elsewhere (frontend.http.callers: per-caller shares of buffered body
bytes, and an idle timeout between chunks).
"""
from __future__ import annotations

import asyncio
import collections
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("diffslot.http")

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")


def _refusal(message: str) -> bytes:
    body = ('{"error": {"message": "%s", "type": "service_unavailable", "param": null, '
            '"code": "too_many_connections"}}' % message).encode()
    return _REFUSED % (len(body), body)


class ConnectionCounts:
    """Open connections, in all and per client address (shared by every protocol instance)."""

    def __init__(self) -> None:
        self.total = 0
        self.per_address: collections.Counter = collections.Counter()
        self.refused = 0
        self.header_timeouts = 0


def guarded_protocol(max_connections: int, max_connections_per_address: int, header_timeout_s: float,
                     counts: ConnectionCounts | None = None) -> type:
    """An h11 protocol class for uvicorn (`uvicorn.Config(http=...)`) with these bounds (0: none)."""
    counts = counts or ConnectionCounts()

    class GuardedH11Protocol(H11Protocol):
        connection_counts = counts

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._address = self.client[0] if self.client else "unknown"
            self._header_timer: asyncio.TimerHandle | None = None
            self._counted = False
            why = None
            if max_connections and counts.total >= max_connections:
                why = f"this server holds {counts.total} connections, its limit (--max-connections); retry shortly"
            elif max_connections_per_address and counts.per_address[self._address] >= max_connections_per_address:
                why = (f"this server holds {counts.per_address[self._address]} connections from your address, its "
                       f"limit (--max-connections-per-address); retry shortly")
            if why is not None:
                counts.refused += 1
                transport.write(_refusal(why))
                transport.close()
                return
            counts.total += 1
            counts.per_address[self._address] += 1
            self._counted = True
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._counted:
                self._counted = False
                counts.total -= 1
                counts.per_address[self._address] -= 1
                if counts.per_address[self._address] <= 0:
                    del counts.per_address[self._address]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and not self._in_request():  # the first bytes of a next request
                self._arm_header_timer()
            super().data_received(data)
            if self._in_request():
                self._cancel_header_timer()

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            if header_timeout_s > 0:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._in_request() or self.transport.is_closing():
                return
            counts.header_timeouts += 1
            self.transport.close()

    return GuardedH11Protocol


__all__ = ["ConnectionCounts", "guarded_protocol"]
