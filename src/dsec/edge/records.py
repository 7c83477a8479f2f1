"""The edge's durable record of its sandboxes (SQLite, WAL).

Written before and after every state change, so an edge that restarts (or crashes mid-burst)
knows every sandbox it owns and which ones were half-created.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pydantic import TypeAdapter

from dsec.types import STORED, SandboxArgs, SandboxInfo, SandboxState

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    project TEXT NOT NULL,
    backend TEXT NOT NULL,
    state TEXT NOT NULL,
    args TEXT NOT NULL,            -- backend argument model as JSON
    image TEXT NOT NULL,
    image_digest TEXT,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    ended_at REAL,
    error TEXT,
    output_used_bytes INTEGER NOT NULL DEFAULT 0,  -- lifetime output budget spent (output_budget.py)
    expires_at REAL,               -- absolute lifetime end (lifetime_s, set_timeout)
    idempotency_key TEXT,          -- the create's key: a retried create returns this sandbox
    end_reason TEXT                -- why it ended, one word of types/events.py's vocabulary
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
"""
INDEXES = "CREATE INDEX IF NOT EXISTS sandboxes_idem ON sandboxes(project, idempotency_key)"
# Columns added after the first schema, with how to add them to an older edge.db.
MIGRATIONS = {"output_used_bytes": "ALTER TABLE sandboxes ADD COLUMN output_used_bytes INTEGER NOT NULL DEFAULT 0",
              "expires_at": "ALTER TABLE sandboxes ADD COLUMN expires_at REAL",
              "idempotency_key": "ALTER TABLE sandboxes ADD COLUMN idempotency_key TEXT",
              "end_reason": "ALTER TABLE sandboxes ADD COLUMN end_reason TEXT"}
COLUMNS = ("id, project, backend, state, args, image, image_digest, uid, gid, created_at, last_active_at, "
           "ended_at, error, output_used_bytes, expires_at, end_reason")
ARGS = TypeAdapter(SandboxArgs)
LEGACY_USED_KEY = "output_used_bytes"    # older edges kept the counter inside the args JSON


def parse_args(raw: str) -> tuple[SandboxArgs, int]:
    """The stored argument model, and a counter an older edge kept inside it (0 if none)."""
    d = json.loads(raw)
    used = int(d.pop(LEGACY_USED_KEY, 0) or 0)
    return ARGS.validate_python(d, context=STORED), used   # bounds added later must not drop records


@dataclass
class SandboxRecord:
    id: str
    project: str
    backend: str
    state: SandboxState
    args: SandboxArgs          # the backend's argument model, as created (network as last set)
    image: str
    image_digest: str | None
    uid: int
    gid: int
    created_at: float
    last_active_at: float
    ended_at: float | None = None
    error: str | None = None
    output_used_bytes: int = 0
    expires_at: float | None = None
    end_reason: str | None = None   # why it ended (types/events.py); error keeps the message
    # not persisted: commands in flight (a busy sandbox is never idle-reaped)
    in_flight: int = field(default=0, compare=False)

    @property
    def cpu_cores(self) -> float:
        return float(self.args.cpu_cores)

    @property
    def memory_mb(self) -> int:
        return self.args.memory_mb

    @property
    def ttl_idle_s(self) -> int:
        return self.args.ttl_idle_s

    def info(self, node: str) -> SandboxInfo:
        ts = lambda t: datetime.fromtimestamp(t, timezone.utc)  # noqa: E731
        return SandboxInfo(id=self.id, node=node, project=self.project, backend=self.backend,
                           state=self.state, image=self.image, image_digest=self.image_digest,
                           cpu_cores=self.cpu_cores, memory_mb=self.memory_mb,
                           ttl_idle_s=self.ttl_idle_s, created_at=ts(self.created_at),
                           last_active_at=ts(self.last_active_at), error=self.error, end_reason=self.end_reason,
                           expires_at=ts(self.expires_at) if self.expires_at is not None else None,
                           labels=self.args.labels, on_timeout=getattr(self.args, "on_timeout", "stop"),
                           volumes=getattr(self.args, "volumes", None) or [],
                           network=getattr(self.args, "network", None),
                           accel=getattr(self.args, "accel", None))


