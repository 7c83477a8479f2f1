"""Per-exec output credit (protocol 2, issue 22 item 3): a slow reader of one exec's output holds
at most EXEC_WINDOW of it in the edge's memory, and it never holds up the connection's other
chans. The real static agent on the host (as in test_agent.py), driven through the real client.
Before credit the client queued every frame the agent sent: a 48 MiB output nobody read sat in
the edge's memory, whole."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from dsec.agent import protocol as P
from dsec.agent.build import agent_binary
from dsec.agent.client import EXEC_WINDOW, Exit, Output

from test_agent import Agent, run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="agent tests switch uids: run as root")

MB = 1 << 20


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory):
    return agent_binary(tmp_path_factory.mktemp("agent-bin"))


def held(client, chan: int) -> int:
    """Output bytes waiting unread in the client's queue of `chan`."""
    q = client._queues[chan]
    return sum(len(item[1]) for item in list(q._queue) if isinstance(item, tuple))


async def test_unread_exec_output_waits_in_the_agent_not_the_edge(agent_bin):
    a = Agent(agent_bin)
    try:
        c = await a.client()
        assert c.protocol_version >= P.CREDIT_VERSION and c.credit
        f = a.root / "out.bin"      # 48 MiB, then its hash on stderr
        cmd = f"head -c 50331648 /dev/urandom > {f}; cat {f}; sha256sum < {f} >&2"
        slow = await c.start_exec(1, cmd=cmd, uid=0, gid=0, cap=64 * MB)
        first = await slow.__anext__()         # read one frame, then nothing for a while
        assert isinstance(first, Output) and first.stream == "stdout"
        for _ in range(30):                    # the command has written all 48 MiB by now
            await asyncio.sleep(0.2)
            assert held(c, 1) <= EXEC_WINDOW, held(c, 1)
        # the connection's other chans are not held up by the one nobody reads
        out, _, ex = await asyncio.wait_for(run(c, 2, "echo other"), 10)
        assert (out, ex.exit_code) == (b"other\n", 0)
        listing = await asyncio.wait_for(c.list_dir("/", uid=0, gid=0), 10)
        assert listing
        # reading on gets every byte, in order, then the exit
        stdout, stderr, exit_ = bytearray(first.data), bytearray(), None
        async for item in slow:
            if isinstance(item, Output):
                (stdout if item.stream == "stdout" else stderr).extend(item.data)
            else:
                assert isinstance(item, Exit)
                exit_ = item
        assert exit_ is not None and exit_.exit_code == 0 and not exit_.truncated
        assert len(stdout) == 48 * MB
        assert hashlib.sha256(stdout).hexdigest() == stderr.split()[0].decode()
    finally:
        await a.stop()


async def test_a_follower_that_lets_go_does_not_strand_the_exec(agent_bin):
    """A follower that stops reading (an HTTP client gone) lets go of the chan: the agent sends the
    rest unpaced, the exec ends and is listed finished (evictable as before), and its output can
    still be replayed by ATTACH."""
    a = Agent(agent_bin)
    try:
        c = await a.client()
        stream = await c.start_exec(1, cmd="head -c 8388608 /dev/zero", uid=0, gid=0, cap=16 * MB)
        await stream.__anext__()
        await stream.aclose()                  # the follower goes away without reading on
        for _ in range(100):
            if (1, True) in await c.list_execs():
                break
            await asyncio.sleep(0.1)
        assert (1, True) in await c.list_execs()
        total, exit_ = 0, None
        async for item in c.attach(1):
            if isinstance(item, Output):
                total += len(item.data)
            else:
                exit_ = item
        assert total == 8 * MB and exit_ is not None and exit_.exit_code == 0
    finally:
        await a.stop()


async def test_an_agent_without_credit_is_driven_unpaced(agent_bin):
    """An edge talking to an agent of protocol 1 (a sandbox made before) sends no WINDOW and no
    CREDIT frames (which such an agent would answer with ERROR): output flows as before."""
    a = Agent(agent_bin)
    try:
        c = await a.client()
        c.protocol_version = 1                 # as an older agent's PONG says
        assert not c.credit
        out, err, ex = await run(c, 1, "head -c 3000000 /dev/zero; echo done >&2", cap=4 * MB)
        assert (len(out), err, ex.exit_code) == (3000000, b"done\n", 0)
        assert 1 not in c._queues
    finally:
        await a.stop()
