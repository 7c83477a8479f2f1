"""The apiserver's HTTP parser is httptools (D75), which bounds no request head by itself: a client
(or a sandbox's process that reaches a listener of the server) sending a huge head must get 431
and a closed connection, not make the server hold it; the server stays up, legitimate requests
(large bodies, a head just under the cap, pipelined requests) still pass. Over HTTPS too."""

from __future__ import annotations

import json
import socket
import ssl
import time

from dsec.apiserver.connections import MAX_HEAD_BYTES

MIB = 1 << 20


def _conn(port: int, tls: bool = False) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        s = ctx.wrap_socket(s)
    return s


def _send(s: socket.socket, data: bytes, chunk: int = 64 * 1024) -> None:
    """Send `data` in pieces; a server that refused the head may stop reading: not an error."""
    try:
        for i in range(0, len(data), chunk):
            s.sendall(data[i:i + chunk])
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
        pass


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, ssl.SSLError, TimeoutError):
        pass
    return out


def _status(resp: bytes) -> int:
    assert resp.startswith(b"HTTP/1.1 "), resp[:200]
    return int(resp[9:12])


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _huge_head_refused(port: int, tls: bool) -> None:
    s = _conn(port, tls)
    _send(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MIB + b"\r\n\r\n")
    resp = _read_all(s)
    s.close()
    assert _status(resp) == 431, resp[:300]
    head, _, body = resp.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["field"] == "headers" and str(MAX_HEAD_BYTES) in err["fix"], err


def _healthy(port: int, tls: bool = False) -> None:
    s = _conn(port, tls)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert _status(_read_all(s)) == 200
    s.close()


def test_huge_request_heads_are_refused_431_and_the_server_stays_up(server):
    pid = server.proc.pid
    maps = open(f"/proc/{pid}/maps").read()
    assert "httptools" in maps, "the server does not parse HTTP with httptools: pip install -e '.[server]'"
    rss0 = _rss_kib(pid)
    # one 1 MiB header value
    _huge_head_refused(server.port, tls=False)
    # many small headers, trickled in small pieces (each read alone is far under the cap)
    s = _conn(server.port)
    _send(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100)
                                                                    for i in range(4000)) + b"\r\n", chunk=1024)
    resp = _read_all(s)
    s.close()
    assert _status(resp) == 431, resp[:300]
    # 20 connections at once, 1 MiB each: the server keeps none of it
    socks = [_conn(server.port) for _ in range(20)]
    for s in socks:
        _send(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * MIB)
    for s in socks:
        assert _status(_read_all(s)) == 431
        s.close()
    assert _rss_kib(pid) - rss0 < 16 * 1024, (rss0, _rss_kib(pid))
    _healthy(server.port)
    # what is legitimate still passes: a head just under the cap, a 2 MiB body sent with its
    # head in one go (the body is not head), two requests pipelined in one write
    s = _conn(server.port)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Fit: "
              + b"c" * (MAX_HEAD_BYTES - 200) + b"\r\n\r\n")
    assert _status(_read_all(s)) == 200
    s.close()
    s = _conn(server.port)
    body = b"{" + b" " * (2 * MIB) + b"}"
    s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert _status(_read_all(s)) not in (431, 500)
    s.close()
    s = _conn(server.port)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    deadline, resp = time.monotonic() + 30, b""
    while resp.count(b"HTTP/1.1 200") < 2 and time.monotonic() < deadline:
        chunk = s.recv(65536)
        if not chunk:
            break
        resp += chunk
    assert resp.count(b"HTTP/1.1 200") == 2, resp
    s.close()


def test_huge_request_head_over_https_is_refused_431(server):
    https_port = int(server.env["DSEC_HTTPS_PORT"])
    _huge_head_refused(https_port, tls=True)
    _healthy(https_port, tls=True)
