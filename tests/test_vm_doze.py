"""Idle microVM clones doze (issue 31, backends/vm/doze.py): once idle for DSEC_RECLAIM_IDLE_S
the edge's idle reclaim stops the clone's vCPUs (QMP `stop`) and pushes its QEMU's private
memory to swap; the next request runs it again, with its clock set. While it dozes no liveness
ping is sent (a stopped guest cannot answer: three missed pings would fail it), and
DSEC_VM_IDLE_STOP=0 turns it off. One node with a short idle threshold and 1 s pings."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from pathlib import Path

import pytest
from conftest import side_server

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]

MEMORY_MB = 256
IDLE_S = "3"


def _node(dsec_home, tmp_path_factory, name: str, env: dict[str, str]):
    # downloads: the guest kernel; without it the node offers no VM backends
    return side_server(dsec_home, tmp_path_factory, name, {"DSEC_RECLAIM_IDLE_S": IDLE_S,
                                                           "DSEC_RECLAIM_PRESSED_IDLE_S": IDLE_S,
                                                           "DSEC_VM_PING_S": "1", **env}, downloads=True)


@pytest.fixture(scope="module")
def doze_server(images, dsec_home, tmp_path_factory):
    with _node(dsec_home, tmp_path_factory, "vm-doze", {}) as srv:
        yield srv


@pytest.fixture(scope="module")
def awake_server(images, dsec_home, tmp_path_factory):
    with _node(dsec_home, tmp_path_factory, "vm-awake", {"DSEC_VM_IDLE_STOP": "0"}) as srv:
        yield srv


def qmp_status(server, sandbox_id: str) -> str:
    """QEMU's run state over the VM's QMP socket, read raw (one short connection)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(server.paths.vm_sandboxes / sandbox_id / "qmp.sock"))
        f = s.makefile("rwb")
        f.readline()                                   # greeting
        for cmd in ("qmp_capabilities", "query-status"):
            f.write(json.dumps({"execute": cmd}).encode() + b"\n")
            f.flush()
            while True:                                # events may come first
                msg = json.loads(f.readline())
                if "return" in msg or "error" in msg:
                    break
        return msg["return"]["status"]


def vm_swap_kib(server, sandbox_id: str) -> int:
    pid = int((server.paths.vm_sandboxes / sandbox_id / "qemu.pid").read_text())
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmSwap:"))
    return int(line.split()[1])


async def wait_for(pred, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(pred):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.5)


async def _microvm(c):
    if "microvm" not in (await c.nodes())[0].backends:
        pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
    return await c.create_microvm(image="busybox", memory_mb=MEMORY_MB)


async def test_an_idle_clone_dozes_and_its_next_command_wakes_it(doze_server):
    async with doze_server.client() as c:
        sb = await _microvm(c)
        try:
            assert (await sb.run("true")).exit_code == 0
            await wait_for(lambda: qmp_status(doze_server, sb.id) == "paused", "the idle clone's vCPU stopped")
            if Path("/proc/swaps").read_text().count("\n") > 1:      # a swap device: its memory went there
                await wait_for(lambda: vm_swap_kib(doze_server, sb.id) > 1024, "QEMU's memory paged out", 30)
            # longer than 3 missed pings 1 s apart would take: none is sent while it dozes
            await asyncio.sleep(8)
            assert (await c.get(sb.id)).info.state == "running"
            assert qmp_status(doze_server, sb.id) == "paused"
            t0 = time.time()
            r = await sb.run("date +%s")
            assert r.exit_code == 0, r
            # its clock stood still while it dozed (>= 8 s): set again on wake
            assert abs(int(r.stdout) - t0) <= 3, (r.stdout, t0)
            assert qmp_status(doze_server, sb.id) == "running"
            assert (await sb.run("echo again")).stdout == "again\n"
        finally:
            await sb.stop()
    vm_dir = doze_server.paths.vm_sandboxes / sb.id
    assert not vm_dir.exists(), "a dozing clone's dir outlived its stop"


async def test_dozing_is_switched_off_by_the_setting(awake_server):
    async with awake_server.client() as c:
        sb = await _microvm(c)
        try:
            assert (await sb.run("true")).exit_code == 0
            # the idle reclaim looked at it (it logs each reclaim) and left it running
            await wait_for(lambda: any(sb.id in ln and "idle sandbox memory reclaimed" in ln
                                       for ln in awake_server.log_tail(10 ** 6).splitlines()),
                           "the idle reclaim of the clone")
            assert qmp_status(awake_server, sb.id) == "running"
            assert (await sb.run("echo awake")).stdout == "awake\n"
        finally:
            await sb.stop()



async def test_a_clone_with_a_running_command_does_not_doze(doze_server):
    """A background job (`start`) goes on while nobody talks to the sandbox: the edge follows it
    (the sandbox counts as in use), so the clone is neither reclaimed nor dozed meanwhile."""
    async with doze_server.client() as c:
        sb = await _microvm(c)
        try:
            job = await sb.start("sleep 600")
            await asyncio.sleep(4 * float(IDLE_S) + 2)       # idle by requests for several periods
            assert qmp_status(doze_server, sb.id) == "running"
            assert not any(sb.id in ln and "vm dozing" in ln for ln in doze_server.log_tail(10 ** 6).splitlines())
            assert (await sb.run("echo awake")).stdout == "awake\n"
            await sb.signal(job.exec_id, 9)
        finally:
            await sb.stop()
