"""Idle reaping and recovery after an edge restart, on fake backends (no root)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsec.backends.base import Prepared
from dsec.edge.edge import Edge
from dsec.edge.records import EdgeRecords, SandboxRecord
from dsec.testing.fake_backend import FakeBackend, ParkingFakeBackend
from dsec.types import ContainerArgs, ExecRequest, MicroVMArgs, SandboxFailed, SandboxState

from ._helpers import Clock, Node


async def test_idle_sandboxes_are_reaped_busy_ones_are_not(edge: Edge, fake: FakeBackend, clock: Clock):
    idle = (await edge.create("p", ContainerArgs(image="busybox", ttl_idle_s=60))).id
    busy = (await edge.create("p", ContainerArgs(image="busybox", ttl_idle_s=60))).id
    clock.advance(30)
    assert await edge.reap_once() == []

    # a command in flight keeps its sandbox, however long it runs
    stream = edge.exec_stream(busy, ExecRequest(cmd="while [ ! -e go ]; do sleep 0.02; done; echo done"))
    assert (await anext(stream)).type == "start"
    clock.advance(31)
    assert await edge.reap_once() == [idle]
    info = await edge.get(idle)
    assert info.state == SandboxState.stopped and "ttl_idle_s=60" in (info.error or "")
    assert idle not in fake.stubs and busy in fake.stubs

    clock.advance(120)
    assert await edge.reap_once() == []
    (fake.fs(busy) / "work/go").touch()
    events = [ev async for ev in stream]
    assert events[-1].result is not None and events[-1].result.stdout == "done\n"
    clock.advance(59)   # the command's end counts as activity
    assert await edge.reap_once() == []
    clock.advance(2)
    assert await edge.reap_once() == [busy]
    assert await fake.list_ids() == {}


async def test_idle_vm_is_parked_then_reaped(edge: Edge, parking: ParkingFakeBackend, clock: Clock):
    sb = (await edge.create("p", MicroVMArgs(image="busybox", suspend_idle_s=10, ttl_idle_s=100))).id
    clock.advance(11)
    assert await edge.reap_once() == []
    assert (await edge.get(sb)).state == SandboxState.suspended and sb in parking.parked
    clock.advance(90)   # parked sandboxes are still reaped by their ttl
    assert await edge.reap_once() == [sb]
    assert await parking.list_ids() == {}


def _record(sandbox_id: str, state: SandboxState) -> SandboxRecord:
    now = time.time()
    args = ContainerArgs(image="busybox")
    return SandboxRecord(id=sandbox_id, project="p", backend="container", state=state, args=args,
                         image="busybox", image_digest=None, uid=1000, gid=1000, created_at=now, last_active_at=now)


async def test_restart_keeps_the_living_and_settles_the_rest(node: Node, fake: FakeBackend):
    edge = await node.start()
    alive = (await edge.create("p", ContainerArgs(image="busybox"))).id
    dies = (await edge.create("p", ContainerArgs(image="busybox"))).id
    await edge.write_file(alive, "state", b"kept")

    # a command started before the restart: its result is picked up after it
    stream = edge.exec_stream(alive, ExecRequest(cmd="sleep 0.3; echo late"))
    start = await anext(stream)
    await stream.aclose()
    await node.stop_edge()

    # while the edge is down: one sandbox dies, the runtime has one nobody owns, and an
    # edge that crashed mid-create left a `creating` record with a half-made sandbox
    await fake.kill(dies)
    orphan, half = "sb-local.0000000000aa", "sb-local.0000000000bb"
    for sandbox_id in (orphan, half):
        await fake.create(sandbox_id, Prepared(ContainerArgs(image="busybox"), None, 1000, 1000), None)  # type: ignore[arg-type]
    records = EdgeRecords(node.paths.edge_db)
    records.insert(_record(half, SandboxState.creating))
    records.close()

    edge = await node.restart()
    assert fake.recovered == {alive}
    assert await fake.list_ids() == {alive: "running"}
    assert {("destroy", orphan), ("destroy", half), ("destroy", dies)} <= set(fake.calls)

    late = await edge.attach(alive, start.exec_id or "")
    assert late.stdout == "late\n"
    r = await edge.run(alive, ExecRequest(cmd="cat state"))
    assert r.stdout == "kept" and int(r.exec_id) > int(start.exec_id or 0)   # chans are not reused

    died = await edge.get(dies)
    assert died.state == SandboxState.failed and died.error == "the sandbox died while the edge was down"
    made = await edge.get(half)
    assert made.state == SandboxState.failed and made.error == "edge restarted while creating the sandbox"
    assert [s.id for s in await edge.list()] == [alive]


async def test_restart_keeps_a_parked_sandbox_parked(node: Node, parking: ParkingFakeBackend):
    edge = await node.start()
    sb = (await edge.create("p", MicroVMArgs(image="busybox"))).id
    await edge.suspend(sb)
    edge = await node.restart()
    assert (await edge.get(sb)).state == SandboxState.suspended
    assert (await edge.run(sb, ExecRequest(cmd="echo back"))).stdout == "back\n"


async def test_restart_loses_a_parked_sandbox_whose_state_is_gone(node: Node, parking: ParkingFakeBackend):
    edge = await node.start()
    sb = (await edge.create("p", MicroVMArgs(image="busybox"))).id
    await edge.suspend(sb)
    await node.stop_edge()
    await parking.kill(sb)
    edge = await node.restart()
    info = await edge.get(sb)
    assert info.state == SandboxState.failed and "saved state was lost" in (info.error or "")


async def test_a_create_in_progress_when_the_edge_closes(node: Node, fake: FakeBackend):
    """Cancelling a create (the edge shutting down, a client gone) leaves no half sandbox."""
    edge = await node.start()
    fake.create_delay_s = 0.3
    task = asyncio.create_task(edge.create("p", ContainerArgs(image="busybox")))
    await asyncio.sleep(0.1)
    task.cancel()
    # the edge turns the cancellation into SandboxFailed (CancelledError would be expected)
    with pytest.raises((asyncio.CancelledError, SandboxFailed)):
        await task
    [rec] = await edge.list(include_ended=True)
    assert rec.state == SandboxState.failed
    assert await fake.list_ids() == {}


async def test_on_timeout_pause_parks_and_a_request_resumes_with_a_fresh_lifetime(
        edge: Edge, parking: ParkingFakeBackend, clock: Clock):
    sb = (await edge.create("p", MicroVMArgs(image="busybox", lifetime_s=10, on_timeout="pause",
                                             ttl_idle_s=1000))).id
    clock.advance(11)
    assert await edge.reap_once() == []
    info = await edge.get(sb)
    assert info.state == SandboxState.suspended and sb in parking.parked and info.expires_at is None
    clock.advance(500)                      # parked: no lifetime runs (only the idle TTL would end it)
    assert await edge.reap_once() == []
    await edge.resume(sb)                   # what any request does first (_live_resumed)
    info = await edge.get(sb)
    assert info.state == SandboxState.running and info.expires_at is not None
    assert info.expires_at.timestamp() > (await edge.get(sb)).created_at.timestamp() + 500   # from the resume
    clock.advance(11)
    assert await edge.reap_once() == [] and (await edge.get(sb)).state == SandboxState.suspended
