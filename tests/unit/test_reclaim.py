"""Idle reclaim scheduling (edge/reclaim.py) on fake backends: a sandbox idle past the threshold
is reclaimed once per idle period, again after it was used; busy, parked and incapable ones are
skipped; memory pressure lowers the threshold; 0 turns it off (no root)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.backends.base import DOZE_BUSY, Doze
from dsec.edge import reclaim as reclaim_module
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge
from dsec.edge.pressure import HostProbe
from dsec.images.service import ImageService
from dsec.testing.fake_backend import ParkingFakeBackend, ReclaimFakeBackend
from dsec.types import ContainerArgs, ExecRequest, MicroVMArgs, NodeCapacity, SandboxState

from ._helpers import Clock, Node

IDLE = 60
PRESSED = 10


@pytest.fixture
def rclock(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The edge's hand-moved clock, seen by the reclaimer too."""
    monkeypatch.setattr(reclaim_module, "time", clock)
    return clock


@pytest.fixture
def proc(short_tmp: Path) -> Path:
    """A fake /proc whose memory pressure the tests set (pressure())."""
    (short_tmp / "proc/pressure").mkdir(parents=True)
    (short_tmp / "proc/meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 8000000 kB\n")
    pressure(short_tmp / "proc", 0.0)
    return short_tmp / "proc"


def pressure(proc: Path, some_avg10: float) -> None:
    (proc / "pressure/memory").write_text(f"some avg10={some_avg10:.2f} avg60=0.00 avg300=0.00 total=1\n"
                                          "full avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")


@pytest.fixture
async def rfake(short_tmp: Path) -> AsyncIterator[ReclaimFakeBackend]:
    b = ReclaimFakeBackend(short_tmp / "rc")
    yield b
    await b.close()


