"""Attacks from inside VM sandboxes (microvm clones): the guest root must not reach the agent's
channel, the read-only layers shared by every VM of the node, the template the clones share,
the host's network or the platform's sockets. Each check of the host runs here, on the host."""

from __future__ import annotations

import shutil

import pytest

from containment._util import sha256

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]


@pytest.fixture
async def vm_pair(vm_client):
    attacker = await vm_client.create_microvm(image="busybox", memory_mb=256, user="root")
    victim = await vm_client.create_microvm(image="busybox", memory_mb=256)
    await victim.files.write("/work/secret", "victim-data")
    yield attacker, victim
    await attacker.stop()
    await victim.stop()


def _layer_and_template_files(server) -> list:
    files = list(server.paths.store.rglob("*.erofs")) + list(server.paths.vm_templates.rglob("upper.img"))
    assert files, "expected layer files and a template disk on the host"
    return files


async def test_guest_root_cannot_forge_agent_requests_on_its_port(vm_pair):
    """The agent holds the virtio-serial port open (exclusive) and Landlock hides the device."""
    attacker, _ = vm_pair
    r = await attacker.run("for p in /dev/vport*; do echo x > $p && echo WROTE $p; cat $p & done; sleep 1; kill %1 2>/dev/null")
    assert "WROTE" not in r.stdout, r
    assert (await attacker.run("echo still-served")).stdout == "still-served\n"


async def test_guest_root_cannot_change_shared_layers_or_the_template(vm_pair, server):
    """Layer disks are attached read-only and the template disk is only a qcow2 backing file:
    raw writes to every block device from guest root change nothing on the host."""
    attacker, victim = vm_pair
    files = _layer_and_template_files(server)
    before = {p: sha256(p) for p in files}
    await attacker.run("for d in /dev/vd? /dev/vd?? ; do dd if=/dev/zero of=$d bs=4k count=16 conv=notrunc; done; sync",
                       timeout_s=60)
    assert {p: sha256(p) for p in files} == before
    assert await victim.files.read_text("/work/secret") == "victim-data"
    assert (await victim.run("ls /bin/busybox")).exit_code == 0


async def test_guest_has_no_network_to_the_platform(vm_pair, server):
    """No NIC at all: the apiserver, the host and metadata addresses are unreachable."""
    attacker, _ = vm_pair
    r = await attacker.run(f"ls /sys/class/net; wget -q -T 2 -O- http://127.0.0.1:{server.port}/healthz; "
                           "wget -q -T 2 -O- http://169.254.169.254/; echo rc=$?")
    assert r.stdout.split()[0] == "lo" and "eth" not in r.stdout and '"ok"' not in r.stdout, r


async def test_guest_cannot_read_another_vms_disk(vm_pair):
    """Each VM sees only its own upper disk and the read-only layers."""
    attacker, _ = vm_pair
    r = await attacker.run("cat /sys/block/*/serial 2>/dev/null; grep -rl victim-data /dev/vd* 2>/dev/null; echo done")
    assert "victim-data" not in r.stdout and "dsec-upper" in r.stdout
