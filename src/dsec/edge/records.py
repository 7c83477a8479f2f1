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

from dsec.types import VM_BACKENDS, SandboxInfo, SandboxState

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
    error TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
"""


@dataclass
class SandboxRecord:
    id: str
    project: str
    backend: str
    state: SandboxState
    args: dict
    image: str
    image_digest: str | None
    uid: int
    gid: int
    created_at: float
    last_active_at: float
    ended_at: float | None = None
    error: str | None = None
    # not persisted: commands in flight (a busy sandbox is never idle-reaped)
    in_flight: int = field(default=0, compare=False)

    @property
    def cpu_cores(self) -> float:
        return float(self.args.get("vcpus", self.args.get("cpu_cores", 1.0)))

    @property
    def memory_mb(self) -> int:
        return int(self.args.get("memory_mb", 512))

    @property
    def ttl_idle_s(self) -> int:
        return int(self.args.get("ttl_idle_s", 600))

    def info(self, node: str) -> SandboxInfo:
        ts = lambda t: datetime.fromtimestamp(t, timezone.utc)  # noqa: E731
        return SandboxInfo(id=self.id, node=node, project=self.project, backend=self.backend,
                           state=self.state, image=self.image, image_digest=self.image_digest,
                           cpu_cores=self.cpu_cores, memory_mb=self.memory_mb,
                           ttl_idle_s=self.ttl_idle_s, created_at=ts(self.created_at),
                           last_active_at=ts(self.last_active_at), error=self.error,
                           labels=self.args.get("labels", {}),
                           network=self.args.get("network") if self.backend == "container" else None,
                           accel=self.args.get("accel") if self.backend in VM_BACKENDS else None)


class EdgeRecords:
    def __init__(self, path: Path):
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL+NORMAL survives process crashes
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    def insert(self, r: SandboxRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (r.id, r.project, r.backend, r.state.value, json.dumps(r.args), r.image,
                 r.image_digest, r.uid, r.gid, r.created_at, r.last_active_at, r.ended_at, r.error))

    def set_state(self, sandbox_id: str, state: SandboxState, error: str | None = None) -> None:
        ended = time.time() if state in (SandboxState.stopped, SandboxState.failed) else None
        with self._lock:
            self._db.execute("UPDATE sandboxes SET state=?, error=COALESCE(?, error), ended_at=COALESCE(?, ended_at) "
                             "WHERE id=?", (state.value, error, ended, sandbox_id))

    def set_args(self, sandbox_id: str, args: dict) -> None:
        with self._lock:
            self._db.execute("UPDATE sandboxes SET args=? WHERE id=?", (json.dumps(args), sandbox_id))

    def touch_many(self, items: list[tuple[float, str]]) -> None:
        with self._lock:
            self._db.executemany("UPDATE sandboxes SET last_active_at=? WHERE id=?", items)

    def load(self, states: tuple[SandboxState, ...] | None = None) -> list[SandboxRecord]:
        if not states:
            return self._select("", ())
        return self._select(f"WHERE state IN ({','.join('?' * len(states))})", tuple(s.value for s in states))

    def _select(self, where: str, params: tuple) -> list[SandboxRecord]:
        q = "SELECT id, project, backend, state, args, image, image_digest, uid, gid, created_at, " \
            "last_active_at, ended_at, error FROM sandboxes " + where
        with self._lock:
            rows = self._db.execute(q, params).fetchall()
        return [SandboxRecord(id=r[0], project=r[1], backend=r[2], state=SandboxState(r[3]),
                              args=json.loads(r[4]), image=r[5], image_digest=r[6], uid=r[7], gid=r[8],
                              created_at=r[9], last_active_at=r[10], ended_at=r[11], error=r[12])
                for r in rows]

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        found = self._select("WHERE id=?", (sandbox_id,))
        return found[0] if found else None

    def purge_ended(self, before: float) -> int:
        with self._lock:
            return self._db.execute("DELETE FROM sandboxes WHERE ended_at IS NOT NULL AND ended_at < ?",
                                    (before,)).rowcount
