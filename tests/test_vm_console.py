"""The VM serial console through the whole stack after the console became a pipe the edge reads
(backends/vm/console.py): what the guest kernel prints reaches `sb.console()`, also after the
edge was killed and restarted (the new edge reopens the running VMs' console FIFOs)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time

import pytest

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]

# dd's 200 MiB block buffer in a 256 MiB guest (~218 MiB usable): the guest kernel OOM-kills it
# and says so on the console (pr_err, shown under `quiet`)
OOM = "dd if=/dev/zero of=/dev/null bs=200M count=1"


async def _console_has(sb, text: str, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if text in await sb.console():
            return True
        await asyncio.sleep(0.2)
    return False


async def test_guest_kernel_messages_reach_the_console_also_after_an_edge_restart(server):
    async with server.client() as c:
        if "microvm" not in (await c.nodes())[0].backends:
            pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
        sb = await c.create_microvm(image="busybox", memory_mb=256)
        assert "dsec-init: root ready" in await sb.console()    # the template's boot log
        r = await sb.run(OOM, timeout_s=60)
        assert r.signal == 9 or r.exit_code == 137 or "Killed" in r.stderr, r
        assert await _console_has(sb, "Killed process"), (await sb.console())[-2000:]
    log = server.paths.vm_sandboxes / sb.id / "console.log"
    n_before = log.read_text(errors="replace").count("Killed process")
    server.kill(signal.SIGKILL)
    server.start()
    async with server.client() as c:
        sb2 = await c.get(sb.id)
        try:
            r = await sb2.run(OOM, timeout_s=60)
            assert r.signal == 9 or r.exit_code == 137 or "Killed" in r.stderr, r
            deadline = time.monotonic() + 20
            while log.read_text(errors="replace").count("Killed process") <= n_before and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert log.read_text(errors="replace").count("Killed process") > n_before, \
                "the restarted edge does not read the VM's console"
        finally:
            await sb2.stop()
