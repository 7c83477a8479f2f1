"""PTY execs (protocol 3, issue 24 item 5): the real static agent on the host (as in
test_agent.py) runs a command on a terminal of its own, driven through the real client:
typed input, the terminal's size and its changes (SIGWINCH), signals, the end at hang-up, and
a flood of terminal output paced by credit instead of piling up in the edge."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from dsec.agent import protocol as P
from dsec.agent.build import agent_binary
from dsec.agent.client import EXEC_WINDOW, AgentError, Exit, Output

from test_agent import Agent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="agent tests switch uids: run as root")


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory):
    return agent_binary(tmp_path_factory.mktemp("agent-bin"))


class Term:
    """A PTY exec's output so far, and waiting for text in it."""

    def __init__(self, items):
        self.items = items
        self.buf = bytearray()
        self.exit: Exit | None = None

    async def expect(self, pattern: bytes, timeout: float = 10.0) -> re.Match:
        async def read() -> re.Match:
            while True:
                m = re.search(pattern, bytes(self.buf))
                if m:
                    del self.buf[:m.end()]
                    return m
                item = await self.items.__anext__()
                if isinstance(item, Output):
                    assert item.stream == "stdout"      # a terminal has one output
                    self.buf += item.data
                else:
                    self.exit = item
                    raise AssertionError(f"ended ({item}) before {pattern!r}; output: {bytes(self.buf)!r}")
        try:
            return await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"no {pattern!r} in {timeout} s; output: {bytes(self.buf)!r}") from None

    async def end(self, timeout: float = 10.0) -> Exit:
        async def read() -> Exit:
            async for item in self.items:
                if isinstance(item, Exit):
                    return item
                self.buf += item.data
            raise AssertionError("no exit")
        try:
            self.exit = self.exit or await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"no exit in {timeout} s; output: {bytes(self.buf)!r}") from None
        return self.exit


async def test_interactive_shell_on_a_terminal(agent_bin):
    a = Agent(agent_bin)
    try:
        c = await a.client()
        assert c.protocol_version >= P.PTY_VERSION
        t = Term(await c.start_exec(1, cmd="exec /bin/bash --norc -i", uid=0, gid=0, pty=(80, 24),
                                    env={"PS1": "$ "}))
        await c.send_stdin(1, b"echo $((6*7)) $TERM; tty; stty size\n")
        await t.expect(rb"42 xterm-256color\r\n/dev/pts/\d+\r\n24 80\r\n")
        await c.resize(1, 120, 40)
        await c.send_stdin(1, b"stty size\n")
        await t.expect(rb"[\r\n]40 120\r\n")
        # a trap on WINCH sees the change: the kernel signals the terminal's foreground group
        await c.send_stdin(1, b"trap 'echo winch $(stty size)' WINCH; sleep 5 & wait\n")
        await asyncio.sleep(0.5)
        await c.resize(1, 100, 30)
        await t.expect(rb"winch 30 100")
        await c.send_stdin(1, b"\x03")           # ^C: the line discipline signals the job
        await t.expect(rb"\^C")
        await asyncio.sleep(0.5)                  # readline redraws its line after ^C
        await c.send_stdin(1, b"exit 3\n")
        ex = await t.end()
        assert ex.exit_code == 3, (ex, bytes(t.buf))
    finally:
        await a.stop()


async def test_pty_signal_kill_and_hangup(agent_bin):
    a = Agent(agent_bin)
    try:
        c = await a.client()
        t = Term(await c.start_exec(1, cmd="echo ready; sleep 60", uid=0, gid=0, pty=(80, 24)))
        await t.expect(rb"ready")
        await c.signal(1, 9)
        ex = await t.end()
        assert ex.signal == 9
        # an empty STDIN (the edge's "close") does not hang the terminal up; ^D ends `cat`
        t = Term(await c.start_exec(2, cmd="cat; echo done", uid=0, gid=0, pty=(80, 24)))
        await c.send_stdin(2, b"")
        await c.send_stdin(2, b"abc\n")
        await t.expect(rb"abc\r\n")
        await c.send_stdin(2, b"\x04")
        await t.expect(rb"done")
        assert (await t.end()).exit_code == 0
        # bad sizes and PTY with a session are refused, naming the field
        with pytest.raises(AgentError, match="PTY"):
            async for _ in c.exec(3, cmd="true", uid=0, gid=0, pty=(0, 24)):
                pass
        with pytest.raises(AgentError, match="PTY is not supported with SESSION"):
            async for _ in c.exec(4, cmd="true", uid=0, gid=0, pty=(80, 24), session="s"):
                pass
    finally:
        await a.stop()


