"""Project quotas: how many sandboxes, CPU cores and MiB of memory a project and everything
below it may hold at once, enforced when a sandbox is created, on every edge together.

A transactional ledger in the IAM database: creating a sandbox first *reserves* its share in
one transaction that adds it to the usage counters of the project and of every ancestor and
refuses (rolling all of it back) if any of them would pass its limit; the reservation is bound
to the sandbox id once an edge created it, and *released* when the sandbox ends (or the
creation failed). SQLite serialises the transactions (BEGIN IMMEDIATE); on PostgreSQL each
counter row's lock does, taken bottom-up so that two chains (which share a suffix up to the
root) always lock in the same order. Sandboxes that end without the apiserver seeing it (TTL
reaps, failures) are found by reconcile() against the edges' own lists.
"""

from __future__ import annotations

import logging
import secrets
import time
from pydantic import BaseModel

from dsec.store import Database, Tx
from dsec.store.db import Row
from dsec.types import CapacityExceeded, NotFound

log = logging.getLogger("dsec.iam.quota")

PENDING_TTL_S = 600.0   # a reservation never bound to a sandbox (its apiserver died mid-create) is freed after this


class QuotaExceeded(CapacityExceeded):
    """429 `capacity_exceeded` like a full node (clients handle both alike), but naming the
    project and the limit; never retried on another node."""


class Usage(BaseModel):
    sandboxes: int = 0
    cpu_cores: float = 0.0
    memory_mb: int = 0


class ProjectQuota(BaseModel):
    """GET /v1/projects/{id}/quota: the limits and what the project and its sub-projects hold."""

    project_id: str
    max_sandboxes: int
    max_cpu_cores: float
    max_memory_mb: int
    used: Usage


class Held(BaseModel):
    """One reservation bound to a sandbox (for reconcile)."""

    reservation_id: str
    sandbox_id: str
    project_id: str
    activated_at: float


def millis(cores: float) -> int:
    return int(round(cores * 1000))


_CHAIN = """WITH RECURSIVE up(id, parent_id, depth) AS (
                SELECT id, parent_id, 0 FROM projects WHERE id=?
                UNION ALL
                SELECT p.id, p.parent_id, up.depth + 1 FROM projects p JOIN up ON p.id = up.parent_id
            ) SELECT p.id, p.name, p.max_sandboxes, p.max_cpu_cores, p.max_memory_mb
              FROM up JOIN projects p ON p.id = up.id ORDER BY up.depth"""


_SUBTREE = """WITH RECURSIVE down(id) AS (
                  SELECT id FROM projects WHERE id=?
                  UNION ALL
                  SELECT p.id FROM projects p JOIN down ON p.parent_id = down.id
              ) SELECT id FROM down"""


