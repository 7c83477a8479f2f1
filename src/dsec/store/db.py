"""A small database layer over SQLite (one file, the single-machine default) and PostgreSQL
(shared by every apiserver of a cluster), chosen by the DSN.

Callers hand a function to `run()`; it executes in one transaction and gets a `Tx` to issue
statements on. On PostgreSQL a lost connection (the server restarted, a failover) or a
serialization/deadlock abort rolls the transaction back and runs the function again on a fresh
connection until DSEC_DB_RETRY_S passes, so a restart mid-use costs latency, not data. The
function must therefore only touch the database (no side effects outside it).

An API request waits less (store/wait.py): a call that finds the store unreachable for its
budget marks it down; while down, requests are refused at once (503, Retry-After) and a probe
thread reconnects every PROBE_S, replacing the pool when the server answers again (the pool's
own reconnection backs off exponentially: ~15 s late after a one-minute outage).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from dsec.store.dialect import POSTGRES, SQLITE, Dialect
from dsec.store.wait import STORE_RETRY_AFTER_S, request_wait
from dsec.types import Unavailable

log = logging.getLogger("dsec.store")

T = TypeVar("T")
Row = dict[str, Any]
RETRY_S = 30.0   # how long to ride out a PostgreSQL restart: the default of DSEC_DB_RETRY_S
POOL_MAX = 8     # connections per process: the default of DSEC_DB_POOL
PROBE_S = 0.25   # while the store is down: how often it is tried again
CONNECT_TIMEOUT_S = 2   # libpq's connect_timeout (whole seconds, at least 2): an unreachable host fails fast
# a connection whose peer vanished (host down, network cut) is noticed in ~10 s, not TCP's ~15 min
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 2,
              "tcp_user_timeout": 10_000}


def is_postgres_dsn(dsn: str | Path) -> bool:
    return isinstance(dsn, str) and dsn.startswith(("postgresql://", "postgres://"))


def in_clause(column: str, values: Sequence[object]) -> str:
    """`column IN (?,?,...)`, one placeholder per value (the caller passes the values)."""
    return f"{column} IN ({','.join('?' * len(values))})"


def redact(dsn: str) -> str:
    """The DSN without its password, for logs and errors."""
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


class Tx:
    """Statements of one transaction; rows come back as dicts."""

    def __init__(self, cursor: Any, dialect: Dialect):
        self._cur = cursor
        self.dialect = dialect

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run a statement; the number of rows it changed."""
        self._cur.execute(self.dialect.sql(sql), tuple(params))
        return int(self._cur.rowcount)

    def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """One statement over many rows (a batch of inserts: one call into the driver, not one per row)."""
        if rows:
            self._cur.executemany(self.dialect.sql(sql), rows)

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        self._cur.execute(self.dialect.sql(sql), tuple(params))
        r = self._cur.fetchone()
        return dict(r) if r is not None else None

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        self._cur.execute(self.dialect.sql(sql), tuple(params))
        return [dict(r) for r in self._cur.fetchall()]


class Database:
    """One database, SQLite or PostgreSQL. Thread-safe. A `run()` inside a `run()` on the same
    thread joins the outer transaction."""

    dialect: Dialect
    url: str          # for logs and errors: a path, or the DSN without its password

    def __init__(self) -> None:
        self._local = threading.local()

    def run(self, fn: Callable[[Tx], T], *, write: bool = True) -> T:
        outer: Tx | None = getattr(self._local, "tx", None)
        if outer is not None:
            return fn(outer)
        return self._run(fn, write)

    def _run(self, fn: Callable[[Tx], T], write: bool) -> T:
        raise NotImplementedError

    def fails_whole_transaction(self, error: BaseException) -> bool:
        """An error that is the transaction's, not one statement's (a deadlock, a serialization
        failure, a lost connection, a full disk): a batch (store/batch.py) must not hand it to one
        caller as its own answer, but fail the whole transaction, which `run` retries or reports."""
        return False

    def _enter(self, tx: Tx, fn: Callable[[Tx], T]) -> T:
        self._local.tx = tx
        try:
            return fn(tx)
        finally:
            self._local.tx = None

    def close(self) -> None:
        raise NotImplementedError


def _dict_row(cur: sqlite3.Cursor, row: tuple[Any, ...]) -> Row:
    return {d[0]: v for d, v in zip(cur.description, row)}


