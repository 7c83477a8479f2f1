"""microVM and full-VM sandboxes through the whole stack: SDK -> apiserver -> edge -> QEMU
(TCG on this host) -> guest kernel -> the agent on virtio-serial. Clones of template snapshots,
cold boots, q35 with virtio-pmem + DAX, snapshot/restore-as-new, and the faults: QEMU killed,
guest kernel panic, disk full, edge restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import pytest

from dsec.backends.vm.qemu import pid_alive
from dsec.types import Conflict, InvalidArgument, MicroVMArgs
from dsec.testing.waiting import wait_until, wait_until_sync

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]


def _qemu_pid(server, sandbox_id: str) -> int:
    return int((server.paths.vm_sandboxes / sandbox_id / "qemu.pid").read_text())


async def _left_running(sb, within_s: float):
    """The sandbox's info once it is no longer running (or when within_s has passed)."""
    async def ended() -> bool:
        return (await sb.refresh()).state.value != "running"
    await wait_until(ended, timeout_s=within_s, every_s=0.2)
    return sb.info


def assert_vm_freed(server, sandbox_id: str, pid: int, within_s: float = 15.0) -> None:
    """QEMU gone and the VM's dir removed (a failed VM is reported failed first, then torn down)."""
    d = server.paths.vm_sandboxes / sandbox_id
    wait_until_sync(lambda: not pid_alive(pid, sandbox_id) and not d.exists(), timeout_s=within_s)
    assert not pid_alive(pid, sandbox_id)
    assert not d.exists()


async def test_microvm_clone_runs_commands_sessions_files(vm_client, server):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    assert sb.info.backend == "microvm" and sb.info.accel in ("kvm", "tcg")
    pid = _qemu_pid(server, sb.id)
    r = await sb.run("echo hello from $(uname -r); id -u")
    assert r.exit_code == 0 and "cloud-amd64" in r.stdout and r.stdout.endswith("1000\n"), r
    await sb.run("cd /tmp; export A=1", session="s")
    assert (await sb.run("echo $A $(pwd)", session="s")).stdout == "1 /tmp\n"
    await sb.files.write("/work/data.txt", "payload")
    assert await sb.files.read_text("/work/data.txt") == "payload"
    assert any(e.name == "data.txt" for e in await sb.files.list("/work"))
    chunks = [ev.data async for ev in sb.stream("for i in 1 2 3; do echo $i; sleep 0.1; done") if ev.type == "stdout"]
    assert "".join(chunks) == "1\n2\n3\n"
    info = await sb.refresh()
    assert info.host_pss_mb is not None and info.host_pss_mb > 0
    await sb.stop()
    assert_vm_freed(server, sb.id, pid)


async def test_clones_are_independent_and_get_their_own_entropy_and_clock(vm_client):
    a, b = [await vm_client.create_microvm(image="busybox", memory_mb=256, user="root") for _ in range(2)]
    try:
        await a.run("echo only-a > /root/mark")
        assert (await b.run("cat /root/mark")).exit_code != 0     # writes stay in each clone's disk
        ra = (await a.run("head -c 16 /dev/urandom | od -An -tx1")).stdout
        rb = (await b.run("head -c 16 /dev/urandom | od -An -tx1")).stdout
        assert ra != rb
        guest_now = int((await a.run("date +%s")).stdout)
        assert abs(guest_now - time.time()) < 30      # not the template's boot time
    finally:
        await a.stop()
        await b.stop()


