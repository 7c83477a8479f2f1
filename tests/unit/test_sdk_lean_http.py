"""The SDK's lean HTTP/1.1 transport (dsec.sdk.lean_http) behaves as httpx's own: kept-alive
connections reused, a connection the server closed dropped or its loss raised as the error the
SDK retries on, timeouts and refused connects as httpx's errors, streamed bodies as they come,
the connection cap, and what it does not take (TLS, streamed uploads) handed to httpx. Against a
real HTTP/1.1 server on loopback (asyncio) whose behaviour each test scripts."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from dsec.sdk import lean_http
from dsec.sdk.client import Client

pytestmark = pytest.mark.skipif(not lean_http.available(), reason="httptools is not installed")

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    return head, await r.readexactly(n)


def _response(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(e + b"\r\n" for e in extra), body)


class Server:
    def __init__(self, handler: Handler):
        self.handler, self.connections, self.live, self.peak = handler, 0, 0, 0

    async def __aenter__(self) -> Server:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            self.live += 1
            self.peak = max(self.peak, self.live)
            try:
                await self.handler(r, w)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                self.live -= 1
                w.close()
        self.srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.srv.close()


def _client(url: str, **kw: object) -> httpx.AsyncClient:
    t = lean_http.LeanTransport(httpx.AsyncHTTPTransport(), **kw)     # type: ignore[arg-type]
    return httpx.AsyncClient(base_url=url, transport=t, timeout=httpx.Timeout(10.0))


async def _echo_forever(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        head, body = await _read_request(r)
        w.write(_response(b'{"path": "%s", "n": %d}' % (head.split(b" ")[1], len(body))))
        await w.drain()


async def test_keep_alive_reuses_one_connection_and_bodies_pass_both_ways():
    async with Server(_echo_forever) as s, _client(s.url) as h:
        for i in range(20):
            r = await h.post(f"/v1/x/{i}", content=b"a" * (i * 10_000))
            assert r.status_code == 200 and r.json() == {"path": f"/v1/x/{i}", "n": i * 10_000}
        big = await h.post("/big", content=b"b" * (3 << 20))       # a body over the write-at-once size
        assert big.json()["n"] == 3 << 20
        assert s.connections == 1


async def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async def one_then_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(_response(b"{}"))
        await w.drain()              # then closes (keep-alive ended, as uvicorn's after 75 s)
    async with Server(one_then_close) as s, _client(s.url) as h:
        for _ in range(3):
            assert (await h.post("/x", content=b"{}")).status_code == 200
            await asyncio.sleep(0.2)   # the close reaches the client
        assert s.connections == 3


async def test_a_lost_connection_raises_what_the_sdk_retries_on():
    async def drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)       # and closes without an answer
    async with Server(drop) as s, _client(s.url) as h:
        with pytest.raises(httpx.RemoteProtocolError):
            await h.post("/x", content=b"{}")
    # the SDK sends a GET again on it, within its retry window: the second connection answers
    calls = 0

    async def drop_first(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal calls
        head, _ = await _read_request(r)
        calls += 1
        if calls == 1:
            return
        w.write(_response(b'{"sandboxes": []}'))
        await w.drain()
        await _echo_forever(r, w)
    async with Server(drop_first) as s:
        c = Client(s.url, "k", autostart=False)
        c._ready = True
        try:
            assert await c.list() == []
            assert isinstance(c._http._transport, lean_http.LeanTransport)
        finally:
            await c.close()
        assert calls == 2


async def test_timeouts_and_refused_connects_are_httpx_errors():
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await asyncio.sleep(30)
    async with Server(silent) as s, _client(s.url) as h:
        with pytest.raises(httpx.ReadTimeout):
            await h.get("/x", timeout=0.5)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()                      # nothing listens there
    async with _client(f"http://127.0.0.1:{port}") as h:
        with pytest.raises(httpx.ConnectError):
            await h.get("/x")


async def test_a_streamed_response_arrives_as_it_is_sent():
    release = asyncio.Event()

    async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await release.wait()
        w.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await w.drain()
        await _echo_forever(r, w)
    async with Server(chunked) as s, _client(s.url) as h:
        async with h.stream("POST", "/stream", content=b"{}") as resp:
            it = resp.aiter_raw()
            assert await asyncio.wait_for(it.__anext__(), 10) == b"first"   # before the rest exists
            release.set()
            assert b"".join([c async for c in it]) == b"second"
        assert (await h.post("/after", content=b"")).json()["path"] == "/after"   # the same connection
        assert s.connections == 1


async def test_connections_are_capped_and_callers_wait_for_one():
    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(r)
            await asyncio.sleep(0.2)
            w.write(_response(b"{}"))
            await w.drain()
    async with Server(slow) as s, _client(s.url, max_connections=2) as h:
        rs = await asyncio.gather(*(h.get("/x") for _ in range(8)))
        assert all(r.status_code == 200 for r in rs)
        assert s.peak <= 2 and s.connections == 2
        with pytest.raises(httpx.PoolTimeout):
            await asyncio.gather(*(h.get("/x", timeout=httpx.Timeout(10.0, pool=0.05)) for _ in range(4)))


async def test_what_it_does_not_take_goes_to_httpx():
    seen: list[httpx.Request] = []

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return httpx.Response(200, json={})

    async def upload() -> AsyncIterator[bytes]:
        yield b"part"
    async with Server(_echo_forever) as s:
        t = lean_http.LeanTransport(Recording())
        async with httpx.AsyncClient(transport=t) as h:
            await h.get("https://127.0.0.1:1/tls")
            await h.post(f"{s.url}/upload", content=upload())
            await h.head(f"{s.url}/head")
            await h.get(f"{s.url}/mine")
    assert [r.url.path for r in seen] == ["/tls", "/upload", "/head"]


async def test_the_sdk_still_keeps_a_cookie_the_server_sets():
    async def sets(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(_response(b'{"sandboxes": []}', b"set-cookie: s=1; Path=/"))
        await w.drain()
        await _echo_forever(r, w)
    async with Server(sets) as s:
        c = Client(s.url, "k", autostart=False)
        c._ready = True
        try:
            await c.list()
            assert c._http.cookies.get("s") == "1"
        finally:
            await c.close()


def test_the_setting_picks_the_transport_and_a_bad_value_names_itself(monkeypatch):
    from dsec.types import InvalidArgument
    monkeypatch.setenv("DSEC_SDK_HTTP", "httpx")
    assert not isinstance(Client("http://127.0.0.1:1", "k")._http._transport, lean_http.LeanTransport)
    monkeypatch.setenv("DSEC_SDK_HTTP", "h2")
    with pytest.raises(InvalidArgument) as e:
        Client("http://127.0.0.1:1", "k")
    assert e.value.field == "DSEC_SDK_HTTP" and "lean" in (e.value.fix or "")
