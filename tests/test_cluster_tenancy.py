"""Tenancy and host shares in cluster mode (D39), on a real local Ray cluster (two raylets on
this machine, one replica) whose replica has no image registry of its own (no images_home) and
keeps IAM in a real PostgreSQL.

- A layer project A packs (pack_diff) is owned by A on its node. Before D39 the replica skipped
  the ownership check without a registry, so a sibling project B built sandboxes on it (dsec and
  E2B routes) and ran FnCall code on it. Now the replica asks the chosen node for the owners: B
  gets 404 naming the field, the same answer as a missing layer; A, its sub-project and its
  parent still use it.
- The two edges share this host: `cluster up` gives each half of it (DSEC_NODE_SHARE=1/2),
  which their status reports to placement.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
from conftest import NO_PSI_ADMISSION, requires_root

from dsec import Client
from dsec.types import NotFound

pytest.importorskip("ray", reason="cluster mode needs ray: pip install -e '.[cluster]'")


class Tenants:
    def __init__(self, url: str, admin: Client, keys: dict[str, str], a_id: str, nodes: set[str]):
        self.url, self.admin, self.keys, self.a_id, self.nodes = url, admin, keys, a_id, nodes


@pytest.fixture(scope="module")
async def cluster(pg_cluster):
    requires_root()
    from dsec.cluster.local import local_cluster

    db_url = pg_cluster.create_database(f"cltenancy_{time.monotonic_ns()}")
    async with local_cluster(nodes=2, replicas=1, edge_env=NO_PSI_ADMISSION, db_url=db_url) as local:
        url = local.replica_urls[0]
        async with Client(url, local.admin_key) as admin:
            root = (await admin.projects())[0].id
            sfx = os.urandom(3).hex()
            a = await admin.create_project(f"cl-a-{sfx}", root)
            a_child = await admin.create_project(f"cl-a-child-{sfx}", a.id)
            b = await admin.create_project(f"cl-b-{sfx}", root)
            keys = {n: (await admin.create_key(p.id)).key for n, p in (("a", a), ("a_child", a_child), ("b", b))}
            t = Tenants(url, admin, keys, a.id, set(local.nodes))
            try:
                yield t
            finally:
                for sb in await admin.list():
                    await (await admin.get(sb.id)).stop()


def _node(sandbox_id: str) -> str:
    return sandbox_id.removeprefix("sb-").split(".")[0]


async def _on_every_node(client: Client, nodes: set[str]) -> list:
    """Sandboxes of `client` until every node holds one (placement spreads by load)."""
    sbs: list = []
    for _ in range(6):
        sbs.append(await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1))
        if {_node(s.id) for s in sbs} >= nodes:
            return sbs
    raise AssertionError(f"six creates did not reach every node: {[s.id for s in sbs]}")


async def test_a_sibling_cannot_build_on_a_projects_layer_on_any_node(cluster):
    name = f"cl-ws-{os.urandom(3).hex()}@1"
    async with Client(cluster.url, cluster.keys["a"]) as a, Client(cluster.url, cluster.keys["b"]) as b, \
            Client(cluster.url, cluster.keys["a_child"]) as child:
        # A packs the layer on every node (each node has its own registry until the shared
        # layer store): wherever B's create lands, the layer is there, owned by A
        for sa in await _on_every_node(a, cluster.nodes):
            await sa.files.write("/work/owner.txt", b"project a")
            assert (await sa.pack_diff(name)).owner == cluster.a_id
            await sa.stop()

        for field, kw in (("workspace", {"image": "busybox", "workspace": name}), ("image", {"image": name}),
                          ("toolkits[0]", {"image": "busybox", "toolkits": [name]})):
            with pytest.raises(NotFound) as e:
                await b.create_container(memory_mb=64, cpu_cores=0.1, **kw)
            assert e.value.field == field, e.value
            assert e.value.message == f"no {field.split('[')[0].rstrip('s')} {name!r} for this project ({field})"
        # the E2B front shares the check: the template (dsec's image) looks missing
        async with httpx.AsyncClient() as h:
            r = await h.post(f"{cluster.url}/e2b/sandboxes", json={"templateID": name},
                             headers={"X-API-Key": cluster.keys["b"]})
        assert r.status_code == 404 and "for this project" in r.text, r.text
        # and so does FnCall: B's code does not run on A's files
        async with httpx.AsyncClient() as h:
            r = await h.post(f"{cluster.url}/v1/fncall", json={"image": name, "language": "bash", "code": "cat /work/*"},
                             headers={"Authorization": f"Bearer {cluster.keys['b']}"})
        assert r.status_code == 404 and r.json()["error"]["field"] == "image", r.text

        # the owner, its sub-project and its parent (the root's key) use it, with the owner's file
        for client in (a, child, cluster.admin):
            sb = await client.create_container(image="busybox", workspace=name, memory_mb=64, cpu_cores=0.1)
            try:
                assert await sb.files.read("/work/owner.txt") == b"project a"
            finally:
                await sb.stop()


async def test_edges_sharing_this_host_each_count_half_of_it(cluster):
    status = await cluster.admin.nodes()
    assert len(status) == 2
    host_cores = os.cpu_count() or 1
    with open("/proc/meminfo") as f:
        mem_total = int(f.readline().split()[1]) >> 10
    for n in status:
        c = n.capacity
        assert c.node_cpu_cores is not None and c.node_memory_mb is not None, n
        assert c.node_cpu_cores <= host_cores / 2 + 1e-9 and c.node_memory_mb <= mem_total // 2 + 1, n
        # the ceiling placement sees is the overcommit ratio times the share, not the host
        assert c.cpu_cores == pytest.approx(c.node_cpu_cores * float(os.environ.get("DSEC_CPU_OVERCOMMIT", 2000))), n
    assert len({(n.capacity.node_cpu_cores, n.capacity.node_memory_mb) for n in status}) == 1
