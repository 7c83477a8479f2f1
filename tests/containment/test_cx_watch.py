"""Directory watches that nobody reads (issue 22, item 3): four watch clients that never read,
plus a rename loop in a 1-core sandbox, grew the apiserver by 1.27 GB in 36 s (every frame was
queued per channel). Each watch now holds at most 1 MiB of unread events and then ends with an
`overflow` event; a sandbox holds at most 16 watches (the agent's limit)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

MAX_WATCHES_PER_SANDBOX = 16      # the agent's own limit (dsec-agent.c)


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _open_watch(server, sandbox_id: str, path: str) -> socket.socket:
    """A watch request whose client then reads nothing (its receive buffer kept small)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(f"GET /v1/sandboxes/{sandbox_id}/files/watch?path={path}&recursive=true HTTP/1.1\r\n"
              f"Host: x\r\nAuthorization: Bearer {server.key}\r\n\r\n".encode())
    return s


def _refusal(s: socket.socket, timeout_s: float = 30) -> str:
    """A whole non-streamed answer (head and its content-length body)."""
    s.settimeout(timeout_s)
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def _drain(s: socket.socket, timeout_s: float = 60) -> bytes:
    s.settimeout(timeout_s)
    out = b""
    while True:
        chunk = s.recv(1 << 20)
        if not chunk:
            return out
        out += chunk
        if out.endswith(b"0\r\n\r\n"):        # the chunked body's end: the watch ended
            return out


async def test_unread_watches_stay_bounded_and_end_with_overflow(server, cx):
    sb = await cx.create_container(image="busybox", cpu_cores=1)
    try:
        await sb.run("mkdir -p /work/w")
        pid = server.proc.pid
        socks = [_open_watch(server, sb.id, "/work/w") for _ in range(4)]
        await asyncio.sleep(1)
        rss0 = _rss_mib(pid)
        a, b = "a" * 200, "b" * 200            # long names: ~220 bytes an event
        await sb.run(f"touch /work/w/{a} && (sh -c 'while true; do mv /work/w/{a} /work/w/{b}; "
                     f"mv /work/w/{b} /work/w/{a}; done' >/dev/null 2>&1 &)")
        assert (await sb.run("sleep 1; ps | grep -c 'while true'")).stdout.strip() != "1"   # the loop runs
        peak = rss0
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end:
            peak = max(peak, _rss_mib(pid))
            await asyncio.sleep(0.5)
        assert peak - rss0 <= 50, (rss0, peak)
        # the sandbox holds 4 watches: 12 more fit, the 17th is refused naming the limit
        more = [_open_watch(server, sb.id, "/work") for _ in range(MAX_WATCHES_PER_SANDBOX - 4)]
        await asyncio.sleep(1)
        extra = _open_watch(server, sb.id, "/work")
        head = await asyncio.to_thread(_refusal, extra)
        assert head.startswith("HTTP/1.1 429"), head[:300]
        assert '"field":"path"' in head.replace(" ", "") and "too many directory watches" in head
        extra.close()
        await sb.run("pkill -f 'mv /work/w' || true", user="root")
        # read what a slow watch kept: it ended with an overflow, after at most ~1 MiB of events
        body = await asyncio.to_thread(_drain, socks[0])
        lines = [ln for ln in body.split(b"\r\n") if ln.startswith(b"{")]
        assert json.loads(lines[-1])["type"] == "overflow", lines[-3:]
        for s in socks + more:
            s.close()
    finally:
        await sb.stop()


async def test_a_project_holds_at_most_256_watches_per_node(server, tmp_path):
    """16 sandboxes of one project with 16 watches each: the next watch, in a 17th sandbox of
    that project, is refused naming the project's limit; another project's is not."""
    from conftest import stranger_key

    from dsec.edge.edge import MAX_WATCHES_PER_PROJECT
    from dsec.sdk.client import Client
    key, other_key = stranger_key(server, "cx-watch-a"), stranger_key(server, "cx-watch-b")
    per_sandbox = MAX_WATCHES_PER_SANDBOX
    n = MAX_WATCHES_PER_PROJECT // per_sandbox
    socks: list[socket.socket] = []

    def watch(sandbox_id: str, api_key: str, source: str) -> socket.socket:
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", server.port))
        s.sendall(f"GET /v1/sandboxes/{sandbox_id}/files/watch?path=/tmp HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {api_key}\r\n\r\n".encode())
        return s

    def first_line(s: socket.socket) -> str:
        s.settimeout(30)
        return s.recv(65536).decode(errors="replace")

    async with Client(server.url, api_key=key) as c, Client(server.url, api_key=other_key) as o:
        sbs = [await c.create_container(image="busybox") for _ in range(n + 1)]
        theirs = await o.create_container(image="busybox")
        try:
            for i, sb in enumerate(sbs[:n]):
                socks += [watch(sb.id, key, f"127.0.1.{i + 1}") for _ in range(per_sandbox)]
            heads = await asyncio.gather(*(asyncio.to_thread(first_line, s) for s in socks))
            assert all(h.startswith("HTTP/1.1 200") for h in heads), [h[:200] for h in heads if "200" not in h][:2]
            extra = watch(sbs[n].id, key, "127.0.1.200")
            head = await asyncio.to_thread(_refusal, extra)
            assert head.startswith("HTTP/1.1 429") and str(MAX_WATCHES_PER_PROJECT) in head, head[:300]
            extra.close()
            ok = watch(theirs.id, other_key, "127.0.1.201")
            assert (await asyncio.to_thread(first_line, ok)).startswith("HTTP/1.1 200")
            ok.close()
        finally:
            for s in socks:
                s.close()
            for sb in sbs + [theirs]:
                await sb.stop()
