"""The edge's logic on a fake backend (no root): create, use, stop, failures, admission,
capabilities, sandboxes that die."""

from __future__ import annotations

import asyncio

import pytest

from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.testing.fake_backend import FakeBackend, ParkingFakeBackend
from dsec.types import (CapacityExceeded, Conflict, ContainerArgs, ExecRequest, InvalidArgument, MicroVMArgs,
                        NetworkPolicy, NodeCapacity, NotFound, SandboxFailed, SandboxState, Unavailable)

from ._helpers import Node

ARGS = ContainerArgs(image="busybox")


async def ended(edge: Edge, state: SandboxState) -> list:
    return [s for s in await edge.list(include_ended=True) if s.state == state]


async def test_create_run_files_stop_frees_everything(edge: Edge, fake: FakeBackend):
    info = await edge.create("p", ARGS)
    assert info.state == SandboxState.running and info.backend == "container"
    assert await fake.list_ids() == {info.id: "running"}

    r = await edge.run(info.id, ExecRequest(cmd="echo hi; echo err >&2; pwd; exit 3"))
    assert r.stdout.splitlines() == ["hi", str(fake.fs(info.id) / "work")]
    assert (r.stderr, r.exit_code) == ("err\n", 3)
    events = [ev async for ev in edge.exec_stream(info.id, ExecRequest(cmd="echo a"))]
    assert [ev.type for ev in events] == ["start", "stdout", "exit"] and events[1].data == "a\n"

    await edge.write_file(info.id, "d/f.txt", b"data")
    assert (fake.fs(info.id) / "work/d/f.txt").read_bytes() == b"data"
    assert await edge.read_file(info.id, "/work/d/f.txt") == b"data"
    assert [(e.name, e.type, e.size) for e in await edge.list_dir(info.id, "d")] == [("f.txt", "file", 4)]
    await edge.remove_file(info.id, "d/f.txt")
    with pytest.raises(NotFound) as e:
        await edge.read_file(info.id, "d/f.txt")
    assert e.value.field == "path"

    live = edge._live[info.id]   # no public view of what the edge holds per sandbox
    agent = live.agent
    assert agent is not None and not agent.closed
    stopped = await edge.stop(info.id)
    assert stopped.state == SandboxState.stopped
    assert agent.closed and live.agent is None and info.id not in edge._live
    assert await fake.list_ids() == {} and fake.stubs == {}
    assert ("destroy", info.id) in fake.calls
    assert (await edge.get(info.id)).state == SandboxState.stopped
    with pytest.raises(Conflict):
        await edge.run(info.id, ExecRequest(cmd="true"))
    assert (await edge.stop(info.id)).state == SandboxState.stopped   # idempotent


async def test_exec_options_reach_the_agent(edge: Edge):
    sb = (await edge.create("p", ContainerArgs(image="busybox", env={"A": "1"}))).id
    r = await edge.run(sb, ExecRequest(cmd="echo $A $B; cat", env={"B": "2"}, stdin="in"))
    assert r.stdout == "1 2\nin"
    r = await edge.run(sb, ExecRequest(cmd="sleep 5", timeout_s=0.2))
    assert r.timed_out and r.exit_code is None
    r = await edge.run(sb, ExecRequest(cmd="head -c 5000 /dev/zero | tr '\\0' x", output_cap_bytes=1024))
    assert r.truncated and len(r.stdout) == 1024 and r.stdout_bytes == 5000
    await edge.run(sb, ExecRequest(cmd="cd /tmp; X=7", session="s"))
    r = await edge.run(sb, ExecRequest(cmd="echo $PWD $X", session="s"))
    assert r.stdout == "/tmp 7\n"
    with pytest.raises(NotFound):
        await edge.run(sb, ExecRequest(cmd="true", cwd="/no/such/dir"))


@pytest.mark.parametrize("stage", ["create", "create_after_agent", "wait_agent", "ready"])
async def test_create_failing_in_the_backend_leaves_a_failed_record_only(edge: Edge, fake: FakeBackend, stage):
    fake.fail_next(stage, RuntimeError("boom"))
    with pytest.raises(SandboxFailed) as e:
        await edge.create("p", ARGS)
    assert "boom" in e.value.message
    [failed] = await ended(edge, SandboxState.failed)
    assert failed.error is not None and "creation failed: boom" in failed.error
    assert await edge.list() == [] and edge._live == {}
    assert await fake.list_ids() == {} and fake.stubs == {}
    assert (await edge.status()).sandboxes == 0


async def test_a_backend_that_leaves_its_sandbox_behind_is_cleaned_up(edge: Edge, fake: FakeBackend):
    fake.fail_next("create_after_agent", RuntimeError("half-made"), leave_behind=True)
    with pytest.raises(SandboxFailed):
        await edge.create("p", ARGS)
    assert await fake.list_ids() == {} and fake.stubs == {}


async def test_dsec_errors_of_the_backend_reach_the_caller_as_they_are(edge: Edge, fake: FakeBackend):
    fake.fail_next("prepare", InvalidArgument("no such toolkit", field="toolkits[0]"))
    with pytest.raises(InvalidArgument) as e:
        await edge.create("p", ARGS)
    assert e.value.field == "toolkits[0]"
    assert await edge.list(include_ended=True) == []   # prepare fails before any record
    assert [c for c in fake.calls if c[0] == "create"] == []

    fake.fail_next("create", Unavailable("crun is broken", field="backend"))
    with pytest.raises(Unavailable):
        await edge.create("p", ARGS)
    assert len(await ended(edge, SandboxState.failed)) == 1


