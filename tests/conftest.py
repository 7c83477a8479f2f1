"""Shared fixtures: a real dsec server (apiserver + edge + crun) in an isolated DSEC_HOME.

Tests need root (crun, mounts, cgroups). Each test session gets a fresh home under /var/tmp;
the debootstrap download cache is shared between sessions so debian-python builds fast.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsec.testing.isolated import ServerProcess, cleanup_home, free_port, link_node_downloads
from dsec.testing.postgres import pg_cluster, pg_dsn  # noqa: F401 - fixtures: a real throwaway PostgreSQL
from dsec.config import Paths
from dsec.testing.waiting import wait_until

# Reuse the install step's debootstrap cache (scripts/install.sh builds the same images there).
SHARED_CACHE = Path(os.environ.get("DSEC_TEST_CACHE", str(Paths.from_env().home / "cache")))


def requires_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (crun, EROFS mounts, cgroups)")


# Admission by pressure (edge/admission.py) is tested on fake /proc trees (tests/unit): the
# servers here run on a shared 2-core box whose PSI a neighbour's burst drives up, so a test's
# creates must not depend on it. Its other checks (ceilings, MemAvailable, disk) stay on.
NO_PSI_ADMISSION = {f"DSEC_ADMIT_PSI_{k}": "100" for k in ("CPU_SOME", "MEMORY_SOME", "MEMORY_FULL", "IO_FULL")}


@pytest.fixture(params=["sqlite", "postgresql"])
def dsn(request, tmp_path):
    """The same store test on each engine: a SQLite file, or a fresh database on the session's
    PostgreSQL (pg_dsn)."""
    if request.param == "sqlite":
        return tmp_path / "store.db"
    return request.getfixturevalue("pg_dsn")


class ServerProc(ServerProcess):
    """A `dsec up` subprocess that tests can kill -9 and restart on the same home."""

    def __init__(self, home: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
        super().__init__(home, {**NO_PSI_ADMISSION, **(env or {})}, args)


def link_downloads(home: Path) -> None:
    """Test homes share the node's install-time downloads (the debootstrap cache, see
    SHARED_CACHE, and the guest kernel) instead of fetching their own."""
    link_node_downloads(home, SHARED_CACHE)


_cleanup_home = cleanup_home


def side_home(dsec_home: Path, tmp_path_factory, name: str) -> Path:
    """A home for a second server: the session's layer files and image records, its own
    mounts, records and settings."""
    import sqlite3
    home = Path(tmp_path_factory.mktemp(name, numbered=True))
    home.chmod(0o711)
    # crun opens a bind's source (lxcfs's view files in the home) from the host first and, if
    # that fails, by path inside the sandbox's user namespace: pytest's 0700 temp dirs would
    # refuse that walk (EACCES) where a real home's parents (/var/lib) allow it. Seen once as
    # "mount <home>/lxcfs/proc/swaps to proc/swaps: Permission denied" in a full run.
    for parent in (home.parent, home.parent.parent):     # pytest-N, pytest-of-root
        parent.chmod(parent.stat().st_mode | 0o011)
    (home / "store").symlink_to(dsec_home / "store")          # same layer files, own mounts
    with sqlite3.connect(dsec_home / "images.db") as src, sqlite3.connect(home / "images.db") as dst:
        src.backup(dst)
    return home


@contextmanager
def side_server(dsec_home: Path, tmp_path_factory, name: str, env: dict[str, str] | None = None,
                downloads: bool = False, start_timeout_s: float = 60) -> Iterator[ServerProc]:
    """A second server on a side home with `env` (`downloads`: the node's guest kernel etc.
    linked in): started, then stopped and its home cleaned up, also when its start fails (a
    start that timed out leaves no server behind)."""
    home = side_home(dsec_home, tmp_path_factory, name)
    if downloads:
        link_downloads(home)
    srv = ServerProc(home, env=env)
    try:
        srv.start(timeout_s=start_timeout_s)
        yield srv
    finally:
        srv.kill(signal.SIGTERM)
        _cleanup_home(home)


@pytest.fixture(scope="session")
def dsec_home():
    requires_root()
    home = Path(tempfile.mkdtemp(prefix="dsec-test-", dir="/var/tmp"))
    link_downloads(home)
    yield home
    _cleanup_home(home)


@pytest.fixture(scope="session")
def images(dsec_home):
    """The built-in images, built once per session into the test home."""
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    paths = Paths(dsec_home)
    paths.ensure()
    svc = ImageService(paths)
    ensure_builtin(svc, "busybox")
    ensure_builtin(svc, "debian-python")
    ensure_builtin(svc, "fncall-python")
    return svc


E2B_TEST_DOMAIN = "sandboxes.dsec.test"
LOCAL_DNS_SINK = "127.0.0.1:9"


@pytest.fixture(scope="session")
def server(dsec_home, images):
    # hung-guest checks within seconds; E2B get_host() names under a test domain (resolved by hand)
    # sandboxes' DNS goes to a closed local port (SERVFAIL): no test query leaves the machine
    # HTTPS for that domain on a port of its own (a certificate from the home's own CA, tls/ca.pem)
    srv = ServerProc(dsec_home, env={"DSEC_VM_PING_S": "2", "DSEC_DOMAIN": E2B_TEST_DOMAIN,
                                     "DSEC_HTTPS_PORT": str(free_port()),
                                     "DSEC_NET_DNS_UPSTREAM": LOCAL_DNS_SINK})
    srv.start()
    yield srv
    srv.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def e2b_env(server):
    """The stock e2b SDKs pointed at the server: E2B_API_URL and E2B_SANDBOX_URL at its /e2b
    prefix, E2B_API_KEY a dsec key (docs/e2b.md). Yields that URL."""
    mp = pytest.MonkeyPatch()
    url = f"{server.url}/e2b"
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_VOLUME_API_URL": url, "E2B_API_KEY": server.key,
                 "E2B_DOMAIN": "dsec.invalid"}.items():
        mp.setenv(k, v)
    mp.delenv("E2B_DEBUG", raising=False)
    yield url
    mp.undo()


def stranger_key(server: ServerProcess, prefix: str) -> str:
    """An API key of a new project beside the root's own (not an ancestor or a descendant of
    the root key's sandboxes' project): what another tenant holds."""
    from dsec.iam import IAM
    with IAM(server.paths.iam_db) as iam:
        return iam.create_key(iam.create_project(f"{prefix}-{os.urandom(4).hex()}", iam.root().id).id)


async def wait_file(sb, path: str, timeout_s: float = 30) -> str:
    """The contents of `path` in the sandbox once it is there and not empty (a background
    process inside signals readiness by writing it)."""
    async def written() -> str:
        r = await sb.run(f"cat {path} 2>/dev/null")
        return r.stdout if r.exit_code == 0 else ""
    return await wait_until(written, timeout_s=timeout_s, what=f"{path} to appear in the sandbox")


@pytest.fixture
async def client(server):
    c = server.client()
    async with c:
        yield c


@pytest.fixture
async def vm_client(client):
    """The client, where the node offers VM backends (else the test is skipped, naming why)."""
    if "microvm" not in (await client.nodes())[0].backends:
        pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
    return client
