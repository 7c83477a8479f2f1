"""A throwaway PostgreSQL cluster for tests: initdb into a temporary directory, served on a
free port and a unix socket there, stopped and removed afterwards.

PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user of
Debian's package (runuser). `pg_cluster` (session) and `pg_dsn` (a fresh database per test)
are pytest fixtures: tests/conftest.py imports them for every test module.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsec.testing.isolated import free_port

INSTALL_FIX = "apt-get install postgresql (scripts/install-extras.sh cluster does)"


def pg_bindir() -> Path | None:
    """The newest installed server's bin directory (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class PostgresCluster:
    """initdb + pg_ctl in a temp dir; `dsn` reaches it as the superuser `dsec` (trust auth on
    127.0.0.1 only)."""

    def __init__(self, bindir: Path | None = None):
        found = bindir or pg_bindir()
        if found is None:
            raise RuntimeError(f"PostgreSQL server binaries (initdb, pg_ctl) not found: {INSTALL_FIX}")
        self.bindir = found
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.dsn = f"postgresql://dsec@127.0.0.1:{self.port}/postgres"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres"
            pw = pwd.getpwnam(self._user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "dsec", "-A", "trust", "--no-sync", "-E", "UTF8")

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / tool), *args]
        if self._user:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.dir)
        if check and r.returncode != 0:
            raise RuntimeError(f"{tool} failed ({r.returncode}): {r.stderr[-2000:]}\n{self.log_tail()}")
        return r

    def log_tail(self, n: int = 2000) -> str:
        log = self.dir / "server.log"
        return log.read_text(errors="replace")[-n:] if log.exists() else ""

    def start(self) -> None:
        # fsync off: a test cluster trades durability against a host crash for speed
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "server.log"), "-w",
                  "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)

    def restart(self) -> None:
        """Stop (closing every client connection) and start again on the same port."""
        self.stop()
        self.start()

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def create_database(self, name: str) -> str:
        """A new empty database; its DSN."""
        import psycopg
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')   # name: from the test, [a-z0-9_]
        return f"postgresql://dsec@127.0.0.1:{self.port}/{name}"

    def destroy(self) -> None:
        if self.running():
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def own_pg_cluster() -> Iterator[PostgresCluster]:
    """A PostgreSQL server of the caller's own, destroyed after (the test is skipped, naming the
    package, if it is not installed)."""
    if pg_bindir() is None:
        pytest.skip(f"PostgreSQL server binaries (initdb, pg_ctl) not installed: {INSTALL_FIX}")
    cluster = PostgresCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    """One PostgreSQL server for the test session."""
    with own_pg_cluster() as cluster:
        yield cluster


@pytest.fixture
def pg_dsn(pg_cluster: PostgresCluster) -> str:
    """A DSN of a fresh, empty database on the session's PostgreSQL."""
    name = f"t_{os.getpid()}_{int(time.monotonic_ns())}"
    return pg_cluster.create_database(name)
