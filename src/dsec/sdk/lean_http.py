"""A lean HTTP/1.1 transport for the SDK's httpx client: plain http://, bodies already in memory.

httpx's default transport (httpcore over anyio, h11's pure-Python parser) was most of the SDK's
CPU per call (issue 29 item 3, D75). This one keeps httpx's API (Client, Request, Response,
timeouts, streaming) and does the wire itself: an asyncio.Protocol per kept-alive connection,
responses parsed by httptools (C). What it does not take it hands to httpx's own transport,
unchanged: https:// (TLS), request bodies that are streams (uploads), and everything when
httptools is not installed. Proxies from the environment are httpx's mounts and never reach it.

Behaviour kept from httpcore: connect/read/write/pool timeouts raise httpx's timeout errors; a
connection the server closed before answering raises RemoteProtocolError, a reset ReadError,
a refused connect ConnectError (the SDK's retries key on these); idle connections expire after
KEEPALIVE_EXPIRY_S (the server keeps them 75 s) and are dropped when the server closed them;
at most `max_connections` at once (a pool timeout beyond).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

try:
    import httptools  # type: ignore[import-not-found, unused-ignore]
except ImportError:          # the SDK then uses httpx's transport alone
    httptools = None  # type: ignore[assignment, unused-ignore]

KEEPALIVE_EXPIRY_S = 5.0      # httpx's default keepalive_expiry
HIGH_WATER = 1 << 20          # buffered response body at which reading pauses (a stream's consumer is slow)


def available() -> bool:
    return httptools is not None


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 connection: parses responses as they arrive, one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.key: tuple[str, int] = ("", 0)
        self._reset_message()

    def _reset_message(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.head_done = False
        self.complete = False
        self.keep_alive = True
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport          # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP response: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and exc is None and not any(
                n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.headers):
            self.complete = True           # a body delimited by the connection's end
        if not self.complete:
            if exc is not None:
                self._fail(httpx.ReadError(str(exc) or type(exc).__name__))
            elif not self.head_done:
                self._fail(httpx.RemoteProtocolError("Server disconnected without sending a response."))
            else:
                self._fail(httpx.RemoteProtocolError("peer closed connection without sending complete message body"))
        self._wake()

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- the request side
    def _fail(self, e: Exception) -> None:
        if self.error is None:
            self.error = e

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until the parser made progress (head, body, end) or the connection failed."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise httpx.RemoteProtocolError("connection closed")
        w = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, w) if timeout is not None else None
        try:
            await w
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(httpx.ReadTimeout("timed out waiting for the server's response"))


class _Body(httpx.AsyncByteStream):
    """The response body, read as it arrives; the connection goes back to the pool at its end."""

    def __init__(self, pool: LeanTransport, conn: _Conn, read_timeout: float | None):
        self.pool, self.conn, self.read_timeout = pool, conn, read_timeout
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                break
            await conn.wait(self.read_timeout)
        await self.aclose()

    async def aclose(self) -> None:
        if self.done:
            return
        self.done = True
        conn = self.conn
        if conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            self.pool._release(conn)
        else:
            conn.close()
            self.pool._release(None)


class LeanTransport(httpx.AsyncBaseTransport):
    """httpx transport: module doc. `fallback` gets what this one does not take."""

    def __init__(self, fallback: httpx.AsyncBaseTransport, max_connections: int = 256):
        self.fallback = fallback
        self.max_connections = max_connections
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _takes(self, request: httpx.Request) -> bool:
        # HEAD: a response parser that is not told the method would wait for the body it announces
        return (request.url.scheme == "http" and request.method != "HEAD"
                and isinstance(request.stream, httpx.ByteStream) and "transfer-encoding" not in request.headers)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._takes(request):
            return await self.fallback.handle_async_request(request)
        timeouts = request.extensions.get("timeout", {})
        url = request.url
        key = (url.host, url.port or 80)
        conn = await self._acquire(key, timeouts)
        try:
            target = url.raw_path
            head = [request.method.encode(), b" ", target, b" HTTP/1.1\r\n"]
            for name, value in request.headers.raw:
                head += [name, b": ", value, b"\r\n"]
            head.append(b"\r\n")
            body = request.content
            assert conn.transport is not None
            conn.transport.write(b"".join(head) + body if len(body) < 65536 else b"".join(head))
            if len(body) >= 65536:
                conn.transport.write(body)
            read_t = timeouts.get("read")
            while not conn.head_done:
                await conn.wait(read_t)
        except BaseException:
            conn.close()
            self._release(None)
            raise
        return httpx.Response(conn.status, headers=conn.headers, stream=_Body(self, conn, read_t),
                              extensions={"http_version": b"HTTP/1.1"}, request=request)

    async def _acquire(self, key: tuple[str, int], timeouts: dict[str, Any]) -> _Conn:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:             # the client moved to another loop (a new thread's)
            self._loop, self._idle, self._active, self._waiters = loop, {}, 0, collections.deque()
        while self._active >= self.max_connections:
            w = loop.create_future()
            self._waiters.append(w)
            try:
                async with asyncio.timeout(timeouts.get("pool")):
                    await w
            except BaseException as e:
                if w.done() and not w.cancelled():
                    self._wake_one()          # woken, then cancelled: the free slot goes to the next
                w.cancel()
                if isinstance(e, TimeoutError):
                    raise httpx.PoolTimeout("no free connection in the SDK's pool") from None
                raise
        self._active += 1
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_EXPIRY_S:
                conn._reset_message()
                return conn
            conn.close()
        try:
            return await self._connect(loop, key, timeouts.get("connect"))
        except BaseException:
            self._release(None)
            raise

    async def _connect(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int], timeout: float | None) -> _Conn:
        conn = _Conn(loop)
        conn.key = key
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: conn, key[0], key[1])
        except TimeoutError:
            conn.close()
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except (OSError, ssl.SSLError) as e:
            raise httpx.ConnectError(str(e)) from e
        return conn

    def _release(self, conn: _Conn | None) -> None:
        if conn is not None:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, []).append(conn)
        self._active -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        """Wake one caller waiting for a free connection."""
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                break

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle = {}
        await self.fallback.aclose()

