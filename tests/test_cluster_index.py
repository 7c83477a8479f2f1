"""The cross-node sandbox index and idempotent creates across nodes (D38).

Cluster tests run a real two-node Ray cluster with two apiserver replicas on a real PostgreSQL
(one cluster for the module): a node's raylet killed, the listing answers at once naming it
with its sandboxes from the index, and a bulk suspend reports that node's sandboxes as errors;
the same idempotency key through both replicas makes one sandbox. Embedded tests (the normal
server, SQLite): listing and idempotency work, a sandbox ended by its lifetime leaves the index.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import NO_PSI_ADMISSION, requires_root

from dsec import Client
from dsec.store import open_db
from dsec.store.sandboxes import SandboxIndex
from dsec.types import DsecError
from dsec.testing.waiting import wait_until


def _node(sandbox_id: str) -> str:
    return sandbox_id.removeprefix("sb-").split(".")[0]


async def _wait(cond, timeout_s: float = 15.0, what: str = "condition"):
    return await wait_until(cond, timeout_s=timeout_s, every_s=0.2, what=what)


# -- the store on both engines ------------------------------------------------------------

@pytest.fixture
def db(dsn):
    """The control store, on each engine (conftest's dsn)."""
    d = open_db(dsn)
    yield d
    d.close()


def test_claims_and_node_sync_on_both_engines(db):
    from dsec.store.idempotency import STALE_S, IdempotencyClaims
    from dsec.store.sandboxes import IndexedSandbox
    claims = IdempotencyClaims(db)
    first = claims.claim("p", "k")
    second = claims.claim("p", "k")             # the first is still creating
    assert first.mine and not second.mine and second.sandbox_id is None and second.token == first.token
    claims.release("p", "k", first.token)       # it failed: the key is free
    third = claims.claim("p", "k")
    assert third.mine
    claims.bind("p", "k", third.token, "sb-n1.a")
    assert claims.claim("p", "k").sandbox_id == "sb-n1.a" and claims.claim("q", "k").mine   # per project
    db.run(lambda tx: tx.execute("UPDATE idempotency_claims SET claimed_at=? WHERE project_id='q'",
                                 (time.time() - STALE_S - 1,)))
    assert claims.claim("q", "k").mine          # an unbound claim whose creator died is taken over

    index = SandboxIndex(db)
    t0 = time.time()
    index.upsert_many([IndexedSandbox("sb-n1.a", "n1", "p", "running"), IndexedSandbox("sb-n1.b", "n1", "p", "running")])
    late = time.time() + 1
    # listed before b was written: b is kept; then a listing after it without b ends b
    assert index.sync_node("n1", [IndexedSandbox("sb-n1.a", "n1", "p", "suspended")], t0 - 1) == (1, 0)
    assert index.get("sb-n1.a").state == "suspended" and index.get("sb-n1.b").ended_at is None
    assert index.sync_node("n1", [IndexedSandbox("sb-n1.a", "n1", "p", "suspended")], late) == (0, 1)
    assert index.get("sb-n1.b").ended_at is not None and index.live_nodes() == {"n1"}


async def test_a_node_ends_lost_only_once_it_stays_gone(tmp_path, monkeypatch):
    """Rows of a node absent from discovery end as "lost" only after DSEC_INDEX_LOST_S; a node
    that is back within it (an edge restarted, a node returning) keeps its sandboxes."""
    from dsec.apiserver.context import ApiContext
    from dsec.apiserver.index import IndexKeeper
    from dsec.iam import IAM
    from dsec.placement import Placer
    from dsec.store.sandboxes import IndexedSandbox
    from dsec.watcher import Watcher
    from dsec.settings import Settings
    iam = IAM(tmp_path / "iam.db")
    edges: dict = {}
    k = IndexKeeper(ApiContext(iam=iam, edges=edges, watcher=Watcher({}), placer=Placer(),
                               settings=Settings.from_env({"DSEC_INDEX_LOST_S": "0.5"})))
    try:
        k.index.upsert_many([IndexedSandbox("sb-ngone.a", "ngone", "p", "running"),
                             IndexedSandbox("sb-nback.a", "nback", "p", "running")])
        await k._end_lost()                    # both absent: noticed, nothing ended yet
        assert k.index.live_nodes() == {"ngone", "nback"}
        edges["nback"] = object()              # discovery found it again (only its key matters here)
        await asyncio.sleep(0.6)
        await k._end_lost()
        assert k.index.get("sb-ngone.a").state == "lost" and k.index.get("sb-nback.a").ended_at is None
    finally:
        iam.close()


# -- embedded (SQLite): the normal session server -------------------------------------------

async def test_embedded_listing_and_ttl_end_leave_the_index(server, client):
    """Listing answers with no unreachable node; the create is indexed; a sandbox ended by its
    lifetime (on the node, unseen by the apiserver) leaves the index after a listing."""
    sb = await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1, lifetime_s=2,
                                       labels={"t": "index-ttl"})
    listed = await client.listing()
    assert sb.id in {s.id for s in listed.sandboxes} and listed.unreachable_nodes == []
    db = open_db(server.paths.iam_db)
    try:
        index = SandboxIndex(db)

        async def indexed():
            return await asyncio.to_thread(index.get, sb.id)
        row = await _wait(indexed, 5, "the create in the index")
        assert row.ended_at is None and row.labels == {"t": "index-ttl"} and row.project_id

        async def ended():
            await client.list()                 # a listing refreshes the node's rows
            r = await asyncio.to_thread(index.get, sb.id)
            return r if r is not None and r.ended_at is not None else None
        row = await _wait(ended, 20, "the TTL-ended sandbox to leave the index")
        assert sb.id not in {s.id for s in await client.list()}
        assert sb.id not in {r.id for r in await asyncio.to_thread(index.list)}
    finally:
        db.close()


