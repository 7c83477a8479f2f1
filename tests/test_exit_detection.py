"""A container sandbox whose init (the agent) dies is noticed at once, with no request made:
the edge watches the init's pidfd, marks the sandbox failed with the real reason (killed by a
signal, or out of memory) and admission stops counting it. Real server, crun, agent."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from dsec.testing.waiting import wait_until


def agent_pid(server, sandbox_id: str) -> int:
    return int((server.paths.sandboxes / sandbox_id / "run" / "pid").read_text())


async def wait_ended(sb, within_s: float):
    """Poll GET (which never touches the agent) until the sandbox is no longer running."""
    await wait_until(lambda: _not_running(sb), timeout_s=within_s)
    return sb.info


async def _not_running(sb) -> bool:
    return (await sb.refresh()).state.value != "running"


async def committed_mb(client) -> int:
    return sum(n.committed_memory_mb for n in await client.nodes())


async def settled_committed_mb(client) -> int:
    """The node's committed memory once the watcher (1 s polls) shows the same twice in a row."""
    last = await committed_mb(client)
    while True:
        await asyncio.sleep(1.2)
        now = await committed_mb(client)
        if now == last:
            return now
        last = now


async def wait_committed(client, pred, within_s: float = 10) -> int:
    seen: list[int] = []

    async def probe() -> bool:
        seen.append(await committed_mb(client))
        return pred(seen[-1])
    await wait_until(probe, timeout_s=within_s, every_s=0.2)
    return seen[-1]


async def test_killed_init_is_failed_at_once_with_its_reason(client, server):
    """kill -9 of the sandbox's init from the host: within a few seconds and without a request,
    GET says failed, killed by SIGKILL (not 'idle' once its short TTL passes), and its memory
    is no longer committed on the node."""
    base = await settled_committed_mb(client)
    sb = await client.create_container(image="busybox", memory_mb=77, ttl_idle_s=6)
    try:
        assert await wait_committed(client, lambda mb: mb == base + 77, 4) == base + 77
        t0 = time.monotonic()
        os.kill(agent_pid(server, sb.id), signal.SIGKILL)
        info = await wait_ended(sb, 3)
        took = time.monotonic() - t0
        assert info.state.value == "failed", info
        assert "killed by SIGKILL" in (info.error or "") and "idle" not in (info.error or ""), info.error
        assert took < 3, took
        assert await wait_committed(client, lambda mb: mb <= base) <= base, "admission still counts it"
        await asyncio.sleep(7)     # past its TTL: the reason stays the real one
        info = await sb.refresh()
        assert info.state.value == "failed" and "killed by SIGKILL" in (info.error or ""), info
    finally:
        await sb.stop()


async def test_init_killed_by_oom_is_failed_as_out_of_memory(client, server):
    """A background job fills the sandbox's memory after the last request; the OOM killer picks
    the agent (made its first choice from the host): GET says failed, out of memory, with the limit."""
    sb = await client.create_container(image="busybox", memory_mb=32)
    try:
        # tmpfs pages are charged to the sandbox and in no process's RSS: nothing to reclaim
        r = await sb.run("(sleep 1; head -c 40000000 /dev/zero > /dev/shm/fill) >/dev/null 2>&1 &")
        assert r.exit_code == 0, r
        # raised after the job forked: commands inherit the agent's score (/proc is read-only inside)
        Path(f"/proc/{agent_pid(server, sb.id)}/oom_score_adj").write_text("1000")
        info = await wait_ended(sb, 10)
        assert info.state.value == "failed", info
        assert "out of memory (memory_mb=32)" in (info.error or ""), info.error
    finally:
        await sb.stop()


async def test_stop_is_not_reported_as_a_death(client):
    """The edge's own teardown (stop) is not mistaken for an exit: the record says stopped."""
    sb = await client.create_container(image="busybox")
    await sb.run("true")
    info = await sb.stop()
    assert info.state.value == "stopped", info
    await asyncio.sleep(0.5)
    info = await sb.refresh()
    assert info.state.value == "stopped" and not (info.error or ""), info
