"""What differs between SQLite and PostgreSQL, in one place.

Every statement in dsec is written once, with `?` placeholders and types both engines accept
(TEXT, BIGINT, DOUBLE PRECISION, INTEGER 0/1 for booleans, ON CONFLICT upserts, recursive CTEs,
partial indexes). The few differences are the members below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dialect:
    name: str
    begin_write: str          # a transaction that will write: SQLite takes the write lock up front
    migration_lock: str | None  # serialises schema migrations between processes (SQLite: BEGIN IMMEDIATE does)
    null_safe_eq: str         # "a <op> b" true when both are NULL

    def sql(self, statement: str) -> str:
        """`?` placeholders in the engine's style (psycopg: %s, with literal % doubled)."""
        if self.name == "sqlite":
            return statement
        return statement.replace("%", "%%").replace("?", "%s")

    def is_(self, column: str) -> str:
        """`column = ?` that also matches NULL = NULL (a top-level project's parent)."""
        return f"{column} {self.null_safe_eq} ?"


SQLITE = Dialect(name="sqlite", begin_write="BEGIN IMMEDIATE", migration_lock=None, null_safe_eq="IS")
# 0x64736563 = "dsec": the advisory lock every dsec process takes while migrating
POSTGRES = Dialect(name="postgresql", begin_write="BEGIN", migration_lock="SELECT pg_advisory_xact_lock(1685283171)",
                   null_safe_eq="IS NOT DISTINCT FROM")
