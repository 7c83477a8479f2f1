"""Fork and container snapshots through the real server and dsec's own SDK (apiserver/forks.py,
backends/container/snapshots.py): what a fork carries and says it does not, the parent running
on unchanged, quota counted per fork, create from a snapshot, a snapshot deleted while
sandboxes stack it, snapshots of forks (chains)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from conftest import stranger_key

from dsec.iam import IAM
from dsec.sdk.client import Client
from dsec.types import CapacityExceeded, Conflict, NotFound, Unavailable
from dsec.testing.waiting import wait_until


@pytest.fixture(scope="module")
async def fc(server):
    c = server.client()
    async with c:
        yield c


async def test_fork_carries_files_and_settings_not_processes(fc):
    parent = await fc.create_container(image="busybox", env={"A": "1"}, labels={"job": "fork-t"},
                                       memory_mb=256, lifetime_s=3600, workdir="/work/w")
    try:
        await parent.run("mkdir -p /work/w && echo state > /work/w/f.txt")
        pid = int((await parent.run("sleep 100000 >/dev/null 2>&1 & echo $!")).stdout)
        before = await parent.refresh()
        forked = await parent.fork(2)
        assert [c.ok for c in forked.forks] == [True, True], [c.error for c in forked.forks]
        assert any("processes" in n for n in forked.not_carried), forked.not_carried
        for kid in forked.sandboxes:
            assert kid.id.split(".")[0] == parent.id.split(".")[0]         # placed on the parent's node
            assert kid.info.memory_mb == 256 and kid.info.labels == {"job": "fork-t"}
            r = await kid.run(f"cat f.txt; echo $A; pwd; kill -0 {pid} 2>/dev/null || echo no-sleep")
            assert r.stdout.split("\n")[:4] == ["state", "1", "/work/w", "no-sleep"], r.stdout
        after = await parent.refresh()     # same sandbox, same lifetime, its process still there
        assert after.state.value == "running" and after.expires_at == before.expires_at
        assert (await parent.run(f"kill -0 {pid} && echo alive")).stdout == "alive\n"
        for kid in forked.sandboxes:
            await kid.stop()
    finally:
        await parent.stop()


async def test_quota_counts_each_fork(server, fc):
    """A project allowed 3 sandboxes: its parent and two forks start, the other two are refused
    one by one (429 naming the quota), and the refusals hold nothing."""
    with IAM(server.paths.iam_db) as iam:
        key = iam.create_key(iam.create_project(f"forkq-{os.urandom(3).hex()}", iam.root().id,
                                                max_sandboxes=3).id)
    async with Client(server.url, key) as c:
        parent = await c.create_container(image="busybox")
        try:
            forked = await parent.fork(4)
            ok = [x for x in forked.forks if x.ok]
            refused = [x.error for x in forked.forks if not x.ok]
            assert len(ok) == 2 and len(refused) == 2, forked.forks
            assert all(isinstance(e, CapacityExceeded) for e in refused), refused
            for x in ok:
                await x.sandbox.stop()
            again = await parent.fork(1)       # the stopped forks gave their share back
            assert again.forks[0].ok, again.forks[0].error
            await again.forks[0].sandbox.stop()
        finally:
            await parent.stop()


async def test_create_from_a_snapshot_and_delete_it_while_used(fc, server):
    src = await fc.create_container(image="busybox", env={"S": "snap"})
    try:
        await src.run("echo one > /work/one.txt")
        snap = await src.snapshot()
        assert snap.backend == "container" and snap.sandbox_id == src.id and snap.size_bytes > 0
        assert snap.id in {s.id for s in await fc.snapshots()}
        await src.run("echo later > /work/later.txt")       # after the snapshot: not in it
        async with Client(server.url, stranger_key(server, "forksnap")) as other:   # another tenant
            with pytest.raises(NotFound):
                await other.create_container(image="busybox", snapshot=snap.id)
            assert snap.id not in {s.id for s in await other.snapshots()}
        made = await fc.create_container(image="busybox", snapshot=snap.id, env={"T": "2"})
        try:
            r = await made.run("cat /work/one.txt; ls /work/later.txt 2>&1; echo $S $T")
            assert r.stdout.startswith("one\n") and "No such file" in r.stdout and r.stdout.endswith("snap 2\n")
            await fc.delete_snapshot(snap.id)
            assert snap.id not in {s.id for s in await fc.snapshots()}
            with pytest.raises(NotFound):
                await fc.create_container(image="busybox", snapshot=snap.id)
            # the sandbox made from it runs on, its layer intact, also through a park to disk
            await made.suspend()
            await made.resume()
            r = await made.run("cat /work/one.txt && echo two > /work/two.txt && cat /work/two.txt")
            assert r.stdout == "one\ntwo\n", r.stdout
            assert (server.paths.sandboxes / ".snap" / snap.id).exists()
        finally:
            await made.stop()
        # its last user gone, the deleted snapshot's files go
        await wait_until(lambda: not (server.paths.sandboxes / ".snap" / snap.id).exists(), timeout_s=30,
                         what="the deleted snapshot's files to be removed")
    finally:
        await src.stop()


async def test_snapshot_and_pack_diff_of_a_fork_keep_the_parents_files(fc):
    """A fork's own upper holds only its changes: its snapshot stacks the parent's snapshot
    too, and its pack_diff packs that layer below its own (a layer made of the upper alone
    would silently drop the parent's files)."""
    parent = await fc.create_container(image="busybox")
    try:
        await parent.run("echo p > /work/p.txt; echo q > /work/q.txt; mkdir /work/dir; echo x > /work/dir/x")
        kid = (await parent.fork(1)).sandboxes[0]
        try:
            await kid.run("echo k > /work/k.txt; rm /work/p.txt; rm -r /work/dir; mkdir /work/dir; "
                          "echo y > /work/dir/y")
            want = "k\nq\ny\n", "No such file"
            snap = await kid.snapshot()
            grand = await fc.create_container(image="busybox", snapshot=snap.id)
            try:
                r = await grand.run("cat /work/k.txt /work/q.txt /work/dir/*; ls /work/p.txt /work/dir/x 2>&1")
                assert r.stdout.startswith(want[0]) and want[1] in r.stdout, r.stdout
            finally:
                await grand.stop()
                await fc.delete_snapshot(snap.id)
            name = f"fork-pack-{os.urandom(3).hex()}@v1"
            layer = await kid.pack_diff(name)
            assert len(layer.layers) >= 2, layer        # the snapshot's layer and the fork's own
            made = await fc.create_container(image="busybox", workspace=name)
            try:
                r = await made.run("cat /work/k.txt /work/q.txt /work/dir/*; ls /work/p.txt /work/dir/x 2>&1; "
                                   "stat -c %u /work/k.txt")
                assert r.stdout.startswith(want[0]) and want[1] in r.stdout, r.stdout
                assert r.stdout.rstrip().endswith("1000"), r.stdout      # owners as inside, not host ids
            finally:
                await made.stop()
        finally:
            await kid.stop()
    finally:
        await parent.stop()


async def test_snapshot_of_a_draining_node_without_a_shared_layer_store_is_refused_by_name(fc):
    """Carrying a container snapshot to another node needs DSEC_LAYER_STORE (one machine has
    none, and no other node): the refusal names it rather than the drain alone."""
    sb = await fc.create_container(image="busybox")
    snap = await sb.snapshot()
    await sb.stop()
    await fc.node_action(snap.node, "drain")
    try:
        with pytest.raises(Unavailable) as e:
            await fc.create_container(image="busybox", snapshot=snap.id)
        assert e.value.field == "DSEC_LAYER_STORE" and snap.node in e.value.message, e.value
    finally:
        await fc.node_action(snap.node, "uncordon")
        await fc.delete_snapshot(snap.id)


async def test_fork_of_a_stopped_sandbox_is_refused(fc):
    sb = await fc.create_container(image="busybox")
    await sb.stop()
    with pytest.raises((Conflict, NotFound)):
        await sb.fork(1)
    await asyncio.sleep(0)


async def test_microvm_fork_carries_memory_and_processes(vm_client, server):
    """A VM fork resumes the guest itself: files, a running process and the parent's own
    lifetime unchanged; the forks are restores of one snapshot whose RAM they map
    copy-on-write (backends/vm/snapram.py: one file, each fork's writes its own; host PSS per
    fork printed)."""
    src = await vm_client.create_microvm(image="busybox", memory_mb=256, labels={"vm": "fork"})
    try:
        await src.files.write("/work/state.txt", "before")
        await src.run("echo parent > /dev/shm/mem.txt")          # guest RAM (tmpfs), not its disk
        await src.run("sleep 1000 >/dev/null 2>&1 &")
        forked = await src.fork(2)
        assert [c.ok for c in forked.forks] == [True, True], [c.error for c in forked.forks]
        assert not any(n.startswith("processes") for n in forked.not_carried), forked.not_carried
        try:
            for kid in forked.sandboxes:
                assert kid.info.backend == "microvm" and kid.info.labels == {"vm": "fork"}
                assert await kid.files.read_text("/work/state.txt") == "before"
                assert "sleep 1000" in (await kid.run("ps")).stdout
            await forked.sandboxes[0].files.write("/work/state.txt", "kid")
            assert await src.files.read_text("/work/state.txt") == "before"
            # memory diverges: a write in one fork's RAM is not seen by its sibling or the parent
            kid0, kid1 = forked.sandboxes
            await kid0.run("echo kid0 > /dev/shm/mem.txt")
            await src.run("echo parent-later >> /dev/shm/mem.txt")
            assert (await kid0.run("cat /dev/shm/mem.txt")).stdout == "kid0\n"
            assert (await kid1.run("cat /dev/shm/mem.txt")).stdout == "parent\n"
            assert (await src.run("cat /dev/shm/mem.txt")).stdout == "parent\nparent-later\n"
            # ... while both QEMUs map the snapshot's one RAM file, read-only to them
            inodes = set()
            for kid in forked.sandboxes:
                d = server.paths.vm_sandboxes / kid.id
                pid = int((d / "qemu.pid").read_text())
                ram = os.stat(d / "snap.ram")
                assert f"{d / 'snap.ram'}" in open(f"/proc/{pid}/maps").read()
                inodes.add((ram.st_dev, ram.st_ino))
            assert len(inodes) == 1, inodes
            pss = [(await k.refresh()).host_pss_mb for k in forked.sandboxes]
            print(f"host PSS per microvm fork, MiB: {pss}")
        finally:
            for kid in forked.sandboxes:
                await kid.stop()
        assert all(s.sandbox_id != src.id for s in await vm_client.snapshots())   # the fork's own went
        # a VM snapshot holds memory and devices: never carried to another node, even when its
        # own takes no sandbox (containers' are: tests/test_cluster_state.py); said by name
        snap = await src.snapshot()
        await vm_client.node_action(snap.node, "drain")
        try:
            with pytest.raises(Unavailable) as e:
                await vm_client.create_microvm(image="busybox", memory_mb=256, snapshot=snap.id)
            assert e.value.field == "snapshot" and "memory and devices" in e.value.message, e.value
            assert "restore only on the node that took it" in e.value.message, e.value
        finally:
            await vm_client.node_action(snap.node, "uncordon")
            await vm_client.delete_snapshot(snap.id)
    finally:
        await src.stop()


async def test_edge_restart_keeps_snapshots_and_forks_and_sweeps_stale_users(server):
    """kill -9 of the server: its snapshots are not taken for orphan sandboxes, a fork runs on
    over its layer, a user marker left by a sandbox that no longer exists is swept (so deleting
    that snapshot frees it at once), and the fork's own snapshot goes with the fork."""
    snaps = server.paths.sandboxes / ".snap"
    async with server.client() as c:
        parent = await c.create_container(image="busybox")
        await parent.run("echo p > /work/p.txt")
        kid = (await parent.fork(1)).sandboxes[0]
        held = [d.name for d in snaps.iterdir() if (d / "users" / kid.id).exists()]
        assert len(held) == 1
        snap = await parent.snapshot()
        (snaps / snap.id / "users" / "sb-local.000000000000").touch()     # a user gone in a crash
    server.kill(signal.SIGKILL)
    server.start()
    async with server.client() as c:
        assert snap.id in {s.id for s in await c.snapshots()}
        kid2 = await c.get(kid.id)
        assert (await kid2.run("cat /work/p.txt")).stdout == "p\n"
        assert not (snaps / snap.id / "users" / "sb-local.000000000000").exists()
        await c.delete_snapshot(snap.id)
        assert not (snaps / snap.id).exists()            # nobody stacks it: its files went at once
        await kid2.stop()
        assert not (snaps / held[0]).exists()            # the fork's snapshot went with the fork
        await (await c.get(parent.id)).stop()
