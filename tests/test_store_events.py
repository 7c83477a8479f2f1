"""The lifecycle events store (store/events.py) on SQLite and a real PostgreSQL: two apiserver
replicas ingesting the same edge's events store each once, with gap-free ids in order; each
event queues one delivery per matching webhook; two workers never claim the same delivery while
its lease lives; a failed attempt waits for its retry time; an edge whose log began again is
read from its start; node_lost is stored once."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest

from dsec.store import open_db
from dsec.store.events import EventStore
from dsec.types import EventType, SandboxEvent


def ev(seq: int, type_: EventType = EventType.created, project: str = "prj-a", sid: str = "sb-n1.000000000001",
       reason: str | None = None) -> SandboxEvent:
    return SandboxEvent(seq=seq, type=type_, sandbox_id=sid, project=project, node="n1", reason=reason,
                        at=datetime.now(timezone.utc))


def audience(project: str) -> list[str]:
    return [project, "prj-root"] if project != "prj-root" else [project]


@pytest.fixture
def stores(dsn):
    a, b = open_db(dsn), open_db(dsn)
    now = time.time()
    a.run(lambda tx: [tx.execute("INSERT INTO projects (id, name, parent_id, max_sandboxes, max_cpu_cores, "
                                 "max_memory_mb, created_at) VALUES (?,?,?,?,?,?,?)", row)
                      for row in (("prj-root", "root", None, 10, 10.0, 1024, now),
                                  ("prj-a", "a", "prj-root", 10, 10.0, 1024, now),
                                  ("prj-b", "b", "prj-root", 10, 10.0, 1024, now))])
    yield EventStore(a), EventStore(b)
    a.close()
    b.close()


def test_two_replicas_ingest_each_event_once_in_order(stores):
    one, two = stores
    one.add_webhook("prj-a", "https://a.example/h", "", None, "s" * 16, "dsec")
    one.add_webhook("prj-root", "https://root.example/h", "", ["ended"], "s" * 16, "dsec")
    one.add_webhook("prj-b", "https://b.example/h", "", None, "s" * 16, "dsec")
    batch = [ev(i) for i in range(1, 40)] + [ev(40, EventType.ended, reason="oom_killed")]
    errors: list[BaseException] = []

    def ingest(store: EventStore) -> None:
        try:
            for start in range(0, 40, 7):     # pages, as the pump pulls them
                store.ingest("n1", batch[start:start + 7], 40, audience)
        except BaseException as e:   # noqa: BLE001 - surfaced below
            errors.append(e)
    threads = [threading.Thread(target=ingest, args=(s,)) for s in (one, two, one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    got = one.list_events(0, None, limit=1000)
    assert [e.id for e in got] == list(range(1, 41)) and [e.seq for e in got] == list(range(1, 41))
    assert got[-1].reason == "oom_killed" and got[-1].infrastructure is True
    assert one.last_id() == 40
    hooks = {h.url: h.id for h in one.webhooks()}
    assert len(one.deliveries(hooks["https://a.example/h"])[0]) == 40           # all types
    assert len(one.deliveries(hooks["https://root.example/h"])[0]) == 1        # an ancestor's, ended only
    assert one.deliveries(hooks["https://b.example/h"])[0] == []                # another project's: none
    assert two.list_events(38, ["prj-b"]) == [] and [e.id for e in two.list_events(38, ["prj-a"])] == [39, 40]


def test_leases_backoff_and_outcomes(stores):
    one, two = stores
    one.add_webhook("prj-a", "https://a.example/h", "", None, "s" * 16, "dsec")
    one.ingest("n1", [ev(i) for i in range(1, 11)], 10, audience)
    a, b = one.claim_due(60, 100), two.claim_due(60, 100)
    assert len(a) == 10 and b == [], (len(a), len(b))              # leased: the other worker skips them
    one.delivered(a[0].delivery_id, 204)
    one.failed_attempt(a[1].delivery_id, 503, "the receiver answered HTTP 503", time.time() + 3600)
    one.failed_attempt(a[2].delivery_id, None, "refused", None)    # given up
    for d in a[3:]:                                                  # the worker died: leases lapse
        one.db.run(lambda tx, i=d.delivery_id: tx.execute("UPDATE webhook_deliveries SET lease_until=0 WHERE id=?", (i,)))
    again = two.claim_due(60, 100)
    assert sorted(d.delivery_id for d in again) == sorted(d.delivery_id for d in a[3:])
    items, counts = one.deliveries(a[0].webhook.id)
    assert counts == {"delivered": 1, "pending": 8, "failed": 1}, counts
    retry = next(i for i in items if i.id == a[1].delivery_id)
    assert retry.attempts == 1 and retry.last_status == 503 and retry.next_at > time.time() + 3000


def test_a_reset_edge_log_and_node_lost_once(stores):
    one, two = stores
    assert one.ingest("n1", [ev(1), ev(2)], 2, audience) == 2
    assert one.ingest("n1", [ev(1), ev(2)], 2, audience) == 0                  # seen
    assert one.ingest("n1", [ev(1, EventType.ended, reason="killed")], 1, audience) == 1   # log began again
    lost = ev(0, EventType.ended, reason="node_lost", sid="sb-n1.000000000002")
    assert one.add_once(lost, audience) and not two.add_once(lost, audience)
    assert [e.reason for e in one.list_events(0)] == [None, None, "killed", "node_lost"]


def test_webhook_secrets_sealed_at_rest_and_old_rows_migrated(stores):
    """Secrets go in encrypted with the given key; rows from before (plain text) are encrypted by
    seal_plain (the apiserver runs it at start) and still sign with the same secret."""
    from cryptography.fernet import Fernet
    plain, _ = stores
    key = Fernet(Fernet.generate_key())
    sealed = EventStore(plain.db, sealer=lambda: key)
    old = plain.add_webhook("prj-a", "http://x.test/old", "", None, "old-secret-value", "dsec")   # an earlier version's
    new = sealed.add_webhook("prj-a", "http://x.test/new", "", None, "new-secret-value", "dsec")

    def stored(wid: str) -> str:
        return plain.db.run(lambda tx: tx.one("SELECT secret FROM webhooks WHERE id=?", (wid,)))["secret"]
    assert stored(old.id) == "old-secret-value"
    assert stored(new.id).startswith("fernet:") and "new-secret-value" not in stored(new.id)
    assert sealed.seal_plain() == 1 and sealed.seal_plain() == 0
    assert stored(old.id).startswith("fernet:") and "old-secret-value" not in stored(old.id)
    sealed.update_webhook(new.id, secret="changed-secret-value")
    assert "changed-secret-value" not in stored(new.id)
    sealed.ingest("n1", [ev(1)], 1, audience)
    got = {d.webhook.id: d.secret for d in sealed.claim_due(lease_s=30)}
    assert got == {old.id: "old-secret-value", new.id: "changed-secret-value"}, got
