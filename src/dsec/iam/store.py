"""Projects and API keys in one SQLite file.

Projects form a tree (parent_id) so a later change can add quota delegation and per-project
permissions without a schema rewrite: a principal acts for its own project and every project
below it. Only SHA-256 hashes of API keys are stored; the plaintext is shown once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from dsec.iam.policy import SandboxPolicy, check_narrows, narrow
from dsec.types import Conflict, Forbidden, InvalidArgument, NotFound, Unauthorized

log = logging.getLogger("dsec.iam")

KEY_PREFIX = "dsk_"
ROOT_PROJECT = "default"
PROJECT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# Root quota: effectively unlimited; real limits are set on the projects below it.
ROOT_MAX_SANDBOXES = 1_000_000
ROOT_MAX_CPU_CORES = 1_000_000.0
ROOT_MAX_MEMORY_MB = 1 << 40

_AUTH_FIX = ("pass 'Authorization: Bearer <key>' (the SDK and CLI read DSEC_API_KEY); "
             "the admin key is in the server's admin.key file")

_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    parent_id     TEXT REFERENCES projects(id) ON DELETE RESTRICT,
    max_sandboxes INTEGER NOT NULL CHECK (max_sandboxes >= 0),
    max_cpu_cores REAL    NOT NULL CHECK (max_cpu_cores >= 0),
    max_memory_mb INTEGER NOT NULL CHECK (max_memory_mb >= 0),
    created_at    REAL    NOT NULL,
    UNIQUE (parent_id, name)
);
-- UNIQUE(parent_id, name) does not cover NULL parents, so top-level names get their own index.
CREATE UNIQUE INDEX IF NOT EXISTS projects_top_name ON projects(name) WHERE parent_id IS NULL;
CREATE INDEX IF NOT EXISTS projects_parent ON projects(parent_id);

CREATE TABLE IF NOT EXISTS api_keys (
    id         TEXT PRIMARY KEY,
    project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
    prefix     TEXT NOT NULL,            -- first chars of the key, to recognise it in listings
    hash       TEXT NOT NULL UNIQUE,     -- sha256 hex of the whole key
    created_at REAL NOT NULL,
    revoked    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS api_keys_project ON api_keys(project_id);

-- a project's own sandbox policy (iam/policy.py); absent: no restriction of its own
CREATE TABLE IF NOT EXISTS project_policies (
    project_id TEXT PRIMARY KEY REFERENCES projects(id) ON DELETE CASCADE,
    policy     TEXT NOT NULL,            -- SandboxPolicy as JSON
    updated_at REAL NOT NULL
);
"""


