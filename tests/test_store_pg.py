"""The durable store (dsec.store): one schema with migrations on SQLite and on a real
PostgreSQL server (a throwaway cluster, dsec.testing.postgres), the cross-node sandbox index,
and a PostgreSQL restart in the middle of use: the store reconnects and nothing is lost."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from dsec.iam import IAM
from dsec.store import SandboxIndex, connect, open_db
from dsec.store.migrate import migrate
from dsec.store.schema import LATEST
from dsec.testing.postgres import own_pg_cluster
from dsec.types import Conflict, InvalidArgument


def versions(db) -> list[int]:
    return [r["version"] for r in db.run(lambda tx: tx.all("SELECT version FROM schema_version ORDER BY version"))]


def test_migrations_apply_once_and_refuse_a_newer_schema(dsn):
    db = open_db(dsn)
    assert versions(db) == list(range(1, LATEST + 1))
    assert migrate(db) == LATEST                       # idempotent
    assert versions(db) == list(range(1, LATEST + 1))
    db.run(lambda tx: tx.execute("INSERT INTO schema_version (version, name, applied_at) VALUES (?,?,?)",
                                 (LATEST + 1, "from the future", time.time())))
    db.close()
    with pytest.raises(Conflict) as ei:
        open_db(dsn)
    assert ei.value.field == "schema_version" and "upgrade dsec" in ei.value.fix


def test_concurrent_starters_migrate_once(dsn):
    """Apiservers starting together: one applies the migrations, the others wait and see them."""
    errors: list[BaseException] = []
    dbs = []

    def start() -> None:
        try:
            dbs.append(open_db(dsn))
        except BaseException as e:   # noqa: BLE001 - surfaced below
            errors.append(e)
    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert versions(dbs[0]) == list(range(1, LATEST + 1))
    for db in dbs:
        db.close()


def test_a_sqlite_iam_db_from_before_migrations_is_adopted(tmp_path):
    """An iam.db the SQLite-only IAM wrote (PRAGMA user_version=1, no schema_version) keeps its
    projects and keys, and gets the new tables."""
    from dsec.store.schema import MIGRATIONS
    path = tmp_path / "iam.db"
    schema = MIGRATIONS[0][2]     # what that IAM created: migration 1 (later ones alter its tables)
    old = sqlite3.connect(path)
    for s in schema:
        old.execute(s)
    old.execute("INSERT INTO projects VALUES ('prj-old','default',NULL,1000000,1000000.0,1099511627776,1.0)")
    old.execute("INSERT INTO projects VALUES ('prj-team','team','prj-old',5,4.0,4096,2.0)")
    old.execute("PRAGMA user_version=1")
    old.commit()
    old.close()
    with IAM(path) as iam:
        assert iam.root().id == "prj-old"
        assert [p.id for p in iam.children("prj-old")] == ["prj-team"]
        assert iam.quotas.quota("prj-team").used.sandboxes == 0
        iam.quotas.reserve("prj-team", 1.0, 512)
        assert iam.quotas.quota("prj-old").used.sandboxes == 1


def test_bad_db_url_names_the_setting():
    with pytest.raises(InvalidArgument) as ei:
        connect("mysql://u:secret@h/db")
    assert ei.value.field == "DSEC_DB_URL" and "secret" not in ei.value.message


def test_sandbox_index_upsert_end_list(dsn):
    db = open_db(dsn)
    idx = SandboxIndex(db)
    idx.upsert("n1-aaa", "n1", "prj-a", "running", {"job": "x"}, created_at=1.0)
    idx.upsert("n2-bbb", "n2", "prj-a", "starting", created_at=2.0)
    idx.upsert("n2-ccc", "n2", "prj-b", "running", created_at=3.0)
    idx.upsert("n2-bbb", "n2", "prj-a", "running")            # a later state, same row
    assert [(s.id, s.state) for s in idx.list(["prj-a"])] == [("n1-aaa", "running"), ("n2-bbb", "running")]
    assert idx.get("n1-aaa").labels == {"job": "x"}
    assert idx.end("n1-aaa", "reaped") and not idx.end("n1-aaa")    # once
    idx.upsert("n1-aaa", "n1", "prj-a", "running")            # a late writer cannot revive it
    assert [s.id for s in idx.list(["prj-a"])] == ["n2-bbb"]
    assert idx.get("n1-aaa").state == "reaped" and idx.get("n1-aaa").ended_at is not None
    assert {s.id for s in idx.list(["prj-a", "prj-b"], include_ended=True)} == {"n1-aaa", "n2-bbb", "n2-ccc"}
    assert idx.end_node("n2") == 2
    assert idx.list(None) == [] and idx.list([]) == []
    assert {s.state for s in idx.list(None, node="n2", include_ended=True)} == {"lost"}
    assert idx.prune(time.time() + 1) == 3
    db.close()


def test_idempotency_claims_of_sdk_keys_are_kept_an_hour_others_a_week(dsn):
    """The SDK keys every create (issue 22, item 7): those claims only serve its own resends, so
    they go after SDK_KEEP_S; a caller's own keys stay KEEP_S; claims never bound are not pruned."""
    from dsec.store.idempotency import KEEP_S, SDK_KEEP_S, IdempotencyClaims
    from dsec.types import SDK_KEY_PREFIX
    db = open_db(dsn)
    claims = IdempotencyClaims(db)
    for key in (f"{SDK_KEY_PREFIX}abc", "mine-1"):
        c = claims.claim("prj-a", key)
        claims.bind("prj-a", key, c.token, f"sb-{key}")
    claims.claim("prj-a", f"{SDK_KEY_PREFIX}unbound")
    now = time.time()
    assert claims.prune(now + SDK_KEEP_S / 2) == 0
    assert claims.prune(now + SDK_KEEP_S + 1) == 1
    assert claims.get("prj-a", f"{SDK_KEY_PREFIX}abc") is None and claims.get("prj-a", "mine-1").sandbox_id == "sb-mine-1"
    assert claims.prune(now + KEEP_S + 1) == 1
    assert claims.get("prj-a", "mine-1") is None and claims.get("prj-a", f"{SDK_KEY_PREFIX}unbound") is not None
    db.close()


@pytest.fixture
def own_cluster():
    """A PostgreSQL server of this test's own (it is restarted)."""
    with own_pg_cluster() as c:
        yield c


def test_postgres_restart_mid_use_loses_nothing(own_cluster, tmp_path):
    dsn = own_cluster.create_database("restart")
    iam = IAM(dsn)
    iam.bootstrap(tmp_path / "admin.key")
    root = iam.root().id
    made: list[tuple[str, str]] = []      # (project id, key) whose creation returned
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                p = iam.create_project(f"p{i}", root, max_sandboxes=3)
                made.append((p.id, iam.create_key(p.id)))
                iam.quotas.reserve(p.id, 0.5, 64)
            except BaseException as e:   # noqa: BLE001 - surfaced below
                errors.append(e)
                return
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    while len(made) < 5:
        time.sleep(0.01)
    own_cluster.restart()                  # every connection of the pool is cut
    before = len(made)
    while len(made) < before + 5 and t.is_alive():
        time.sleep(0.01)
    stop.set()
    t.join(30)
    assert not errors, errors
    assert len(made) >= before + 5
    iam.close()
    own_cluster.restart()
    with IAM(dsn) as again:               # a fresh process's view: everything committed is there
        for pid, key in made:
            assert again.authenticate(key).project_id == pid
            assert again.quotas.quota(pid).used.sandboxes == 1
        assert again.quotas.quota(root).used.sandboxes == len(made)
