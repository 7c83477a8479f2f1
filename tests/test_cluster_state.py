"""Volumes and container snapshots across the nodes of a cluster (issue 27 item 4), on a real
local Ray cluster of two raylets (one replica, SQLite control store) whose edges share one
DSEC_VOLUMES_DIR and one file:// layer store, as a cluster sharing an NFS/CephFS path would.

- One volume mounted into sandboxes of both nodes holds the same files for both; deleting it
  is refused while a sandbox of *any* node mounts it (before: only the answering node's own
  sandboxes were checked, so the volume was deleted under a sandbox of the other node).
- A container snapshot whose node is draining is created on the other node: its node packs it
  into the shared layer store as a workspace layer, and the create gets the snapshot's files,
  env and workdir there (before: 503 "node ... is draining").
- So is one whose node is full (its final capacity check refuses), not draining.
- Deleting that snapshot deletes its export from the shared layer store once no node uses it
  (before: kept for ever); one a sandbox still runs from stays, and that sandbox reads on.
- A snapshot whose node no longer answers: a create from it is 503 naming the node and
  `dsec nodes forget` (before: 404 "no snapshot" once the node left the cluster). Last: it
  kills a node.

One cluster for the module (~40-60 s to start on the 2-core box): each test cleans up after itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import urllib.parse
import tempfile
from pathlib import Path

import pytest
from conftest import NO_PSI_ADMISSION, requires_root

from dsec import Client
from dsec.testing.waiting import wait_until
from dsec.types import Conflict, Unavailable

pytest.importorskip("ray", reason="cluster mode needs ray: pip install -e '.[cluster]'")

SMALL = {"image": "busybox", "memory_mb": 64, "cpu_cores": 0.1}


class State:
    def __init__(self, admin: Client, nodes: list[str], local, shared: Path):
        self.admin, self.nodes, self.local, self.shared = admin, nodes, local, shared


@pytest.fixture(scope="module")
async def cluster():
    requires_root()
    from dsec.cluster.local import local_cluster

    shared = Path(tempfile.mkdtemp(prefix="dsec-clstate-", dir="/var/tmp"))
    (shared / "volumes").mkdir()
    (shared / "layers").mkdir()
    env = {**NO_PSI_ADMISSION, "DSEC_VOLUMES_DIR": str(shared / "volumes"),
           "DSEC_LAYER_STORE": f"file://{shared}/layers", "DSEC_LAZY": "0",
           "DSEC_MEM_OVERCOMMIT": "4"}    # a memory ceiling one sandbox's limit can fill (the full-node test)
    try:
        async with local_cluster(nodes=2, replicas=1, edge_env=env) as local:
            async with Client(local.replica_urls[0], local.admin_key) as admin:
                try:
                    yield State(admin, sorted(local.nodes), local, shared)
                finally:
                    for sb in await admin.list():
                        await (await admin.get(sb.id)).stop()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _node(sandbox_id: str) -> str:
    return sandbox_id.removeprefix("sb-").split(".")[0]


async def _one_per_node(admin: Client, nodes: list[str], **kw) -> dict[str, object]:
    """A sandbox on each node (placement spreads by load); extra ones are stopped."""
    got: dict[str, object] = {}
    for _ in range(8):
        sb = await admin.create_container(**SMALL, **kw)
        if _node(sb.id) in got:
            await sb.stop()
        else:
            got[_node(sb.id)] = sb
        if set(got) >= set(nodes):
            return got
    raise AssertionError(f"eight creates did not reach every node: {list(got)}")


async def test_one_volume_on_two_nodes_sees_the_same_files_and_is_not_deleted_under_either(cluster):
    name = f"shared-{os.urandom(3).hex()}"
    await cluster.admin.create_volume(name, size_mb=16)
    sbs = await _one_per_node(cluster.admin, cluster.nodes, volumes=[{"name": name, "path": "/mnt/v"}])
    first, other = (sbs[n] for n in cluster.nodes)
    # close-to-open: a file closed on one node is read whole on the other
    r = await first.run("printf from-first > /mnt/v/a.txt")
    assert r.exit_code == 0, r
    assert (await other.run("cat /mnt/v/a.txt")).stdout == "from-first"
    assert (await other.run("printf from-other > /mnt/v/b.txt")).exit_code == 0
    assert (await first.run("cat /mnt/v/b.txt")).stdout == "from-other"
    # the file API (answered by the first node) sees them too
    assert await cluster.admin.volume_read(name, "b.txt") == b"from-other"

    # the volume's keeper is the first node: with only the other node's sandbox mounting it,
    # the delete must still be refused, naming that sandbox
    await first.stop()
    with pytest.raises(Conflict) as e:
        await cluster.admin.delete_volume(name)
    assert other.id in e.value.message and e.value.field == "name", e.value
    assert (await other.run("cat /mnt/v/a.txt")).stdout == "from-first"   # still there
    await other.stop()
    await cluster.admin.delete_volume(name)
    assert name not in {v.name for v in await cluster.admin.volumes()}


async def test_a_container_snapshot_of_a_draining_node_is_created_on_the_other(cluster):
    sb = await cluster.admin.create_container(**SMALL, env={"KEPT": "yes"}, workdir="/srv")
    home = _node(sb.id)
    r = await sb.run("printf state > /srv/f.txt && mkdir -p /srv/d && printf x > /srv/d/g && sync")
    assert r.exit_code == 0, r
    snap = await sb.snapshot()
    assert snap.node == home and snap.id.startswith(f"snap-{home}.")    # the node's name (D55), not a Ray id
    await sb.stop()
    await cluster.admin.node_action(home, "drain")
    made = []
    try:
        for extra in ({"A": "1"}, {"B": "2"}):      # the second reuses the first's export
            new = await cluster.admin.create_container(**SMALL, snapshot=snap.id, env=extra)
            made.append(new)
            assert _node(new.id) != home, new.id
            assert (await new.run("cat /srv/f.txt /srv/d/g")).stdout == "statex"
            r = await new.run("echo $KEPT $A$B; pwd")
            assert r.stdout.split() == ["yes", "1" if "A" in extra else "2", "/srv"], r
    finally:
        await cluster.admin.node_action(home, "uncordon")
        for s in made:
            await s.stop()
    # on its own node again once it takes sandboxes
    back = await cluster.admin.create_container(**SMALL, snapshot=snap.id)
    try:
        assert _node(back.id) == home
        assert (await back.run("cat /srv/f.txt")).stdout == "state"
    finally:
        await back.stop()


async def _wait_empty(admin: Client, node_id: str):
    """The node as the nodes' view has it once nothing is placed or committed on it."""
    async def empty():
        n = {n.node_id: n for n in await admin.nodes()}[node_id]
        return n if n.sandboxes == 0 and n.committed_memory_mb == 0 else None
    return await wait_until(empty, timeout_s=30, every_s=0.3, what=f"node {node_id} to have nothing committed")


