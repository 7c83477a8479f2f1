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

    def set(self, available_mb: int) -> None:
        tmp = self.root / "meminfo.tmp"
        tmp.write_text(f"MemTotal: {32000 << 10} kB\nMemAvailable: {available_mb << 10} kB\n")
        tmp.replace(self.root / "meminfo")


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
