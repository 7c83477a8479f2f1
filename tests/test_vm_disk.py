"""Full VMs that bring their own kernel and init: `debian-vm` (debootstrap + systemd + Debian's
cloud kernel) built into a qcow2 disk (dsec.backends.vm.disks), booted on q35 from a per-sandbox
overlay through the whole stack (SDK -> apiserver -> edge -> QEMU -> systemd -> the agent's unit)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest

from dsec.backends.vm import disks
from dsec.backends.vm.qemu import pid_alive
from dsec.types import DsecError, InvalidArgument, NotFound

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
    pytest.mark.skipif(shutil.which("qemu-img") is None, reason="qemu-img is not installed (apt-get install qemu-utils)"),
    pytest.mark.skipif(shutil.which("mkfs.ext4") is None and not os.path.exists("/usr/sbin/mkfs.ext4"),
                       reason="mkfs.ext4 is not installed (apt-get install e2fsprogs)"),
]


@pytest.fixture(scope="module")
def vm_disk(server, images) -> disks.DiskInfo:
    from dsec.images.builtin import ensure_builtin
    try:   # from the debootstrap cache scripts/install.sh fills: seconds
        ensure_builtin(images, "debian-vm")
    except DsecError as e:
        pytest.skip(f"the debian-vm image cannot be built on this host (debootstrap needs Debian's mirror "
                    f"or the cache `dsec image build debian-vm --builtin` leaves): {e.message}")
    t0 = time.monotonic()
    d = disks.build(server.paths, "dvm", "debian-vm")
    print(f"disk build: {time.monotonic() - t0:.1f}s")
    return d


async def test_disk_vm_boots_its_own_kernel_and_systemd(client, server, vm_disk):
    nodes = await client.nodes()
    if "vm" not in nodes[0].backends:
        pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
    f = vm_disk.files(server.paths)
    assert f.qcow2.is_file() and f.kernel.is_file() and f.initrd is not None and f.initrd.is_file()
    base_mtime = f.qcow2.stat().st_mtime_ns

    # wrong arguments fail before anything boots, naming the field
    with pytest.raises(NotFound) as e:
        await client.create_vm(image="debian-vm", disk="no-such-disk")
    assert e.value.field == "disk" and "dsec vm disk build" in (e.value.fix or "")
    with pytest.raises(InvalidArgument) as e:
        await client.create_vm(image="busybox", disk="dvm")
    assert e.value.field == "image"
    with pytest.raises(ValueError, match="cannot also have toolkits"):
        await client.create_vm(image="debian-vm", disk="dvm", toolkits=["x"])

    t0 = time.monotonic()
    sb = await client.create_vm(image="debian-vm", disk="dvm", memory_mb=512)
    print(f"boot to agent: {time.monotonic() - t0:.1f}s")
    pid = int((server.paths.vm_sandboxes / sb.id / "qemu.pid").read_text())
    try:
        assert sb.info.backend == "vm"
        assert (await sb.run("cat /proc/1/comm")).stdout == "systemd\n"
        assert (await sb.run("uname -r")).stdout.strip() == vm_disk.kernel_version
        # commands run under the agent started by the image's systemd (its unit's cgroup), root on vda
        r = await sb.run("id -u; cat /proc/self/cgroup; findmnt -no SOURCE,FSTYPE /")
        assert r.stdout.startswith("1000\n") and "/system.slice/dsec-agent.service" in r.stdout, r
        assert "/dev/vda ext4" in r.stdout, r
        await sb.files.write("/work/data.txt", "payload")
        assert await sb.files.read_text("/work/data.txt") == "payload"
        assert any(e.name == "data.txt" for e in await sb.files.list("/work"))
        console = await sb.console()
        assert "systemd" in console and "Reached target" in console and "dsec-agent.service" in console
        # suspend to disk and back: the same VM, its files and processes, even though the disk
        # it booted from is rebuilt meanwhile (the VM holds its own link to the old one)
        await sb.run("sleep 1000 >/dev/null 2>&1 &")
        await sb.suspend()
        assert not pid_alive(pid, sb.id)
        old_inode = f.qcow2.stat().st_ino
        await asyncio.to_thread(disks.build, server.paths, "dvm", "debian-vm")
        assert f.qcow2.stat().st_ino != old_inode
        linked = server.paths.vm_sandboxes / sb.id / "chain-disk-dvm.qcow2"
        assert linked.stat().st_ino == old_inode
        assert linked.stat().st_mtime_ns == base_mtime     # untouched: the VM writes its own overlay
        r = await sb.run("cat /work/data.txt; grep -qx sleep /proc/[0-9]*/comm && echo sleeping")
        assert r.stdout == "payloadsleeping\n", r
        pid = int((server.paths.vm_sandboxes / sb.id / "qemu.pid").read_text())
    finally:
        await sb.stop()
    assert not pid_alive(pid, sb.id)
    assert not (server.paths.vm_sandboxes / sb.id).exists()
