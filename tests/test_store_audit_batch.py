"""The audit log's batch insert (store/audit.py, one executemany per batch) on SQLite and a
real PostgreSQL: every entry of a batch lands with a distinct id that sorts by time, details
round-trip (empty ones too), and pages by `before` resume exactly."""

from __future__ import annotations

import time

from dsec.store import open_db
from dsec.store.audit import AuditStore, Query, Record


def test_batch_insert_ids_details_and_pages(dsn):
    store = AuditStore(open_db(dsn))
    now = time.time()
    batch = [Record(at=now + i * 1e-3, project_id="p", key_id="k", action="exec.start", target=f"sb-n1.{i:012x}",
                    status=200, details={"path": f"/f{i}"} if i % 2 else {}) for i in range(300)]
    assert store.add(batch) == 300 and store.add([]) == 0
    got = store.query(Query(projects=["p"], limit=1000)).entries
    assert len(got) == 300 and len({e.id for e in got}) == 300
    assert [e.target for e in got] == [r.target for r in reversed(batch)]      # newest first, by id
    assert all(e.details == ({"path": f"/f{int(e.target[-12:], 16)}"} if int(e.target[-12:], 16) % 2 else {})
               for e in got)
    first = store.query(Query(projects=["p"], limit=100)).entries
    rest = store.query(Query(projects=["p"], limit=1000, before=first[-1].id)).entries
    assert [e.id for e in first + rest] == [e.id for e in got]
