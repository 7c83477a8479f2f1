"""The edge when the node's storage fails under it (no root; the faults are the fake backend's):
a creation whose teardown fails too, and recovery past sandboxes (and backends) that cannot
be read or torn down. The real thing, a DSEC_HOME that fills up, is tests/test_storage_limits.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from dsec.edge.admission import Admission
from dsec.testing.fake_backend import FakeBackend
from dsec.types import ContainerArgs, NodeCapacity, SandboxState, Unavailable

from ._helpers import Node

ARGS = ContainerArgs(image="busybox")


def eio(what: str) -> OSError:
    return OSError(errno.EIO, "Input/output error", what)


async def test_a_create_whose_teardown_fails_too_leaves_a_failed_record(node: Node, fake: FakeBackend):
    edge = await node.start()
    fake.fail_next("create", eio("sb/x/upper"))
    fake.fail_next("destroy", eio("sb/x"))
    with pytest.raises(Unavailable) as e:          # JSON 503, not a bare 500
        await edge.create("p", ARGS)
    assert "Input/output error" in e.value.message and e.value.fix
    [rec] = await edge.list(include_ended=True)
    assert rec.state == SandboxState.failed, rec    # never left `creating`
    assert "teardown failed too" in (rec.error or "")
    assert edge._live == {}
    assert (await edge.create("p", ARGS)).state == SandboxState.running   # the next one is fine


async def test_recovery_survives_a_sandbox_it_cannot_tear_down(node: Node, fake: FakeBackend):
    edge = await node.start()
    a, b, keep = [(await edge.create("p", ARGS)).id for _ in range(3)]
    await node.stop_edge()
    await fake.kill(a)
    await fake.kill(b)
    fake.fail_next("destroy", eio("sb/" + a))      # the first teardown of recovery hits a broken disk
    edge = await node.start()                       # old code: the OSError ended `dsec up` here
    states = {s.id: s for s in await edge.list(include_ended=True)}
    assert states[keep].state == SandboxState.running
    assert {states[a].state, states[b].state} == {SandboxState.failed}
    assert sum("could not tear it down" in (states[i].error or "") for i in (a, b)) == 1
    assert (await edge.create("p", ARGS)).state == SandboxState.running


class UnlistableBackend(FakeBackend):
    broken = False

    async def list_ids(self) -> dict[str, str]:
        if self.broken:
            raise eio(str(self.root))
        return await super().list_ids()


async def test_recovery_survives_a_backend_it_cannot_list(image_service, short_tmp: Path):
    fake = UnlistableBackend(short_tmp / "rt2")
    node = Node(image_service.paths, image_service, [fake])
    try:
        edge = await node.start()
        sid = (await edge.create("p", ARGS)).id
        await node.stop_edge()
        fake.broken = True
        edge = await node.start()
        [rec] = await edge.list(include_ended=True)
        assert rec.id == sid and rec.state == SandboxState.failed
        assert "could not list the container backend" in (rec.error or "")
    finally:
        await node.stop_edge()
        await fake.close()


async def test_admission_refuses_below_a_disk_reserve_naming_it(node: Node, short_tmp: Path):
    import os

    from dsec.edge.admission import DiskReserve, StorageLow
    free = os.statvfs(short_tmp).f_bavail * os.statvfs(short_tmp).f_frsize >> 20
    tight = Admission(NodeCapacity(cpu_cores=64, memory_mb=1 << 20, max_sandboxes=100), mem_reserve_mb=0,
                      disks=(DiskReserve("the DSEC_HOME filesystem", short_tmp, free + 1024, "DSEC_HOME_RESERVE_MB"),))
    edge = await node.start(admission=tight)
    with pytest.raises(StorageLow) as e:
        await edge.create("p", ARGS)
    assert e.value.status == 503 and "DSEC_HOME filesystem" in e.value.message
    assert "DSEC_HOME_RESERVE_MB" in e.value.message and e.value.fix
    assert await edge.list(include_ended=True) == []    # refused before any record
