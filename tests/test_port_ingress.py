"""Port ingress: HTTP and WebSocket to a port inside a sandbox through the apiserver
(/v1/sandboxes/{id}/ports/{port}/{path}), against a real server, real crun containers.

One module-scoped sandbox (default network: deny-all, loopback only) runs every server the
tests need, each bound to 127.0.0.1 inside it: python3 -m http.server, an echo server, a
WebSocket echo server and a malicious server sending endless response heads.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import httpx
import pytest
from conftest import stranger_key

from dsec import Client
from dsec.testing.waiting import wait_until

try:   # the [server] extra's WebSocket library (the server relays WebSockets with it too)
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, RejectConnection, TextMessage)
    from wsproto.events import Request as WsRequest
    HAVE_WSPROTO = True
except ImportError:
    HAVE_WSPROTO = False
needs_wsproto = pytest.mark.skipif(not HAVE_WSPROTO, reason="wsproto not installed: pip install -e '.[server]'")

FILES, ECHO, WS, EVIL = 8000, 8001, 8002, 8003
BIG_BYTES = 20 * 1024 * 1024

ECHO_SERVER = r'''
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def body(self):
        if self.headers.get("Transfer-Encoding") == "chunked":
            out = b""
            while True:
                n = int(self.rfile.readline().split(b";")[0], 16)
                if n == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(n)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))
    def reply(self, body, ctype):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Echo-Method", self.command)
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        self.reply(self.body(), "application/octet-stream")
    do_PUT = do_POST
    def do_GET(self):
        self.reply(json.dumps({"path": self.path, "headers": [[k.lower(), v] for k, v in self.headers.items()]}).encode(),
                   "application/json")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''

# The end of the raw-socket servers below: on 127.0.0.1:argv[1], a thread per connection runs run(c).
SERVE = r'''
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
while True:
    threading.Thread(target=run, args=(s.accept()[0],)).start()
'''

# A minimal RFC 6455 echo server (stdlib only). Its first message is the request head it got;
# "close-me" makes it close with 4002; pings are answered.
WS_SERVER = r'''
import base64, hashlib, socket, struct, sys, threading
def exact(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
def frame(op, data):
    n = len(data)
    ln = bytes([n]) if n < 126 else bytes([126]) + struct.pack("!H", n) if n < 65536 else bytes([127]) + struct.pack("!Q", n)
    return bytes([0x80 | op]) + ln + data
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    c.sendall(frame(1, head.split(b"\r\n\r\n")[0]))
    while True:
        b0, b1 = exact(c, 2)
        op, n = b0 & 15, b1 & 127
        if n == 126:
            n, = struct.unpack("!H", exact(c, 2))
        elif n == 127:
            n, = struct.unpack("!Q", exact(c, 8))
        mask = exact(c, 4) if b1 & 128 else b"\0\0\0\0"
        data = bytes(x ^ mask[i % 4] for i, x in enumerate(exact(c, n)))
        if op == 8:
            c.sendall(frame(8, data))
            return
        if op == 9:
            c.sendall(frame(10, data))
        elif data == b"close-me":
            c.sendall(frame(8, struct.pack("!H", 4002) + b"server says bye"))
        else:
            c.sendall(frame(op, data))
def run(c):
    try:
        serve(c)
    except Exception:
        pass
    c.close()
''' + SERVE

# Answers every request with a response head that never ends: one endless header line
# (/line) or endless small headers (/many); or (/hang) a chunked body that stops after its
# first chunk, the connection left open.
EVIL_SERVER = r'''
import socket, sys, threading, time
def run(c):
    try:
        req = c.recv(65536)
        c.sendall(b"HTTP/1.1 200 OK\r\n")
        if b" /hang" in req:
            c.sendall(b"Transfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            time.sleep(3600)
        if b" /line" in req:
            c.sendall(b"X-Endless: ")
            while True:
                c.sendall(b"a" * 65536)
        else:
            i = 0
            while True:
                c.sendall(b"".join(b"X-H%d: v\r\n" % (i + j) for j in range(4096)))
                i += 4096
    except OSError:
        pass
    c.close()
''' + SERVE


def _url(server, sandbox_id: str, port: int, path: str = "") -> str:
    return f"{server.url}/v1/sandboxes/{sandbox_id}/ports/{port}/{path}"


def _auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.key}"}


async def _wait_listening(http: httpx.AsyncClient, server, sandbox_id: str, port: int, path: str = "") -> None:
    async def listening() -> bool:
        return (await http.get(_url(server, sandbox_id, port, path), headers=_auth(server))).status_code != 503
    await wait_until(listening, timeout_s=10, what=f"port {port} in {sandbox_id} to listen")


@pytest.fixture(scope="module")
async def sb(server):
    """A debian-python sandbox (default deny-all network) running every test server."""
    async with Client(server.url, server.key) as c:
        box = await c.create_container(image="debian-python", memory_mb=512, ttl_idle_s=600)
        try:
            await box.run(f"head -c {BIG_BYTES} /dev/urandom > /work/big.bin && echo hello-from-sandbox > /work/hi.txt")
            for name, src in (("echo.py", ECHO_SERVER), ("ws.py", WS_SERVER), ("evil.py", EVIL_SERVER)):
                await box.files.write(f"/work/{name}", src)
            await box.start(f"python3 -m http.server {FILES} --bind 127.0.0.1 --directory /work", timeout_s=900)
            await box.start(f"python3 /work/echo.py {ECHO}", timeout_s=900)
            await box.start(f"python3 /work/ws.py {WS}", timeout_s=900)
            await box.start(f"python3 /work/evil.py {EVIL}", timeout_s=900)
            async with httpx.AsyncClient(timeout=30) as http:
                for port in (FILES, ECHO):
                    await _wait_listening(http, server, box.id, port)
            yield box
        finally:
            await box.stop()


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=60) as h:
        yield h


@pytest.fixture(scope="module")
def stranger(server) -> str:
    """A key of another, unrelated project."""
    return stranger_key(server, "ports-other")


# -- HTTP -------------------------------------------------------------------------------------
async def test_get_a_file_from_http_server(server, sb, http):
    r = await http.get(_url(server, sb.id, FILES, "hi.txt"), headers=_auth(server))
    assert r.status_code == 200, r.text
    assert r.content == b"hello-from-sandbox\n"
    assert r.headers["content-type"].startswith("text/plain")
    assert r.headers["content-length"] == str(len(b"hello-from-sandbox\n"))
    r = await http.get(_url(server, sb.id, FILES, "missing.txt"), headers=_auth(server))
    assert r.status_code == 404      # the sandbox server's own 404, passed through
    assert "error" not in r.text[:20]


async def test_path_query_and_headers_reach_the_sandbox_without_the_api_key(server, sb, http):
    r = await http.get(_url(server, sb.id, ECHO, "a/b%20c?x=1&y=%2F"),
                       headers={**_auth(server), "X-Api-Key": server.key, "X-Custom": "kept",
                                "X-Forwarded-For": "6.6.6.6", "Connection": "keep-alive, X-Hop", "X-Hop": "dropped"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["path"] == "/a/b%20c?x=1&y=%2F"
    headers = dict(body["headers"])
    assert "authorization" not in headers and "x-api-key" not in headers
    assert server.key not in r.text                       # the sandbox never sees the dsec key
    assert headers["host"] == f"localhost:{ECHO}"
    assert headers["x-custom"] == "kept" and "x-hop" not in headers
    # set once by the proxy (to the client address uvicorn reports; it trusts X-Forwarded-For
    # from loopback proxies itself)
    assert [k for k, _ in body["headers"]].count("x-forwarded-for") == 1
    assert headers["x-forwarded-proto"] == "http" and headers["x-forwarded-host"] == f"127.0.0.1:{server.port}"
    assert headers["x-forwarded-prefix"] == f"/v1/sandboxes/{sb.id}/ports/{ECHO}"
    assert r.headers["x-echo-method"] == "GET"


async def test_request_bodies_are_streamed_to_the_sandbox(server, sb, http):
    payload = os.urandom(700_000)
    r = await http.post(_url(server, sb.id, ECHO, "echo"), headers=_auth(server), content=payload)
    assert r.status_code == 200 and r.content == payload

    async def chunks():      # no Content-Length: forwarded chunked, as it arrives
        for i in range(0, len(payload), 50_000):
            yield payload[i:i + 50_000]
            await asyncio.sleep(0)
    r = await http.put(_url(server, sb.id, ECHO, "echo"), headers=_auth(server), content=chunks())
    assert r.status_code == 200 and r.content == payload
    assert r.headers["x-echo-method"] == "PUT"


async def test_large_response_is_streamed(server, sb, http):
    want = (await sb.run("sha256sum /work/big.bin")).stdout.split()[0]
    h, n = hashlib.sha256(), 0
    async with http.stream("GET", _url(server, sb.id, FILES, "big.bin"), headers=_auth(server)) as r:
        assert r.status_code == 200
        assert int(r.headers["content-length"]) == BIG_BYTES
        async for chunk in r.aiter_raw():
            h.update(chunk)
            n += len(chunk)
    assert (n, h.hexdigest()) == (BIG_BYTES, want)


async def test_nothing_listening_is_503_naming_the_port(server, sb, http):
    r = await http.get(_url(server, sb.id, 9, "x"), headers=_auth(server))
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["field"] == "port" and "port 9" in err["message"]


async def test_host_ports_are_not_reachable_through_the_sandbox(server, sb, http):
    # the apiserver listens on the host's 127.0.0.1:<port>; inside the sandbox's own network
    # namespace nothing does, so the connection is made there, not on the host
    r = await http.get(_url(server, sb.id, server.port, "healthz"), headers=_auth(server))
    assert r.status_code == 503, r.text
    assert f"port {server.port}" in r.json()["error"]["message"]


@pytest.mark.parametrize("port", ["0", "70000", "-1", "http"])
async def test_bad_ports_are_422(server, sb, http, port):
    r = await http.get(f"{server.url}/v1/sandboxes/{sb.id}/ports/{port}/", headers=_auth(server))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "port"


async def test_needs_a_key_and_the_callers_own_sandbox(server, sb, http, stranger):
    r = await http.get(_url(server, sb.id, FILES, "hi.txt"))
    assert r.status_code == 401 and "hello" not in r.text
    r = await http.get(_url(server, sb.id, FILES, "hi.txt"), headers={"Authorization": f"Bearer {stranger}"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["field"] == "sandbox_id" and "hello" not in r.text


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("kind", ["line", "many"])
async def test_endless_response_head_is_a_clean_502_in_bounded_memory(server, sb, http, kind):
    await _wait_listening(http, server, sb.id, EVIL, kind)
    before = _rss_kb(server.proc.pid)
    for _ in range(20):
        r = await http.get(_url(server, sb.id, EVIL, kind), headers=_auth(server))
        assert r.status_code == 502, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "bad_gateway" and err["field"] == "port"
    assert _rss_kb(server.proc.pid) - before < 30_000     # 64 KiB heads at most, not what was sent
    assert (await http.get(_url(server, sb.id, FILES, "hi.txt"), headers=_auth(server))).status_code == 200


async def test_a_caller_that_goes_away_frees_the_connection_into_the_sandbox(server, sb, http):
    """A response the sandbox never finishes lasts as long as the caller reads it; once the
    caller disconnects, the proxy closes its end (no ESTABLISHED connection left in the sandbox)."""
    established = ("python3 -c \"import sys; print(sum(1 for l in open('/proc/net/tcp') "
                   f"if l.split()[1].endswith(':{EVIL:04X}') and l.split()[3] == '01'))\"")
    async with http.stream("GET", _url(server, sb.id, EVIL, "hang"), headers=_auth(server)) as r:
        assert r.status_code == 200
        body = r.aiter_raw()          # (held: a dropped iterator closes the response)
        assert await body.__anext__() == b"first"
        assert (await sb.run(established)).stdout.strip() == "1"
    for _ in range(50):
        if (await sb.run(established)).stdout.strip() == "0":
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the proxy kept its connection into the sandbox after the caller left")


# -- WebSocket ----------------------------------------------------------------------------------
class WsClient:
    """A small wsproto client over an asyncio connection to the apiserver."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: "WSConnection"):
        self.reader, self.writer, self.conn = reader, writer, conn
        self.parts: list = []

    @classmethod
    async def open(cls, server, target: str, headers: dict[str, str]) -> "WsClient | RejectConnection":
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        conn = WSConnection(ConnectionType.CLIENT)
        writer.write(conn.send(WsRequest(host=f"127.0.0.1:{server.port}", target=target,
                                         extra_headers=[(k.encode(), v.encode()) for k, v in headers.items()])))
        while True:
            conn.receive_data(await asyncio.wait_for(reader.read(65536), 30) or None)
            for ev in conn.events():
                if isinstance(ev, AcceptConnection):
                    return cls(reader, writer, conn)
                if isinstance(ev, RejectConnection):
                    writer.close()
                    return ev

    async def send(self, data: str | bytes) -> None:
        self.writer.write(self.conn.send(TextMessage(data=data) if isinstance(data, str) else BytesMessage(data=data)))
        await self.writer.drain()

    async def recv(self) -> "str | bytes | CloseConnection":
        """The next whole message, or the close the other side sent."""
        while True:
            for ev in self.conn.events():
                if isinstance(ev, CloseConnection):
                    return ev
                if isinstance(ev, (TextMessage, BytesMessage)):
                    self.parts.append(ev.data)
                    if ev.message_finished:
                        msg = "".join(self.parts) if isinstance(ev, TextMessage) else b"".join(self.parts)
                        self.parts = []
                        return msg
            data = await asyncio.wait_for(self.reader.read(65536), 30)
            self.conn.receive_data(data or None)
            if not data:
                raise EOFError("connection closed without a close frame")

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.writer.write(self.conn.send(CloseConnection(code=code, reason=reason)))
        await self.writer.drain()


