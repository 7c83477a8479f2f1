"""Lifecycle faults: cleanup leaves nothing, TTL reaping, admission, edge killed and restarted."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dsec import ContainerArgs
from dsec.backends.container.cgroups import leftover_dirs
from dsec.backends.container.idmap import REGISTRY
from dsec.backends.container.spec import cgroup_path
from dsec.types import CapacityExceeded

from conftest import side_server


def _crun_ids(server) -> set[str]:
    out = subprocess.run(["crun", "--root", str(server.paths.crun_root), "list", "-q"],
                         capture_output=True, text=True).stdout
    return set(out.split())


def _overlay_mounts_of(sandbox_dir: Path) -> int:
    """Overlay mounts referencing the sandbox in ANY mount namespace on the host."""
    n = 0
    for mi in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            n += mi.read_text().count(str(sandbox_dir))
        except OSError:
            pass
    return n


def _id_claims(d: Path) -> list[Path]:
    """Host uid-range claims (backends/container/idmap.py) held for sandbox dir `d`."""
    out = []
    for f in REGISTRY.glob("[0-9]*"):
        try:
            if f.read_text() == str(d.resolve()):
                out.append(f)
        except OSError:
            pass
    return out


def assert_freed(server, sandbox_id: str) -> None:
    d = server.paths.sandboxes / sandbox_id
    assert sandbox_id not in _crun_ids(server)
    assert leftover_dirs(cgroup_path(sandbox_id)) == []
    assert not d.exists()
    assert _overlay_mounts_of(d) == 0
    assert _id_claims(d) == []                 # its uid range is free again


async def test_stop_frees_everything(client, server):
    sb = await client.create_container(image="busybox")
    d = server.paths.sandboxes / sb.id
    assert _overlay_mounts_of(d) >= 1            # the overlay exists, in the sandbox's namespace
    host_mounts = Path("/proc/self/mountinfo").read_text()
    assert str(d) not in host_mounts             # ... but not in the host mount table
    await sb.run("sleep 1000 > /dev/null 2>&1 &")  # a background process must not survive either
    await sb.stop()
    assert_freed(server, sb.id)


async def test_idle_ttl_reaps_and_frees(client, server):
    sb = await client.create_container(image="busybox", ttl_idle_s=1)
    deadline = time.monotonic() + 20
    # "stopping" is visible while the reaper tears the sandbox down (a busy host makes it last)
    while (await sb.refresh()).state.value in ("running", "stopping"):
        assert time.monotonic() < deadline, "sandbox was not reaped"
        await asyncio.sleep(0.5)
    assert sb.info.state.value == "stopped" and "ttl_idle_s" in (sb.info.error or "")
    assert_freed(server, sb.id)


async def test_busy_sandbox_is_not_reaped(client):
    async with await client.create_container(image="busybox", ttl_idle_s=1) as sb:
        r = await sb.run("sleep 4; echo done", timeout_s=30)
        assert r.stdout == "done\n"


@pytest.fixture
def small_server(images, dsec_home, tmp_path_factory):
    """A second server on its own home that admits at most 3 sandboxes."""
    with side_server(dsec_home, tmp_path_factory, "small", {"DSEC_MAX_SANDBOXES": "3"}) as srv:
        yield srv


async def test_admission_rejects_when_full_and_burst_reports_each(small_server):
    async with small_server.client() as c:
        outcomes = [x async for x in c.create_many(5, ContainerArgs(image="busybox"), concurrency=5)]
        ok = [x for x in outcomes if x.ok]
        failed = [x for x in outcomes if not x.ok]
        assert len(ok) == 3 and len(failed) == 2
        assert all(isinstance(x.error, CapacityExceeded) for x in failed), [x.error for x in failed]
        assert all("sandbox" in x.error.message and x.error.fix for x in failed), [x.error.message for x in failed]
        for x in ok:
            await x.sandbox.stop()
        # room again after stopping, once placement's own reservations (2 s) have expired
        await asyncio.sleep(2.5)
        sb = await c.create_container(image="busybox")
        await sb.stop()


async def test_edge_restart_keeps_sandboxes_sessions_and_running_commands(server):
    async with server.client() as c:
        sb = await c.create_container(image="debian-python")
        claims = _id_claims(server.paths.sandboxes / sb.id)
        assert len(claims) == 1                # its own host uid range, claimed host-wide
        await sb.run("export KEEP=me; cd /tmp", session="s")
        detached = await sb.start("cat; echo bye", keep_stdin=True)    # its stdin stays open across it
        await sb.send_stdin(detached.exec_id, "a\n")
        stream = sb.stream("sleep 2; echo finished", timeout_s=60)
        start = await anext(stream)
        exec_id = start.exec_id
        server.kill(signal.SIGKILL)            # the edge dies mid-command
        try:
            await stream.aclose()
        except Exception:
            pass
    server.start()
    async with server.client() as c:
        sb2 = await c.get(sb.id)
        assert sb2.info.state.value == "running"
        r = await sb2.attach(exec_id)          # the command kept running and its result survived
        assert r.stdout == "finished\n" and r.exit_code == 0
        assert (await sb2.run("echo $KEEP $(pwd)", session="s")).stdout == "me /tmp\n"
        assert detached.exec_id in {e.exec_id for e in await sb2.execs()}
        await sb2.send_stdin(detached.exec_id, "b\n", close=True)
        assert (await sb2.attach(detached.exec_id)).stdout == "a\nb\nbye\n"
        # the restarted edge kept the range: still claimed, never handed to a new sandbox
        assert _id_claims(server.paths.sandboxes / sb.id) == claims
        fresh = await c.create_container(image="busybox")
        assert _id_claims(server.paths.sandboxes / fresh.id)[0] != claims[0]
        await fresh.stop()
        await sb2.stop()
    assert_freed(server, sb.id)


async def test_edge_killed_mid_burst_loses_nothing_and_leaks_nothing(server):
    async with server.client() as c:
        before = {s.id for s in await c.list()}

        async def burst():
            return [x async for x in c.create_many(12, ContainerArgs(image="busybox"), concurrency=4)]
        task = asyncio.create_task(burst())
        await asyncio.sleep(1.0)
        server.kill(signal.SIGKILL)
        await asyncio.gather(task, return_exceptions=True)
    server.start()
    async with server.client() as c:
        live = {s.id: s for s in await c.list()}
        new = set(live) - before
        # every sandbox the edge kept works; everything else was cleaned
        for sid in new:
            assert live[sid].state.value == "running"
            assert (await (await c.get(sid)).run("echo ok")).stdout == "ok\n"
        assert _crun_ids(server) == set(live)
        # dot names are the node's snapshots and volumes (.snap, .volumes), not sandboxes
        on_disk = {p.name for p in server.paths.sandboxes.iterdir() if not p.name.startswith(".")}
        assert on_disk == set(live)
        ended = [s for s in await c.list(include_ended=True) if s.id not in live and s.id not in before]
        for s in ended:
            assert s.state.value in ("failed", "stopped")
            assert leftover_dirs(cgroup_path(s.id)) == []
        for sid in new:
            await (await c.get(sid)).stop()
            assert_freed(server, sid)