async def test_embedded_idempotency_key_claimed_once(server, client):
    """Concurrent creates with one key make one sandbox, claimed in the control store; a first
    attempt that fails frees the key for a retry."""
    key = f"idem-{os.urandom(4).hex()}"
    sbs = await asyncio.gather(*(client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1,
                                                         idempotency_key=key) for _ in range(3)))
    assert len({sb.id for sb in sbs}) == 1
    db = open_db(server.paths.iam_db)
    try:
        rows = db.run(lambda tx: tx.all("SELECT sandbox_id FROM idempotency_claims WHERE key=?", (key,)),
                      write=False)
        assert [r["sandbox_id"] for r in rows] == [sbs[0].id]
        bad = f"idem-{os.urandom(4).hex()}"
        with pytest.raises(DsecError) as e:
            await client.create_container(image="no-such-image-here", memory_mb=64, idempotency_key=bad)
        assert e.value.status == 404
        assert not db.run(lambda tx: tx.all("SELECT 1 FROM idempotency_claims WHERE key=?", (bad,)), write=False)
        again = await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1, idempotency_key=bad)
        await again.stop()
    finally:
        db.close()
    await sbs[0].stop()


# -- cluster (PostgreSQL, real Ray) -------------------------------------------------------

@pytest.fixture(scope="module")
async def cluster(pg_cluster):
    requires_root()
    pytest.importorskip("ray", reason="cluster mode needs ray: pip install -e '.[cluster]'")
    from dsec.cluster.local import local_cluster

    db_url = pg_cluster.create_database(f"index_{time.monotonic_ns()}")
    async with local_cluster(nodes=2, replicas=2, edge_env=NO_PSI_ADMISSION, db_url=db_url) as local:
        clients = [Client(url, local.admin_key) for url in local.replica_urls]
        try:
            yield local, clients
        finally:
            for c in clients:
                try:
                    for sb in await c.list():
                        try:
                            await (await c.get(sb.id)).stop()
                        except DsecError:
                            pass           # the killed node's: torn down with the cluster
                except DsecError:
                    pass
                await c.close()


