"""What the agent retains of finished execs: never the result a connection is still waiting for,
and no more than its -R budget of the rest. The real static agent on the host (as in
test_agent.py), driven over its socket."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from dsec.agent import protocol as P
from dsec.agent.build import agent_binary
from dsec.agent.protocol import MsgType, Tag

from test_agent import Agent, run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="agent tests switch uids: run as root")

MB = 1 << 20


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory):
    return agent_binary(tmp_path_factory.mktemp("agent-bin"))


def exec_frame(chan: int, cmd: str, cap: int) -> bytes:
    fields = P.encode_fields([(Tag.CMD, cmd), (Tag.UID, 0), (Tag.GID, 0), (Tag.CAP, cap)])
    return P.encode_frame(MsgType.EXEC, chan, fields)


async def test_undelivered_results_are_never_evicted(agent_bin):
    """80 execs of 1 MiB output each finish while the edge is not reading (80 MiB > the 64 MiB
    retention budget): every one still delivers its whole output and its EXIT once the edge
    reads again. (The agent used to evict the oldest finished execs, delivered or not: their
    clients waited forever and ATTACH said ENOENT.)"""
    a = Agent(agent_bin)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(a.sock)
        n = 80
        s.sendall(b"".join(exec_frame(c, "head -c 1048576 /dev/zero", 2 * MB) for c in range(1, n + 1)))
        await asyncio.sleep(3)              # all finish meanwhile; the edge reads nothing
        s.settimeout(30)
        buf, exits, out = b"", {}, {c: 0 for c in range(1, n + 1)}
        deadline = time.monotonic() + 60
        while len(exits) < n and time.monotonic() < deadline:
            chunk = s.recv(1 << 20)
            assert chunk, "agent closed the connection"
            buf += chunk
            while len(buf) >= P.HEADER_SIZE:
                length, type_, chan = P.decode_header(buf[:P.HEADER_SIZE])
                if len(buf) < P.HEADER_SIZE + length:
                    break
                payload, buf = buf[P.HEADER_SIZE:P.HEADER_SIZE + length], buf[P.HEADER_SIZE + length:]
                assert type_ != MsgType.ERROR, P.decode_error(payload)
                if type_ == MsgType.STDOUT:
                    out[chan] += len(payload)
                elif type_ == MsgType.EXIT:
                    exits[chan] = P.decode_exit(payload)
        assert len(exits) == n, f"{n - len(exits)} execs never sent EXIT: {sorted(set(out) - set(exits))}"
        assert all(e.exit_code == 0 and e.stdout_total == MB for e in exits.values())
        assert set(out.values()) == {MB}
    finally:
        s.close()
        await a.stop()


async def test_retention_budget_keeps_the_newest(agent_bin):
    """-R bounds the output of finished, unreleased execs (the container driver sets it from
    the sandbox's memory): the oldest delivered ones go, the newest stay attachable."""
    a = Agent(agent_bin, extra=("-R", str(3 * MB)))
    try:
        c = await a.client()
        for chan in range(1, 11):       # delivered, never released (an edge that forgot to)
            out, _, ex = await run(c, chan, "head -c 1048576 /dev/zero")
            assert len(out) == MB and ex.exit_code == 0
        await asyncio.sleep(0.1)
        kept = sorted(ch for ch, done in await c.list_execs() if done)
        assert kept and len(kept) <= 3 and kept[-1] == 10, kept
        rss = a.rss_kib()
        assert rss < 8 * 1024, f"agent RSS {rss} KiB with a 3 MiB retention budget"
        c2 = await a.client()             # a new connection (edge restart) still gets the newest
        got = bytearray()
        async for item in c2.attach(10):
            if hasattr(item, "data"):
                got += item.data
        assert len(got) == MB
    finally:
        await a.stop()
