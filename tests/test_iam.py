import os
import sqlite3
import stat
import threading
import time

import pytest

from dsec.iam import IAM, KEY_PREFIX, ROOT_PROJECT
from dsec.types import Conflict, Forbidden, InvalidArgument, NotFound, Unauthorized


@pytest.fixture(params=["sqlite", "postgresql"])
def new_dsn(request, tmp_path):
    """A factory of fresh databases of one engine: SQLite files, or databases on a real
    PostgreSQL server (dsec.testing.postgres)."""
    if request.param == "sqlite":
        n = iter(range(100))
        return lambda: tmp_path / f"iam{next(n)}.db"
    cluster = request.getfixturevalue("pg_cluster")
    return lambda: cluster.create_database(f"iam_{os.getpid()}_{time.monotonic_ns()}")


@pytest.fixture
def dsn(new_dsn):
    return new_dsn()


@pytest.fixture
def iam(dsn):
    with IAM(dsn) as i:
        yield i


def test_bootstrap_writes_private_key_file_and_is_idempotent(tmp_path, dsn, iam):
    key_file = tmp_path / "admin.key"
    key = iam.bootstrap(key_file)
    assert key.startswith(KEY_PREFIX)
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

    assert iam.bootstrap(key_file) == key
    # A second process / restart on the same files gets the same root and key.
    with IAM(dsn) as again:
        assert again.bootstrap(key_file) == key
        assert again.root().id == iam.root().id
    p = iam.authenticate(key)
    assert p.project_name == ROOT_PROJECT and p.project_id == iam.root().id
    assert len(iam.list_keys(iam.root().id)) == 1


def test_bootstrap_readopts_key_when_db_is_recreated(tmp_path, new_dsn):
    key_file = tmp_path / "admin.key"
    with IAM(new_dsn()) as first:
        key = first.bootstrap(key_file)
    with IAM(new_dsn()) as fresh:
        assert fresh.bootstrap(key_file) == key
        assert fresh.authenticate(key).project_name == ROOT_PROJECT


def test_bootstrap_refuses_revoked_admin_key(tmp_path, iam):
    key_file = tmp_path / "admin.key"
    key = iam.bootstrap(key_file)
    iam.revoke_key(iam.authenticate(key).key_id)
    with pytest.raises(Unauthorized) as ei:
        iam.bootstrap(key_file)
    assert "delete" in ei.value.fix


def test_db_uses_wal_and_stores_only_hashes(tmp_path, dsn, iam):
    if not isinstance(dsn, os.PathLike):
        pytest.skip("SQLite file layout only (WAL, iterdump); PostgreSQL stores the same rows")
    key = iam.bootstrap(tmp_path / "admin.key")
    db = sqlite3.connect(dsn)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    dump = "\n".join(db.iterdump())
    assert key not in dump
    prefix, = db.execute("SELECT prefix FROM api_keys").fetchone()
    assert key.startswith(prefix) and len(prefix) < len(key) // 2


def test_authenticate_errors_tell_how_to_fix(tmp_path, iam):
    iam.bootstrap(tmp_path / "admin.key")
    for bad in (None, "", "Bearer xyz", KEY_PREFIX + "nope"):
        with pytest.raises(Unauthorized) as ei:
            iam.authenticate(bad)
        assert "Authorization: Bearer" in ei.value.fix and "DSEC_API_KEY" in ei.value.fix
        assert ei.value.status == 401


def test_keys_create_and_revoke(tmp_path, iam):
    iam.bootstrap(tmp_path / "admin.key")
    team = iam.create_project("team-a", iam.root().id, max_sandboxes=10)
    key = iam.create_key(team.id)
    p = iam.authenticate(key)
    assert (p.project_id, p.project_name) == (team.id, "team-a")
    other = iam.create_key(team.id)
    iam.revoke_key(p.key_id)
    with pytest.raises(Unauthorized, match="revoked"):
        iam.authenticate(key)
    assert iam.authenticate(other).project_id == team.id   # only that key is gone
    iam.revoke_key(p.key_id)                                 # idempotent
    with pytest.raises(NotFound):
        iam.revoke_key("key-doesnotexist")
    with pytest.raises(NotFound):
        iam.create_key("prj-missing")


def test_child_quota_cannot_exceed_parent(tmp_path, iam):
    iam.bootstrap(tmp_path / "admin.key")
    team = iam.create_project("team", iam.root().id, max_sandboxes=100, max_cpu_cores=64,
                              max_memory_mb=65536)
    sub = iam.create_project("sub", team.id, max_cpu_cores=8)
    # Omitted quotas inherit the parent's.
    assert (sub.max_sandboxes, sub.max_cpu_cores, sub.max_memory_mb) == (100, 8.0, 65536)
    with pytest.raises(Forbidden) as ei:
        iam.create_project("greedy", team.id, max_memory_mb=65537)
    assert ei.value.field == "max_memory_mb" and "65536" in ei.value.fix
    with pytest.raises(Forbidden):
        iam.create_project("greedy", sub.id, max_cpu_cores=9)
    with pytest.raises(InvalidArgument):
        iam.create_project("neg", team.id, max_sandboxes=-1)
    with pytest.raises(InvalidArgument):
        iam.create_project("bad name!", team.id)
    with pytest.raises(NotFound):
        iam.create_project("orphan", "prj-missing")
    with pytest.raises(Conflict):
        iam.create_project("sub", team.id)
    iam.create_project("sub", sub.id)   # same name under another parent is fine
    with pytest.raises(Conflict):
        iam.create_project(ROOT_PROJECT)


def test_can_access_self_and_ancestors_only(tmp_path, iam):
    admin = iam.authenticate(iam.bootstrap(tmp_path / "admin.key"))
    a = iam.create_project("a", iam.root().id)
    a1 = iam.create_project("a1", a.id)
    a11 = iam.create_project("a11", a1.id)
    b = iam.create_project("b", iam.root().id)
    pa = iam.authenticate(iam.create_key(a.id))
    pa11 = iam.authenticate(iam.create_key(a11.id))

    assert iam.ancestors(a11.id) == [a11.id, a1.id, a.id, iam.root().id]
    assert all(iam.can_access(admin, p.id) for p in (a, a1, a11, b))
    assert iam.can_access(pa, a.id) and iam.can_access(pa, a11.id)
    assert not iam.can_access(pa, b.id) and not iam.can_access(pa, iam.root().id)
    assert iam.can_access(pa11, a11.id) and not iam.can_access(pa11, a1.id)
    assert not iam.can_access(pa, "prj-missing")
    assert [c.id for c in iam.children(a.id)] == [a1.id]
    assert iam.project(a1.id).parent_id == a.id
    with pytest.raises(NotFound):
        iam.project("prj-missing")


def test_thread_safe_under_concurrent_use(tmp_path, iam):
    iam.bootstrap(tmp_path / "admin.key")
    root = iam.root().id
    errors: list[BaseException] = []
    keys: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            p = iam.create_project(f"p{i}", root)
            for _ in range(5):
                k = iam.create_key(p.id)
                assert iam.authenticate(k).project_id == p.id
                with lock:
                    keys.append(k)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(keys)) == 80