class EdgeRecords:
    def __init__(self, path: Path):
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL+NORMAL survives process crashes
        self._db.executescript(SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        for column, ddl in MIGRATIONS.items():
            if column not in have:
                self._db.execute(ddl)
        self._db.execute(INDEXES)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    def insert(self, r: SandboxRecord) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT INTO sandboxes ({COLUMNS}, idempotency_key) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (r.id, r.project, r.backend, r.state.value, r.args.model_dump_json(), r.image,
                 r.image_digest, r.uid, r.gid, r.created_at, r.last_active_at, r.ended_at, r.error,
                 r.output_used_bytes, r.expires_at, r.end_reason, r.args.idempotency_key))

    def set_state(self, sandbox_id: str, state: SandboxState, error: str | None = None,
                  end_reason: str | None = None) -> None:
        ended = time.time() if state in (SandboxState.stopped, SandboxState.failed) else None
        with self._lock:
            self._db.execute("UPDATE sandboxes SET state=?, error=COALESCE(?, error), ended_at=COALESCE(?, ended_at), "
                             "end_reason=COALESCE(?, end_reason) WHERE id=?",
                             (state.value, error, ended, end_reason, sandbox_id))

    def set_args(self, sandbox_id: str, args: SandboxArgs) -> None:
        with self._lock:
            self._db.execute("UPDATE sandboxes SET args=? WHERE id=?", (args.model_dump_json(), sandbox_id))

    def set_expires_at(self, sandbox_id: str, expires_at: float | None) -> None:
        with self._lock:
            self._db.execute("UPDATE sandboxes SET expires_at=? WHERE id=?", (expires_at, sandbox_id))

    def find_idempotent(self, project: str, key: str) -> SandboxRecord | None:
        """The sandbox an earlier create of `project` with this idempotency key made (not one
        whose creation failed: the caller got that error, and a retry may try again)."""
        found = self._select("WHERE project=? AND idempotency_key=? AND NOT (state='failed' AND error LIKE "
                             "'creation failed%') ORDER BY created_at DESC LIMIT 1", (project, key))
        return found[0] if found else None

    def flush_activity(self, items: list[tuple[float, int, str]]) -> None:
        """(last_active_at, output_used_bytes, id) of sandboxes used since the last flush."""
        with self._lock:
            self._db.executemany("UPDATE sandboxes SET last_active_at=?, output_used_bytes=? WHERE id=?", items)

    def load(self, states: tuple[SandboxState, ...] | None = None) -> list[SandboxRecord]:
        if not states:
            return self._select("", ())
        return self._select(f"WHERE state IN ({','.join('?' * len(states))})", tuple(s.value for s in states))

    def _select(self, where: str, params: tuple) -> list[SandboxRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {COLUMNS} FROM sandboxes " + where, params).fetchall()
        out = []
        for r in rows:
            args, legacy_used = parse_args(r[4])
            out.append(SandboxRecord(id=r[0], project=r[1], backend=r[2], state=SandboxState(r[3]), args=args,
                                     image=r[5], image_digest=r[6], uid=r[7], gid=r[8], created_at=r[9],
                                     last_active_at=r[10], ended_at=r[11], error=r[12],
                                     output_used_bytes=max(r[13], legacy_used), expires_at=r[14],
                                     end_reason=r[15]))
        return out

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        found = self._select("WHERE id=?", (sandbox_id,))
        return found[0] if found else None

    def purge_ended(self, before: float) -> int:
        with self._lock:
            return self._db.execute("DELETE FROM sandboxes WHERE ended_at IS NOT NULL AND ended_at < ?",
                                    (before,)).rowcount
