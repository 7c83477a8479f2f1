"""virtio-balloon with free page reporting: memory a guest frees goes back to the host, and a
template clone's balloon never writes the template's RAM file that every clone maps.

Real QEMU guests (TCG here) through the whole stack. The guest fills a tmpfs with FILL_MB and
removes it; the QEMU process's host RSS (VmRSS) must fall back by most of that within a
bounded time. Without reporting it stays: the guest's freed pages are still the QEMU
process's memory (docs/benchmarks.md, vm-balloon, has both side by side; D29)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from dsec.backends.vm import balloon, ramshim
from dsec.backends.vm.qemu import Qmp
from dsec.backends.vm.templates import ram_dir

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]

MEMORY_MB = 256
FILL_MB = 96
CACHE_MB = 48
ZEROS_48M_MD5 = hashlib.md5(bytes(CACHE_MB << 20)).hexdigest()


def _pid(server, sandbox_id: str) -> int:
    return int((server.paths.vm_sandboxes / sandbox_id / "qemu.pid").read_text())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def template_ram(server, pid: int) -> Path:
    """The template RAM file the clone's QEMU maps."""
    for ram in ram_dir(server.paths).glob("*.ram"):
        if ramshim.open_modes(pid, ram):
            return ram
    raise AssertionError(f"QEMU {pid} maps no template RAM file")


def fingerprint(p: Path) -> str:
    """The file's contents. (Its allocated size may grow: a clone's first write to a page that
    is a hole in the tmpfs file allocates a zero page there. Contents are what clones see.)"""
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


async def fill_and_free(sb, pid: int, within_s: float = 30.0) -> tuple[float, float, float, float]:
    """RSS before, after the guest wrote FILL_MB into its tmpfs, and once it removed the file
    and the host got the pages back (or within_s passed); and the seconds that took."""
    before = rss_mb(pid)
    r = await sb.run(f"dd if=/dev/zero of=/dev/shm/fill bs=1M count={FILL_MB} 2>&1")
    assert r.exit_code == 0, r
    filled = rss_mb(pid)
    # (less than FILL_MB may be new: a cold-booted guest reuses pages its boot touched)
    assert filled - before > FILL_MB * 0.5, (before, filled)
    t0 = time.monotonic()
    assert (await sb.run("rm /dev/shm/fill")).exit_code == 0
    deadline = time.monotonic() + within_s
    while (after := rss_mb(pid)) > filled - FILL_MB * 0.7 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return before, filled, after, time.monotonic() - t0


async def test_freed_guest_memory_returns_to_the_host_cold_boot(vm_client, server):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB, user="root", clone=False)
    try:
        pid = _pid(server, sb.id)
        before, filled, after, took = await fill_and_free(sb, pid)
        print(f"cold boot: RSS {before:.0f} -> {filled:.0f} (filled) -> {after:.0f} MiB ({took:.1f}s after rm)")
        assert filled - after > FILL_MB * 0.7, (before, filled, after)
    finally:
        await sb.stop()


async def test_clone_returns_memory_and_never_writes_the_template(vm_client, server, monkeypatch):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB, user="root")
    other = None
    try:
        pid = _pid(server, sb.id)
        ram = template_ram(server, pid)
        assert set(ramshim.open_modes(pid, ram)) == {os.O_RDONLY}     # kernel-enforced: no writes, no punch
        tpl = await asyncio.to_thread(fingerprint, ram)

        before, filled, after, took = await fill_and_free(sb, pid)
        print(f"clone: RSS {before:.0f} -> {filled:.0f} (filled) -> {after:.0f} MiB ({took:.1f}s after rm)")
        assert filled - after > FILL_MB * 0.7, (before, filled, after)

        # idle reclaim squeezes the guest: its page cache goes back to the host. (The same
        # discard path as a guest that inflates by itself: QEMU does not check the target.)
        r = await sb.run(f"dd if=/dev/zero of=/work/cache bs=1M count={CACHE_MB} 2>&1 && sync")
        assert r.exit_code == 0, r
        cached = rss_mb(pid)
        monkeypatch.setattr(balloon, "SQUEEZE_S", 90.0)      # TCG on a shared 2-core box
        t0 = time.monotonic()
        freed = await balloon.squeeze(server.paths.vm_sandboxes / sb.id, sb.id, MEMORY_MB, pid)
        print(f"clone squeeze: RSS {cached:.0f} -> {rss_mb(pid):.0f} MiB, {freed >> 20} MiB freed "
              f"({time.monotonic() - t0:.1f}s)")
        assert freed > (CACHE_MB << 20) // 2, freed
        async with Qmp(server.paths.vm_sandboxes / sb.id / "qmp.sock", sb.id) as q:   # let go again
            deadline = time.monotonic() + 30
            while (await q.run("query-balloon"))["actual"] < MEMORY_MB << 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert (await q.run("query-balloon"))["actual"] == MEMORY_MB << 20
        r = await sb.run("md5sum < /work/cache")
        assert r.stdout.startswith(ZEROS_48M_MD5), r      # its page cache went; the file is read again

        assert await asyncio.to_thread(fingerprint, ram) == tpl, "a clone changed its template's RAM file"
        other = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB, user="root")
        r = await other.run("ls / | wc -l; md5sum /bin/busybox")
        assert r.exit_code == 0, r
    finally:
        await sb.stop()
        if other is not None:
            await other.stop()
