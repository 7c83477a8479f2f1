"""The apiserver's connection limits (issue 22, item 5), through the real server: a request
head must be complete within 10 s of its first byte, at most 256 connections per client
address (the 257th is answered 503 naming the limit), and nothing stays behind."""

from __future__ import annotations

import json
import os
import socket
import time

from dsec.apiserver.connections import HEADER_TIMEOUT_S, MAX_PER_CLIENT


def _open(server, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", server.port))
    return s


def _closed_within(s: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed `s` (EOF), None if it was still open after limit_s."""
    t0 = time.monotonic()
    s.settimeout(limit_s)
    try:
        while s.recv(4096):
            pass
    except (socket.timeout, TimeoutError):
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_and_slow_header_connections_are_closed(server):
    silent = _open(server, "127.0.0.61")
    slow = _open(server, "127.0.0.61")
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")        # never finishes its head
    t_slow = _closed_within(slow, HEADER_TIMEOUT_S + 10)
    t_silent = _closed_within(silent, 5)
    assert t_slow is not None and t_slow <= HEADER_TIMEOUT_S + 3, t_slow
    assert t_silent is not None
    # a complete request on a fresh connection is answered (the deadline is for the head only)
    ok = _open(server, "127.0.0.61")
    ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok.recv(4096).startswith(b"HTTP/1.1 200")
    for s in (silent, slow, ok):
        s.close()


def test_connections_per_client_address_are_capped(server):
    pid = server.proc.pid
    before = _fds(pid)
    held = [_open(server, "127.0.0.62") for _ in range(MAX_PER_CLIENT)]
    try:
        extra = _open(server, "127.0.0.62")
        head, _, body = extra.recv(65536).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        err = json.loads(body)["error"]
        assert err["field"] == "connections" and str(MAX_PER_CLIENT) in err["message"] and err["fix"]
        extra.close()
        # another address is not affected
        other = _open(server, "127.0.0.63")
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert other.recv(4096).startswith(b"HTTP/1.1 200")
        other.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while _fds(pid) > before + 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _fds(pid) <= before + 5, (before, _fds(pid))


ANYIO_THREADS = 40     # anyio's default thread limiter (FastAPI's sync dependencies run there)


def _threads(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


async def test_port_ingress_connects_use_a_bounded_number_of_threads(server, client):
    """A listener that never accepts (backlog full: each connect waits for its 5 s timeout):
    200 requests at once once started 200 threads; now at most MAX_CONNECT_THREADS run. (The
    server's other threads: anyio's worker threads for sync dependencies, at most 40, and
    asyncio's default executor.)"""
    import asyncio

    import httpx

    from dsec.backends.container.ports import MAX_CONNECT_THREADS
    async with await client.create_container(image="debian-python") as sb:
        await sb.run("nohup python3 -c \"import socket, time; s = socket.socket(); "
                     "s.bind(('127.0.0.1', 8009)); s.listen(0); time.sleep(600)\" >/dev/null 2>&1 &")
        await asyncio.sleep(1)
        pid = server.proc.pid
        base = _threads(pid)
        peak = base
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _threads(pid))
                await asyncio.sleep(0.05)

        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": f"Bearer {server.key}"},
                                     limits=httpx.Limits(max_connections=250)) as h:
            sampler = asyncio.create_task(sample())
            rs = await asyncio.gather(*(h.get(f"/v1/sandboxes/{sb.id}/ports/8009/") for _ in range(200)),
                                      return_exceptions=True)
            done.set()
            await sampler
        codes = [r.status_code for r in rs if isinstance(r, httpx.Response)]
        assert len(codes) == 200 and all(c != 500 for c in codes), rs[:3]
        assert peak <= base + MAX_CONNECT_THREADS + ANYIO_THREADS + 8, (base, peak)