def _ws_target(sandbox_id: str, port: int, path: str = "ws") -> str:
    return f"/v1/sandboxes/{sandbox_id}/ports/{port}/{path}"


@needs_wsproto
async def test_websocket_echo_both_ways_and_close_codes(server, sb, http):
    await _wait_listening(http, server, sb.id, WS)     # (a plain GET there: the server drops it)
    ws = await WsClient.open(server, _ws_target(sb.id, WS, "ws?q=1"), _auth(server))
    assert isinstance(ws, WsClient), ws
    head = await ws.recv()            # the handshake the sandbox's server got
    assert isinstance(head, str) and head.startswith("GET /ws?q=1 HTTP/1.1")
    assert "authorization" not in head.lower() and server.key not in head
    assert f"localhost:{WS}" in head.lower()
    await ws.send("hello")
    assert await ws.recv() == "hello"
    blob = os.urandom(300_000)
    await ws.send(blob)
    assert await ws.recv() == blob
    await ws.send("close-me")          # the sandbox's server closes: its code and reason come through
    closed = await ws.recv()
    assert isinstance(closed, CloseConnection) and (closed.code, closed.reason) == (4002, "server says bye")
    ws.writer.close()

    ws = await WsClient.open(server, _ws_target(sb.id, WS), _auth(server))
    assert isinstance(ws, WsClient)
    await ws.recv()
    await ws.close(4001, "client says bye")
    closed = await ws.recv()
    assert isinstance(closed, CloseConnection) and closed.code == 4001
    ws.writer.close()