async def _create(client: Client, label: str, **kw):
    return await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1, labels={"t": label}, **kw)


async def test_same_idempotency_key_through_two_replicas_is_one_sandbox(cluster):
    """Eight keys, each sent through both replicas at once (in opposite orders, so each
    replica's placement spreads them differently: old code made two sandboxes of most keys,
    on different nodes), and once more later: one sandbox per key."""
    _, (c0, c1) = cluster
    keys = [f"k-{os.urandom(4).hex()}" for _ in range(8)]
    made = await asyncio.gather(*(_create(c0, "idem", idempotency_key=k) for k in keys),
                                *(_create(c1, "idem", idempotency_key=k) for k in reversed(keys)))
    first, second = made[:8], made[8:][::-1]
    assert [a.id for a in first] == [b.id for b in second]
    assert len({a.id for a in first}) == 8
    assert len({_node(a.id) for a in first}) == 2       # the keys did spread over both nodes
    for k, a in zip(keys, first):
        assert (await _create(c1, "idem", idempotency_key=k)).id == a.id     # a later retry too
    for a in first:
        await a.stop()


async def test_dead_node_listing_and_bulk_answer_from_the_index(cluster):
    local, (c0, c1) = cluster
    victim = next(n for n, rn in local.nodes.items() if rn is not None)
    mine: list = []
    for i in range(12):      # sandboxes on both nodes
        mine.append(await _create((c0, c1)[i % 2], "dead"))
        nodes = {_node(sb.id) for sb in mine}
        if len(mine) >= 4 and len(nodes) == 2:
            break
    on_victim = {sb.id for sb in mine if _node(sb.id) == victim}
    assert on_victim and len(on_victim) < len(mine), [sb.id for sb in mine]
    for c in (c0, c1):       # both replicas' index writes are in (each flushes within 50 ms)
        assert {sb.id for sb in mine} <= {s.id for s in await c.list()}
    await asyncio.sleep(0.5)

    # the victim's edge frozen (alive to Ray, not answering): the listing waits one deadline for it
    from dsec.cluster.discovery import EDGE_PREFIX, actor_address
    pid = (await actor_address(EDGE_PREFIX + victim))["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        listed = await c0.listing()
        took = time.monotonic() - t0
        assert listed.unreachable_nodes == [victim], listed.unreachable_nodes
        _from_index(listed, mine, on_victim, victim)
        assert took < 10, took
        # bulk: the victim's sandboxes are items with an error naming it, the others suspended
        items = await c1.suspend_all({"t": "dead"})      # answers, never a 503
        by_id = {i.id: i for i in items}
        assert set(by_id) == {sb.id for sb in mine}, items
        for i in on_victim:
            assert by_id[i].error and victim in by_id[i].error, by_id[i]
        for sb in mine:
            if sb.id not in on_victim:
                assert by_id[sb.id].error is None, by_id[sb.id]
    finally:
        os.kill(pid, signal.SIGCONT)

    # the victim's raylet killed: every listing answers, and names it (the edge's port refuses
    # at once; once Ray declares the node dead, discovery drops it and the index still shows it)
    await asyncio.to_thread(local.kill_node, victim)

    async def names_victim():
        listed = await c0.listing()
        return listed if listed.unreachable_nodes else None
    listed = await _wait(names_victim, 20, "a listing naming the dead node")
    assert listed.unreachable_nodes == [victim]
    _from_index(listed, mine, on_victim, victim)
    items = await c1.suspend_all({"t": "dead"})
    assert {i.id for i in items if i.error and victim in i.error} == on_victim, items


def _from_index(listed, mine, on_victim: set[str], victim: str) -> None:
    ids = {s.id: s for s in listed.sandboxes}
    assert {sb.id for sb in mine} <= set(ids)
    assert all(ids[i].node == victim and ids[i].state.value == "running" for i in on_victim), ids
