"""The audit log in the control store (schema migration 9): written in batches, read newest
first in pages, pruned after the retention (DSEC_AUDIT_RETENTION_S).

Ids sort by time: 16 hex digits of microseconds since the epoch, then 8 random ones, so a page
of `id < before ORDER BY id DESC` resumes exactly where the last one ended, on both engines,
with no counter row to lock on the write path.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dsec.store.db import Database, Row, Tx, in_clause
from dsec.types import AuditEntry, AuditList


@dataclass(frozen=True)
class Record:
    """One entry as the apiserver notes it (before it has an id)."""

    at: float
    project_id: str
    key_id: str
    action: str
    target: str
    status: int
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Query:
    projects: Sequence[str] | None     # the caller's reach (its project and those below it); None: all
    key_id: str | None = None
    action: str | None = None          # exact, or a prefix ending in '.' ("file.")
    target: str | None = None
    since: float | None = None
    until: float | None = None
    before: str | None = None
    limit: int = 100


_DUMPS = json.JSONEncoder(separators=(",", ":")).encode    # one encoder, not one per entry


def _entry(r: Row) -> AuditEntry:
    return AuditEntry(id=r["id"], at=datetime.fromtimestamp(float(r["at"]), timezone.utc), project=r["project_id"],
                      key_id=r["key_id"], action=r["action"], target=r["target"], status=int(r["status"]),
                      details=json.loads(r["details"] or "{}"))


class AuditStore:
    def __init__(self, db: Database):
        self.db = db

    def add(self, records: Sequence[Record]) -> int:
        """Write a batch in one transaction (one commit for many entries)."""
        # one random draw for the batch, not a getrandom call per entry
        rand = secrets.token_hex(4 * len(records))
        rows = [(f"{int(r.at * 1_000_000):016x}{rand[8 * i:8 * i + 8]}", r.at, r.project_id, r.key_id, r.action,
                 r.target, r.status, _DUMPS(r.details) if r.details else "{}") for i, r in enumerate(records)]

        def run(tx: Tx) -> int:
            tx.execute_many("INSERT INTO audit_log (id, at, project_id, key_id, action, target, status, details) "
                            "VALUES (?,?,?,?,?,?,?,?)", rows)
            return len(rows)
        return self.db.run(run) if records else 0

    def query(self, q: Query) -> AuditList:
        if q.projects is not None and not q.projects:
            return AuditList(entries=[])
        where: list[str] = ["1=1"]
        params: list[Any] = []
        if q.projects is not None:
            where.append(in_clause("project_id", q.projects))
            params += list(q.projects)
        if q.key_id:
            where.append("key_id=?")
            params.append(q.key_id)
        if q.action:
            if q.action.endswith("."):
                where.append("substr(action, 1, ?) = ?")      # a prefix, with no LIKE wildcards to escape
                params += [len(q.action), q.action]
            else:
                where.append("action=?")
                params.append(q.action)
        if q.target:
            where.append("target=?")
            params.append(q.target)
        if q.since is not None:
            where.append("at >= ?")
            params.append(q.since)
        if q.until is not None:
            where.append("at < ?")
            params.append(q.until)
        if q.before:
            where.append("id < ?")
            params.append(q.before)
        sql = f"SELECT * FROM audit_log WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?"
        rows = self.db.run(lambda tx: tx.all(sql, (*params, q.limit + 1)), write=False)
        entries = [_entry(r) for r in rows[:q.limit]]
        return AuditList(entries=entries, next_before=entries[-1].id if len(rows) > q.limit else None)

    def prune(self, older_than: float) -> int:
        """Drop entries from before `older_than` (epoch seconds); how many."""
        return self.db.run(lambda tx: tx.execute("DELETE FROM audit_log WHERE at < ?", (older_than,)))
