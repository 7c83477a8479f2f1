"""Sandboxes see their own size (D50): nproc, os.cpu_count(), /proc/meminfo and `free` say the
sandbox's CPU and memory limits, not the host's (a cpuset of ceil(cpu_cores) CPUs, lxcfs's
/proc files bound over the sandbox's own). Real containers, a real lxcfs daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsec.backends.container.hibernate import on_disk
from dsec.backends.container.lxcfs import Lxcfs
from dsec.testing.waiting import wait_until
from conftest import side_server

# what each reader says: coreutils nproc (sched_getaffinity), Python (glibc: sys/.../cpu/online),
# the affinity itself, /proc/cpuinfo, /proc/meminfo and procps `free -m`
SIZE = r"""python3 - <<'EOF'
import json, os, subprocess
mem = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/meminfo')}
free = subprocess.run(['free', '-m'], capture_output=True, text=True).stdout.split('\n')[1].split()
print(json.dumps({
    'nproc': int(subprocess.run(['nproc'], capture_output=True, text=True).stdout),
    'cpu_count': os.cpu_count(), 'affinity': len(os.sched_getaffinity(0)),
    'cpuinfo': sum(l.startswith('processor') for l in open('/proc/cpuinfo')),
    'mem_total_kb': mem['MemTotal'], 'mem_available_kb': mem['MemAvailable'],
    'free_total_mb': int(free[1])}))
EOF"""


async def size_of(sb) -> dict:
    r = await sb.run(SIZE)
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


def assert_size(seen: dict, cpus: int, memory_mb: int) -> None:
    host = len(os.sched_getaffinity(0))
    want_cpus = min(cpus, host)
    assert (seen["nproc"], seen["cpu_count"], seen["affinity"], seen["cpuinfo"]) == (want_cpus,) * 4, seen
    assert seen["mem_total_kb"] == memory_mb * 1024, seen
    assert 0 < seen["mem_available_kb"] <= seen["mem_total_kb"], seen
    assert seen["free_total_mb"] == memory_mb, seen


async def test_one_core_512(client):
    sb = await client.create_container(image="debian-python", cpu_cores=1, memory_mb=512)
    try:
        assert_size(await size_of(sb), 1, 512)
    finally:
        await sb.stop()


async def test_two_cores_1024_and_half_core(client):
    sb = await client.create_container(image="debian-python", cpu_cores=2, memory_mb=1024)
    half = await client.create_container(image="debian-python", cpu_cores=0.5, memory_mb=256)
    try:
        assert_size(await size_of(sb), 2, 1024)
        assert_size(await size_of(half), 1, 256)      # fractional cores count as one CPU
    finally:
        await sb.stop()
        await half.stop()


async def test_size_after_suspend_in_memory_and_to_disk(client, server):
    sb = await client.create_container(image="debian-python", cpu_cores=1, memory_mb=512)
    run = server.paths.sandboxes / sb.id / "run"
    try:
        bg = await sb.start("sleep 600")           # a process kept: parked in memory (frozen)
        await sb.suspend()
        assert not on_disk(run)
        await sb.resume()
        assert_size(await size_of(sb), 1, 512)
        await sb.signal(bg.exec_id, 9)
        await sb.attach(bg.exec_id)
        await sb.suspend()                          # quiescent: parked to disk, started again
        assert on_disk(run)
        await sb.resume()
        assert not on_disk(run)
        assert_size(await size_of(sb), 1, 512)
    finally:
        await sb.stop()


async def test_lxcfs_killed_is_started_again_and_views_repaired(client, server):
    """kill -9 of the node's lxcfs: its binds read ENOTCONN for good, so the edge starts a new
    daemon and moves fresh binds into every running sandbox (a parked, frozen one too)."""
    lx = Lxcfs(server.paths.home / "lxcfs")
    sb = await client.create_container(image="debian-python", cpu_cores=1, memory_mb=512)
    frozen = await client.create_container(image="debian-python", cpu_cores=2, memory_mb=1024)
    try:
        await frozen.start("sleep 600")
        await frozen.suspend()                      # in memory: frozen while the daemon dies
        old = lx.pid()
        assert old is not None
        os.kill(old, 9)

        async def repaired() -> dict | None:
            new = lx.pid()
            if new is None or new == old:
                return None
            r = await sb.run("head -1 /proc/meminfo")
            return await size_of(sb) if r.exit_code == 0 else None
        assert_size(await wait_until(repaired, timeout_s=30, what="lxcfs restarted and views repaired"), 1, 512)
        await frozen.resume()
        assert_size(await size_of(frozen), 2, 1024)
        # and a sandbox created after it
        again = await client.create_container(image="debian-python", cpu_cores=1, memory_mb=256)
        try:
            assert_size(await size_of(again), 1, 256)
        finally:
            await again.stop()
    finally:
        await sb.stop()
        await frozen.stop()


async def test_microvm_sees_its_own_size_from_its_kernel(vm_client):
    """VMs need no view: the guest kernel has only the vcpus and memory it was given (its own
    reserved memory off MemTotal)."""
    sb = await vm_client.create_microvm(image="busybox", vcpus=2, memory_mb=384)
    try:
        r = await sb.run("nproc; grep -c ^processor /proc/cpuinfo; head -1 /proc/meminfo")
        nproc, cpuinfo, _, kb, _ = r.stdout.split()
        assert (nproc, cpuinfo) == ("2", "2"), r
        assert 300 << 10 < int(kb) <= 384 << 10, r
    finally:
        await sb.stop()


def test_lxcfs_outlives_the_cgroup_that_started_it(tmp_path):
    """The daemon is moved out of its starter's cgroup into dsec's own (lxcfs.py): ending every
    process of the starter's cgroup (systemd's `stop` with KillMode=control-group, a job runner
    cleaning up after a test run: what killed the default home's daemon twice, leaving its FUSE
    mount behind) leaves it serving."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    import pytest

    from dsec.backends.container import cgroups
    if os.geteuid() != 0 or not Lxcfs(tmp_path / "x").installed:
        pytest.skip("needs root and lxcfs")
    hier = cgroups.v2_root() if cgroups.is_unified() else cgroups.CGROUP_ROOT / "memory"
    starter = hier / f"dsec-test-starter-{os.getpid()}"
    starter.mkdir()
    lx = Lxcfs(tmp_path / "lxcfs")
    try:
        code = f"from pathlib import Path; from dsec.backends.container.lxcfs import Lxcfs; Lxcfs(Path({str(lx.mountpoint)!r})).ensure()"
        subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(starter / "cgroup.procs"),
                        sys.executable, "-c", code], check=True, timeout=60)
        pid = lx.pid()
        assert pid is not None and lx.healthy()
        left = [int(p) for p in (starter / "cgroup.procs").read_text().split()]
        for p in left:
            os.kill(p, 9)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{p}").exists() for p in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid not in left, f"lxcfs {pid} stayed in its starter's cgroup {starter}"
        assert lx.pid() == pid and lx.healthy()
        assert starter.name not in Path(f"/proc/{pid}/cgroup").read_text()
    finally:
        lx.stop()
        for p in (starter / "cgroup.procs").read_text().split():
            os.kill(int(p), 9)
        deadline = time.monotonic() + 30
        while True:
            try:
                starter.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def lxcfs_mounted(home) -> bool:
    """A fuse.lxcfs mount on the home's mountpoint (a live daemon's, or a dead one's left)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(home / "lxcfs") and line.split(" - ")[1].startswith("fuse.lxcfs")
                   for line in f)


def dsec_down(srv) -> None:
    """`dsec down` on the side server's home (SIGTERM, waits for the clean stop). `down` waits
    for the pid to go; the server is this test's child: reaped here meanwhile."""
    down = subprocess.Popen([sys.executable, "-m", "dsec", "down", "--timeout-s", "60"], env=srv.env,
                            stdout=subprocess.PIPE, text=True)
    srv.proc.wait(timeout=60)
    out = down.communicate(timeout=30)[0]
    assert "stopped" in out, (out, srv.log_tail())


