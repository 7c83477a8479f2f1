"""`dsec nodes` on one machine and the node registry in the control store (both engines):
cordon refuses placement (503 naming the node), drain lists what the node still holds, forget
is refused while the node answers; subnets are given once per node name and kept, the lost
timer is kept in the store (a replica restarting does not start it again)."""

from __future__ import annotations

import pytest

from dsec.store import open_db
from dsec.store.nodes import NodeRegistry
from dsec.types import Conflict, DsecError, Unavailable


@pytest.fixture
def db(dsn):
    """The control store, on each engine (conftest's dsn)."""
    d = open_db(dsn)
    yield d
    d.close()


def test_registry_subnets_states_and_lost_timer(db):
    reg = NodeRegistry(db)
    pool = ["10.1.0.0/24", "10.1.1.0/24"]
    assert reg.assign_subnet("a", pool) == "10.1.0.0/24"
    assert reg.assign_subnet("b", pool) == "10.1.1.0/24"
    assert reg.assign_subnet("a", pool) == "10.1.0.0/24"      # kept: a restarted node adopts with it
    assert reg.assign_subnet("c", pool) is None               # full
    reg.set_state("b", "forgotten")
    assert reg.assign_subnet("b", pool) == "10.1.1.0/24"      # a forgotten name that returns: its own
    reg.set_state("b", "forgotten")
    assert reg.assign_subnet("c", pool) == "10.1.1.0/24"      # the pool full: a forgotten one's is reused
    assert "b" not in reg.all() and reg.all()["c"].state == "active"
    reg.set_state("a", "cordoned")
    assert reg.all()["a"].state == "cordoned"
    # the lost timer: the first absence counts, a second replica (or a restart) keeps it
    first = reg.missing(["a"], [], now=100.0)
    again = NodeRegistry(db).missing(["a"], ["c"], now=200.0)
    assert first == again == {"a": 100.0}
    reg.missing([], ["a"], now=300.0)                          # back: cleared
    assert reg.all()["a"].missing_since is None
    assert reg.missing(["a"], [], now=400.0) == {"a": 400.0}


async def test_cordon_drain_uncordon_forget_on_one_machine(server, client):
    node = (await client.nodes())[0].node_id
    sb = await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1, labels={"t": "nodes"})
    try:
        with pytest.raises(Conflict) as e:      # it answers: forgetting it would orphan sandboxes
            await client.node_action(node, "forget")
        assert e.value.field == "node"
        assert (await client.node_action(node, "cordon"))["state"] == "cordoned"
        assert [n.state for n in await client.nodes()] == ["cordoned"]
        with pytest.raises(Unavailable) as e:
            await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
        assert f"{node} cordoned" in str(e.value) and e.value.field == "node"
        drained = await client.node_action(node, "drain")
        assert drained["state"] == "draining" and sb.id in drained["sandboxes"]
        assert (await sb.run("echo still")).stdout == "still\n"     # drain moves and stops nothing
        with pytest.raises(DsecError) as e:
            await client.node_action("no-such-node", "cordon")
        assert e.value.status == 404
    finally:
        await client.node_action(node, "uncordon")
        await sb.stop()
    again = await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
    await again.stop()


async def test_the_lost_timer_survives_a_replica_restart(tmp_path):
    """A replica noticed the node gone, then restarted (a new IndexKeeper on the same store):
    the node's rows end once DSEC_INDEX_LOST_S has passed since the first notice (old code: the
    count started again with every replica's memory)."""
    import asyncio

    from dsec.apiserver.context import ApiContext
    from dsec.apiserver.index import IndexKeeper
    from dsec.iam import IAM
    from dsec.placement import Placer
    from dsec.settings import Settings
    from dsec.store.sandboxes import IndexedSandbox
    from dsec.watcher import Watcher

    iam = IAM(tmp_path / "iam.db")
    settings = Settings.from_env({"DSEC_INDEX_LOST_S": "0.5"})

    def keeper() -> IndexKeeper:
        return IndexKeeper(ApiContext(iam=iam, edges={}, watcher=Watcher({}), placer=Placer(), settings=settings))
    try:
        first = keeper()
        first.index.upsert_many([IndexedSandbox("sb-ngone.a", "ngone", "p", "running")])
        await first._end_lost()               # noticed; not ended yet
        assert first.index.get("sb-ngone.a").ended_at is None
        await asyncio.sleep(0.6)
        await keeper()._end_lost()            # a restarted replica: its first look ends it
        assert first.index.get("sb-ngone.a").state == "lost"
    finally:
        iam.close()
