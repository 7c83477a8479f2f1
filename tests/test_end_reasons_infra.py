"""The infrastructure end reasons that need the platform to act (issue 26, item 3):
`host_pressure` (the kernel's OOM killer ended a sandbox because the node's sandboxes cgroup,
which dsec makes under DSEC_CGROUP_PARENT, ran out, not the sandbox's own memory_mb) and
`preempted` (`dsec nodes drain --stop`). Beside them, a sandbox past its own limit stays
`oom_killed`. Each is an `ended` event on GET /v1/events and an InfrastructureFailure in the SDK.

One server of its own (its sandboxes under a parent cgroup with a small memory limit) serves
the whole module: draining the session's server would stop other tests' sandboxes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.backends.container import cgroups
from dsec.sdk.client import Client
from dsec.testing.waiting import wait_until
from dsec.types import EventType, InfrastructureFailure
from conftest import ServerProc, side_server

PARENT_LIMIT_MB = 96       # the node's sandboxes together; a sandbox's own memory_mb may be larger


def _set_parent_limit(parent: str, mb: int) -> None:
    d = cgroups.v1_dir("memory", parent) if not cgroups.is_unified() else cgroups.v2_root() / parent.lstrip("/")
    d.mkdir(exist_ok=True)
    if cgroups.is_unified():
        (d / "memory.max").write_text(str(mb << 20))
        (d / "memory.swap.max").write_text("0")      # no way out to swap: the parent's OOM killer acts
        return
    (d / "memory.limit_in_bytes").write_text(str(mb << 20))
    try:
        (d / "memory.memsw.limit_in_bytes").write_text(str(mb << 20))   # RAM + swap: no swap either
    except OSError:
        pass                                                             # no swap accounting


@pytest.fixture(scope="module")
def pserver(dsec_home, images, tmp_path_factory):
    parent = f"/dsec-t26-{os.urandom(4).hex()}"
    _set_parent_limit(parent, PARENT_LIMIT_MB)
    try:
        with side_server(dsec_home, tmp_path_factory, "reasons",
                         {"DSEC_CGROUP_PARENT": parent, "DSEC_EVENTS_POLL_S": "0.2"}) as srv:
            yield srv
    finally:
        for d in cgroups.leftover_dirs(parent):       # crun removed the sandboxes' own dirs
            try:
                d.rmdir()
            except OSError:
                pass
        assert not cgroups.leftover_dirs(parent), cgroups.leftover_dirs(parent)


async def ended(client: Client, sandbox_id: str):
    async def found():
        evs = (await client.events(sandbox_id=sandbox_id)).events
        return next((e for e in evs if e.type == EventType.ended), None)
    return await wait_until(found, timeout_s=60, what=f"the ended event of {sandbox_id}")


async def fill_shm(server: ServerProc, sb, mb: int) -> None:
    """Fill `mb` of the sandbox's memory (tmpfs) a second from now, with its agent (the
    sandbox's init) the OOM killer's first choice, as tests/test_events.py does."""
    r = await sb.run(f"(sleep 1; head -c {mb << 20} /dev/zero > /dev/shm/fill) >/dev/null 2>&1 &")
    assert r.exit_code == 0, r
    pid = int((server.paths.sandboxes / sb.id / "run" / "pid").read_text())
    Path(f"/proc/{pid}/oom_score_adj").write_text("1000")


async def test_own_limit_is_oom_killed_and_the_parents_is_host_pressure(pserver):
    async with pserver.client() as client:
        # past its own memory_mb (32, under the parent's 96): its own doing, oom_killed
        own = await client.create_container(image="busybox", memory_mb=32)
        try:
            await fill_shm(pserver, own, 40)
            e = await ended(client, own.id)
            assert e.reason == "oom_killed" and e.infrastructure is True, e
        finally:
            await own.stop()
        # below its own memory_mb (512) when the node's parent cgroup (96) runs out: host_pressure
        pressed = await client.create_container(image="busybox", memory_mb=512)
        try:
            await fill_shm(pserver, pressed, 150)
            e = await ended(client, pressed.id)
            assert e.reason == "host_pressure" and e.infrastructure is True, e
            assert "host memory pressure" in (e.message or "") and "memory_mb=512" in (e.message or ""), e
            assert (await pressed.refresh()).end_reason == "host_pressure"
            with pytest.raises(InfrastructureFailure) as exc:
                await pressed.run("true")
            assert exc.value.reason == "host_pressure" and exc.value.infrastructure
        finally:
            await pressed.stop()


async def test_drain_stop_preempts(pserver, monkeypatch):
    """`dsec nodes drain --stop`: the node takes no new sandbox and its running and parked
    sandboxes end `preempted`; a request to one raises InfrastructureFailure. One made with
    the stock e2b SDK: E2B's events API carries the reason in eventData."""
    e2b = pytest.importorskip("e2b")
    import httpx
    url = f"{pserver.url}/e2b"
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": pserver.key,
                 "E2B_DOMAIN": "dsec.invalid"}.items():
        monkeypatch.setenv(k, v)
    async with pserver.client() as client:
        node = (await client.nodes())[0].node_id
        running = await client.create_container(image="busybox", memory_mb=16)
        parked = await client.create_container(image="busybox", memory_mb=16)
        stock = await e2b.AsyncSandbox.create("busybox")
        try:
            await parked.suspend()
            answer = await client.node_action(node, "drain", stop=True)
            assert answer["state"] == "draining", answer
            stock_id = next(s for s in answer["stopped"] if s.endswith(stock.sandbox_id.split(".")[-1][-12:]))
            assert sorted(answer["stopped"]) == sorted([running.id, parked.id, stock_id]), answer
            assert answer["sandboxes"] == [], answer
            e = await ended(client, stock_id)
            assert e.reason == "preempted", e
            async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": pserver.key}, timeout=30) as h:
                got = (await h.get(f"/events/sandboxes/{stock.sandbox_id}")).json()
            data = [ev["eventData"] for ev in got if ev["type"].endswith("killed")]
            assert data and data[0]["reason"] == "preempted" and data[0]["infrastructure"] is True, got
            for sb in (running, parked):
                e = await ended(client, sb.id)
                assert e.reason == "preempted" and e.infrastructure is True, e
                assert "drained" in (e.message or ""), e
                with pytest.raises(InfrastructureFailure) as exc:
                    await sb.run("true")
                assert exc.value.reason == "preempted", exc.value
        finally:
            await client.node_action(node, "uncordon")
            for sb in (running, parked):
                await sb.stop()
            await e2b.AsyncSandbox.kill(stock.sandbox_id)      # already ended: answers False
