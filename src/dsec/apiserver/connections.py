"""Connection limits of the apiserver's HTTP/1.1 (uvicorn's h11 protocol, subclassed).

uvicorn bounds none of these, so 200 idle plus 200 slow-header connections with no key stayed
open for good (issue 22, item 5). Here:
  - a request's head (request line and headers) must be complete within HEADER_TIMEOUT_S of
    its first byte (of the connection, for the first request); else the connection is closed;
  - an idle kept-alive connection is closed after uvicorn's timeout_keep_alive (75 s, server.py);
  - at most MAX_PER_CLIENT connections per client address and MAX_CONNECTIONS in all: beyond,
    the connection is answered 503 (dsec's error body, naming the limit) and closed.
A connection upgraded to a WebSocket leaves the per-address count (uvicorn's WebSocket protocol
takes it over; the total still counts it).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from dsec.types import Unavailable

HEADER_TIMEOUT_S = 10.0
MAX_PER_CLIENT = 256
MAX_CONNECTIONS = 10_000


def _per_client(server_state: Any) -> Counter[str]:
    counts = getattr(server_state, "dsec_per_client", None)
    if counts is None:
        counts = server_state.dsec_per_client = Counter()
    return counts


def _refusal(why: str, field: str) -> bytes:
    body = json.dumps(Unavailable(why, field=field, fix="close idle connections, or retry in a moment").to_body())
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body.encode())


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and connection caps (module doc)."""

    _host: str | None = None
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:     # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else "unix"
        counts = _per_client(self.server_state)
        counts[host] += 1
        self._host = host
        if counts[host] > MAX_PER_CLIENT:
            self._refuse(f"this client ({host}) already holds {MAX_PER_CLIENT} connections", "connections")
        elif len(self.connections) > MAX_CONNECTIONS:
            self._refuse(f"the server already holds {MAX_CONNECTIONS} connections", "connections")
        else:
            self._arm_head_timer()

    def _refuse(self, why: str, field: str) -> None:
        self.transport.write(_refusal(why, field))
        self.transport.close()

    def _release(self) -> None:
        if self._host is not None:
            counts = _per_client(self.server_state)
            counts[self._host] -= 1
            if counts[self._host] <= 0:
                del counts[self._host]
            self._host = None
        self._disarm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._release()
        super().handle_websocket_upgrade(event)

    def data_received(self, data: bytes) -> None:
        between_requests = self.cycle is None or self.cycle.response_complete
        if between_requests and self._head_timer is None:
            self._arm_head_timer()            # the first bytes of the next request's head
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_timer()         # the head is complete: the app has the request

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