class QuotaLedger:
    def __init__(self, db: Database):
        self.db = db

    def reserve(self, project_id: str, cpu_cores: float, memory_mb: int) -> str:
        """Hold one sandbox's share for the project and every ancestor; its reservation id.
        QuotaExceeded names the first project (bottom-up) whose limit it would pass."""
        cpu = millis(cpu_cores)

        def go(tx: Tx) -> str:
            chain = tx.all(_CHAIN, (project_id,))
            if not chain:
                raise NotFound(f"no project {project_id!r}", field="project",
                               fix="use a key of an existing project")
            for p in chain:        # bottom-up: the same lock order for every chain
                r = tx.one("UPDATE quota_usage SET sandboxes=sandboxes+1, cpu_millis=cpu_millis+?, "
                           "memory_mb=memory_mb+? WHERE project_id=? RETURNING sandboxes, cpu_millis, memory_mb",
                           (cpu, memory_mb, p["id"]))
                if r is None:      # a row lost to a bug or a hand edit: recreate it from the ledger
                    self._rebuild(tx, p["id"])
                    r = tx.one("UPDATE quota_usage SET sandboxes=sandboxes+1, cpu_millis=cpu_millis+?, "
                               "memory_mb=memory_mb+? WHERE project_id=? RETURNING sandboxes, cpu_millis, memory_mb",
                               (cpu, memory_mb, p["id"]))
                    assert r is not None
                _check(p, r, project_id, cpu_cores, memory_mb)
            rid = "rsv-" + secrets.token_hex(8)
            tx.execute("INSERT INTO quota_reservations (id, project_id, cpu_millis, memory_mb, created_at) "
                       "VALUES (?,?,?,?,?)", (rid, project_id, cpu, memory_mb, time.time()))
            return rid
        return self.db.run(go)

    def activate(self, reservation_id: str, sandbox_id: str) -> bool:
        """Bind a reservation to the sandbox the edge created. False (and the reservation given
        back) when another reservation holds that sandbox already: an idempotent create's retry
        was handed the sandbox an earlier request created and reserved for."""
        def go(tx: Tx) -> bool:
            holder = tx.one("SELECT id FROM quota_reservations WHERE sandbox_id=?", (sandbox_id,))
            if holder is not None and holder["id"] != reservation_id:
                _release(tx, "id", reservation_id)
                return False
            tx.execute("UPDATE quota_reservations SET sandbox_id=?, activated_at=? WHERE id=?",
                       (sandbox_id, time.time(), reservation_id))
            return True
        return self.db.run(go)

    def release(self, *, reservation_id: str | None = None, sandbox_id: str | None = None) -> bool:
        """Give back a reservation (by id, or by the sandbox it holds); False if none (idempotent)."""
        col, val = ("id", reservation_id) if reservation_id else ("sandbox_id", sandbox_id)
        return self.db.run(lambda tx: _release(tx, col, val))

    def quota(self, project_id: str) -> ProjectQuota:
        def go(tx: Tx) -> ProjectQuota:
            p = tx.one("SELECT p.id, p.max_sandboxes, p.max_cpu_cores, p.max_memory_mb, u.sandboxes, "
                       "u.cpu_millis, u.memory_mb FROM projects p LEFT JOIN quota_usage u ON u.project_id = p.id "
                       "WHERE p.id=?", (project_id,))
            if p is None:
                raise NotFound(f"no project {project_id!r}", field="project_id",
                               fix="use a project id from `dsec project ls`")
            return ProjectQuota(project_id=p["id"], max_sandboxes=int(p["max_sandboxes"]),
                                max_cpu_cores=float(p["max_cpu_cores"]), max_memory_mb=int(p["max_memory_mb"]),
                                used=Usage(sandboxes=int(p["sandboxes"] or 0),
                                           cpu_cores=int(p["cpu_millis"] or 0) / 1000,
                                           memory_mb=int(p["memory_mb"] or 0)))
        return self.db.run(go, write=False)

    def held(self, activated_before: float) -> list[Held]:
        """Reservations bound to a sandbox before this time (reconcile compares them with the
        edges' lists taken after it)."""
        rows = self.db.run(lambda tx: tx.all(
            "SELECT id, sandbox_id, project_id, activated_at FROM quota_reservations "
            "WHERE sandbox_id IS NOT NULL AND activated_at < ?", (activated_before,)), write=False)
        return [Held(reservation_id=r["id"], sandbox_id=r["sandbox_id"], project_id=r["project_id"],
                     activated_at=float(r["activated_at"])) for r in rows]

    def release_node(self, node: str) -> int:
        """Give back every reservation held by a sandbox of `node` (ids `sb-<node>.*`): the node
        is gone for good (`dsec nodes forget`). How many."""
        def go(tx: Tx) -> int:
            rows = tx.all("SELECT id FROM quota_reservations WHERE sandbox_id LIKE ?", (f"sb-{node}.%",))
            return sum(_release(tx, "id", r["id"]) for r in rows)
        return self.db.run(go)

    def release_stale_pending(self, older_than_s: float = PENDING_TTL_S) -> int:
        """Free reservations never bound to a sandbox (an apiserver died between reserving and
        the edge's answer)."""
        rows = self.db.run(lambda tx: tx.all(
            "SELECT id FROM quota_reservations WHERE sandbox_id IS NULL AND created_at < ?",
            (time.time() - older_than_s,)), write=False)
        return sum(self.release(reservation_id=r["id"]) for r in rows)

    def rebuild(self) -> None:
        """Recompute every usage counter from the ledger (a repair; the two never drift apart
        in normal operation, since both change in one transaction)."""
        def go(tx: Tx) -> None:
            for r in tx.all("SELECT id FROM projects"):
                self._rebuild(tx, r["id"])
        self.db.run(go)

    def _rebuild(self, tx: Tx, project_id: str) -> None:
        ids = [r["id"] for r in tx.all(_SUBTREE, (project_id,))] or [project_id]
        s = tx.one("SELECT COUNT(*) AS n, COALESCE(SUM(cpu_millis), 0) AS c, COALESCE(SUM(memory_mb), 0) AS m "
                   f"FROM quota_reservations WHERE project_id IN ({','.join('?' * len(ids))})", ids)
        assert s is not None
        tx.execute("INSERT INTO quota_usage (project_id, sandboxes, cpu_millis, memory_mb) VALUES (?,?,?,?) "
                   "ON CONFLICT(project_id) DO UPDATE SET sandboxes=excluded.sandboxes, "
                   "cpu_millis=excluded.cpu_millis, memory_mb=excluded.memory_mb",
                   (project_id, int(s["n"]), int(s["c"]), int(s["m"])))


def _check(p: Row, used: Row, project_id: str, cpu_cores: float, memory_mb: int) -> None:
    who = f"project {p['name']} ({p['id']})" + ("" if p["id"] == project_id else f", a parent of {project_id},")
    fix = (f"stop sandboxes of {p['id']} or its sub-projects (`dsec sandbox ls`), or ask an admin of its parent "
           f"to raise the quota (`dsec project quota {p['id']} ...`)")
    if used["sandboxes"] > p["max_sandboxes"]:
        raise QuotaExceeded(f"{who} is at its quota of max_sandboxes={p['max_sandboxes']}",
                            field="max_sandboxes", fix=fix)
    if used["cpu_millis"] > millis(float(p["max_cpu_cores"])):
        raise QuotaExceeded(f"{who} would pass its quota of max_cpu_cores={float(p['max_cpu_cores']):g} "
                            f"(holds {(used['cpu_millis'] - millis(cpu_cores)) / 1000:g}, asked {cpu_cores:g})",
                            field="cpu_cores", fix=fix)
    if used["memory_mb"] > p["max_memory_mb"]:
        raise QuotaExceeded(f"{who} would pass its quota of max_memory_mb={p['max_memory_mb']} "
                            f"(holds {used['memory_mb'] - memory_mb}, asked {memory_mb})",
                            field="memory_mb", fix=fix)


def _release(tx: Tx, col: str, val: str | None) -> bool:
    """Delete one reservation (by id or sandbox_id) and take it off its project's chain."""
    r = tx.one(f"DELETE FROM quota_reservations WHERE {col}=? RETURNING project_id, cpu_millis, memory_mb", (val,))
    if r is None:
        return False
    for p in tx.all(_CHAIN, (r["project_id"],)):
        tx.execute("UPDATE quota_usage SET sandboxes=sandboxes-1, cpu_millis=cpu_millis-?, "
                   "memory_mb=memory_mb-? WHERE project_id=?", (r["cpu_millis"], r["memory_mb"], p["id"]))
    return True
