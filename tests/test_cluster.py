"""Cluster mode on a real multi-node Ray cluster on this one machine (ray.cluster_utils: a head
and two more raylets, each its own Ray node): `cluster up` starts an edge per node (own
DSEC_HOME, network namespace, bridge, subnet) and two apiserver replicas; sandboxes created through both replicas
land on the three edges; a node killed mid-burst fails only its own sandboxes and placement
moves on; a replica killed leaves the other serving everything. Torn down with nothing left:
no Ray processes, containers, mounts or cgroups of the edges' homes.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from conftest import NO_PSI_ADMISSION, requires_root

from dsec import Client
from dsec.testing.waiting import wait_until
from dsec.types import DsecError

pytest.importorskip("ray", reason="cluster mode needs ray: pip install -e '.[cluster]'")


class Cluster:
    def __init__(self, local, clients: list[Client], pg):
        self.local = local
        self.clients = clients
        self.nodes = local.nodes        # dsec node id -> its Ray node (None: the head)
        self.pg = pg                    # the PostgreSQL server the replicas use


@pytest.fixture(scope="module")
async def cluster(pg_cluster):
    """The replicas share a real PostgreSQL (the session's, a database of its own)."""
    requires_root()
    import time as _time

    from dsec.cluster.local import local_cluster

    db_url = pg_cluster.create_database(f"cluster_{_time.monotonic_ns()}")
    node_ids: list[str] = []
    # each edge in a network namespace of its own (D40), as on separate machines
    async with local_cluster(nodes=3, replicas=2, edge_env=NO_PSI_ADMISSION, db_url=db_url, edge_netns=True) as local:
        print(f"ray cluster {local.started_s['ray_s']:.1f}s, dsec cluster up {local.started_s['dsec_up_s']:.1f}s")
        clients = [Client(url, local.admin_key) for url in local.replica_urls]
        cl = Cluster(local, clients, pg_cluster)
        try:
            yield cl
        finally:
            # every sandbox the live edges hold, through a replica that still answers
            for c in cl.clients:
                try:
                    for sb in await c.list():
                        await (await c.get(sb.id)).stop()
                    break
                except Exception:
                    continue
            for c in clients:
                await c.close()
        homes, node_ids = local.homes, list(local.nodes)
    for h in homes:                       # local_cluster removed them: nothing mounted is left
        assert not h.exists()
    with open("/proc/self/mountinfo") as f:
        assert not any(str(h) in f.read() for h in homes)
    # no sandbox cgroup of any of the edges (the killed node's included) in any hierarchy
    cgroups = [*Path("/sys/fs/cgroup").glob("dsec/sb-*"), *Path("/sys/fs/cgroup").glob("*/dsec/sb-*")]
    left = [p for p in cgroups if any(p.name.startswith(f"sb-{n}.") for n in node_ids)]
    assert not left, left


async def _create(client: Client, label: str):
    # a replica swapping its store pool answers 503 + Retry-After (D62): the SDK waits it out
    return await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1, labels={"t": label})


async def test_sandboxes_through_two_replicas_land_on_three_edges(cluster):
    c0, c1 = cluster.clients
    assert len(cluster.nodes) == 3
    status = await c0.nodes()
    assert sorted(n.node_id for n in status) == sorted(cluster.nodes) and all(n.healthy for n in status)
    sbs = await asyncio.gather(*(_create(cluster.clients[i % 2], "spread") for i in range(9)))
    nodes = {sb.id.removeprefix("sb-").split(".")[0] for sb in sbs}
    assert nodes == set(cluster.nodes), nodes         # power-of-two placement reaches all three
    # every sandbox answers through the replica that did not create it
    async def via_other(i: int, sb) -> str:
        return (await (await cluster.clients[(i + 1) % 2].get(sb.id)).run(f"echo {i}")).stdout

    results = await asyncio.gather(*(via_other(i, sb) for i, sb in enumerate(sbs)))
    assert results == [f"{i}\n" for i in range(9)]
    listed = {s.id for s in await c1.list()}
    assert {sb.id for sb in sbs} <= listed


async def test_edge_crash_is_restarted_on_its_node_and_adopts_its_sandboxes(cluster):
    """The edge's process dies (SIGKILL), its node lives: Ray restarts the actor on the same
    node (hard affinity), the replicas find it on its new port, and the sandboxes it ran (they
    kept running) answer again, with their files."""
    import os
    import signal
    from dsec.cluster.discovery import EDGE_PREFIX, actor_address
    c0, c1 = cluster.clients
    head = next(n for n, rn in cluster.nodes.items() if rn is None)
    sbs = await asyncio.gather(*(_create(c0, "crash") for _ in range(6)))
    mine = [sb for sb in sbs if f"sb-{head}." in sb.id]
    if not mine:
        pytest.skip("placement put none of 6 sandboxes on the head's edge")
    sb = mine[0]
    await sb.files.write("/tmp/mark", b"before")
    before = await actor_address(EDGE_PREFIX + head)
    os.kill(before["pid"], signal.SIGKILL)

    async def served_via(c, cmd: str, want: str) -> None:
        # each replica finds the new port on its own (its watcher sees the node unhealthy,
        # then asks Ray): they do not converge at the same instant
        for _ in range(300):
            try:
                if (await (await c.get(sb.id)).run(cmd)).stdout == want:
                    return
            except DsecError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError("the restarted edge did not serve its sandbox again")
    await served_via(c1, "cat /tmp/mark", "before")
    after = await actor_address(EDGE_PREFIX + head)
    assert after["pid"] != before["pid"] and after["ray_node"] == before["ray_node"]
    await served_via(c0, "echo via-0", "via-0\n")


