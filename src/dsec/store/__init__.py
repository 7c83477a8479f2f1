"""Durable control state: one schema with migrations on SQLite (single machine) or PostgreSQL
(a cluster), chosen by the DSN; see docs/decisions.md (D31)."""

from dsec.store.db import Database, Tx, connect, is_postgres_dsn, redact
from dsec.store.migrate import open_db
from dsec.store.sandboxes import IndexedSandbox, SandboxIndex

DB_URL_ENV = "DSEC_DB_URL"   # postgresql://... selects PostgreSQL; unset: the SQLite file in DSEC_HOME

__all__ = ["DB_URL_ENV", "Database", "IndexedSandbox", "SandboxIndex", "Tx", "connect", "is_postgres_dsn",
           "open_db", "redact"]
