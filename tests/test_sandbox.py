"""End to end through the SDK: real HTTP, real edge, real crun containers, real agent."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsec import ContainerArgs, SyncClient
from dsec.sdk.client import ExecFailed


async def test_quickstart_flow(client):
    sb = await client.create_container(ContainerArgs(image="debian-python", cpu_cores=1, memory_mb=512,
                                                     ttl_idle_s=300))
    try:
        r = await sb.run("python3 -c 'print(6*7)'")
        assert (r.stdout, r.exit_code) == ("42\n", 0)

        await sb.run("cd /tmp && export X=1", session="s1")
        r = await sb.run("pwd; echo $X", session="s1")
        assert r.stdout == "/tmp\n1\n"

        await sb.files.write("/work/a.txt", b"hi")
        assert await sb.files.read("/work/a.txt") == b"hi"
        names = {e.name for e in await sb.files.list("/work")}
        assert "a.txt" in names
    finally:
        await sb.stop()
    assert sb.info.state.value == "stopped"


async def test_stream_arrives_live(client):
    async with await client.create_container(image="busybox") as sb:
        arrivals: list[tuple[float, str]] = []
        t0 = time.monotonic()
        async for ev in sb.stream("for i in 1 2 3; do echo $i; sleep 1; done"):
            if ev.type == "stdout":
                arrivals.append((time.monotonic() - t0, ev.data))
            last = ev
        assert "".join(d for _, d in arrivals) == "1\n2\n3\n"
        assert last.type == "exit" and last.result.exit_code == 0
        # the first line arrives long before the command ends (it sleeps 3 s in total)
        assert arrivals[0][0] < 1.5 and arrivals[-1][0] > 1.8


async def test_image_without_python_and_default_user(client):
    async with await client.create_container(image="busybox") as sb:
        r = await sb.run("id -u; id -g; pwd; ls /usr/bin/python3 2>&1 || true")
        lines = r.stdout.splitlines()
        assert lines[:3] == ["1000", "1000", "/work"]   # non-root by default, in its workdir
        assert "No such file" in r.stdout
        r = await sb.run("id -u", user="root")
        assert r.stdout == "0\n"


async def test_root_sandbox_and_stderr_exit_code(client):
    async with await client.create_container(image="busybox", user="root") as sb:
        r = await sb.run("echo out; echo err >&2; exit 7")
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 7)
        assert (await sb.run("id -u")).stdout == "0\n"
        with pytest.raises(ExecFailed):
            await sb.run("false", check=True)


async def test_env_cwd_stdin(client):
    async with await client.create_container(image="busybox", env={"A": "sandbox-level"}) as sb:
        r = await sb.run("echo $A $B; pwd", env={"B": "call-level"}, cwd="/tmp")
        assert r.stdout == "sandbox-level call-level\n/tmp\n"
        r = await sb.run("cat | tr a-z A-Z", stdin="hello")
        assert r.stdout == "HELLO"


async def test_timeout_kills_process_tree(client):
    async with await client.create_container(image="busybox") as sb:
        t0 = time.monotonic()
        r = await sb.run("sleep 100 & sleep 100", timeout_s=1)
        assert r.timed_out and time.monotonic() - t0 < 10
        ps = await sb.run("ps -o pid,args | grep 'sleep 100' | grep -v grep || true")
        assert ps.stdout == ""


async def test_output_cap_reported(client):
    async with await client.create_container(image="busybox", output_cap_bytes=4096) as sb:
        r = await sb.run("yes | head -c 5000000")
        assert r.truncated and len(r.stdout) == 4096 and r.stdout_bytes == 5000000
        assert r.exit_code == 0


async def test_memory_limit_kills_only_the_command(client):
    async with await client.create_container(image="debian-python", memory_mb=128) as sb:
        r = await sb.run("python3 -c 'x = bytearray(400 * 1024 * 1024); print(len(x))'", timeout_s=60)
        assert r.exit_code != 0
        assert (await sb.run("echo alive")).stdout == "alive\n"


async def test_session_semantics(client):
    async with await client.create_container(image="debian-python") as sb:
        r = await sb.run("if then", session="s")          # syntax error: session survives
        assert r.exit_code == 2 and not r.session_ended
        await sb.run("export K=v; cd /", session="s")
        assert (await sb.run("echo $K $(pwd)", session="s")).stdout == "v /\n"
        r = await sb.run("exit 3", session="s")
        assert r.session_ended and r.exit_code == 3
        assert (await sb.run("echo ${K:-fresh}", session="s")).stdout == "fresh\n"
        # sessions are independent
        await sb.run("export Q=1", session="a")
        assert (await sb.run("echo ${Q:-none}", session="b")).stdout == "none\n"


async def test_create_many_reports_each(client):
    n = 6
    got = []
    async for created in client.create_many(n, ContainerArgs(image="busybox"), concurrency=3):
        assert created.ok, created.error
        got.append(created.sandbox)
    assert len({sb.id for sb in got}) == n
    outs = await asyncio.gather(*(sb.run("hostname") for sb in got))
    assert all(o.stdout == "sandbox\n" for o in outs)
    await asyncio.gather(*(sb.stop() for sb in got))


def test_sync_client_same_surface(server):
    with SyncClient(server.url, server.key) as c:
        sb = c.create_container(ContainerArgs(image="busybox"))
        try:
            assert sb.run("echo sync").stdout == "sync\n"
            sb.files.write("/work/s.txt", "x")
            assert sb.files.read("/work/s.txt") == b"x"
            chunks = [ev.data for ev in sb.stream("echo a; echo b") if ev.type == "stdout"]
            assert "".join(chunks) == "a\nb\n"
            ids = [x.sandbox.id for x in c.create_many(2, ContainerArgs(image="busybox"))]
            assert len(ids) == 2
            for sid in ids:
                c.get(sid).stop()
        finally:
            sb.stop()
