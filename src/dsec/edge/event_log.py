"""The edge's lifecycle event log (SQLite, the edge's own database file).

The edge is where a sandbox's end is understood (OOM, a TTL, a stop), so it writes the event
there, durably, with its own monotonic seq; the apiserver pulls what is new (events_since) into
the control store, as the sandbox index pulls listings (D38), and ingests each (node, seq) once.
Kept for KEEP_S: an apiserver away for longer than that loses the oldest.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dsec.types import EdgeEvents, EventType, SandboxEvent, is_infrastructure

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    type TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    project TEXT NOT NULL,
    reason TEXT,
    message TEXT,
    details TEXT NOT NULL DEFAULT '{}'
);
"""
KEEP_S = 7 * 86400.0
MAX_BATCH = 1000


class EventLog:
    def __init__(self, path: Path, node: str, *, enabled: bool = True):
        self.node = node
        self.enabled = enabled      # DSEC_OBSERVABILITY=0: append writes nothing
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    def append(self, type_: EventType, sandbox_id: str, project: str, *, reason: str | None = None,
               message: str | None = None, details: dict[str, Any] | None = None) -> None:
        """One event (a few dozen µs: one WAL append, no fsync). Never raises: an event that
        cannot be written is logged, the lifecycle step it describes goes on."""
        if not self.enabled:
            return
        try:
            with self._lock:
                self._db.execute("INSERT INTO events (at, type, sandbox_id, project, reason, message, details) "
                                 "VALUES (?,?,?,?,?,?,?)",
                                 (time.time(), type_.value, sandbox_id, project, reason, message,
                                  json.dumps(details or {}, default=str)))
        except sqlite3.Error:
            import logging
            logging.getLogger("dsec.edge").exception("could not record a lifecycle event",
                                                     extra={"sandbox": sandbox_id, "event": type_.value})

    def since(self, after: int, limit: int = MAX_BATCH) -> EdgeEvents:
        with self._lock:
            rows = self._db.execute("SELECT seq, at, type, sandbox_id, project, reason, message, details FROM events "
                                    "WHERE seq > ? ORDER BY seq LIMIT ?", (after, min(limit, MAX_BATCH))).fetchall()
            last = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name='events'").fetchone()
        events = [SandboxEvent(seq=r[0], at=datetime.fromtimestamp(r[1], timezone.utc), type=EventType(r[2]),
                               sandbox_id=r[3], project=r[4], node=self.node, reason=r[5], message=r[6],
                               infrastructure=is_infrastructure(r[5]) if r[5] else None,
                               details=json.loads(r[7] or "{}")) for r in rows]
        return EdgeEvents(events=events, last_seq=int(last[0]) if last else 0)

    def purge(self, before: float) -> int:
        with self._lock:
            return self._db.execute("DELETE FROM events WHERE at < ?", (before,)).rowcount