@pytest.fixture
def lxcfs_server(images, dsec_home, tmp_path_factory):
    with side_server(dsec_home, tmp_path_factory, "lxcfs-down") as srv:
        yield srv


async def test_down_stops_lxcfs_only_when_no_sandbox_is_left(lxcfs_server):
    """D50 keeps the home's lxcfs across edge restarts for the sandboxes that survive them;
    `dsec down` with none left stops it (no fuse.lxcfs mount of the home stays behind), with
    one left keeps it (the same daemon serves the sandbox after the next `up`)."""
    srv, lx = lxcfs_server, Lxcfs(lxcfs_server.home / "lxcfs")
    async with srv.client() as c:
        sb = await c.create_container(image="debian-python", cpu_cores=1, memory_mb=512)
        assert_size(await size_of(sb), 1, 512)
        await sb.stop()
    pid = lx.pid()
    assert pid is not None and lxcfs_mounted(srv.home)
    dsec_down(srv)
    assert not lxcfs_mounted(srv.home), "dsec down with no sandbox left kept the home's lxcfs mount"
    assert lx.pid() is None
    await wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout_s=30, what="the home's lxcfs to exit")

    srv.start()
    async with srv.client() as c:
        sb = await c.create_container(image="debian-python", cpu_cores=1, memory_mb=512)
    kept = lx.pid()
    assert kept is not None
    dsec_down(srv)
    assert lx.pid() == kept and lxcfs_mounted(srv.home), "dsec down with a sandbox left stopped its lxcfs"
    srv.start()
    async with srv.client() as c:
        sb = await c.get(sb.id)
        assert_size(await size_of(sb), 1, 512)     # its views still answer, from the same daemon
        assert lx.pid() == kept
        await sb.stop()
    dsec_down(srv)
    assert not lxcfs_mounted(srv.home)
