"""Memory short: idle microVM clones doze early, and a create waits for it (issue 31, D95).

An edge in this process with the real VM backend (QEMU clones of busybox) and real idle
reclaim/doze; only the host's MemAvailable is the test's (a /proc/meminfo of its own that the
admission and the reclaimer read), so "the node is short of memory" does not depend on what
other work the box has. The memory it reports comes back when the clone really dozed (QMP
`stop` and its QEMU's pages in swap), which is what a real node would see.

- Below DSEC_RECLAIM_MEM_LOW_MB an idle clone dozes after DSEC_RECLAIM_SQUEEZE_IDLE_S, though
  DSEC_RECLAIM_IDLE_S is 600 s (the old code left it running for 600 s).
- Templates' RAM files live on the home's disk (DSEC_VM_TEMPLATE_RAM=disk), not in /dev/shm.
- Below the reserve (DSEC_MEM_RESERVE_MB), with early dozing off, a create waits for the idle
  clone to doze and then succeeds (the old code refused it at once); with nothing left to
  reclaim, a create is refused at once, naming the setting, and the node reports unhealthy.
- D100: with the host's CPU saturated (PSI cpu some >= DSEC_RECLAIM_CPU_PSI) an idle clone's
  vCPUs stop after the squeeze threshold with memory plentiful (the old code left it awake,
  costing CPU), its memory left in place; once memory is short it is paged out as well;
  two creates in flight near the memory floor are admitted one after the other, the second
  counting the first's memory as taken (the old code admitted both on the same MemAvailable);
  a guest that stops answering while the host's PSI memory stall is high is not failed as
  hung, and is once the stall is over (the old code failed it after 3 pings).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import _cleanup_home, link_downloads, side_home

from dsec.backends.vm.templates import ram_dir
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge, EdgeSettings
from dsec.edge.pressure import HostProbe
from dsec.embedded.server import vm_driver
from dsec.images.service import ImageService
from dsec.settings import Settings
from dsec.types import CapacityExceeded, ExecRequest, MicroVMArgs, SandboxState

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]

PLENTY_MB = 16000
RESERVE_MB = 512


class Meminfo:
    """The node's /proc as the edge reads it: the test says how much memory is available."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.set(PLENTY_MB)
        self.psi("cpu", 0.0)
        self.psi("memory", 0.0)

    def set(self, available_mb: int) -> None:
        tmp = self.root / "meminfo.tmp"
        tmp.write_text(f"MemTotal: {32000 << 10} kB\nMemAvailable: {available_mb << 10} kB\n")
        tmp.replace(self.root / "meminfo")

    def psi(self, resource: str, some_avg10: float) -> None:
        """The host's PSI `some` avg10 for cpu or memory, as the edge reads it."""
        (self.root / "pressure").mkdir(exist_ok=True)
        tmp = self.root / "pressure" / f"{resource}.tmp"
        tmp.write_text(f"some avg10={some_avg10:.2f} avg60=0.00 avg300=0.00 total=1\n"
                       "full avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
        tmp.replace(self.root / "pressure" / resource)


@pytest.fixture
async def node(images, dsec_home, tmp_path_factory, request) -> AsyncIterator[tuple[Edge, Meminfo]]:
    home = side_home(dsec_home, tmp_path_factory, "vm-squeeze")
    link_downloads(home)
    env = {"DSEC_HOME": str(home), "DSEC_RECLAIM_IDLE_S": "600", "DSEC_RECLAIM_PRESSED_IDLE_S": "600",
           "DSEC_RECLAIM_SQUEEZE_IDLE_S": "1.5", "DSEC_MEM_RESERVE_MB": str(RESERVE_MB), **request.param}
    conf = Settings.from_env(env)
    paths = conf.paths
    paths.ensure()
    mem = Meminfo(home / "fake-proc")
    vm, why = await asyncio.to_thread(vm_driver, paths, conf.vm)
    assert vm is not None, why
    admission = Admission.for_this_host(paths.home, probe=HostProbe(mem.root, ttl_s=0), conf=conf)
    admission.psi = ()     # the fake /proc has no PSI files: memory is what these tests are about
    edge = Edge(paths, ImageService(paths, keep_reader=True, settings=conf.images), [vm],
                EdgeSettings(node_id="n1", reap_interval_s=0.5), admission, conf=conf)
    await edge.start()
    try:
        yield edge, mem
    finally:
        for sb in await edge.list():
            await edge.stop(sb.id)
        await edge.close()
        await vm.release_node()
        _cleanup_home(home)


def vm_swap_kib(edge: Edge, sandbox_id: str) -> int:
    pid = int((edge.paths.vm_sandboxes / sandbox_id / "qemu.pid").read_text())
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmSwap:"))
    return int(line.split()[1])


def dozed(edge: Edge, sandbox_id: str) -> bool:
    """Really dozing: vCPUs stopped and its memory paged out (not just marked)."""
    vm = edge._backend("microvm")
    return vm.dozing(sandbox_id) and vm_swap_kib(edge, sandbox_id) > 0      # type: ignore[attr-defined]


async def clone(edge: Edge) -> str:
    sb = await edge.create("p", MicroVMArgs(image="busybox", memory_mb=256, ttl_idle_s=3600))
    events = [ev async for ev in edge.exec_stream(sb.id, ExecRequest(cmd="true"))]
    assert events[-1].result is not None and events[-1].result.exit_code == 0
    return sb.id


@pytest.mark.parametrize("node", [{}], indirect=True)
async def test_memory_low_dozes_idle_clones_early(node: tuple[Edge, Meminfo]):
    edge, mem = node
    a = await clone(edge)
    # the template's RAM is page cache on the home's disk (DSEC_VM_TEMPLATE_RAM=disk), not tmpfs
    rams = list(ram_dir(edge.paths, "disk").glob("*.ram"))
    assert rams and rams[0].is_relative_to(edge.paths.vm) and not ram_dir(edge.paths, "tmpfs").exists()
    await asyncio.sleep(3)                       # idle past the squeeze threshold, memory plentiful
    assert not edge._backend("microvm").dozing(a)           # type: ignore[attr-defined]

    mem.set(1500)          # below DSEC_RECLAIM_MEM_LOW_MB (2048), above the reserve
    deadline = time.monotonic() + 30
    while not (dozed(edge, a) and edge._reclaimer.squeezed >= 1):    # counted once its batch is over
        assert time.monotonic() < deadline, "the idle clone did not doze while memory was low"
        await asyncio.sleep(0.2)
    mem.set(PLENTY_MB)
    events = [ev async for ev in edge.exec_stream(a, ExecRequest(cmd="echo up"))]    # wakes it
    assert events[-1].result is not None and events[-1].result.exit_code == 0


@pytest.mark.parametrize("node", [{"DSEC_RECLAIM_MEM_LOW_MB": "0", "DSEC_ADMIT_RECLAIM_WAIT_S": "30"}],
                         indirect=True)
async def test_create_waits_for_reclaim_then_refuses_when_nothing_is_left(node: tuple[Edge, Meminfo]):
    edge, mem = node
    a = await clone(edge)
    await asyncio.sleep(2)                       # idle past the squeeze threshold
    assert not edge._backend("microvm").dozing(a)           # type: ignore[attr-defined]

    async def memory_back_when_dozed() -> None:  # what the host would see once `a` dozes
        while not dozed(edge, a):
            await asyncio.sleep(0.1)
        mem.set(PLENTY_MB)

    mem.set(RESERVE_MB - 100)                    # below the reserve: the old code refused at once
    watcher = asyncio.create_task(memory_back_when_dozed())
    t0 = time.monotonic()
    b = await clone(edge)                        # waits for `a` to doze, then is created
    waited = time.monotonic() - t0
    await watcher
    assert dozed(edge, a) and (await edge.get(b)).state == SandboxState.running
    assert waited < 30

    # nothing idle left to reclaim (a dozes, b was just used): refused at once, unhealthy
    events = [ev async for ev in edge.exec_stream(b, ExecRequest(cmd="true"))]
    assert events[-1].result is not None
    mem.set(RESERVE_MB - 100)
    assert not (await edge.status()).healthy
    t0 = time.monotonic()
    with pytest.raises(CapacityExceeded) as e:
        await edge.create("p", MicroVMArgs(image="busybox", memory_mb=256, ttl_idle_s=3600))
    assert time.monotonic() - t0 < 5
    assert e.value.field == "memory_mb" and "DSEC_MEM_RESERVE_MB" in e.value.message


@pytest.mark.parametrize("node", [{}], indirect=True)
async def test_cpu_saturated_dozes_idle_clones_early(node: tuple[Edge, Meminfo]):
    edge, mem = node
    a = await clone(edge)
    await asyncio.sleep(3)                       # idle past the squeeze threshold, CPU quiet
    assert not edge._backend("microvm").dozing(a)           # type: ignore[attr-defined]

    vm = edge._backend("microvm")
    mem.psi("cpu", 95.0)         # at or above DSEC_RECLAIM_CPU_PSI (50); memory plentiful
    deadline = time.monotonic() + 30
    # stopped only (memory is not short): dozing, its memory not paged out
    while not (vm.dozing(a) and a in vm._unpaged):      # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the idle clone did not doze while the CPU was saturated"
        await asyncio.sleep(0.2)
    mem.set(1500)                # memory short now: its memory goes out too
    while not (dozed(edge, a) and a not in vm._unpaged):      # type: ignore[attr-defined]
        assert time.monotonic() < deadline + 30, "the clone dozing for CPU was not paged out once memory was short"
        await asyncio.sleep(0.2)
    mem.set(PLENTY_MB)
    mem.psi("cpu", 0.0)
    events = [ev async for ev in edge.exec_stream(a, ExecRequest(cmd="echo up"))]    # wakes it
    assert events[-1].result is not None and events[-1].result.exit_code == 0


@pytest.mark.parametrize("node", [{"DSEC_RECLAIM_MEM_LOW_MB": "0"}], indirect=True)
async def test_creates_near_the_floor_are_paced_by_what_was_admitted(node: tuple[Edge, Meminfo]):
    edge, mem = node
    await clone(edge)                            # the template is built: the creates below are clones
    claim = edge._backend("microvm").start_resident_mb        # type: ignore[attr-defined]
    # room for one clone above the reserve, not two: MemAvailable (the test's) does not move
    # when a clone starts, as the real one does not for a second or two
    mem.set(RESERVE_MB + edge.admission.sandbox_mb + claim // 2)
    b, c = await asyncio.gather(clone(edge), clone(edge))
    assert (await edge.get(b)).state == SandboxState.running and (await edge.get(c)).state == SandboxState.running
    assert edge._claims.paced == 1, "the second create did not count the first one's memory"


@pytest.mark.parametrize("node", [{"DSEC_VM_PING_S": "1"}], indirect=True)
async def test_a_silent_guest_is_not_failed_as_hung_while_the_host_stalls(node: tuple[Edge, Meminfo]):
    edge, mem = node
    a = await clone(edge)
    vm = edge._backend("microvm")
    mem.psi("memory", 80.0)      # a thrashing host: >= DSEC_LIVENESS_STALL_PSI (60)
    await vm.pause(a)            # type: ignore[attr-defined]  # its agent answers no ping now
    live = edge._live[a]
    deadline = time.monotonic() + 60
    while live.ping_misses < 4:  # one more than the 3 that fail a guest
        assert time.monotonic() < deadline, f"only {live.ping_misses} pings missed"
        assert (await edge.get(a)).state == SandboxState.running, "failed while the host was stalled"
        await asyncio.sleep(0.5)
    assert (await edge.get(a)).state == SandboxState.running

    mem.psi("memory", 0.0)       # the stall is over: a guest still silent is failed as hung
    deadline = time.monotonic() + 30
    while (await edge.get(a)).state == SandboxState.running:
        assert time.monotonic() < deadline, "the silent guest was not failed after the stall"
        await asyncio.sleep(0.5)
    info = await edge.get(a)
    assert info.state == SandboxState.failed and "hung" in (info.error or "")
