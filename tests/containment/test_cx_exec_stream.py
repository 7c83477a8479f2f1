"""Exec streams that nobody reads (issue 22, item 3: per-channel credit). Four clients stream a
48 MiB exec each, one per sandbox, and then read nothing: before credit the edge queued every
frame the agent sent, so the apiserver grew by their whole output (~190 MiB here); now each chan
holds at most its window (EXEC_WINDOW) and the rest waits in the sandbox's own agent (charged to
the sandbox's memory), within the exec's cap. The sandboxes' other chans answer meanwhile, and
the slow streams still deliver every byte once read."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time

MB = 1 << 20
SIZE = 48 * MB


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _open_stream(server, sandbox_id: str, cmd: str) -> socket.socket:
    """An exec stream whose client then reads nothing (its receive buffer kept small)."""
    body = json.dumps({"cmd": cmd, "output_cap_bytes": 64 * MB, "timeout_s": 300}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(f"POST /v1/sandboxes/{sandbox_id}/exec/stream HTTP/1.1\r\nHost: x\r\n"
              f"Authorization: Bearer {server.key}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _read_all(s: socket.socket, timeout_s: float = 120) -> list[dict]:
    """The whole chunked NDJSON answer, as events."""
    s.settimeout(timeout_s)
    raw = bytearray()
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        raw += chunk
    head, _, rest = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    body, i = bytearray(), 0
    while True:                                 # de-chunk
        j = rest.index(b"\r\n", i)
        n = int(rest[i:j], 16)
        if n == 0:
            break
        body += rest[j + 2:j + 2 + n]
        i = j + 2 + n + 2
    return [json.loads(line) for line in body.splitlines() if line]


async def test_unread_exec_streams_stay_in_the_sandbox(server, cx):
    sbs = [await cx.create_container(image="busybox", cpu_cores=1, memory_mb=512) for _ in range(4)]
    try:
        pid = server.proc.pid
        await asyncio.sleep(1)
        rss0 = _rss_mib(pid)
        # each writes 48 MiB (of one letter: the stream's JSON stays that size), then its hash
        socks = [_open_stream(server, sb.id, f"head -c {SIZE} /dev/zero | tr '\\0' {c} > /tmp/o; cat /tmp/o; "
                                              f"sha256sum < /tmp/o >&2") for c, sb in zip("abcd", sbs)]
        peak = rss0
        t_end = time.monotonic() + 25
        while time.monotonic() < t_end:
            peak = max(peak, _rss_mib(pid))
            await asyncio.sleep(0.5)
        for sb in sbs:      # each wrote its whole output, and its other chans answer meanwhile
            assert (await asyncio.wait_for(sb.files.list("/tmp"), 10))[0].size == SIZE
        assert peak - rss0 <= 50, (rss0, peak)
        # reading on delivers each stream whole
        for c, s in zip("abcd", socks):
            events = await asyncio.to_thread(_read_all, s)
            s.close()
            stdout = "".join(ev["data"] for ev in events if ev["type"] == "stdout")
            stderr = "".join(ev["data"] for ev in events if ev["type"] == "stderr")
            exit_ = events[-1]
            assert exit_["type"] == "exit" and exit_["result"]["exit_code"] == 0, exit_
            assert exit_["result"]["stdout_bytes"] == SIZE and not exit_["result"]["truncated"]
            assert stdout == c * SIZE
            assert stderr.split()[0] == hashlib.sha256(c.encode() * SIZE).hexdigest()
    finally:
        for sb in sbs:
            await sb.stop()
