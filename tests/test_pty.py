"""PTY execs through dsec's own SDKs against a real server (issue 24 item 5): `sb.pty()` (async)
and its generated blocking twin: typed input, output bytes, resize, signals, the end; the
request errors name the field."""

from __future__ import annotations

import asyncio
import re

import pytest

from dsec import ContainerArgs, SyncClient
from dsec.types import Conflict, ExecRequest


@pytest.fixture
async def sb(client):
    sandbox = await client.create_container(ContainerArgs(image="busybox", ttl_idle_s=300))
    yield sandbox
    await sandbox.stop()


async def expect(out, buf: bytearray, pattern: bytes, timeout: float = 20.0) -> re.Match:
    async def read() -> re.Match:
        while not (m := re.search(pattern, bytes(buf))):
            buf.extend(await anext(out))
        del buf[:m.end()]
        return m
    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"no {pattern!r} in {timeout} s: {bytes(buf)!r}") from None


async def test_async_pty_shell_resize_and_exit(sb):
    pty = await sb.pty(cols=80, rows=24, env={"GREETING": "hi"})
    assert pty.info.pty and pty.info.stdin_open
    out, buf = pty.output(), bytearray()
    await pty.send("echo $GREETING $((6*7)); stty size; echo $TERM\n")
    await expect(out, buf, rb"hi 42\r\n24 80\r\nxterm-256color\r\n")
    await pty.resize(132, 43)
    await pty.send(b"stty size\n")
    await expect(out, buf, rb"43 132\r\n")
    assert any(e.exec_id == pty.exec_id and e.pty for e in await sb.execs())
    await pty.send(b"exit 4\n")
    async for chunk in out:     # the rest, to its end
        pass
    assert pty.result is not None and pty.result.exit_code == 4
    assert (await pty.wait()).exit_code == 4


async def test_pty_command_signal_and_errors(sb):
    pty = await sb.pty("echo ready; sleep 600")
    out, buf = pty.output(), bytearray()
    await expect(out, buf, rb"ready")
    await pty.signal(15)
    assert (await pty.wait()).signal == 15
    plain = await sb.start("sleep 30")
    with pytest.raises(Conflict, match="does not run on a terminal") as e:
        await sb.resize(plain.exec_id, 100, 30)
    assert e.value.field == "exec_id"
    await sb.signal(plain.exec_id, 9)
    with pytest.raises(ValueError, match="pty cannot be combined with session"):
        ExecRequest(cmd="sh", pty={"cols": 80, "rows": 24}, session="s")


def test_sync_pty(server):
    with SyncClient(server.url, server.key) as c:
        sb = c.create_container(ContainerArgs(image="busybox", ttl_idle_s=120))
        try:
            pty = sb.pty("stty size; read line; echo got:$line", cols=100, rows=30)
            pty.send("abc\n")
            data = b"".join(pty.output())
            assert b"30 100\r\n" in data and b"got:abc\r\n" in data, data
            assert pty.result is not None and pty.result.exit_code == 0
        finally:
            sb.stop()


async def test_pty_in_a_microvm(vm_client):
    """The guest's agent (device mode) runs terminals the same way (vm-init mounts devpts)."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    try:
        pty = await sb.pty("stty size; read line; echo got:$line", cols=90, rows=33)
        out, buf = pty.output(), bytearray()
        await expect(out, buf, rb"33 90\r\n")
        await pty.resize(100, 20)
        await pty.send(b"x\n")
        await expect(out, buf, rb"got:x\r\n")
        assert (await pty.wait()).exit_code == 0
    finally:
        await sb.stop()