async def test_pty_runs_as_the_user_with_its_own_terminal(agent_bin):
    """The PTY child switches to the sandbox user like any exec and cannot open another exec's
    terminal (its slave is root's, 0620) nor reach the agent's master."""
    a = Agent(agent_bin)
    try:
        c = await a.client()
        root = Term(await c.start_exec(1, cmd="tty; sleep 30", uid=0, gid=0, pty=(80, 24)))
        other = (await root.expect(rb"(/dev/pts/\d+)\r\n")).group(1).decode()
        t = Term(await c.start_exec(2, cmd=f"id -u; tty; echo x > {other} && echo WROTE; ls -l /proc/1/fd/ 2>&1 | "
                                    "grep -c ptmx; echo end", uid=1000, gid=1000, pty=(80, 24)))
        m = await t.expect(rb"1000\r\n(/dev/pts/\d+)\r\n")
        assert m.group(1).decode() != other
        await t.expect(rb"end")
        assert b"WROTE" not in t.buf
        await t.end()
        await c.signal(1, 9)
        await root.end()
    finally:
        await a.stop()


def client_held(c, chan: int) -> int:
    q = c._queues[chan]
    return sum(len(item[1]) for item in list(q._queue) if isinstance(item, tuple))


async def test_pty_flood_is_paced_not_buffered(agent_bin):
    """A terminal that floods output nobody reads: the edge holds at most its window, the
    agent at most the exec's cap, and the program waits in write() (the kernel's tty buffer)
    instead of its output being dropped. Reading on then gets every byte, in order."""
    a = Agent(agent_bin)
    try:
        c = await a.client()
        total = 24 << 20
        cap = 1 << 20
        t = await c.start_exec(1, cmd=f"head -c {total} /dev/zero | tr '\\0' x; echo; echo END",
                               uid=0, gid=0, pty=(80, 24), cap=cap)
        first = await t.__anext__()
        rss0 = a.rss_kib()
        for _ in range(15):
            await asyncio.sleep(0.2)
            assert client_held(c, 1) <= EXEC_WINDOW
        assert a.rss_kib() - rss0 < 4 * 1024       # the agent: within its cap (and the queue)
        got = len(first.data)
        tail = bytearray()
        ex = None
        async for item in t:
            if isinstance(item, Output):
                got += len(item.data)
                tail = (tail + item.data)[-64:]
            else:
                ex = item
        assert ex is not None and ex.exit_code == 0 and not ex.truncated, ex
        assert got == total + len(b"\r\nEND\r\n"), got
        assert tail.endswith(b"x\r\nEND\r\n")
    finally:
        await a.stop()


async def test_agents_before_ptys_are_refused_by_name(agent_bin):
    """A sandbox started before PTYs (its agent's PONG says protocol 2) is not sent a PTY field
    it would ignore (the command would run without a terminal): refused, naming why."""
    a = Agent(agent_bin)
    try:
        c = await a.client()
        c.protocol_version = 2                 # as an older agent's PONG says
        with pytest.raises(AgentError, match="protocol 2, PTYs need 3"):
            await c.start_exec(1, cmd="true", uid=0, gid=0, pty=(80, 24))
        out = []
        async for item in c.exec(2, cmd="echo plain", uid=0, gid=0):   # the rest works as before
            out.append(item)
        assert out[0].data == b"plain\n" and out[-1].exit_code == 0
    finally:
        await a.stop()