@pytest.fixture
async def rnode(image_service: ImageService, rfake: ReclaimFakeBackend, parking: ParkingFakeBackend,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    monkeypatch.setenv("DSEC_RECLAIM_IDLE_S", str(IDLE))
    monkeypatch.setenv("DSEC_RECLAIM_PRESSED_IDLE_S", str(PRESSED))
    monkeypatch.setenv("DSEC_RECLAIM_PSI", "5")
    monkeypatch.setenv("DSEC_RECLAIM_PER_TICK", "4")
    n = Node(image_service.paths, image_service, [rfake, parking])   # containers reclaim, microvms cannot
    yield n
    await n.stop_edge()


async def start(node: Node, proc: Path) -> Edge:
    probe = HostProbe(proc=proc, ttl_s=0)
    return await node.start(admission=Admission(NodeCapacity(cpu_cores=64, memory_mb=1 << 20, max_sandboxes=100),
                                                mem_reserve_mb=0, probe=probe))


async def run(edge: Edge, sandbox_id: str, cmd: str = "true") -> None:
    events = [ev async for ev in edge.exec_stream(sandbox_id, ExecRequest(cmd=cmd))]
    assert events[-1].result is not None and events[-1].result.exit_code == 0


async def container(edge: Edge) -> str:
    return (await edge.create("p", ContainerArgs(image="busybox", ttl_idle_s=3600))).id


async def test_reclaimed_once_per_idle_period_and_again_after_use(rnode: Node, proc: Path, rfake: ReclaimFakeBackend,
                                                                  rclock: Clock):
    edge = await start(rnode, proc)
    sb = await container(edge)
    rclock.advance(IDLE - 5)
    assert await edge._reclaimer.run_once() == []
    rclock.advance(6)
    assert await edge._reclaimer.run_once() == [(sb, ReclaimFakeBackend.RECLAIM_BYTES)]
    assert (await edge.get(sb)).state == SandboxState.running           # it runs on
    for _ in range(3):                                                  # not again while it stays idle
        rclock.advance(IDLE + 1)
        assert await edge._reclaimer.run_once() == []
    assert rfake.reclaimed() == [sb]

    await run(edge, sb)                                                 # used again
    rclock.advance(IDLE - 5)
    assert await edge._reclaimer.run_once() == []
    rclock.advance(6)
    assert await edge._reclaimer.run_once() == [(sb, ReclaimFakeBackend.RECLAIM_BYTES)]
    assert rfake.reclaimed() == [sb, sb]
    assert edge._reclaimer.reclaims == 2 and edge._reclaimer.reclaimed_bytes == 2 * ReclaimFakeBackend.RECLAIM_BYTES


async def test_busy_parked_and_incapable_sandboxes_are_skipped(rnode: Node, proc: Path, rfake: ReclaimFakeBackend,
                                                               rclock: Clock):
    edge = await start(rnode, proc)
    idle, busy, parked = await container(edge), await container(edge), await container(edge)
    vm = (await edge.create("p", MicroVMArgs(image="busybox", ttl_idle_s=3600))).id    # no Reclaim capability
    await edge.suspend(parked)
    stream = edge.exec_stream(busy, ExecRequest(cmd="while [ ! -e go ]; do sleep 0.02; done"))
    assert (await anext(stream)).type == "start"                        # a request in flight
    rclock.advance(IDLE + 1)
    assert [sid for sid, _ in await edge._reclaimer.run_once()] == [idle]
    assert vm not in rfake.reclaimed()

    rclock.advance(IDLE + 1)                                            # still busy: still skipped
    assert await edge._reclaimer.run_once() == []
    (rfake.fs(busy) / "work/go").touch()
    assert [ev async for ev in stream][-1].result is not None           # the command's end is activity
    await edge.resume(parked)                                           # so is a resume
    rclock.advance(IDLE + 1)
    assert sorted(sid for sid, _ in await edge._reclaimer.run_once()) == sorted([busy, parked])
    assert sorted(rfake.reclaimed()) == sorted([idle, busy, parked])


async def test_memory_pressure_lowers_the_threshold(rnode: Node, proc: Path, rfake: ReclaimFakeBackend,
                                                    rclock: Clock):
    edge = await start(rnode, proc)
    sb = await container(edge)
    rclock.advance(PRESSED + 1)
    assert await edge._reclaimer.run_once() == []                       # 0% pressure: 60 s apply
    pressure(proc, 12.5)                                                # above DSEC_RECLAIM_PSI=5
    assert edge._reclaimer.threshold() == PRESSED
    assert [sid for sid, _ in await edge._reclaimer.run_once()] == [sb]
    await run(edge, sb)
    pressure(proc, 4.0)                                                 # below again
    rclock.advance(PRESSED + 1)
    assert await edge._reclaimer.run_once() == []
    rclock.advance(IDLE)
    assert [sid for sid, _ in await edge._reclaimer.run_once()] == [sb]


async def test_at_most_per_tick_one_at_a_time(rnode: Node, proc: Path, rfake: ReclaimFakeBackend, rclock: Clock):
    edge = await start(rnode, proc)
    ids = [await container(edge) for _ in range(6)]
    rfake.reclaim_delay_s = 0.05
    rclock.advance(IDLE + 1)
    task = edge._reclaimer.tick()
    assert task is not None and edge._reclaimer.tick() is None          # a batch runs: no second one
    first = await task
    assert len(first) == 4 and rfake.max_reclaiming == 1
    rest = await edge._reclaimer.run_once()
    assert sorted(sid for sid, _ in first + rest) == sorted(ids)
    assert await edge._reclaimer.run_once() == []


async def test_a_suspend_waits_for_a_reclaim_under_way(rnode: Node, proc: Path, rfake: ReclaimFakeBackend,
                                                       rclock: Clock):
    edge = await start(rnode, proc)
    sb = await container(edge)
    rfake.reclaim_delay_s = 0.2
    rclock.advance(IDLE + 1)
    task = edge._reclaimer.tick()
    assert task is not None
    await asyncio.sleep(0.05)                                           # the reclaim is under way
    info = await edge.suspend(sb)                                       # waits for it (park lock)
    assert info.state == SandboxState.suspended and rfake.calls[-2:] == [("reclaim", sb), ("park", sb)]
    assert [sid for sid, _ in await task] == [sb]


async def test_zero_turns_it_off(rnode: Node, proc: Path, rfake: ReclaimFakeBackend, rclock: Clock,
                                 monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DSEC_RECLAIM_IDLE_S", "0")
    edge = await start(rnode, proc)
    await container(edge)
    pressure(proc, 50.0)
    rclock.advance(10 * IDLE)
    assert not edge._reclaimer.enabled and await edge._reclaimer.run_once() == []
    assert await edge.reap_once() == [] and rfake.reclaimed() == []


def meminfo(proc: Path, available_mb: int) -> None:
    (proc / "meminfo").write_text(f"MemTotal: 8388608 kB\nMemAvailable: {available_mb << 10} kB\n")


async def test_memory_low_squeezes_back_to_back(rnode: Node, proc: Path, rfake: ReclaimFakeBackend,
                                                rclock: Clock, monkeypatch: pytest.MonkeyPatch):
    """Below DSEC_RECLAIM_MEM_LOW_MB: the threshold is DSEC_RECLAIM_SQUEEZE_IDLE_S and one tick
    reclaims every due sandbox, batch after batch (D95)."""
    monkeypatch.setenv("DSEC_RECLAIM_MEM_LOW_MB", "2048")
    monkeypatch.setenv("DSEC_RECLAIM_SQUEEZE_IDLE_S", "2")
    edge = await start(rnode, proc)
    ids = [await container(edge) for _ in range(6)]
    rclock.advance(3)
    assert await edge._reclaimer.run_once() == []                       # memory plentiful: 60 s apply
    meminfo(proc, 1500)
    assert edge._reclaimer.threshold() == 2
    assert sorted(sid for sid, _ in await edge._reclaimer.run_once()) == sorted(ids)   # one tick
    assert edge._reclaimer.squeezed == 6


async def test_squeeze_says_whether_anything_can_be_reclaimed(rnode: Node, proc: Path, rfake: ReclaimFakeBackend,
                                                              rclock: Clock, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DSEC_RECLAIM_MEM_LOW_MB", "0")                  # no early squeeze: only asked
    monkeypatch.setenv("DSEC_RECLAIM_SQUEEZE_IDLE_S", "2")
    edge = await start(rnode, proc)
    sb = await container(edge)
    assert not edge._reclaimer.squeeze()                                # used just now: nothing idle
    rclock.advance(3)
    assert edge._reclaimer.squeeze()                                    # idle 3 s: reclaimed now
    assert edge._reclaimer._task is not None
    assert [sid for sid, _ in await edge._reclaimer._task] == [sb]
    assert not edge._reclaimer.squeeze()                                # reclaimed already: nothing left


class DozeFake(ReclaimFakeBackend, Doze):
    """Reclaim + Doze (VMs' capabilities): the first `busy` dozes find the sandbox working."""

    def __init__(self, root: Path, busy: int):
        super().__init__(root)
        self.busy = busy
        self.dozed: set[str] = set()

    async def doze(self, sandbox_id: str, pageout: bool = True) -> int:
        self.calls.append(("doze" if pageout else "doze-cpu", sandbox_id))
        if self.busy:
            self.busy -= 1
            return DOZE_BUSY
        self.dozed.add(sandbox_id)
        return 1 << 20

    async def wake(self, sandbox_id: str) -> bool:
        was = sandbox_id in self.dozed
        self.dozed.discard(sandbox_id)
        return was

    def dozing(self, sandbox_id: str) -> bool:
        return sandbox_id in self.dozed


async def test_a_busy_doze_is_asked_again_without_a_second_reclaim(image_service: ImageService, short_tmp: Path,
                                                                   proc: Path, rclock: Clock,
                                                                   monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DSEC_RECLAIM_IDLE_S", str(IDLE))
    fake = DozeFake(short_tmp / "dz", busy=1)
    node = Node(image_service.paths, image_service, [fake])
    try:
        edge = await start(node, proc)
        sb = await container(edge)
        rclock.advance(IDLE + 1)
        await edge._reclaimer.run_once()                                # reclaimed; the doze finds it busy
        assert fake.calls[-2:] == [("reclaim", sb), ("doze", sb)] and not fake.dozing(sb)
        rclock.advance(IDLE + 1)
        await edge._reclaimer.run_once()                                # asked again: dozes, no 2nd reclaim
        assert fake.dozing(sb) and fake.reclaimed() == [sb]
        rclock.advance(IDLE + 1)
        assert await edge._reclaimer.run_once() == []                   # done for this idle period
    finally:
        await node.stop_edge()
        await fake.close()


async def test_cpu_saturated_stops_dozers_only_and_memory_short_pages_them_out(
        image_service: ImageService, short_tmp: Path, proc: Path, rclock: Clock, monkeypatch: pytest.MonkeyPatch):
    """D100: PSI cpu some >= DSEC_RECLAIM_CPU_PSI: a sandbox that can doze is stopped after the
    squeeze threshold, without a reclaim or a pageout; one that cannot (a container) is left
    to its idle threshold. Once memory is short, the one dozing for CPU has its memory pushed
    out (a doze with pageout), without a reclaim."""
    monkeypatch.setenv("DSEC_RECLAIM_IDLE_S", str(IDLE))
    fake = DozeFake(short_tmp / "dz", busy=0)
    plain = ReclaimFakeBackend(short_tmp / "rc2", kinds=("microvm",))
    node = Node(image_service.paths, image_service, [fake, plain])
    try:
        edge = await start(node, proc)
        vm = (await edge.create("p", ContainerArgs(image="busybox", ttl_idle_s=3600))).id
        ct = (await edge.create("p", MicroVMArgs(image="busybox", ttl_idle_s=3600))).id
        assert edge._live[vm].backend is fake and edge._live[ct].backend is plain
        (proc / "pressure/cpu").write_text("some avg10=95.00 avg60=0.00 avg300=0.00 total=1\n")
        rclock.advance(3)                                               # past the squeeze threshold (2 s)
        await edge._reclaimer.run_once()
        dozes = lambda: [c for c in fake.calls if c[0].startswith(("doze", "reclaim"))]  # noqa: E731
        assert dozes() == [("doze-cpu", vm)] and plain.reclaimed() == [] and fake.dozing(vm)
        (proc / "meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 1000000 kB\n")   # < 2 GiB
        rclock.advance(3)
        await edge._reclaimer.run_once()
        assert dozes() == [("doze-cpu", vm), ("doze", vm)] and fake.reclaimed() == []
        assert plain.reclaimed() == [ct]                                # memory short: everything idle
    finally:
        await node.stop_edge()
        await fake.close()
        await plain.close()


async def test_squeeze_counts_a_vm_stopped_for_the_cpu_alone(
        image_service: ImageService, short_tmp: Path, proc: Path, rclock: Clock, monkeypatch: pytest.MonkeyPatch):
    """D100: a create that waits for memory asks squeeze(); a VM stopped for the CPU alone a
    moment ago is not due again yet, but its memory can still go out: squeeze() says so (True:
    the create waits) instead of False (refused at once), and pages it out once due."""
    monkeypatch.setenv("DSEC_RECLAIM_IDLE_S", str(IDLE))
    monkeypatch.setenv("DSEC_RECLAIM_MEM_LOW_MB", "0")                  # memory short only when asked
    fake = DozeFake(short_tmp / "dz", busy=0)
    node = Node(image_service.paths, image_service, [fake])
    try:
        edge = await start(node, proc)
        vm = (await edge.create("p", ContainerArgs(image="busybox", ttl_idle_s=3600))).id
        (proc / "pressure/cpu").write_text("some avg10=95.00 avg60=0.00 avg300=0.00 total=1\n")
        rclock.advance(3)
        await edge._reclaimer.run_once()
        assert fake.calls[-1] == ("doze-cpu", vm) and fake.dozing(vm)
        (proc / "pressure/cpu").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
        assert edge._reclaimer.squeeze()          # nothing due now, but the stopped VM's memory can go
        rclock.advance(3)
        assert edge._reclaimer.squeeze()          # due: its pageout starts
        assert edge._reclaimer._task is not None
        await edge._reclaimer._task
        assert fake.calls[-1] == ("doze", vm) and fake.reclaimed() == []
        assert not edge._reclaimer.squeeze()      # paged out: nothing left to give
    finally:
        await node.stop_edge()
        await fake.close()
