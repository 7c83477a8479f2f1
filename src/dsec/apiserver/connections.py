"""Connection limits of the apiserver's HTTP/1.1 (uvicorn's protocols, subclassed).

uvicorn bounds none of these, so 200 idle plus 200 slow-header connections with no key stayed
open for good (issue 22, item 5). Here:
  - a request's head (request line and headers) must be complete within HEADER_TIMEOUT_S of
    its first byte (of the connection, for the first request); else the connection is closed;
  - a request's head is at most MAX_HEAD_BYTES: beyond, it is answered 431 and the connection
    closed (h11 has its own 16 KiB cap, answered 400; httptools has none, D75);
  - an idle kept-alive connection is closed after uvicorn's timeout_keep_alive (75 s, server.py);
  - at most MAX_PER_CLIENT connections per client address and MAX_CONNECTIONS in all: beyond,
    the connection is answered 503 (dsec's error body, naming the limit) and closed.
A connection upgraded to a WebSocket leaves the per-address count (uvicorn's WebSocket protocol
takes it over; the total still counts it).

The server speaks through httptools (uvicorn's C parser: -0.15 ms of server CPU per request,
D75) when it is installed (a dependency of dsec-sandbox), else through h11: `server_protocol()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from dsec.types import DsecError, Unavailable

HEADER_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 64 * 1024
LINGER_S = 2.0          # after a 431: how long the rest of the head is read and dropped
MAX_PER_CLIENT = 256
MAX_CONNECTIONS = 10_000

log = logging.getLogger("dsec.apiserver")


class HeadTooLarge(DsecError):
    status, code = 431, "request_header_fields_too_large"


def _per_client(server_state: Any) -> Counter[str]:
    counts = getattr(server_state, "dsec_per_client", None)
    if counts is None:
        counts = server_state.dsec_per_client = Counter()
    return counts


def _answer(status: bytes, err: DsecError, extra: bytes = b"") -> bytes:
    body = json.dumps(err.to_body()).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n" + extra
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _refusal(why: str, field: str) -> bytes:
    return _answer(b"503 Service Unavailable",
                   Unavailable(why, field=field, fix="close idle connections, or retry in a moment"),
                   b"retry-after: 1\r\n")


HEAD_TOO_LARGE = _answer(b"431 Request Header Fields Too Large", HeadTooLarge(
    f"the request line and headers are larger than {MAX_HEAD_BYTES // 1024} KiB", field="headers",
    fix=f"send fewer or shorter headers (at most {MAX_HEAD_BYTES} bytes with the request line); "
        "large values belong in the request body"))


class _Guard:
    """The limits of the module doc, over either uvicorn protocol (a mixin placed first)."""

    _host: str | None = None
    _head_timer: asyncio.TimerHandle | None = None
    # supplied by the uvicorn protocol beside this mixin
    client: Any
    cycle: Any
    connections: Any
    loop: asyncio.AbstractEventLoop
    server_state: Any
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)                 # type: ignore[misc]
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
        super().connection_lost(exc)                       # type: ignore[misc]

    def handle_websocket_upgrade(self, *event: Any) -> None:   # h11 passes the request event
        self._release()
        super().handle_websocket_upgrade(*event)           # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        between_requests = self.cycle is None or self.cycle.response_complete
        if between_requests and self._head_timer is None:
            self._arm_head_timer()            # the first bytes of the next request's head
        self._parse(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_timer()         # the head is complete: the app has the request

    def _parse(self, data: bytes) -> None:
        super().data_received(data)                        # type: ignore[misc]

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


class GuardedH11Protocol(_Guard, H11Protocol):
    """uvicorn's h11 protocol with a header deadline and connection caps (module doc)."""


def _httptools_protocol() -> type[asyncio.Protocol] | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:                   # httptools not installed (a dependency: pip install -e .)
        return None

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol with the guard and a head-size cap (module doc).

        The parser is fed whole reads (asyncio: at most 256 KiB each) and keeps a header it is
        given until it is complete, so the cap is checked after each read: the bytes of the
        reads that began outside a body, since the last complete head. A read that ends a body
        and begins the next head (pipelining) is not counted: the cap may be passed by at most
        one read, never by a stream of them."""

        _in_body = False
        _head_bytes = 0

        def on_headers_complete(self) -> None:
            self._in_body, self._head_bytes = True, 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        _refused = False

        def _parse(self, data: bytes) -> None:
            if self._refused:
                return                        # draining what the client still sends: dropped
            if not self._in_body:
                self._head_bytes += len(data)
            super()._parse(data)
            if not self._in_body and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._head_too_large()

        def _head_too_large(self) -> None:
            # Half-close and drain for a moment rather than close at once: closing a socket with
            # unread bytes sends a reset, which can destroy the 431 before the client reads it.
            self._refused = True
            self.transport.write(HEAD_TOO_LARGE)
            if self.transport.can_write_eof():    # TLS cannot: the client closes on `connection: close`
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    return GuardedHttpToolsProtocol


GuardedHttpToolsProtocol = _httptools_protocol()


def server_protocol() -> type[asyncio.Protocol]:
    """The protocol class `dsec up` serves with: httptools when installed, else h11."""
    if GuardedHttpToolsProtocol is None:
        log.warning("httptools is not installed: serving HTTP with h11 (more CPU per request); "
                    "pip install httptools")
        return GuardedH11Protocol
    return GuardedHttpToolsProtocol
