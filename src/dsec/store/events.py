"""Lifecycle events and webhook deliveries in the control store (schema migration 8).

Events come from the edges' logs (apiserver/events.py pulls them) and from the apiserver itself
(node_lost). Each gets the next id of events_head in the transaction that inserts it, under that
row's lock: ids are gap-free and commit in order on both engines, so a stream resumed after id N
misses nothing. The same transaction queues one delivery per matching webhook (durable: a
receiver down for hours loses nothing while the delivery's retry window lasts).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Protocol
from dataclasses import dataclass
from datetime import datetime, timezone

from dsec.store.db import Database, Row, Tx, in_clause
from dsec.types import (DeliveryInfo, EventType, NotFound, SandboxEvent, WebhookInfo, is_infrastructure)

KEEP_S = 7 * 86400.0        # events and finished deliveries are kept a week


@dataclass(frozen=True)
class Due:
    """A delivery to attempt now (claimed under a lease), with what it sends."""

    delivery_id: str
    attempts: int
    created_at: float
    webhook: WebhookInfo
    secret: str
    event: SandboxEvent
    private_ok: bool           # registered by an admin (or with DSEC_WEBHOOK_PRIVATE_OK): any address


def _event(r: Row) -> SandboxEvent:
    return SandboxEvent(id=int(r["id"]), seq=int(r["seq"]), type=EventType(r["type"]), sandbox_id=r["sandbox_id"],
                        project=r["project_id"], node=r["node"], reason=r["reason"], message=r["message"],
                        infrastructure=is_infrastructure(r["reason"]) if r["reason"] else None,
                        at=datetime.fromtimestamp(float(r["at"]), timezone.utc), details=json.loads(r["details"] or "{}"))


def _webhook(r: Row) -> WebhookInfo:
    return WebhookInfo(id=r["id"], project=r["project_id"], url=r["url"], name=r["name"],
                       events=json.loads(r["events"]) if r["events"] else None, scheme=r["scheme"],
                       enabled=bool(r["enabled"]), created_at=float(r["created_at"]))


class Sealer(Protocol):
    """What encrypts webhook signing secrets at rest: a Fernet (iam/secrets.py, D57's key)."""

    def encrypt(self, data: bytes) -> bytes: ...
    def decrypt(self, token: bytes) -> bytes: ...


SEALED = "fernet:"     # a stored secret that starts so is a Fernet token; others are from before


class EventStore:
    def __init__(self, db: Database, sealer: Callable[[], Sealer] | None = None):
        """`sealer`: the key that encrypts webhook secrets at rest (made on first use); None:
        stored as given (the store's own tests)."""
        self.db = db
        self._sealer = sealer

    def _seal(self, secret: str) -> str:
        if self._sealer is None:
            return secret
        return SEALED + self._sealer().encrypt(secret.encode()).decode()

    def _unseal(self, stored: str) -> str:
        if self._sealer is None or not stored.startswith(SEALED):
            return stored       # a row from before encryption (seal_plain turns them over)
        return self._sealer().decrypt(stored[len(SEALED):].encode()).decode()

    def seal_plain(self) -> int:
        """Encrypt the webhook secrets stored in plain text before this version; how many."""
        if self._sealer is None:
            return 0

        def run(tx: Tx) -> int:
            n = 0
            for r in tx.all("SELECT id, secret FROM webhooks WHERE substr(secret, 1, ?) <> ?", (len(SEALED), SEALED)):
                n += tx.execute("UPDATE webhooks SET secret=? WHERE id=? AND secret=?",
                                (self._seal(r["secret"]), r["id"], r["secret"]))
            return n
        return self.db.run(run)

    # -- events ------------------------------------------------------------------------------
    def ingest(self, source: str, events: Sequence[SandboxEvent], last_seq: int,
               audience: Callable[[str], list[str]]) -> int:
        """Store the events of `source` newer than its cursor (another replica may have taken
        some already) and queue their webhook deliveries; the number stored. `audience(project)`:
        the projects whose webhooks get that project's events (itself and its ancestors)."""
        def run(tx: Tx) -> int:
            head = self._lock_head(tx)
            r = tx.one("SELECT seq FROM event_cursors WHERE source=?", (source,))
            cursor = int(r["seq"]) if r else 0
            if last_seq < cursor:
                cursor = 0     # the edge's log began again (its database was replaced)
            new = [e for e in events if e.seq > cursor]
            head = self._insert(tx, head, source, new, audience)
            top = max([e.seq for e in new] + [cursor])
            tx.execute("INSERT INTO event_cursors (source, seq) VALUES (?,?) "
                       "ON CONFLICT (source) DO UPDATE SET seq=excluded.seq", (source, top))
            tx.execute("UPDATE events_head SET last_id=? WHERE k=1", (head,))
            return len(new)
        return self.db.run(run)

    def add_once(self, event: SandboxEvent, audience: Callable[[str], list[str]]) -> bool:
        """An event the apiserver makes (node_lost), stored once per (sandbox, type, reason)
        whichever replica gets there first."""
        def run(tx: Tx) -> bool:
            head = self._lock_head(tx)
            if tx.one("SELECT id FROM events WHERE sandbox_id=? AND type=? AND source='apiserver'",
                      (event.sandbox_id, event.type.value)):
                return False
            tx.execute("UPDATE events_head SET last_id=? WHERE k=1",
                       (self._insert(tx, head, "apiserver", [event], audience),))
            return True
        return self.db.run(run)

    @staticmethod
    def _lock_head(tx: Tx) -> int:
        tx.execute("UPDATE events_head SET last_id=last_id WHERE k=1")     # the row lock: one ingest at a time
        r = tx.one("SELECT last_id FROM events_head WHERE k=1")
        return int(r["last_id"]) if r else 0

    @staticmethod
    def _insert(tx: Tx, head: int, source: str, events: Sequence[SandboxEvent],
                audience: Callable[[str], list[str]]) -> int:
        now = time.time()
        hooks: dict[str, list[Row]] = {}
        for e in events:
            head += 1
            tx.execute("INSERT INTO events (id, source, seq, type, sandbox_id, project_id, node, reason, message, at, "
                       "details) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (head, source, e.seq, e.type.value, e.sandbox_id, e.project, e.node, e.reason, e.message,
                        e.at.timestamp(), json.dumps(e.details, default=str)))
            if e.project not in hooks:
                projects = audience(e.project) or [e.project]
                hooks[e.project] = tx.all("SELECT id, events FROM webhooks WHERE enabled=1 AND "
                                          + in_clause("project_id", projects), projects)
            for h in hooks[e.project]:
                wanted = json.loads(h["events"]) if h["events"] else None
                if wanted is None or e.type.value in wanted:
                    tx.execute("INSERT INTO webhook_deliveries (id, webhook_id, event_id, status, next_at, created_at) "
                               "VALUES (?,?,?,?,?,?)", (secrets.token_hex(10), h["id"], head, "pending", now, now))
        return head

    def list_events(self, after: int = 0, projects: Sequence[str] | None = None, *, sandbox_id: str | None = None,
             limit: int = 500) -> list[SandboxEvent]:
        """Events after id `after`, oldest first; `projects` None: every project's."""
        where: list[str] = ["id > ?"]
        params: list[object] = [after]
        if projects is not None:
            if not projects:
                return []
            where.append(in_clause("project_id", projects))
            params.extend(projects)
        if sandbox_id is not None:
            where.append("sandbox_id = ?")
            params.append(sandbox_id)
        rows = self.db.run(lambda tx: tx.all(f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id LIMIT ?",
                                             [*params, limit]), write=False)
        return [_event(r) for r in rows]

    def last_id(self) -> int:
        r = self.db.run(lambda tx: tx.one("SELECT last_id FROM events_head WHERE k=1"), write=False)
        return int(r["last_id"]) if r else 0

    def prune(self, before: float) -> int:
        def run(tx: Tx) -> int:
            n = tx.execute("DELETE FROM events WHERE at < ?", (before,))
            tx.execute("DELETE FROM webhook_deliveries WHERE status <> 'pending' AND created_at < ?", (before,))
            return n
        return self.db.run(run)

    # -- webhooks ----------------------------------------------------------------------------
    def add_webhook(self, project: str, url: str, name: str, events: list[str] | None, secret: str,
                    scheme: str, private_ok: bool = False) -> WebhookInfo:
        wid = "wh_" + secrets.token_hex(8)
        now = time.time()
        self.db.run(lambda tx: tx.execute(
            "INSERT INTO webhooks (id, project_id, url, name, events, secret, scheme, enabled, private_ok, created_at) "
            "VALUES (?,?,?,?,?,?,?,1,?,?)", (wid, project, url, name, json.dumps(events) if events is not None else None,
                                             self._seal(secret), scheme, int(private_ok), now)))
        return WebhookInfo(id=wid, project=project, url=url, name=name, events=events, scheme=scheme,
                           created_at=now, secret=secret)

    def webhooks(self, projects: Sequence[str] | None = None, scheme: str | None = None) -> list[WebhookInfo]:
        where: list[str] = ["1=1"]
        params: list[object] = []
        if projects is not None:
            if not projects:
                return []
            where.append(in_clause("project_id", projects))
            params.extend(projects)
        if scheme is not None:
            where.append("scheme = ?")
            params.append(scheme)
        rows = self.db.run(lambda tx: tx.all(f"SELECT * FROM webhooks WHERE {' AND '.join(where)} "
                                             "ORDER BY created_at, id", params), write=False)
        return [_webhook(r) for r in rows]

    def webhook(self, webhook_id: str, projects: Sequence[str] | None = None) -> WebhookInfo:
        """The webhook, if `projects` (None: any) holds it; else NotFound (others' look missing)."""
        r = self.db.run(lambda tx: tx.one("SELECT * FROM webhooks WHERE id=?", (webhook_id,)), write=False)
        if r is None or (projects is not None and r["project_id"] not in projects):
            raise NotFound(f"no webhook {webhook_id!r}", field="webhook_id", fix="list them: GET /v1/webhooks")
        return _webhook(r)

    def update_webhook(self, webhook_id: str, **fields: object) -> None:
        cols = {k: (json.dumps(v) if k == "events" and v is not None else int(bool(v)) if k in ("enabled", "private_ok")
                    else self._seal(str(v)) if k == "secret" else v)
                for k, v in fields.items()}
        if cols:
            self.db.run(lambda tx: tx.execute(f"UPDATE webhooks SET {', '.join(f'{k}=?' for k in cols)} WHERE id=?",
                                              [*cols.values(), webhook_id]))

    def delete_webhook(self, webhook_id: str) -> None:
        self.db.run(lambda tx: tx.execute("DELETE FROM webhooks WHERE id=?", (webhook_id,)))

    # -- deliveries --------------------------------------------------------------------------
    def claim_due(self, lease_s: float, limit: int = 50) -> list[Due]:
        """Deliveries due now, each leased for `lease_s` (another replica skips them meanwhile;
        a worker that dies mid-send lets its lease lapse: at-least-once)."""
        now = time.time()

        def run(tx: Tx) -> list[Due]:
            rows = tx.all("SELECT d.id AS did, d.attempts, d.created_at AS dcreated, w.*, e.id AS eid, e.seq, e.type, "
                          "e.sandbox_id, e.project_id AS eproject, e.node, e.reason, e.message, e.at, e.details "
                          "FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id "
                          "JOIN events e ON e.id = d.event_id "
                          "WHERE d.status='pending' AND d.next_at <= ? AND d.lease_until < ? "
                          "ORDER BY d.next_at LIMIT ?", (now, now, limit))
            out = []
            for r in rows:
                if tx.execute("UPDATE webhook_deliveries SET lease_until=? WHERE id=? AND lease_until < ?",
                              (now + lease_s, r["did"], now)):
                    ev = _event({**r, "id": r["eid"], "project_id": r["eproject"]})
                    out.append(Due(r["did"], int(r["attempts"]), float(r["dcreated"]), _webhook(r), self._unseal(r["secret"]), ev,
                                   bool(r["private_ok"])))
            return out
        return self.db.run(run)

    def delivered(self, delivery_id: str, status: int) -> None:
        self.db.run(lambda tx: tx.execute(
            "UPDATE webhook_deliveries SET status='delivered', attempts=attempts+1, last_status=?, last_error=NULL, "
            "delivered_at=?, lease_until=0 WHERE id=?", (status, time.time(), delivery_id)))

    def failed_attempt(self, delivery_id: str, status: int | None, error: str, next_at: float | None) -> None:
        """An attempt failed: retry at `next_at`, or give up (None)."""
        self.db.run(lambda tx: tx.execute(
            "UPDATE webhook_deliveries SET status=?, attempts=attempts+1, last_status=?, last_error=?, next_at=?, "
            "lease_until=0 WHERE id=?", ("pending" if next_at is not None else "failed", status, error[:500],
                                         next_at if next_at is not None else time.time(), delivery_id)))

    def deliveries(self, webhook_id: str, limit: int = 100) -> tuple[list[DeliveryInfo], dict[str, int]]:
        def run(tx: Tx) -> tuple[list[Row], list[Row]]:
            return (tx.all("SELECT * FROM webhook_deliveries WHERE webhook_id=? ORDER BY created_at DESC, event_id DESC "
                           "LIMIT ?", (webhook_id, limit)),
                    tx.all("SELECT status, COUNT(*) AS n FROM webhook_deliveries WHERE webhook_id=? GROUP BY status",
                           (webhook_id,)))
        rows, counts = self.db.run(run, write=False)
        items = [DeliveryInfo(id=r["id"], webhook_id=r["webhook_id"], event_id=int(r["event_id"]), status=r["status"],
                              attempts=int(r["attempts"]),
                              next_at=float(r["next_at"]) if r["status"] == "pending" else None,
                              last_status=r["last_status"], last_error=r["last_error"],
                              created_at=float(r["created_at"]), delivered_at=r["delivered_at"]) for r in rows]
        return items, {r["status"]: int(r["n"]) for r in counts}
