"""Parking a quiescent container to disk (backends/container/hibernate.py, D44): nothing but its
agent runs, so suspend tears it down to its directory (no crun state, cgroup, process or
network left) and the next request starts it again with its files, ids, limits, network
policy and containment; anything that lives outside the files keeps it parked in memory."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3

from test_lifecycle import _crun_ids, assert_freed

from dsec.backends.container import cgroups
from dsec.backends.container.hibernate import on_disk
from dsec.backends.container.parking import CgroupParking
from dsec.backends.container.spec import cgroup_path
from dsec.types import ContainerArgs


def _run_dir(server, sandbox_id: str):
    return server.paths.sandboxes / sandbox_id / "run"


def assert_on_disk(server, sandbox_id: str) -> None:
    """Parked to disk: its directory and nothing else."""
    assert on_disk(_run_dir(server, sandbox_id))
    assert sandbox_id not in _crun_ids(server)
    assert cgroups.leftover_dirs(cgroup_path(sandbox_id)) == []
    assert not (_run_dir(server, sandbox_id) / "pid").exists()
    assert (server.paths.sandboxes / sandbox_id / "upper").is_dir()


def assert_in_memory(server, sandbox_id: str) -> None:
    """Parked the other way: frozen, its processes kept."""
    assert not on_disk(_run_dir(server, sandbox_id))
    assert CgroupParking(cgroups.is_unified()).frozen(cgroup_path(sandbox_id))


async def test_quiescent_container_parks_to_disk_and_comes_back_as_it_was(client, server):
    sb = await client.create_container(ContainerArgs(image="debian-python", memory_mb=384, pids_limit=77))
    try:
        await sb.files.write("/work/f.txt", b"kept")
        await sb.run("echo tmp > /tmp/t && mkdir -p /home/x && chown 1234:1234 /home/x", user="root")
        policy = {"rules": [{"cidr": "10.0.0.5", "ports": [443], "protocol": "tcp"}]}
        await sb.set_network(policy)
        before = (await sb.run("cat /proc/self/uid_map; id -u; ls -ln /home; ulimit -n")).stdout
        info = await sb.suspend()
        assert info.state.value == "suspended"
        assert_on_disk(server, sb.id)
        parked = await sb.refresh()
        assert parked.host_pss_mb == 0 and parked.host_swap_mb == 0

        # a request starts it again: files (upper dir and /tmp), id range, user, limits, policy
        assert await sb.files.read_text("/work/f.txt") == "kept"
        assert (await sb.refresh()).state.value == "running"
        assert not on_disk(_run_dir(server, sb.id))
        after = (await sb.run("cat /proc/self/uid_map; id -u; ls -ln /home; ulimit -n")).stdout
        assert after == before
        assert (await sb.run("cat /tmp/t")).stdout == "tmp\n"
        mem = cgroups.v2_dir(cgroup_path(sb.id)) / "memory.max" if cgroups.is_unified() else \
            cgroups.v1_dir("memory", cgroup_path(sb.id)) / "memory.limit_in_bytes"
        assert int(mem.read_text()) == 384 << 20
        pids = cgroups.v2_dir(cgroup_path(sb.id)) if cgroups.is_unified() else cgroups.v1_dir("pids", cgroup_path(sb.id))
        assert (pids / "pids.max").read_text().strip() == "77"
        allows = sqlite3.connect(server.paths.edge_db).execute(
            "SELECT allows FROM net_sandboxes WHERE sandbox_id=?", (sb.id,)).fetchone()
        assert allows is not None and "10.0.0.5" in allows[0]          # the driver's policy, re-applied
        # commands run as before, and the next park goes to disk again
        assert (await sb.run("python3 -c 'print(6*7)'")).stdout == "42\n"
        await sb.suspend()
        assert_on_disk(server, sb.id)
    finally:
        await sb.stop()
    assert_freed(server, sb.id)


async def test_what_lives_outside_the_files_keeps_it_parked_in_memory(client, server):
    """A background process, a file in /dev/shm, a System V shared memory segment, or exec
    output nobody collected: each would be lost by a fresh start, so the park stays in memory
    and all of it is there after the resume."""
    cases = {
        "process": "sleep 1000 > /dev/null 2>&1 &",
        "shm file": "echo x > /dev/shm/keep",
        "sysv shm": "python3 -c \"import ctypes; print(ctypes.CDLL(None).shmget(0, 4096, 0o1600))\"",
    }
    for what, cmd in cases.items():
        sb = await client.create_container(image="debian-python")
        try:
            r = await sb.run(cmd, user="root")
            assert r.exit_code == 0, (what, r.stderr)
            await sb.suspend()
            assert_in_memory(server, sb.id)
            await sb.resume()
            check = {"process": "grep -lx sleep /proc/[0-9]*/comm", "shm file": "cat /dev/shm/keep", "sysv shm": "cat /proc/sysvipc/shm"}
            out = (await sb.run(check[what])).stdout
            assert out.strip() and (what != "sysv shm" or len(out.splitlines()) == 2), (what, out)
            await sb.run({"process": "kill $(grep -lx sleep /proc/[0-9]*/comm | cut -d/ -f3)", "shm file": "rm /dev/shm/keep",
                          "sysv shm": "ipcrm --all=shm || true"}[what], user="root")
            await asyncio.sleep(0.2)
        finally:
            await sb.stop()
        assert_freed(server, sb.id)

    # exec output only the agent holds (the edge let go of the exec at an earlier park while it
    # ran): a fresh agent would not have it, so the park is in memory until it is collected
    sb = await client.create_container(image="busybox")
    try:
        job = await sb.start("sleep 1; echo done")
        await sb.suspend()
        assert_in_memory(server, sb.id)                  # it runs
        await sb.resume()
        await asyncio.sleep(1.5)                         # it has finished, output in the agent
        await sb.suspend()
        assert_in_memory(server, sb.id)
        assert (await sb.attach(job.exec_id)).stdout == "done\n"
        await sb.suspend()                               # collected: now it goes to disk
        assert_on_disk(server, sb.id)
        # a detached exec the edge followed to its end: its result is the edge's, kept
        quick = await sb.start("echo quick")
        await asyncio.sleep(0.5)
        await sb.suspend()
        assert_on_disk(server, sb.id)
        assert (await sb.attach(quick.exec_id)).stdout == "quick\n"
    finally:
        await sb.stop()
    assert_freed(server, sb.id)


async def test_edge_restart_keeps_a_container_parked_to_disk(server):
    async with server.client() as c:
        sb = await c.create_container(image="busybox")
        await sb.files.write("/work/k", b"kept")
        await sb.suspend()
        assert_on_disk(server, sb.id)
    server.kill(signal.SIGKILL)
    server.start()
    async with server.client() as c:
        sb2 = await c.get(sb.id)
        assert sb2.info.state.value == "suspended"
        assert_on_disk(server, sb.id)
        assert await sb2.files.read_text("/work/k") == "kept"           # a request starts it again
        assert (await sb2.refresh()).state.value == "running"
        await sb2.stop()
    assert_freed(server, sb.id)


async def test_edge_death_between_marker_and_teardown_is_finished_on_resume(server):
    """The edge died after marking the park to disk, before tearing the runtime down: the
    container is still there (frozen). Recovery keeps it parked; the resume removes what was
    left and starts it again."""
    async with server.client() as c:
        sb = await c.create_container(image="busybox")
        await sb.files.write("/work/k", b"kept")
    run = _run_dir(server, sb.id)
    rel = cgroup_path(sb.id)
    p = CgroupParking(cgroups.is_unified())
    p.freeze(rel)
    (run / "parked").write_text(json.dumps({"at": 0, "to_disk": True, "pushed_out": 0}))
    server.kill(signal.SIGKILL)
    server.start()
    async with server.client() as c:
        sb2 = await c.get(sb.id)
        assert sb2.info.state.value == "suspended"
        assert await sb2.files.read_text("/work/k") == "kept"
        assert (await sb2.run("echo ok")).stdout == "ok\n"
        await sb2.stop()
    assert_freed(server, sb.id)


async def test_a_container_started_again_is_contained_as_before(client, server):
    """Containment of the start from disk: same user namespace range, masked paths, no
    capabilities beyond the profile, and nothing in the sandbox sees or steers how it is
    started again (the spec lives in the host-side run dir)."""
    sb = await client.create_container(image="busybox")
    try:
        probe = ("cat /proc/self/uid_map; grep CapEff /proc/self/status; wc -c < /proc/kcore 2>&1; "
                 "ls /sys/firmware | wc -l; ls /.dsec 2>&1 | head -1")
        before = (await sb.run(probe, user="root")).stdout
        await sb.suspend()
        assert_on_disk(server, sb.id)
        after = (await sb.run(probe, user="root")).stdout
        assert after == before
        assert "spec.json" not in (await sb.run("find / -xdev -name 'spec.json' 2>/dev/null", user="root")).stdout
    finally:
        await sb.stop()
    assert_freed(server, sb.id)