async def test_microvm_guest_keeps_per_entry_landlock_rules(vm_client):
    """D11: the guest's /proc and /dev are writable mounts, so the agent does not grant / itself
    there (containers do): root writes below existing top-level entries but cannot create one,
    nor write /proc or /dev; the files API makes a new top-level directory for later commands."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256, user="root")
    try:
        r = await sb.run("mkdir -p /usr/local/bin && touch /usr/local/bin/y && echo ok; mkdir /app; "
                         "echo x > /proc/self/comm; touch /dev/x; ls /dev | grep -c '^x$'")
        assert r.stdout == "ok\n0\n", r
        assert r.stderr.count("Permission denied") == 3, r
        await sb.files.write("/app/f", "x")                 # mkdirs: a new top-level directory
        assert (await sb.run("echo y >> /app/f && cat /app/f")).stdout == "xy\n"
    finally:
        await sb.stop()


async def test_cold_boot_and_q35_with_pmem_dax(vm_client, server):
    cold = await vm_client.create_microvm(image="busybox", memory_mb=256, clone=False)
    vm = await vm_client.create_vm(image="busybox", memory_mb=256)
    try:
        assert (await cold.run("echo cold")).stdout == "cold\n"
        # the layer is a DAX-capable pmem device (mapped, not copied), only the upper is a disk
        r = await vm.run("ls /sys/block; cat /sys/block/pmem0/queue/dax")
        assert r.stdout.split() == ["pmem0", "vda", "1"], r
        assert (await vm.run("ls /bin/busybox")).exit_code == 0
    finally:
        await cold.stop()
        await vm.stop()


async def test_snapshot_restores_as_new_sandboxes(vm_client):
    src = await vm_client.create_microvm(image="busybox", memory_mb=256)
    try:
        await src.files.write("/work/state.txt", "before")
        await src.run("sleep 1000 >/dev/null 2>&1 &")                   # a process in memory
        snap = await src.snapshot()
        assert snap.id.startswith("snap-") and snap.size_bytes > 0
        await src.files.write("/work/state.txt", "after")              # the source runs on
        new = await vm_client.create_microvm(image="busybox", snapshot=snap.id)
        try:
            assert await new.files.read_text("/work/state.txt") == "before"
            assert "sleep 1000" in (await new.run("ps")).stdout
            await new.files.write("/work/state.txt", "new")
            assert await src.files.read_text("/work/state.txt") == "after"
        finally:
            await new.stop()
    finally:
        await src.stop()
    with pytest.raises(InvalidArgument) as e:     # a snapshot restores only as its own kind
        await vm_client.create_vm(image="busybox", snapshot=snap.id)
    assert e.value.field == "backend"


async def test_qemu_killed_marks_failed_with_console_and_frees(vm_client, server):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    pid = _qemu_pid(server, sb.id)
    os.kill(pid, signal.SIGKILL)
    info = await _left_running(sb, within_s=20)
    assert info.state.value == "failed" and "QEMU process exited" in (info.error or ""), info
    assert "console" in info.error
    assert_vm_freed(server, sb.id, pid)
    assert "dsec-init: root ready" in await sb.console()   # the boot log outlives the VM
    with pytest.raises(Conflict):
        await sb.run("true")


async def test_guest_shutting_itself_down_marks_failed_and_frees(vm_client, server):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256, user="root")
    pid = _qemu_pid(server, sb.id)
    # commands cannot crash the guest kernel through sysrq (Landlock keeps /proc read-only) ...
    r = await sb.run("echo c > /proc/sysrq-trigger")
    assert r.exit_code != 0 and "Permission denied" in r.stderr
    # ... but root in a VM may reboot it: QEMU runs with -no-reboot, so the VM ends
    try:
        await sb.run("reboot -f", timeout_s=10)
    except Exception:
        pass          # the channel dies with the guest
    info = await _left_running(sb, within_s=30)
    assert info.state.value == "failed" and "shut itself down" in (info.error or ""), info
    assert_vm_freed(server, sb.id, pid)


async def test_disk_full_in_guest_is_an_error_not_a_dead_sandbox(vm_client):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256, disk_mb=64)
    try:
        r = await sb.run("dd if=/dev/zero of=/work/fill bs=1M count=200", timeout_s=120)
        assert r.exit_code != 0 and "No space left" in r.stderr, r
        assert (await sb.run("rm /work/fill; echo ok")).stdout == "ok\n"
    finally:
        await sb.stop()


async def test_vm_has_no_network_policy_to_change(vm_client):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    try:
        with pytest.raises(InvalidArgument) as e:
            await sb.set_network(rules=[{"cidr": "10.0.0.0/8"}])
        assert e.value.field == "network" and "network={}" in (e.value.fix or "")   # made without one
        assert "eth0" not in (await sb.run("cat /proc/net/dev")).stdout   # no NIC at all
    finally:
        await sb.stop()


async def test_bad_vm_arguments_name_the_field(vm_client):
    with pytest.raises(InvalidArgument) as e:
        await vm_client._request("POST", "/v1/sandboxes", json={"backend": "microvm", "image": "busybox", "vcpus": 0})
    assert e.value.field == "vcpus"
    with pytest.raises(InvalidArgument) as e:
        await vm_client._request("POST", "/v1/sandboxes", json={"backend": "microvm", "image": "busybox",
                                                                "secrets": ["s"]})
    assert e.value.field == "secrets" and "accel" in (e.value.fix or "")


async def test_edge_restart_keeps_vms(server):
    async with server.client() as c:
        if "microvm" not in (await c.nodes())[0].backends:
            pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
        sb = await c.create_microvm(image="busybox", memory_mb=256)
        await sb.run("echo kept > /work/k")
    server.kill(signal.SIGKILL)
    server.start()
    async with server.client() as c:
        sb2 = await c.get(sb.id)
        assert sb2.info.state.value == "running"
        assert (await sb2.run("cat /work/k")).stdout == "kept\n"
        await sb2.stop()


async def test_suspend_to_disk_frees_memory_and_next_request_resumes(vm_client, server):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    try:
        pid = _qemu_pid(server, sb.id)
        stream = sb.stream("sleep 3; echo survived", timeout_s=120)   # a command in flight
        start = await anext(stream)
        await stream.aclose()
        info = await sb.suspend()
        assert info.state.value == "suspended"
        assert not pid_alive(pid, sb.id)                                 # the host memory is free
        assert (await sb.refresh()).state.value == "suspended"
        r = await sb.run("echo back")                                    # resumes transparently
        assert r.stdout == "back\n"
        assert (await sb.refresh()).state.value == "running"
        assert (await sb.attach(start.exec_id)).stdout == "survived\n"   # and the command ran on
        guest_now = int((await sb.run("date +%s")).stdout)
        assert abs(guest_now - time.time()) < 30
    finally:
        await sb.stop()
    assert not (server.paths.vm_sandboxes / sb.id).exists()


async def test_idle_vm_is_parked_then_resumed_by_its_next_request(vm_client):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256, suspend_idle_s=1)
    try:
        await sb.files.write("/work/x", "kept")
        deadline = time.monotonic() + 30
        while (await sb.refresh()).state.value != "suspended" and time.monotonic() < deadline:
            await asyncio.sleep(0.3)
        assert sb.info.state.value == "suspended"
        assert await sb.files.read_text("/work/x") == "kept"
    finally:
        await sb.stop()


async def test_hung_guest_is_marked_failed_and_freed(vm_client, server):
    """A guest that stops running (here: its QEMU frozen with SIGSTOP) keeps its process but
    stops answering; the edge's liveness pings (every DSEC_VM_PING_S=2 s in tests) notice."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    pid = _qemu_pid(server, sb.id)
    os.kill(pid, signal.SIGSTOP)
    info = await _left_running(sb, within_s=90)
    assert info.state.value == "failed" and "hung" in (info.error or ""), info
    assert_vm_freed(server, sb.id, pid)


