"""The agent stub answers the real AgentClient as the agent would (docs/agent-protocol.md)."""

from __future__ import annotations

import asyncio
import errno
import signal

import pytest

from dsec.agent.client import AgentClient, AgentDisconnected, AgentError, Exit, Output
from dsec.testing.agent_stub import AgentStub

ME = {"uid": 1000, "gid": 1000}


async def run(agent: AgentClient, chan: int, cmd: str, **kw) -> tuple[bytes, bytes, Exit]:
    out, err = bytearray(), bytearray()
    async for item in agent.exec(chan, cmd=cmd, **ME, **kw):
        if isinstance(item, Output):
            (out if item.stream == "stdout" else err).extend(item.data)
        else:
            return bytes(out), bytes(err), item
    raise AssertionError("no EXIT")


async def collect(stream) -> tuple[bytes, bytes, Exit]:
    out, err = bytearray(), bytearray()
    async for item in stream:
        if isinstance(item, Output):
            (out if item.stream == "stdout" else err).extend(item.data)
        else:
            return bytes(out), bytes(err), item
    raise AssertionError("no EXIT")


async def test_ping_and_landlock(agent: AgentClient):
    await agent.ping()
    assert await agent.landlock_abi() == 0


async def test_exec_streams_env_and_cwd(agent: AgentClient, stub: AgentStub):
    out, err, ex = await run(agent, 1, "echo out; echo err >&2; echo $FOO; pwd; exit 3", env={"FOO": "bar"})
    assert out.splitlines() == [b"out", b"bar", str(stub.tree.root / "work").encode()]
    assert err == b"err\n"
    assert (ex.exit_code, ex.signal, ex.timed_out, ex.truncated) == (3, None, False, False)
    assert (ex.stdout_total, ex.stderr_total) == (len(out), 4)


async def test_timeout_kills_and_cap_truncates(agent: AgentClient):
    _, _, ex = await run(agent, 1, "sleep 5", timeout_ms=100)
    assert ex.timed_out and ex.signal == signal.SIGKILL and ex.exit_code is None
    out, _, ex = await run(agent, 2, "head -c 5000 /dev/zero", cap=1000)
    assert len(out) == 1000 and ex.truncated and ex.stdout_total == 5000


async def test_stdin_keep_stdin_and_signal(agent: AgentClient):
    out, _, _ = await run(agent, 1, "cat", stdin=b"hello")
    assert out == b"hello"
    follow = await agent.start_exec(2, cmd="cat", **ME, keep_stdin=True)
    await agent.send_stdin(2, b"abc")
    await agent.send_stdin(2, b"")
    out, _, ex = await collect(follow)
    assert out == b"abc" and ex.exit_code == 0
    follow = await agent.start_exec(3, cmd="sleep 5", **ME)
    await agent.signal(3, signal.SIGTERM)
    _, _, ex = await collect(follow)
    assert ex.signal == signal.SIGTERM


async def test_errors(agent: AgentClient):
    with pytest.raises(AgentError) as e:
        await run(agent, 2, "true", cwd="/missing")
    assert e.value.errno == errno.ENOENT
    with pytest.raises(AgentError) as e:
        await agent.refresh(seed=b"x", time_ns=1)
    assert e.value.errno == errno.EPERM


async def test_exec_on_running_chan_is_eexist(stub: AgentStub):
    a = await AgentClient.connect(stub.socket_path)
    follow = await a.start_exec(7, cmd="sleep 5", **ME)
    b = await AgentClient.connect(stub.socket_path)   # replaces a
    with pytest.raises(AgentError) as e:
        await run(b, 7, "true")
    assert e.value.errno == errno.EEXIST
    await b.signal(7, signal.SIGKILL)
    with pytest.raises(AgentDisconnected):
        await collect(follow)
    await a.close()
    await b.close()


