"""Project quotas (iam/quota.py, apiserver/quotas.py): sandboxes, CPU cores and memory per
project, counted for the project and every ancestor, race-free across apiservers (separate
connections to one SQLite file or one real PostgreSQL server), enforced at creation through
the real server, and given back when a sandbox ends, also when it ended unseen (TTL)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from dsec.iam import IAM, QuotaExceeded
from dsec.types import CapacityExceeded, Conflict, Forbidden


@pytest.fixture
def iam(dsn, tmp_path):
    with IAM(dsn) as i:
        i.bootstrap(tmp_path / "admin.key")
        yield i


def test_racing_reservations_take_exactly_the_free_slots(dsn, iam):
    """16 apiservers (each its own connection) race for 5 slots of a sub-project: exactly 5 win."""
    team = iam.create_project("team", iam.root().id, max_sandboxes=7)
    sub = iam.create_project("sub", team.id, max_sandboxes=5)
    iam.quotas.reserve(team.id, 1, 64)           # the parent holds 2 itself: 5 left for sub
    iam.quotas.reserve(team.id, 1, 64)
    servers = [IAM(dsn) for _ in range(16)]
    won: list[str] = []
    refused: list[QuotaExceeded] = []
    other: list[BaseException] = []
    go = threading.Barrier(len(servers))

    def race(s: IAM) -> None:
        go.wait()
        try:
            won.append(s.quotas.reserve(sub.id, 0.5, 128))
        except QuotaExceeded as e:
            refused.append(e)
        except BaseException as e:   # noqa: BLE001 - surfaced below
            other.append(e)
    threads = [threading.Thread(target=race, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in servers:
        s.close()
    assert not other, other
    assert len(won) == 5 and len(refused) == 11
    for e in refused:   # the parent (7 = 2 own + 5) and sub (5) are both full: the first full one on the way up
        assert e.status == 429 and e.field == "max_sandboxes" and sub.id in e.message
        assert "max_sandboxes=5" in e.message and "dsec project quota" in e.fix
    assert iam.quotas.quota(sub.id).used.sandboxes == 5
    assert iam.quotas.quota(team.id).used.model_dump() == {"sandboxes": 7, "cpu_cores": 4.5, "memory_mb": 768}
    assert iam.quotas.release(reservation_id=won[0]) and not iam.quotas.release(reservation_id=won[0])
    assert iam.quotas.quota(team.id).used.sandboxes == 6
    iam.quotas.reserve(sub.id, 0.5, 128)         # the freed slot is usable again


def test_sub_project_usage_counts_against_every_ancestor(iam):
    team = iam.create_project("team", iam.root().id, max_sandboxes=10, max_cpu_cores=4, max_memory_mb=4096)
    a = iam.create_project("a", team.id, max_cpu_cores=3)
    b = iam.create_project("b", team.id)
    b1 = iam.create_project("b1", b.id)          # three levels: b1's use counts for b and team
    iam.quotas.reserve(a.id, 2.5, 1024)
    iam.quotas.reserve(b1.id, 1.0, 1024)
    with pytest.raises(QuotaExceeded) as ei:      # b1 and b have room; team has 0.5 core left
        iam.quotas.reserve(b1.id, 1.0, 512)
    assert ei.value.field == "cpu_cores" and team.id in ei.value.message and "max_cpu_cores=4" in ei.value.message
    assert f"a parent of {b1.id}" in ei.value.message
    with pytest.raises(QuotaExceeded) as ei:
        iam.quotas.reserve(a.id, 0.5, 4096)
    assert ei.value.field == "memory_mb" and "max_memory_mb=4096" in ei.value.message
    with pytest.raises(QuotaExceeded) as ei:      # a's own limit (3 cores) comes first
        iam.quotas.reserve(a.id, 1.0, 16)
    assert a.id in ei.value.message and "max_cpu_cores=3" in ei.value.message
    rid = iam.quotas.reserve(b1.id, 0.5, 512)     # exactly fills team's cores
    assert iam.quotas.quota(team.id).used.cpu_cores == 4.0
    assert iam.quotas.quota(b.id).used.sandboxes == 2 and iam.quotas.quota(a.id).used.sandboxes == 1
    iam.quotas.activate(rid, "sb-n1.000000000001")
    assert iam.quotas.release(sandbox_id="sb-n1.000000000001")
    assert iam.quotas.quota(team.id).used.cpu_cores == 3.5
    before = {p.id: iam.quotas.quota(p.id).used for p in iam.subtree(iam.root().id)}
    iam.quotas.rebuild()                          # the counters agree with the ledger
    assert {p.id: iam.quotas.quota(p.id).used for p in iam.subtree(iam.root().id)} == before


def test_delegation_never_exceeds_what_the_delegator_holds(iam, tmp_path):
    team = iam.create_project("team", iam.root().id, max_sandboxes=10, max_cpu_cores=8, max_memory_mb=8192)
    lead = iam.authenticate(iam.create_key(team.id))
    sub = iam.create_project("sub", team.id, max_sandboxes=4, by=lead)
    assert (sub.max_sandboxes, sub.max_cpu_cores, sub.max_memory_mb) == (4, 8.0, 8192)
    with pytest.raises(Forbidden) as ei:          # more than team holds
        iam.create_project("greedy", team.id, max_cpu_cores=9, by=lead)
    assert ei.value.field == "max_cpu_cores" and "8" in ei.value.fix
    with pytest.raises(Forbidden):
        iam.set_quota(sub.id, max_memory_mb=8193, by=lead)
    assert iam.set_quota(sub.id, max_sandboxes=10, by=lead).max_sandboxes == 10
    with pytest.raises(Forbidden) as ei:          # a project never raises its own quota
        iam.set_quota(team.id, max_sandboxes=11, by=lead)
    assert "parent project" in ei.value.fix
    member = iam.authenticate(iam.create_key(sub.id))
    with pytest.raises(Forbidden):
        iam.set_quota(sub.id, max_sandboxes=1, by=member)
    deep = iam.create_project("deep", sub.id, max_sandboxes=3, by=member)   # delegates further down
    with pytest.raises(Forbidden):
        iam.create_project("deeper", deep.id, max_sandboxes=4, by=member)
    with pytest.raises(Conflict) as ei:           # take back from the sub-project first
        iam.set_quota(sub.id, max_sandboxes=2, by=lead)
    assert deep.id in ei.value.message and ei.value.field == "max_sandboxes"
    admin = iam.authenticate(iam.bootstrap(tmp_path / "admin.key"))
    assert iam.set_quota(team.id, max_sandboxes=20, by=admin).max_sandboxes == 20


# -- through the real server (crun sandboxes, HTTP) ------------------------------------------
@pytest.fixture
def tight(server):
    """A project of the test server with room for 2 sandboxes, and its key."""
    with IAM(server.paths.iam_db) as iam:
        p = iam.create_project(f"quota-{os.urandom(3).hex()}", iam.root().id, max_sandboxes=2,
                               max_memory_mb=4096)
        return p.id, iam.create_key(p.id)


async def test_concurrent_creates_race_for_the_last_slots(server, tight):
    from dsec.sdk.client import Client
    project, key = tight
    async with Client(server.url, key) as c:
        results = await asyncio.gather(*(c.create_container(image="busybox", memory_mb=64) for _ in range(6)),
                                       return_exceptions=True)
        made = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        try:
            assert len(made) == 2, results
            for e in refused:
                assert isinstance(e, CapacityExceeded), e
                assert project in e.message and "max_sandboxes=2" in e.message and e.field == "max_sandboxes"
            q = await c.quota(project)
            assert q.used.sandboxes == 2 and q.used.memory_mb == 128
            await made.pop().stop()               # stopped through the apiserver: freed at once
            assert (await c.quota(project)).used.sandboxes == 1
            made.append(await c.create_container(image="busybox", memory_mb=64))
        finally:
            for sb in made:
                await sb.stop()
        assert (await c.quota(project)).used.sandboxes == 0


async def test_a_sandbox_reaped_unseen_gives_its_quota_back(server, tight):
    """A TTL ends sandboxes on the edge, without the apiserver: the next creation that would be
    refused reconciles with the edge's list first."""
    from dsec.sdk.client import Client
    project, key = tight
    async with Client(server.url, key) as c:
        a = await c.create_container(image="busybox", memory_mb=64)
        b = await c.create_container(image="busybox", memory_mb=64)
        await a.set_timeout(0.5)
        deadline = time.monotonic() + 30
        while any(s.id == a.id for s in await c.list()):
            assert time.monotonic() < deadline, "the TTL did not end the sandbox"
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.6)                  # past the reconcile rate limit of an earlier test
        c3 = await c.create_container(image="busybox", memory_mb=64)
        assert (await c.quota(project)).used.sandboxes == 2
        await b.stop()
        await c3.stop()
        with IAM(server.paths.iam_db) as iam:
            assert iam.quotas.quota(project).used.sandboxes == 0