class SQLiteDatabase(Database):
    """One connection guarded by a lock (calls are short); writes open BEGIN IMMEDIATE so that
    two processes sharing the file serialise instead of failing on a lock upgrade."""

    dialect = SQLITE

    def __init__(self, path: Path | str):
        super().__init__()
        self.path = Path(path)
        self.url = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0, isolation_level=None)
        self._conn.row_factory = _dict_row
        _set_wal(self._conn)
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA synchronous=NORMAL")

    def _run(self, fn: Callable[[Tx], T], write: bool) -> T:
        with self._lock:
            cur = self._conn.cursor()
            if not write:   # reads run in autocommit: no BEGIN/COMMIT round (authenticate is one per request)
                return self._enter(Tx(cur, self.dialect), fn)
            try:
                cur.execute(self.dialect.begin_write)
                try:
                    out = self._enter(Tx(cur, self.dialect), fn)
                    self._conn.execute("COMMIT")
                except BaseException:
                    # a failed COMMIT (disk full) may leave the transaction open: the one shared
                    # connection would then refuse every later BEGIN ("within a transaction")
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
                return out
            except sqlite3.OperationalError as e:
                if "disk is full" in str(e):
                    raise self._full(e) from None
                raise

    def fails_whole_transaction(self, error: BaseException) -> bool:
        return isinstance(error, sqlite3.OperationalError)

    def _full(self, error: sqlite3.OperationalError) -> Unavailable:
        """A write the filesystem has no room for: the node's fault, never the request's (503)."""
        e = Unavailable(f"the DSEC_HOME filesystem has no room: the control store ({self.path}) cannot "
                        f"write ({error}); DSEC_HOME_RESERVE_MB keeps room for the node's own records",
                        field="DSEC_HOME", fix="free space on the DSEC_HOME filesystem, then retry")
        e.retry_after_s = STORE_RETRY_AFTER_S   # type: ignore[attr-defined]
        return e

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class PostgresDatabase(Database):
    """A pool of connections (psycopg_pool): threads run transactions in parallel, and a
    connection broken by a server restart is dropped and replaced."""

    dialect = POSTGRES

    def __init__(self, dsn: str, *, retry_s: float = RETRY_S, pool_max: int = POOL_MAX):
        super().__init__()
        import psycopg
        from psycopg_pool import PoolClosed, PoolTimeout
        self._psycopg = psycopg
        self._transient: tuple[type[BaseException], ...] = (psycopg.OperationalError, PoolTimeout, PoolClosed)
        self._dsn = dsn
        self.url = redact(dsn)
        self.retry_s = retry_s
        self._pool_max = pool_max
        self._state = threading.Lock()
        self._down_since: float | None = None     # monotonic; None: the store answers
        self._closed = threading.Event()
        self._pool = self._new_pool()
        try:
            self._pool.wait(timeout=retry_s)
        except PoolTimeout:
            self._pool.close()
            raise Unavailable(f"cannot connect to PostgreSQL at {self.url} within {retry_s:.0f} s",
                              field="DSEC_DB_URL",
                              fix="check that the server runs and the DSN (user, password, host, port, "
                                  "database) is right, e.g. postgresql://dsec:PASS@db-host:5432/dsec") from None

    def _connect_kwargs(self) -> dict[str, Any]:
        """libpq options the DSN does not set itself: a short connect timeout, TCP keepalives."""
        given = self._dsn.split("?", 1)[1] if "?" in self._dsn else ""
        extra: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, **KEEPALIVES}
        return {k: v for k, v in extra.items() if f"{k}=" not in given}

    def _new_pool(self) -> Any:
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool
        pool = ConnectionPool(self._dsn, min_size=1, max_size=self._pool_max, open=False, name="dsec",
                              kwargs={"row_factory": dict_row, "autocommit": True, **self._connect_kwargs()})
        pool.open()
        return pool

    def fails_whole_transaction(self, error: BaseException) -> bool:
        # DeadlockDetected and SerializationFailure are OperationalErrors: retried by _run
        return isinstance(error, self._transient)

    @property
    def down_for_s(self) -> float | None:
        """How long the store has been unreachable (None: it answers)."""
        since = self._down_since
        return None if since is None else time.monotonic() - since

    def _unavailable(self, error: BaseException | None = None) -> Unavailable:
        down = self.down_for_s
        why = f" for {down:.1f} s" if down is not None else ""
        e = Unavailable(f"the control store (PostgreSQL at {self.url}) is unreachable{why}"
                        + (f": {str(error)[:200]}" if error is not None else ""),
                        field="DSEC_DB_URL",
                        fix=f"retry in {STORE_RETRY_AFTER_S} s (Retry-After): dsec reconnects by itself; running "
                            "sandboxes keep answering meanwhile. Operators: check the database server")
        e.retry_after_s = STORE_RETRY_AFTER_S   # type: ignore[attr-defined]
        return e

    def _mark_down(self, error: BaseException) -> None:
        with self._state:
            if self._down_since is not None or self._closed.is_set():
                return
            self._down_since = time.monotonic()
        log.error("control store unreachable: requests that need it are refused until it answers",
                  extra={"db": self.url, "error": str(error)[:200]})
        threading.Thread(target=self._probe, name="dsec-db-probe", daemon=True).start()

    def _probe(self) -> None:
        """Until the server answers: try a plain connection every PROBE_S; then a fresh pool."""
        from psycopg_pool import PoolTimeout
        while not self._closed.wait(PROBE_S):
            pool: Any = None
            try:
                with self._psycopg.connect(self._dsn, autocommit=True, **self._connect_kwargs()) as conn:
                    conn.execute("SELECT 1")
                pool = self._new_pool()
                pool.wait(timeout=CONNECT_TIMEOUT_S)
            except Exception as e:      # not yet (or a surprise: never leave the store marked down for good)
                if pool is not None:
                    pool.close()
                if not isinstance(e, (self._psycopg.Error, PoolTimeout, OSError)):
                    log.warning("control store probe failed", extra={"db": self.url, "error": repr(e)[:200]})
                continue
            old, self._pool = self._pool, pool
            down = self.down_for_s or 0.0
            with self._state:
                self._down_since = None
            log.warning("control store answers again", extra={"db": self.url, "down_s": round(down, 1)})
            # the old pool's waiters get PoolClosed (transient: they retry on the new one)
            threading.Thread(target=old.close, kwargs={"timeout": 1.0}, daemon=True).start()
            if self._closed.is_set():
                pool.close()
            return

    def _run(self, fn: Callable[[Tx], T], write: bool) -> T:
        wait = request_wait()
        if wait is not None and self._down_since is not None:
            raise self._unavailable()      # known down: a request does not wait for it
        budget = self.retry_s if wait is None else min(wait, self.retry_s)
        deadline = time.monotonic() + budget
        delay, attempt, at_once = 0.02, 0, 0
        while True:
            attempt += 1
            used: Any = None
            try:
                # a write transaction commits on a clean exit, rolls back on an exception; a
                # broken connection is discarded when it goes back to the pool
                with self._pool.connection(timeout=max(0.05, deadline - time.monotonic())) as conn:
                    used = conn
                    if not write:     # autocommit: one round trip per statement, no BEGIN/COMMIT
                        with conn.cursor() as cur:
                            return self._enter(Tx(cur, self.dialect), fn)
                    with conn.transaction(), conn.cursor() as cur:
                        return self._enter(Tx(cur, self.dialect), fn)
            except self._transient as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._mark_down(e)
                    if wait is not None:
                        raise self._unavailable(e) from e
                    raise Unavailable(f"PostgreSQL at {self.url} unreachable for {self.retry_s:.0f} s: {e}",
                                      fix="check the database server; dsec retries by itself meanwhile "
                                          "(DSEC_DB_RETRY_S)") from e
                log.warning("database transaction retried", extra={"attempt": attempt, "error": str(e)[:200]})
                if used is not None and used.broken and at_once <= self._pool_max:
                    # an idle connection the server closed (it restarted): the pool's next one at
                    # once; waiting here would spend a request's budget on stale connections
                    at_once += 1
                    continue
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.5)

    def close(self) -> None:
        self._closed.set()
        self._pool.close()


def _set_wal(conn: sqlite3.Connection, deadline_s: float = 30.0) -> None:
    """Switching a new file to WAL takes an exclusive lock, and SQLite may answer "database is
    locked" at once (without its busy handler) while other starters hold the file: retry."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > end:
                raise
            time.sleep(0.05)


def connect(dsn: str | Path, *, retry_s: float = RETRY_S, pool_max: int = POOL_MAX) -> Database:
    """A SQLite path (or sqlite:///path) or a postgresql:// DSN, without migrating it."""
    if is_postgres_dsn(dsn):
        return PostgresDatabase(str(dsn), retry_s=retry_s, pool_max=pool_max)
    s = str(dsn)
    if s.startswith("sqlite:///"):
        s = s[len("sqlite://"):]
    elif "://" in s:
        from dsec.types import InvalidArgument
        raise InvalidArgument(f"unsupported database URL {redact(s)!r}", field="DSEC_DB_URL",
                              fix="use a SQLite file path or postgresql://USER:PASS@HOST:PORT/DB")
    return SQLiteDatabase(s)
