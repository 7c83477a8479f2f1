"""Parking containers (suspend/resume): the cgroup is frozen and its memory pushed to
(compressed) swap; processes, running execs, sessions, files and network policy survive;
any request resumes it; an edge restart keeps it parked (backends/container/parking.py)."""

from __future__ import annotations

import asyncio
import signal
import time
import warnings
from pathlib import Path

import pytest
from test_lifecycle import assert_freed

from conftest import wait_file
from dsec.backends.container import cgroups
from dsec.backends.container.parking import CgroupParking
from dsec.backends.container.spec import cgroup_path
from dsec.types import Conflict

# 100 MiB of anonymous memory whose checksum the process can print again later (after its
# pages went to swap and came back); it ends when /work/stop appears.
HOLD = r"""
import hashlib, os, time
buf = bytearray(os.urandom(100 << 20))
digest = hashlib.sha256(buf).hexdigest()
print("ready", os.getpid(), digest, flush=True)
open("/work/ready", "w").write(f"{os.getpid()} {digest}")
while not os.path.exists("/work/stop"):
    if os.path.exists("/work/check"):
        os.remove("/work/check")
        again = hashlib.sha256(buf).hexdigest()
        print("check", again, flush=True)
        open("/work/checked", "w").write(again)
    time.sleep(0.05)
print("bye", flush=True)
"""

# a timestamp every 20 ms: a gap shows when it could not run
TICKS = r"""
import time
with open("/work/ticks", "a", buffering=1) as f:
    while True:
        f.write(f"{time.time()}\n")
        time.sleep(0.02)
"""


def _parking() -> CgroupParking:
    return CgroupParking(cgroups.is_unified())