async def test_files(agent: AgentClient, stub: AgentStub):
    await agent.write_file("d/e/f.txt", b"data", **ME, mode=0o600)
    assert (stub.tree.root / "work/d/e/f.txt").read_bytes() == b"data"
    assert await agent.read_file("/work/d/e/f.txt", **ME) == b"data"
    [entry] = await agent.list_dir("d/e", **ME)
    assert (entry.name, entry.kind, entry.mode, entry.size) == ("f.txt", "file", 0o600, 4)
    await agent.mkdir("/work/g/h", **ME)
    await agent.mkdir("/work/g/h", **ME)   # an existing directory is fine
    assert [e.kind for e in await agent.list_dir("g", **ME)] == ["dir"]
    for path, code in (("d", errno.EISDIR), ("nope", errno.ENOENT), ("../../x", errno.EACCES),
                       ("/../../etc/passwd", errno.EACCES)):
        with pytest.raises(AgentError) as e:
            await agent.read_file(path, **ME)
        assert e.value.errno == code, path
    (stub.tree.root / "work/out").symlink_to("/etc")
    with pytest.raises(AgentError) as e:
        await agent.list_dir("out", **ME)
    assert e.value.errno == errno.EACCES
    with pytest.raises(AgentError) as e:
        await agent.remove("d", **ME)
    assert e.value.errno == errno.ENOTEMPTY
    await agent.remove("d/e/f.txt", **ME)
    await agent.remove("out", **ME)   # the link, not /etc
    assert not (stub.tree.root / "work/out").is_symlink()
    with pytest.raises(AgentError) as e:
        await agent.read_file("big", **ME, maxlen=1)
    assert e.value.errno == errno.ENOENT
    await agent.write_file("big", b"12", **ME)
    with pytest.raises(AgentError) as e:
        await agent.read_file("big", **ME, maxlen=1)
    assert e.value.errno == errno.EFBIG


async def test_reconnect_lists_attaches_and_releases(stub: AgentStub):
    a = await AgentClient.connect(stub.socket_path)
    await a.start_exec(5, cmd="echo one; sleep 0.2; echo two >&2", **ME)
    await a.close()   # the edge goes away mid-command
    b = await AgentClient.connect(stub.socket_path)
    assert await b.list_execs() == [(5, False)]
    out, err, ex = await collect(b.attach(5))
    assert (out, err, ex.exit_code) == (b"one\n", b"two\n", 0)
    assert await b.list_execs() == [(5, True)]
    out, err, _ = await collect(b.attach(5))   # retained until RELEASE
    assert (out, err) == (b"one\n", b"two\n")
    await b.release(5)
    assert await b.list_execs() == []
    with pytest.raises(AgentError) as e:
        await collect(b.attach(5))
    assert e.value.errno == errno.ENOENT
    assert stub.connections == 2
    await b.close()


async def test_sessions(agent: AgentClient):
    _, _, ex = await run(agent, 1, "cd /tmp; export X=1", session="s")
    assert ex.exit_code == 0
    out, _, ex = await run(agent, 2, "echo $PWD $X; false", session="s")
    assert out == b"/tmp 1\n" and ex.exit_code == 1 and not ex.session_ended
    _, err, ex = await run(agent, 3, "if then", session="s")   # syntax error: session survives
    assert ex.exit_code == 2 and err
    out, _, _ = await run(agent, 4, "echo $X", session="s")
    assert out == b"1\n"
    follow = await agent.start_exec(5, cmd="sleep 5", **ME, session="s")
    with pytest.raises(AgentError) as e:
        await run(agent, 6, "true", session="s")
    assert e.value.errno == errno.EBUSY
    await agent.close_session("s")
    _, _, ex = await collect(follow)
    assert ex.session_ended and ex.signal == signal.SIGKILL
    out, _, ex = await run(agent, 7, "echo ${X:-fresh}; exit 4", session="s")
    assert out == b"fresh\n" and ex.exit_code == 4 and ex.session_ended
    _, _, ex = await run(agent, 8, "sleep 5", session="s", timeout_ms=100)
    assert ex.timed_out and ex.session_ended


async def test_stop_disconnects_and_kills(stub: AgentStub, agent: AgentClient):
    follow = await agent.start_exec(1, cmd="sleep 30", **ME)
    await asyncio.wait_for(stub.stop(), 5)
    with pytest.raises(AgentDisconnected):
        await collect(follow)
    assert not stub.socket_path.exists()
    with pytest.raises(AgentDisconnected):
        await AgentClient.connect(stub.socket_path, timeout=0.2)