async def test_request_to_a_guest_that_stops_mid_command_ends(vm_client, server):
    """A guest frozen while a command runs: the request does not hang forever; the liveness
    pings (busy VMs too) fail the VM and the waiting request gets an error."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    pid = _qemu_pid(server, sb.id)

    async def freeze_soon() -> None:
        await asyncio.sleep(1.0)
        os.kill(pid, signal.SIGSTOP)

    freezer = asyncio.create_task(freeze_soon())
    with pytest.raises(Exception):
        await asyncio.wait_for(sb.run("sleep 600", timeout_s=900), timeout=120)
    await freezer
    info = await sb.refresh()
    assert info.state.value == "failed" and "hung" in (info.error or ""), info
    assert_vm_freed(server, sb.id, pid)


async def test_burst_of_clones_each_ready_and_independent(vm_client):
    args = MicroVMArgs(image="busybox", memory_mb=256)
    made = [c async for c in vm_client.create_many(6, args, concurrency=6)]
    try:
        assert all(c.ok for c in made), [c.error for c in made]
        outs = await asyncio.gather(*(c.sandbox.run("echo $$; hostname") for c in made))
        assert all(o.exit_code == 0 for o in outs)
    finally:
        await asyncio.gather(*(c.sandbox.stop() for c in made if c.sandbox))