class Project(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    parent_id: str | None
    max_sandboxes: int
    max_cpu_cores: float
    max_memory_mb: int
    created_at: datetime


class Principal(BaseModel):
    """Who a request acts as: the project its API key belongs to."""

    model_config = ConfigDict(frozen=True)

    project_id: str
    key_id: str
    project_name: str


class ApiKeyInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    project_id: str
    prefix: str
    created_at: datetime
    revoked: bool


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _row_project(r: sqlite3.Row) -> Project:
    return Project(id=r["id"], name=r["name"], parent_id=r["parent_id"],
                   max_sandboxes=r["max_sandboxes"], max_cpu_cores=r["max_cpu_cores"],
                   max_memory_mb=r["max_memory_mb"], created_at=_ts(r["created_at"]))


class IAM:
    """Thread-safe: one connection guarded by a lock (calls are short, single-row queries)."""

    def __init__(self, db_path: Path | str):
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # Autocommit mode; writes open explicit BEGIN IMMEDIATE transactions so that two
        # apiserver processes sharing the file serialise instead of failing on upgrade.
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, timeout=10.0,
                                   isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > _SCHEMA_VERSION:
                raise RuntimeError(f"{self.db_path} has schema v{version}; this dsec knows "
                                   f"v{_SCHEMA_VERSION}: upgrade dsec")
            self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "IAM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ bootstrap

    def bootstrap(self, admin_key_file: Path | str) -> str:
        """Ensure the root project and an admin key exist; return the admin key.

        Idempotent: if admin_key_file exists its key is reused (and re-registered if the
        database was recreated); otherwise a new key is minted and written there (0600).
        """
        admin_key_file = Path(admin_key_file)
        root = self._ensure_root()
        if admin_key_file.exists():
            return self._adopt_key_file(admin_key_file, root)
        key, key_id = self._new_key(root.id)
        admin_key_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            # O_EXCL: if another process bootstrapped concurrently, its file wins.
            fd = os.open(admin_key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            self.revoke_key(key_id)
            return self._adopt_key_file(admin_key_file, root)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        log.info("bootstrapped IAM: root project %s, admin key %s written to %s",
                 root.id, key_id, admin_key_file)
        return key

    def _ensure_root(self) -> Project:
        with self._lock, self._tx():
            r = self._db.execute("SELECT * FROM projects WHERE parent_id IS NULL AND name=?",
                                 (ROOT_PROJECT,)).fetchone()
            if r is not None:
                return _row_project(r)
            return self._insert_project(ROOT_PROJECT, None, ROOT_MAX_SANDBOXES,
                                        ROOT_MAX_CPU_CORES, ROOT_MAX_MEMORY_MB)

    def _adopt_key_file(self, path: Path, root: Project) -> str:
        key = path.read_text().strip()
        if not key.startswith(KEY_PREFIX):
            raise InvalidArgument(f"{path} does not hold a dsec key", field="admin_key_file",
                                  fix=f"delete {path} and restart the server to mint a new admin key")
        with self._lock, self._tx():
            r = self._db.execute("SELECT id, project_id, revoked FROM api_keys WHERE hash=?",
                                 (_hash(key),)).fetchone()
            if r is None:
                # The file outlived the database: register its key again rather than
                # silently handing out a different one.
                self._insert_key(key, root.id)
                log.warning("admin key from %s was not in %s; re-registered it", path, self.db_path)
                return key
        if r["revoked"]:
            raise Unauthorized(f"the admin key in {path} was revoked", field="admin_key_file",
                               fix=f"delete {path} and restart the server to mint a new admin key")
        if r["project_id"] != root.id:
            raise Forbidden(f"the key in {path} does not belong to the root project",
                            field="admin_key_file",
                            fix=f"delete {path} and restart the server to mint a new admin key")
        return key

    # ------------------------------------------------------------------ projects

    def create_project(self, name: str, parent_id: str | None = None, *,
                       max_sandboxes: int | None = None, max_cpu_cores: float | None = None,
                       max_memory_mb: int | None = None) -> Project:
        """Create a project. Omitted quotas inherit the parent's (root defaults at top level).

        A child's quota may not exceed its parent's (Forbidden). Sibling quotas are not
        summed yet; delegation accounting comes with nested quotas.
        """
        if not PROJECT_NAME_RE.match(name or ""):
            raise InvalidArgument(f"bad project name {name!r}", field="name",
                                  fix="use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        with self._lock, self._tx():
            if parent_id is None:
                limits = (ROOT_MAX_SANDBOXES, ROOT_MAX_CPU_CORES, ROOT_MAX_MEMORY_MB)
            else:
                parent = self._get_project(parent_id, field="parent_id")
                limits = (parent.max_sandboxes, parent.max_cpu_cores, parent.max_memory_mb)
            want = (limits[0] if max_sandboxes is None else max_sandboxes,
                    limits[1] if max_cpu_cores is None else max_cpu_cores,
                    limits[2] if max_memory_mb is None else max_memory_mb)
            for field, value, limit in zip(("max_sandboxes", "max_cpu_cores", "max_memory_mb"),
                                           want, limits):
                if value < 0:
                    raise InvalidArgument(f"{field} must be >= 0, got {value}", field=field,
                                          fix=f"pass a {field} between 0 and {limit}")
                if parent_id is not None and value > limit:
                    raise Forbidden(f"{field}={value} exceeds the parent project's {limit}",
                                    field=field,
                                    fix=f"ask for at most {limit}, or raise the parent's quota first")
            dup = self._db.execute(
                "SELECT 1 FROM projects WHERE name=? AND parent_id IS ?", (name, parent_id)).fetchone()
            if dup:
                raise Conflict(f"project {name!r} already exists here", field="name",
                               fix="pick another name or use the existing project")
            p = self._insert_project(name, parent_id, int(want[0]), float(want[1]), int(want[2]))
        log.info("created project %s (%s) under %s", p.id, name, parent_id)
        return p

    def project(self, project_id: str) -> Project:
        with self._lock:
            return self._get_project(project_id, field="project_id")

    def root(self) -> Project:
        """The root project created by bootstrap()."""
        with self._lock:
            r = self._db.execute("SELECT * FROM projects WHERE parent_id IS NULL AND name=?",
                                 (ROOT_PROJECT,)).fetchone()
        if r is None:
            raise NotFound("IAM is not bootstrapped: no root project", fix="call IAM.bootstrap() first")
        return _row_project(r)

    def children(self, project_id: str) -> list[Project]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM projects WHERE parent_id=? ORDER BY created_at",
                                    (project_id,)).fetchall()
        return [_row_project(r) for r in rows]

    def ancestors(self, project_id: str) -> list[str]:
        """Ids from project_id itself up to its top-level project (empty if unknown)."""
        with self._lock:
            rows = self._db.execute(
                """WITH RECURSIVE up(id, parent_id, depth) AS (
                       SELECT id, parent_id, 0 FROM projects WHERE id=?
                       UNION ALL
                       SELECT p.id, p.parent_id, up.depth + 1 FROM projects p JOIN up ON p.id = up.parent_id
                   ) SELECT id FROM up ORDER BY depth""", (project_id,)).fetchall()
        return [r["id"] for r in rows]

    def can_access(self, principal: Principal, project_id: str) -> bool:
        """True if the principal's project is project_id or one of its ancestors."""
        return principal.project_id in self.ancestors(project_id)

    # ------------------------------------------------------------------ sandbox policy

    def own_policy(self, project_id: str) -> SandboxPolicy:
        with self._lock:
            self._get_project(project_id, field="project_id")
            r = self._db.execute("SELECT policy FROM project_policies WHERE project_id=?", (project_id,)).fetchone()
        return SandboxPolicy.model_validate_json(r["policy"]) if r else SandboxPolicy()

    def effective_policy(self, project_id: str) -> SandboxPolicy:
        """The project's policy narrowed by every ancestor's (what its sandboxes may loosen)."""
        chain = self.ancestors(project_id)          # self first, top-level last
        if not chain:
            raise NotFound(f"no project {project_id!r}", field="project_id",
                           fix="use a project id returned by create_project")
        with self._lock:
            marks = ",".join("?" * len(chain))
            rows = {r["project_id"]: r["policy"] for r in self._db.execute(
                f"SELECT project_id, policy FROM project_policies WHERE project_id IN ({marks})", chain)}
        eff = SandboxPolicy()
        for pid in reversed(chain):                  # from the top down
            if pid in rows:
                eff = narrow(eff, SandboxPolicy.model_validate_json(rows[pid]))
        return eff

    def set_policy(self, project_id: str, policy: SandboxPolicy, *, by: Principal | None = None) -> SandboxPolicy:
        """Replace a project's own policy. It must lie within the parent's effective policy
        (Forbidden otherwise). `by`: the caller, who must act for a strict ancestor of the
        project (a project cannot loosen its own policy), except for the root project."""
        project = self.project(project_id)
        if by is not None:
            chain = self.ancestors(project_id)
            if by.project_id not in chain or (by.project_id == project_id and project.parent_id is not None):
                raise Forbidden(f"project {by.project_id} may not set the policy of {project_id}",
                                field="project_id",
                                fix="use a key of a parent project: a project's policy is set from above")
        if project.parent_id is not None:
            check_narrows(self.effective_policy(project.parent_id), policy)
        with self._lock, self._tx():
            self._db.execute(
                "INSERT INTO project_policies (project_id, policy, updated_at) VALUES (?,?,?) "
                "ON CONFLICT(project_id) DO UPDATE SET policy=excluded.policy, updated_at=excluded.updated_at",
                (project_id, policy.model_dump_json(exclude_none=True), time.time()))
        log.info("set sandbox policy of project %s: %s", project_id, policy.model_dump(exclude_none=True))
        return policy

    # ------------------------------------------------------------------ keys

    def create_key(self, project_id: str) -> str:
        """Mint a key for the project; the plaintext is returned once and never stored."""
        key, key_id = self._new_key(project_id)
        log.info("created api key %s for project %s", key_id, project_id)
        return key

    def _new_key(self, project_id: str) -> tuple[str, str]:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        with self._lock, self._tx():
            self._get_project(project_id, field="project_id")
            key_id = self._insert_key(key, project_id)
        return key, key_id

    def revoke_key(self, key_id: str) -> None:
        """Revoke a key by id (idempotent)."""
        with self._lock, self._tx():
            cur = self._db.execute("UPDATE api_keys SET revoked=1 WHERE id=?", (key_id,))
            if cur.rowcount == 0:
                raise NotFound(f"no api key {key_id!r}", field="key_id",
                               fix="use a key id from list_keys()")
        log.info("revoked api key %s", key_id)

    def list_keys(self, project_id: str) -> list[ApiKeyInfo]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM api_keys WHERE project_id=? ORDER BY created_at",
                                    (project_id,)).fetchall()
        return [ApiKeyInfo(id=r["id"], project_id=r["project_id"], prefix=r["prefix"],
                           created_at=_ts(r["created_at"]), revoked=bool(r["revoked"])) for r in rows]

    def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise Unauthorized("no API key given", field="authorization", fix=_AUTH_FIX)
        key = key.strip()
        if not key.startswith(KEY_PREFIX):
            raise Unauthorized(f"not a dsec API key (they start with {KEY_PREFIX!r})",
                               field="authorization", fix=_AUTH_FIX)
        # Looking up by hash means no comparison ever runs over the secret itself.
        h = _hash(key)
        with self._lock:
            r = self._db.execute(
                "SELECT k.id, k.hash, k.revoked, p.id AS pid, p.name FROM api_keys k "
                "JOIN projects p ON p.id = k.project_id WHERE k.hash=?", (h,)).fetchone()
        if r is None or not hmac.compare_digest(r["hash"], h):
            raise Unauthorized("unknown API key", field="authorization", fix=_AUTH_FIX)
        if r["revoked"]:
            raise Unauthorized(f"API key {r['id']} was revoked", field="authorization",
                               fix=_AUTH_FIX + "; ask a project admin for a new key")
        return Principal(project_id=r["pid"], key_id=r["id"], project_name=r["name"])

    # ------------------------------------------------------------------ internals

    def _tx(self) -> "_Tx":
        return _Tx(self._db)

    def _get_project(self, project_id: str, *, field: str) -> Project:
        r = self._db.execute("SELECT * FROM projects WHERE id=?", (project_id,)).fetchone()
        if r is None:
            raise NotFound(f"no project {project_id!r}", field=field,
                           fix="use a project id returned by create_project")
        return _row_project(r)

    def _insert_project(self, name: str, parent_id: str | None, max_sandboxes: int,
                        max_cpu_cores: float, max_memory_mb: int) -> Project:
        pid = "prj-" + secrets.token_hex(6)
        now = time.time()
        self._db.execute(
            "INSERT INTO projects (id, name, parent_id, max_sandboxes, max_cpu_cores, max_memory_mb,"
            " created_at) VALUES (?,?,?,?,?,?,?)",
            (pid, name, parent_id, max_sandboxes, max_cpu_cores, max_memory_mb, now))
        return Project(id=pid, name=name, parent_id=parent_id, max_sandboxes=max_sandboxes,
                       max_cpu_cores=max_cpu_cores, max_memory_mb=max_memory_mb, created_at=_ts(now))

    def _insert_key(self, key: str, project_id: str) -> str:
        key_id = "key-" + secrets.token_hex(6)
        self._db.execute(
            "INSERT INTO api_keys (id, project_id, prefix, hash, created_at) VALUES (?,?,?,?,?)",
            (key_id, project_id, key[:len(KEY_PREFIX) + 6], _hash(key), time.time()))
        return key_id


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT/ROLLBACK; caller holds the IAM lock."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")