async def test_a_container_snapshot_of_a_full_node_is_created_on_the_other(cluster):
    """Full (its own final check refuses for capacity), not draining: the same carry. The
    snapshot's node is filled by a restore of the snapshot itself (restores go to its node)
    asking for all its memory ceiling (a cgroup limit: nothing is allocated); a small restore
    then does not fit there."""
    sb = await cluster.admin.create_container(**SMALL)
    home = _node(sb.id)
    assert (await sb.run("printf full > /tmp/f && sync")).exit_code == 0
    snap = await sb.snapshot()
    await sb.stop()

    node = await _wait_empty(cluster.admin, home)
    filler = await cluster.admin.create_container(**{**SMALL, "memory_mb": node.capacity.memory_mb - SMALL["memory_mb"] // 2},
                                                  snapshot=snap.id)
    try:
        assert _node(filler.id) == home
        moved = await cluster.admin.create_container(**SMALL, snapshot=snap.id)
        try:
            assert _node(moved.id) != home, moved.id
            assert (await moved.run("cat /tmp/f")).stdout == "full"
        finally:
            await moved.stop()
    finally:
        await filler.stop()
        # the node's ceiling was full: the next test places only once the nodes' view has it back
        await _wait_empty(cluster.admin, home)
    await cluster.admin.delete_snapshot(snap.id)


def _export_record(shared: Path, snapshot_id: str) -> Path:
    return shared / "layers" / "images" / (urllib.parse.quote(f"{snapshot_id}@export", safe="") + ".json")


async def test_deleting_a_snapshot_deletes_its_export_once_no_sandbox_uses_it(cluster):
    sb = await cluster.admin.create_container(**SMALL)
    home = _node(sb.id)
    assert (await sb.run("printf one > /tmp/f && sync")).exit_code == 0
    used = await sb.snapshot()
    assert (await sb.run("printf two > /tmp/f && sync")).exit_code == 0     # another layer digest
    unused = await sb.snapshot()
    await sb.stop()
    await cluster.admin.node_action(home, "drain")
    made = []
    try:
        for snap in (used, unused):
            made.append(await cluster.admin.create_container(**SMALL, snapshot=snap.id))
            assert _node(made[-1].id) != home
    finally:
        await cluster.admin.node_action(home, "uncordon")
    runs, done = made
    try:
        await done.stop()
        record = _export_record(cluster.shared, unused.id)
        top = json.loads(record.read_text())["layers"][-1]["digest"].split(":")[1]
        objects = [cluster.shared / "layers" / "layers" / f"{top}.{x}" for x in ("erofs", "chunks.json")]
        assert all(p.exists() for p in objects)
        await cluster.admin.delete_snapshot(unused.id)
        assert not record.exists() and not any(p.exists() for p in objects), "export left in the store"
        # a sandbox made from the other export still runs: that export stays, the sandbox reads on
        kept = _export_record(cluster.shared, used.id)
        await cluster.admin.delete_snapshot(used.id)
        assert kept.exists()
        assert (await runs.run("cat /tmp/f")).stdout == "one"
    finally:
        await runs.stop()


async def test_a_snapshot_of_a_node_that_no_longer_answers_is_a_503_naming_it(cluster):
    """Last in the module: it kills the worker node (not the head) for good."""
    worker = next(n for n, rn in cluster.local.nodes.items() if rn is not None)
    sbs = await _one_per_node(cluster.admin, cluster.nodes)
    for n, s in sbs.items():
        if n != worker:
            await s.stop()
    sb = sbs[worker]
    snap = await sb.snapshot()
    await sb.stop()
    await asyncio.to_thread(cluster.local.kill_node, worker)

    async def dropped() -> bool:       # discovery let it go (Ray declared its raylet dead)
        n = {n.node_id: n for n in await cluster.admin.nodes()}.get(worker)
        return n is None or n.missing_since is not None
    await wait_until(dropped, timeout_s=60, every_s=0.5, what="the killed node to leave the cluster")
    with pytest.raises(Unavailable) as e:
        await cluster.admin.get_snapshot(snap.id)
    assert e.value.status == 503 and worker in e.value.message, e.value
    with pytest.raises(Unavailable) as e:
        await cluster.admin.create_container(**SMALL, snapshot=snap.id)
    assert e.value.status == 503 and worker in e.value.message, e.value
    assert f"dsec nodes forget {worker}" in (e.value.fix or ""), e.value
