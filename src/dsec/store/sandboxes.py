"""The cross-node sandbox index: every sandbox of a cluster with its node, project, labels and
state, so that listing a project's sandboxes reads one table instead of asking every edge.

Written by whoever learns of a change (the apiserver after a create, an edge when a sandbox ends
or is reaped); the edges stay the truth about a sandbox, the index is what listing reads.
Upserts are idempotent and carry the state they saw, so writers need no coordination.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dsec.store.db import Database, Row, Tx, in_clause


@dataclass(frozen=True)
class IndexedSandbox:
    id: str
    node: str
    project_id: str
    state: str
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    ended_at: float | None = None
    info: str | None = None     # the SandboxInfo last seen, as JSON (what listing shows while its node is away)
    updated_at: float = 0.0


def _row(r: Row) -> IndexedSandbox:
    return IndexedSandbox(id=r["id"], node=r["node"], project_id=r["project_id"], state=r["state"],
                          labels=json.loads(r["labels"] or "{}"), created_at=float(r["created_at"]),
                          ended_at=None if r["ended_at"] is None else float(r["ended_at"]),
                          info=r.get("info"), updated_at=float(r.get("updated_at") or 0.0))


_UPSERT = ("INSERT INTO sandbox_index (id, node, project_id, labels, state, created_at, updated_at, ended_at, info) "
           "VALUES (?,?,?,?,?,?,?,NULL,?) ON CONFLICT(id) DO UPDATE SET state=excluded.state, "
           "labels=excluded.labels, updated_at=excluded.updated_at, info=COALESCE(excluded.info, sandbox_index.info), "
           "ended_at=NULL WHERE sandbox_index.ended_at IS NULL OR sandbox_index.state='lost'")
# an ended sandbox never comes back, but one of a node that was gone so long its rows ended as
# `lost` does, when its node returns and lists it (the node adopted it: names.py)
_END = "UPDATE sandbox_index SET state=?, ended_at=?, updated_at=? WHERE id=? AND ended_at IS NULL"


class SandboxIndex:
    def __init__(self, db: Database):
        self.db = db

    def upsert(self, sandbox_id: str, node: str, project_id: str, state: str,
               labels: dict[str, str] | None = None, created_at: float | None = None) -> None:
        """Record a live sandbox (or its new state)."""
        self.upsert_many([IndexedSandbox(sandbox_id, node, project_id, state, labels or {},
                                         created_at if created_at is not None else time.time())])

    def upsert_many(self, sandboxes: Iterable[IndexedSandbox]) -> None:
        """Several in one transaction (a burst of creations)."""
        now = time.time()
        rows = [(s.id, s.node, s.project_id, json.dumps(s.labels, sort_keys=True), s.state,
                 s.created_at or now, now, s.info) for s in sandboxes]

        def put(tx: Tx) -> None:
            for r in rows:
                tx.execute(_UPSERT, r)
        if rows:
            self.db.run(put)

    def end(self, sandbox_id: str, state: str = "stopped", at: float | None = None) -> bool:
        """Mark a sandbox ended; False if it was not indexed or already ended."""
        return self.end_many([(sandbox_id, state)], at) > 0

    def end_many(self, ended: Sequence[tuple[str, str]], at: float | None = None) -> int:
        """Several (id, final state) in one transaction; how many were live in the index."""
        t = at if at is not None else time.time()

        def put(tx: Tx) -> int:
            return sum(tx.execute(_END, (state, t, t, sid)) for sid, state in ended)
        return self.db.run(put) if ended else 0

    def sync_node(self, node: str, live: Sequence[IndexedSandbox], listed_at: float) -> tuple[int, int]:
        """Make the node's rows what its edge listed (`live`, asked at `listed_at`): new or
        changed ones upserted, rows it no longer has ended (a TTL, a failure, a stop through
        another front). Rows written after `listed_at` (a create racing the listing) are kept.
        Writes only what differs: (upserted, ended)."""
        now = time.time()
        seen = {s.id: s for s in live}

        def sync(tx: Tx) -> tuple[int, int]:
            rows = {r["id"]: r for r in tx.all("SELECT id, state, labels, updated_at FROM sandbox_index "
                                               "WHERE node=? AND ended_at IS NULL", (node,))}
            put = [s for s in live if s.id not in rows or rows[s.id]["state"] != s.state
                   or json.loads(rows[s.id]["labels"] or "{}") != s.labels]
            for s in put:
                tx.execute(_UPSERT, (s.id, s.node, s.project_id, json.dumps(s.labels, sort_keys=True), s.state,
                                     s.created_at or now, now, s.info))
            gone = [i for i, r in rows.items() if i not in seen and float(r["updated_at"]) < listed_at]
            for i in gone:
                tx.execute(_END, ("stopped", now, now, i))
            return len(put), len(gone)
        return self.db.run(sync)

    def live_nodes(self) -> set[str]:
        """Nodes that have live sandboxes in the index."""
        return {r["node"] for r in self.db.run(lambda tx: tx.all(
            "SELECT DISTINCT node FROM sandbox_index WHERE ended_at IS NULL"), write=False)}

    def end_node(self, node: str, state: str = "lost") -> int:
        """A node left the cluster: its live sandboxes ended with it. How many."""
        t = time.time()
        return self.db.run(lambda tx: tx.execute(
            "UPDATE sandbox_index SET state=?, ended_at=?, updated_at=? WHERE node=? AND ended_at IS NULL",
            (state, t, t, node)))

    def get(self, sandbox_id: str) -> IndexedSandbox | None:
        r = self.db.run(lambda tx: tx.one("SELECT * FROM sandbox_index WHERE id=?", (sandbox_id,)), write=False)
        return _row(r) if r else None

    def list(self, projects: Sequence[str] | None = None, *, node: str | None = None,
             include_ended: bool = False, limit: int = 100_000) -> list[IndexedSandbox]:
        """Sandboxes of these projects (None: all), oldest first."""
        where, params = [], []
        if projects is not None:
            if not projects:
                return []
            where.append(in_clause("project_id", projects))
            params += list(projects)
        if node is not None:
            where.append("node=?")
            params.append(node)
        if not include_ended:
            where.append("ended_at IS NULL")
        sql = ("SELECT * FROM sandbox_index" + (" WHERE " + " AND ".join(where) if where else "")
               + " ORDER BY created_at, id LIMIT ?")
        return [_row(r) for r in self.db.run(lambda tx: tx.all(sql, [*params, limit]), write=False)]

    def prune(self, ended_before: float) -> int:
        """Forget sandboxes that ended before this time."""
        return self.db.run(lambda tx: tx.execute(
            "DELETE FROM sandbox_index WHERE ended_at IS NOT NULL AND ended_at < ?", (ended_before,)))
