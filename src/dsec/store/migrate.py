"""The migrations runner: applies store/schema.py's migrations newer than the database's
schema_version, each in the transaction that records it, under a lock that serialises
concurrent starters (BEGIN IMMEDIATE on SQLite, an advisory lock on PostgreSQL)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from dsec.store.db import POOL_MAX, RETRY_S, Database, Tx, connect
from dsec.store.schema import LATEST, MIGRATIONS
from dsec.types import Conflict

log = logging.getLogger("dsec.store")


def current_version(tx: Tx) -> int:
    r = tx.one("SELECT MAX(version) AS v FROM schema_version")
    return int(r["v"]) if r and r["v"] is not None else 0


def migrate(db: Database, migrations: list[tuple[int, str, list[str]]] = MIGRATIONS) -> int:
    """Bring the schema up to date; the version it is at afterwards."""
    latest = migrations[-1][0] if migrations else 0

    def step(tx: Tx) -> int:
        if tx.dialect.migration_lock:
            tx.one(tx.dialect.migration_lock)
        tx.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                   "name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)")
        have = current_version(tx)
        if have > latest:
            raise Conflict(f"database {db.url} has schema version {have}; this dsec knows {latest}",
                           field="schema_version", fix="upgrade dsec on this machine to the version the "
                                                       "other apiservers run")
        for version, name, statements in migrations:
            if version <= have:
                continue
            for s in statements:
                tx.execute(s)
            tx.execute("INSERT INTO schema_version (version, name, applied_at) VALUES (?,?,?)",
                       (version, name, time.time()))
            log.info("applied schema migration", extra={"db": db.url, "version": version, "migration": name})
        return max(have, latest)

    return db.run(step)


def open_db(dsn: str | Path, *, retry_s: float = RETRY_S, pool_max: int = POOL_MAX) -> Database:
    """Connect and bring the schema up to date."""
    db = connect(dsn, retry_s=retry_s, pool_max=pool_max)
    try:
        migrate(db)
    except BaseException:
        db.close()
        raise
    return db


__all__ = ["LATEST", "migrate", "open_db"]