async def _run_error(sb) -> DsecError | None:
    try:
        await sb.run("echo gone")
    except DsecError as e:
        return e
    return None


async def test_node_killed_mid_burst_fails_only_its_sandboxes(cluster):
    c0, c1 = cluster.clients
    victim = next(n for n, rn in cluster.nodes.items() if rn is not None)
    before = [await _create(cluster.clients[i % 2], "burst") for i in range(6)]
    on_victim = [sb for sb in before if f"sb-{victim}." in sb.id]
    survivors = [sb for sb in before if f"sb-{victim}." not in sb.id]

    async def burst(i: int):
        try:
            return await _create(cluster.clients[i % 2], "burst")
        except DsecError as e:
            return e

    tasks = [asyncio.create_task(burst(i)) for i in range(12)]
    await asyncio.sleep(0.3)
    await asyncio.to_thread(cluster.local.kill_node, victim)     # SIGKILL its raylet (and the edge)
    outcomes = await asyncio.gather(*tasks)
    created = [o for o in outcomes if not isinstance(o, Exception)]
    failed = [o for o in outcomes if isinstance(o, Exception)]
    # a failure is only ever about the victim (a create in flight there); everything else landed
    assert all(e.status in (503, 404) and victim in e.message for e in failed), failed
    assert len(created) >= 12 - len(failed) and created, outcomes
    # the survivors, old and new, all answer; the victim's own sandboxes fail cleanly
    alive = survivors + [sb for sb in created if f"sb-{victim}." not in sb.id]
    for sb in alive:
        assert (await sb.run("echo ok")).stdout == "ok\n"
    # Ray ends a killed raylet's workers asynchronously: the victim's edge may answer a moment
    # longer (a flake once), so its sandboxes must fail cleanly within seconds, not at once
    for sb in on_victim:
        err = await wait_until(lambda: _run_error(sb), timeout_s=30, every_s=0.5,
                               what=f"{sb.id} on the killed node to fail")
        assert err.status in (503, 404), err
    # membership: both replicas drop the node (Ray declares it dead); placement moves on
    for c in (c0, c1):
        for _ in range(100):
            if victim not in {n.node_id for n in await c.nodes()}:
                break
            await asyncio.sleep(0.2)
        assert victim not in {n.node_id for n in await c.nodes()}
    after = await asyncio.gather(*(_create(cluster.clients[i % 2], "after") for i in range(6)))
    assert all(f"sb-{victim}." not in sb.id for sb in after)


async def test_postgres_restarted_nothing_lost(cluster):
    """PostgreSQL restarted under the replicas: projects, keys and quota reservations made
    before are all there after; the replicas reconnect and create again."""
    c0, c1 = cluster.clients
    root = (await c0.projects())[0].id
    team = await c0.create_project(f"pg-{os.urandom(3).hex()}", root, max_sandboxes=2)
    key = (await c0.create_key(team.id)).key
    before = await _create(c1, "pg")
    used = (await c0.quota(root)).used.sandboxes
    await asyncio.to_thread(cluster.pg.restart)
    after = await _create(c0, "pg")                          # the replicas reconnected
    assert {before.id, after.id} <= {s.id for s in await c1.list()}
    assert (await c1.quota(root)).used.sandboxes == used + 1
    assert team.id in {p.id for p in await c1.projects()}
    async with Client(cluster.local.replica_urls[1], key) as tenant:   # its key still works
        sb = await tenant.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
        assert (await sb.run("echo t")).stdout == "t\n"
        await sb.stop()
    for sb in (before, after):
        await sb.stop()


async def test_replica_killed_the_other_serves_everything(cluster):
    import ray
    from dsec.cluster.discovery import API_PREFIX, NAMESPACE
    c0, c1 = cluster.clients
    mine = await _create(c0, "replica")
    ray.kill(ray.get_actor(f"{API_PREFIX}0", namespace=NAMESPACE), no_restart=True)
    with pytest.raises(Exception):
        await c0.list()
    listed = await c1.list()
    assert mine.id in {s.id for s in listed}
    assert (await (await c1.get(mine.id)).run("echo still")).stdout == "still\n"
    new = await _create(c1, "replica")
    assert (await new.run("echo new")).stdout == "new\n"
    cluster.clients = [c1]


async def test_cluster_status_cli(cluster):
    """`dsec cluster status` from another process (a Ray driver of its own): the edges left and
    the replica left, each alive."""
    import json
    import subprocess
    import sys
    p = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "dsec", "cluster", "status", "--address",
                                                 cluster.local.ray_cluster.address],
                                capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    st = json.loads(p.stdout)
    assert sorted(e["node_id"] for e in st["edges"] if e["alive"]) == sorted(cluster.nodes), st
    assert [r["name"] for r in st["replicas"] if r["alive"]] == ["dsec-api-1"], st