@needs_wsproto
async def test_websocket_refusals_close_with_a_reason(server, sb, stranger):
    """Refused before the relay starts: accepted, then closed with a code and the reason
    (1008: the caller's request; 1011: the sandbox's side)."""
    cases = [(WS, "ws", {}, 1008, "API key"),
             (WS, "ws", {"Authorization": f"Bearer {stranger}"}, 1008, "no sandbox"),
             (70000, "ws", _auth(server), 1008, "port 70000"),
             (9, "ws", _auth(server), 1011, "nothing listens on port 9"),
             (EVIL, "line", _auth(server), 1011, "invalid WebSocket handshake")]   # endless head
    for port, path, headers, code, words in cases:
        ws = await WsClient.open(server, _ws_target(sb.id, port, path), headers)
        assert isinstance(ws, WsClient), ws
        closed = await ws.recv()
        assert isinstance(closed, CloseConnection), closed
        assert closed.code == code and words in closed.reason, (port, closed)
        ws.writer.close()


# -- backends without port ingress ------------------------------------------------------------
async def test_vm_sandboxes_have_no_port_ingress(server, vm_client, http):
    vm = await vm_client.create_microvm(image="busybox", memory_mb=256)
    try:
        r = await http.get(_url(server, vm.id, 8000, ""), headers=_auth(server))
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["field"] == "backend" and "microvm" in err["message"]
    finally:
        await vm.stop()

