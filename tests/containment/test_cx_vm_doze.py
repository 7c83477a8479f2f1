"""Dozing VMs (backends/vm/doze.py) and other tenants: one tenant's guest, root and busy,
neither wakes nor sees a neighbour that dozes (the neighbour's QEMU stays stopped through the
attacker's work, and the attacker's view of the node is the same as before: no device, file or
address of the other VM); a dozing VM that is stopped leaves nothing behind: no QEMU, no
directory, no sockets, its swapped-out memory freed with its process.

What a guest could learn about another's dozing: only timing, as before (CPU contention, and
KSM's copy-on-write faults, docs/security.md: DSEC_VM_KSM=0 closes that one). The pages pushed
out are the dozing QEMU's own private ones; pages KSM merged or that other processes map are
skipped by the kernel, so a neighbour's accesses to shared pages take no new fault."""

from __future__ import annotations

import shutil

import pytest
from conftest import side_server
from test_vm_doze import IDLE_S, qmp_status, wait_for

from dsec.home_qemus import qemu_pids_of

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]


@pytest.fixture(scope="module")
def dozing_node(images, dsec_home, tmp_path_factory):
    with side_server(dsec_home, tmp_path_factory, "cx-vm-doze", {"DSEC_RECLAIM_IDLE_S": IDLE_S,
                                                                 "DSEC_RECLAIM_PRESSED_IDLE_S": IDLE_S,
                                                                 "DSEC_VM_PING_S": "1"}, downloads=True) as srv:
        yield srv.home, srv


async def test_a_tenant_neither_wakes_nor_sees_a_dozing_neighbour(dozing_node):
    home, srv = dozing_node
    async with srv.client() as c:
        if "microvm" not in (await c.nodes())[0].backends:
            pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
        victim = await c.create_microvm(image="busybox", memory_mb=256)
        attacker = await c.create_microvm(image="busybox", memory_mb=256, user="root")
        try:
            await victim.files.write("/work/secret", "victim-data")
            await wait_for(lambda: qmp_status(srv, victim.id) == "paused", "the victim dozes")
            pid = int((srv.paths.vm_sandboxes / victim.id / "qemu.pid").read_text())
            # the attacker works, as root, looking for the neighbour by every way it has
            r = await attacker.run("ls /dev /sys/class/net /sys/bus/virtio/devices; cat /proc/swaps; "
                                   "grep -r victim-data /dev/vd* 2>/dev/null | head -c 100; "
                                   "for i in $(seq 30000); do :; done; echo done", timeout_s=120)
            assert r.stdout.rstrip().endswith("done"), r
            assert "victim-data" not in r.stdout
            assert victim.id not in r.stdout
            assert qmp_status(srv, victim.id) == "paused", "another tenant's work woke the dozing VM"
            # its own next request wakes it, with its data
            assert await victim.files.read_text("/work/secret") == "victim-data"
        finally:
            await attacker.stop()
            await wait_for(lambda: qmp_status(srv, victim.id) == "paused", "the victim dozes again")
            await victim.stop()
    # a dozing VM's stop: nothing of it is left
    assert not (srv.paths.vm_sandboxes / victim.id).exists()
    assert pid not in qemu_pids_of(home), "the dozing VM's QEMU outlived its stop"