async def test_admission_rejects_naming_the_short_resource(node: Node, fake: FakeBackend):
    tiny = Admission(NodeCapacity(cpu_cores=2, memory_mb=1024, max_sandboxes=2), mem_reserve_mb=0)
    edge = await node.start(admission=tiny)
    await edge.create("p", ContainerArgs(image="busybox", memory_mb=512, cpu_cores=1))
    with pytest.raises(CapacityExceeded) as e:
        await edge.create("p", ContainerArgs(image="busybox", memory_mb=1024))
    assert e.value.field == "memory_mb"
    with pytest.raises(CapacityExceeded) as e:
        await edge.create("p", ContainerArgs(image="busybox", memory_mb=16, cpu_cores=1.5))
    assert e.value.field == "cpu_cores"
    await edge.create("p", ContainerArgs(image="busybox", memory_mb=16, cpu_cores=0.5))
    with pytest.raises(CapacityExceeded) as e:
        await edge.create("p", ContainerArgs(image="busybox", memory_mb=16, cpu_cores=0.1))
    assert "2/2 sandboxes" in e.value.message
    # rejected before anything was recorded or created
    assert len(await edge.list(include_ended=True)) == 2
    assert len([c for c in fake.calls if c[0] == "create"]) == 2


async def test_unavailable_backend_says_why_and_how_to_fix(node: Node, fake: FakeBackend):
    node.backends = [fake]
    edge = await node.start(unavailable={"microvm": ("no guest kernel", "run `dsec vm fetch-kernel`")})
    with pytest.raises(Unavailable) as e:
        await edge.create("p", MicroVMArgs(image="busybox"))
    assert "no guest kernel" in e.value.message and e.value.fix == "run `dsec vm fetch-kernel`"
    assert e.value.field == "backend"


async def test_a_capability_the_backend_lacks(edge: Edge):
    sb = (await edge.create("p", ARGS)).id
    calls = {"suspend": lambda: edge.suspend(sb), "snapshot": lambda: edge.snapshot(sb),
             "set_network": lambda: edge.set_network(sb, NetworkPolicy())}
    for verb, call in calls.items():
        with pytest.raises(InvalidArgument) as e:
            await call()
        assert f"backend 'container' cannot {verb}" in e.value.message
        assert e.value.field == "backend"
    with pytest.raises(InvalidArgument, match="cannot console"):
        await edge.console(sb)
    assert (await edge.run(sb, ExecRequest(cmd="true"))).exit_code == 0   # unharmed


async def test_parking_and_transparent_resume(edge: Edge, parking: ParkingFakeBackend):
    sb = (await edge.create("p", MicroVMArgs(image="busybox"))).id
    await edge.write_file(sb, "kept", b"1")
    assert (await edge.suspend(sb)).state == SandboxState.suspended
    assert await parking.list_ids() == {sb: "parked"}
    assert (await edge.status()).sandboxes == 0   # parked ones hold nothing
    r = await edge.run(sb, ExecRequest(cmd="cat kept"))   # the next request resumes it
    assert r.stdout == "1" and (await edge.get(sb)).state == SandboxState.running
    assert [c[0] for c in parking.calls if c[1] == sb][-3:] == ["park", "unpark", "wait_agent"]


async def test_a_sandbox_dying_between_requests_reports_failed(edge: Edge, fake: FakeBackend):
    sb = (await edge.create("p", ARGS)).id
    await edge.run(sb, ExecRequest(cmd="true"))
    await fake.kill(sb, "out of memory (test)")
    with pytest.raises(SandboxFailed) as e:
        await edge.run(sb, ExecRequest(cmd="true"))
    assert "out of memory (test)" in e.value.message
    info = await edge.get(sb)
    assert info.state == SandboxState.failed and "out of memory (test)" in (info.error or "")
    assert await fake.list_ids() == {} and sb not in edge._live
    with pytest.raises(Conflict):
        await edge.read_file(sb, "x")


async def test_a_sandbox_dying_mid_command_reports_failed(edge: Edge, fake: FakeBackend):
    sb = (await edge.create("p", ARGS)).id
    run = asyncio.create_task(edge.run(sb, ExecRequest(cmd="sleep 10")))
    while not fake.stubs[sb].execs:
        await asyncio.sleep(0.01)
    await fake.kill(sb, "killed mid-command")
    with pytest.raises(SandboxFailed, match="killed mid-command"):
        await asyncio.wait_for(run, 5)
    assert (await edge.get(sb)).state == SandboxState.failed


async def test_stop_with_an_end_reason(edge: Edge):
    """The platform's own stop ends `preempted` (issue 26.3); a word outside the vocabulary is
    refused naming the field, and the sandbox runs on."""
    info = await edge.create("p", ARGS)
    with pytest.raises(InvalidArgument) as e:
        await edge.stop(info.id, end="bogus")
    assert e.value.field == "end" and "preempted" in (e.value.fix or "")
    assert (await edge.get(info.id)).state == SandboxState.running
    stopped = await edge.stop(info.id, reason="drained", end="preempted")
    assert stopped.state == SandboxState.stopped and stopped.end_reason == "preempted"
    with pytest.raises(Conflict) as c:
        await edge.run(info.id, ExecRequest(cmd="true"))
    assert c.value.reason == "preempted"