def _swap_free() -> int:
    """Free swap bytes on the host (zram from scripts/host-setup.sh)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SwapFree:"):
            return int(line.split()[1]) << 10
    return 0


async def test_parked_container_keeps_processes_memory_execs_sessions_files(client, server):
    sb = await client.create_container(image="debian-python", memory_mb=512)
    rel = cgroup_path(sb.id)
    try:
        await sb.run("cd /tmp && export KEEP=me", session="s")
        await sb.files.write("/work/f.txt", b"kept")
        await sb.files.write("/work/hold.py", HOLD.encode())
        policy = {"rules": [{"cidr": "10.0.0.5", "ports": [443], "protocol": "tcp"}]}
        await sb.set_network(policy)
        job = await sb.start("python3 /work/hold.py", tag="hold")       # a running detached exec
        pid, digest = (await wait_file(sb, "/work/ready")).split()
        await asyncio.sleep(0.3)                                         # idle after the checks

        before = _parking().memory(rel)
        t0 = time.monotonic()
        info = await sb.suspend()
        park_s = time.monotonic() - t0
        assert info.state.value == "suspended"
        assert (await sb.refresh()).state.value == "suspended"
        assert _parking().frozen(rel)                                    # nothing of it runs
        after = _parking().memory(rel)
        if _swap_free() > 200 << 20:
            # most of the 100 MiB left RAM (to compressed swap), the rest was page cache
            assert before.resident - after.resident > 80 << 20, (before, after)
            assert after.swapped > 80 << 20, after
        else:
            warnings.warn("no swap on this host (zram: scripts/host-setup.sh): the park could not push "
                          "anonymous memory out, not checked")
        assert cgroups.oom_kills(rel) == 0                               # the park killed nothing

        # any request resumes it transparently: session, files, network policy as they were
        t0 = time.monotonic()
        r = await sb.run("cat /work/f.txt; echo; echo $KEEP $(pwd)", session="s")
        resume_s = time.monotonic() - t0
        assert r.stdout == "kept\nme /tmp\n"
        assert (await sb.refresh()).state.value == "running"
        assert not _parking().frozen(rel)
        assert sb.info.network is not None and [str(x.cidr) for x in sb.info.network.rules] == ["10.0.0.5/32"]
        # the same process, its memory intact after the round trip through swap
        assert (await sb.run(f"kill -0 {pid}")).exit_code == 0
        await sb.run("touch /work/check")
        assert (await wait_file(sb, "/work/checked")) == digest
        # the detached exec ran on and its output is complete
        assert job.exec_id in {e.exec_id for e in await sb.execs()}
        await sb.run("touch /work/stop")
        res = await sb.attach(job.exec_id)
        assert res.exit_code == 0
        assert res.stdout == f"ready {pid} {digest}\ncheck {digest}\nbye\n"
        assert cgroups.oom_kills(rel) == 0
        print(f"park {park_s * 1000:.0f} ms, first request after {resume_s * 1000:.0f} ms, "
              f"resident {before.resident >> 20} -> {after.resident >> 20} MiB, swapped {after.swapped >> 20} MiB")
    finally:
        await sb.stop()


async def test_parked_container_cannot_run(client):
    """A counter writing timestamps every 20 ms shows a gap over the whole park."""
    sb = await client.create_container(image="debian-python")
    try:
        await sb.files.write("/work/ticks.py", TICKS.encode())
        await sb.start("python3 /work/ticks.py")
        await wait_file(sb, "/work/ticks")
        await asyncio.sleep(0.3)
        await sb.suspend()
        parked_at = time.time()
        await asyncio.sleep(2)
        resumed_at = time.time()
        await sb.resume()
        await asyncio.sleep(0.3)
        ticks = [float(x) for x in (await sb.files.read_text("/work/ticks")).split()]
        assert not [t for t in ticks if parked_at < t < resumed_at], "it ran while parked"
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) >= 1.9
        assert ticks[-1] > resumed_at                                   # and runs again after
    finally:
        await sb.stop()


async def test_suspend_of_a_stopped_container_is_a_conflict_and_stop_frees_a_parked_one(client, server):
    sb = await client.create_container(image="busybox")
    await sb.suspend()
    with pytest.raises(Conflict):                # already parked: suspend wants a running one
        await sb.suspend()
    await sb.stop()                               # a frozen container is torn down too
    assert_freed(server, sb.id)
    with pytest.raises(Conflict):
        await sb.suspend()


async def test_edge_restart_keeps_a_parked_container_parked(server):
    async with server.client() as c:
        sb = await c.create_container(image="busybox")
        await sb.files.write("/work/k", b"kept")
        job = await sb.start("sleep 1; echo done")
        await sb.suspend()
    server.kill(signal.SIGKILL)
    server.start()
    rel = cgroup_path(sb.id)
    async with server.client() as c:
        sb2 = await c.get(sb.id)
        assert sb2.info.state.value == "suspended"                       # recovery left it parked
        assert _parking().frozen(rel)
        assert await sb2.files.read_text("/work/k") == "kept"           # a request resumes it
        assert (await sb2.refresh()).state.value == "running"
        assert (await sb2.attach(job.exec_id)).stdout == "done\n"
        await sb2.stop()
    assert_freed(server, sb.id)


async def test_edge_restart_mid_park_thaws_and_restores_the_sandbox(server):
    """The edge died after freezing and changing the reclaim settings, before the park
    finished: recovery puts the settings back and thaws it; it runs on as before."""
    async with server.client() as c:
        sb = await c.create_container(image="busybox")
        await sb.files.write("/work/k", b"kept")
    rel = cgroup_path(sb.id)
    run_dir = server.paths.sandboxes / sb.id / "run"
    p = _parking()
    mem = p._mem(rel)
    setting = "memory.swap.max" if p.v2 else "memory.swappiness"
    original = (mem / setting).read_text().strip()
    (run_dir / "parking.json").write_text(f'{{"{setting}": "{original}"}}')
    (mem / setting).write_text("max" if p.v2 else "100")
    p.freeze(rel)
    server.kill(signal.SIGKILL)
    server.start()
    async with server.client() as c:
        sb2 = await c.get(sb.id)
        assert sb2.info.state.value == "running"
        assert not p.frozen(rel)
        assert (mem / setting).read_text().strip() == original
        assert not (run_dir / "parking.json").exists()
        assert await sb2.files.read_text("/work/k") == "kept"
        await sb2.stop()
