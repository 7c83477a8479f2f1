"""Projects and API keys, on SQLite (one file, single machine) or PostgreSQL (a cluster).

Projects form a tree (parent_id): a principal acts for its own project and every project below
it. A project's quota caps what it and everything below it hold at once (iam/quota.py counts
it at every level); a sub-project is never given more than its parent holds, and only a key of
a strict ancestor changes a project's quota or policy (a project cannot raise its own). Only
SHA-256 hashes of API keys are stored; the plaintext is shown once.

What every request reads (a key, a project's ancestors, its effective policy) is cached for
DSEC_AUTH_CACHE_S and, while the store is unreachable, served up to DSEC_AUTH_STALE_S old
(iam/cache.py): a control-store outage does not stop the sandboxes callers already run.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from dsec.config import DEFAULT_HOME
from dsec.iam.cache import StaleCache
from dsec.iam.policy import SandboxPolicy, check_narrows, narrow
from dsec.iam.quota import QuotaLedger
from dsec.iam.rulesets import RulesetStore
from dsec.settings import ClusterEnvSettings
from dsec.store import Database, Tx, is_postgres_dsn, open_db
from dsec.store.db import Row
from dsec.types import Conflict, Forbidden, InvalidArgument, NotFound, Unauthorized

log = logging.getLogger("dsec.iam")

KEY_PREFIX = "dsk_"
ROOT_PROJECT = "default"
PROJECT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# Root quota: effectively unlimited; real limits are set on the projects below it.
ROOT_MAX_SANDBOXES = 1_000_000
ROOT_MAX_CPU_CORES = 1_000_000.0
ROOT_MAX_MEMORY_MB = 1 << 40
QUOTA_FIELDS = ("max_sandboxes", "max_cpu_cores", "max_memory_mb")
DEFAULT_ROTATION_GRACE_S = 3600.0      # the old key keeps working this long after a rotation
MAX_ROTATION_GRACE_S = 30 * 86400.0
KEY_ROLES = ("admin", "member")   # admin: manages keys, reads the audit log; member: uses sandboxes

_AUTH_FIX = ("pass 'Authorization: Bearer <key>' (the SDK and CLI read DSEC_API_KEY); "
             "the admin key is in the server's admin.key file")
_PROJECT_FIX = "use a project id from `dsec project ls` (GET /v1/projects)"


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
    role: str = "admin"     # KEY_ROLES: admin (manages keys, reads the audit log) or member


class ApiKeyInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    project_id: str
    prefix: str
    created_at: datetime
    revoked: bool
    expires_at: datetime | None = None     # a rotated key: valid until then (grace), then not
    role: str = "admin"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _row_project(r: Row) -> Project:
    return Project(id=r["id"], name=r["name"], parent_id=r["parent_id"],
                   max_sandboxes=int(r["max_sandboxes"]), max_cpu_cores=float(r["max_cpu_cores"]),
                   max_memory_mb=int(r["max_memory_mb"]), created_at=_ts(float(r["created_at"])))


def _row_key(r: Row) -> ApiKeyInfo:
    return ApiKeyInfo(id=r["id"], project_id=r["project_id"], prefix=r["prefix"],
                      created_at=_ts(float(r["created_at"])), revoked=bool(r["revoked"]),
                      expires_at=_ts(float(r["expires_at"])) if r["expires_at"] is not None else None,
                      role=r.get("role") or "admin")


_ANCESTORS = """WITH RECURSIVE up(id, parent_id, depth) AS (
                    SELECT id, parent_id, 0 FROM projects WHERE id=?
                    UNION ALL
                    SELECT p.id, p.parent_id, up.depth + 1 FROM projects p JOIN up ON p.id = up.parent_id
                ) SELECT id FROM up ORDER BY depth"""
_SUBTREE = """WITH RECURSIVE down(id, depth) AS (
                  SELECT id, 0 FROM projects WHERE id=?
                  UNION ALL
                  SELECT p.id, down.depth + 1 FROM projects p JOIN down ON p.parent_id = down.id
              ) SELECT id FROM down ORDER BY depth, id"""


class IAM:
    """Thread-safe. `dsn`: a SQLite file path, or postgresql://... (the schema is migrated on
    open, store/schema.py). `home`: the server's state directory (defaults to the SQLite
    file's), where secrets beside the database live."""

    def __init__(self, dsn: Path | str, *, home: Path | str | None = None, db: ClusterEnvSettings | None = None):
        db = db or ClusterEnvSettings()      # DSEC_DB_RETRY_S, DSEC_DB_POOL
        self.db: Database = open_db(dsn, retry_s=db.db_retry_s, pool_max=db.db_pool)
        self.home = Path(home) if home is not None else (
            Path(DEFAULT_HOME) if is_postgres_dsn(dsn) else Path(dsn).parent)
        self.quotas = QuotaLedger(self.db)
        self.rulesets = RulesetStore(self.db)   # operators' named network rule sets
        fresh, stale = db.auth_cache_s, db.auth_stale_s
        self._keys: StaleCache[str, Row | None] = StaleCache(fresh, stale)          # key hash -> row
        self._ancestry: StaleCache[str, list[str]] = StaleCache(fresh, stale)     # project -> ancestors
        self._policies: StaleCache[str, tuple[list[str], dict[str, str]]] = StaleCache(fresh, stale)
        self._root: StaleCache[str, Row | None] = StaleCache(fresh, stale)

    def _changed(self) -> None:
        """This process changed keys, projects or policies: read them again (other replicas
        see the change within DSEC_AUTH_CACHE_S)."""
        for c in (self._keys, self._ancestry, self._policies, self._root):
            c.clear()

    @property
    def db_path(self) -> Path:
        """The SQLite file (with PostgreSQL: where it would be, in `home`)."""
        return Path(self.db.url) if self.db.dialect.name == "sqlite" else self.home / "iam.db"

    def close(self) -> None:
        self.db.close()

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
            adopted = self._adopt_key_file(admin_key_file, root)
            self._changed()            # it may have been registered again
            return adopted
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
        self._changed()
        log.info("bootstrapped IAM: root project %s, admin key %s written to %s",
                 root.id, key_id, admin_key_file)
        return key

    def _ensure_root(self) -> Project:
        def go(tx: Tx) -> Project:
            r = tx.one("SELECT * FROM projects WHERE parent_id IS NULL AND name=?", (ROOT_PROJECT,))
            if r is not None:
                return _row_project(r)
            return self._insert_project(tx, ROOT_PROJECT, None, ROOT_MAX_SANDBOXES,
                                        ROOT_MAX_CPU_CORES, ROOT_MAX_MEMORY_MB)
        return self.db.run(go)

    def _adopt_key_file(self, path: Path, root: Project) -> str:
        key = path.read_text().strip()
        if not key.startswith(KEY_PREFIX):
            raise InvalidArgument(f"{path} does not hold a dsec key", field="admin_key_file",
                                  fix=f"delete {path} and restart the server to mint a new admin key")

        def go(tx: Tx) -> Row | None:
            r = tx.one("SELECT id, project_id, revoked FROM api_keys WHERE hash=?", (_hash(key),))
            if r is None:
                # The file outlived the database: register its key again rather than
                # silently handing out a different one.
                self._insert_key(tx, key, root.id)
                log.warning("admin key from %s was not in %s; re-registered it", path, self.db.url)
            return r
        r = self.db.run(go)
        if r is None:
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
                       max_memory_mb: int | None = None, by: Principal | None = None) -> Project:
        """Create a project. Omitted quotas inherit the parent's (root defaults at top level).

        A child's quota may not exceed its parent's (Forbidden): the parent delegates part of
        what it holds, never more. `by`: the caller, who must act for the parent (or above).
        """
        if not PROJECT_NAME_RE.match(name or ""):
            raise InvalidArgument(f"bad project name {name!r}", field="name",
                                  fix="use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        if by is not None and (parent_id is None or not self.can_access(by, parent_id)):
            raise NotFound(f"no project {parent_id!r}", field="parent_id", fix=_PROJECT_FIX)

        def go(tx: Tx) -> Project:
            if parent_id is None:
                limits = (ROOT_MAX_SANDBOXES, ROOT_MAX_CPU_CORES, ROOT_MAX_MEMORY_MB)
            else:
                parent = self._get_project(tx, parent_id, field="parent_id")
                limits = (parent.max_sandboxes, parent.max_cpu_cores, parent.max_memory_mb)
            want = (limits[0] if max_sandboxes is None else max_sandboxes,
                    limits[1] if max_cpu_cores is None else max_cpu_cores,
                    limits[2] if max_memory_mb is None else max_memory_mb)
            _check_quota(want, limits, parent_id)
            if tx.one(f"SELECT 1 AS x FROM projects WHERE name=? AND {tx.dialect.is_('parent_id')}",
                      (name, parent_id)):
                raise Conflict(f"project {name!r} already exists here", field="name",
                               fix="pick another name or use the existing project")
            return self._insert_project(tx, name, parent_id, int(want[0]), float(want[1]), int(want[2]))
        p = self.db.run(go)
        self._changed()
        log.info("created project %s (%s) under %s", p.id, name, parent_id)
        return p

    def set_quota(self, project_id: str, *, max_sandboxes: int | None = None,
                  max_cpu_cores: float | None = None, max_memory_mb: int | None = None,
                  by: Principal | None = None) -> Project:
        """Change a project's quota (omitted: unchanged). Within its parent's and at least every
        sub-project's (delegated quota is taken back by lowering the sub-project first). `by`
        must act for a strict ancestor (the root project sets its own). Lowering below what the
        project holds now stops new sandboxes only; running ones keep going."""
        def go(tx: Tx) -> Project:
            p = self._get_project(tx, project_id, field="project_id")
            if by is not None:
                chain = self._ancestors(tx, project_id)
                if by.project_id not in chain or (by.project_id == project_id and p.parent_id is not None):
                    raise Forbidden(f"project {by.project_id} may not change the quota of {project_id}",
                                    field="project_id",
                                    fix="use a key of a parent project: a project's quota is set from above")
            want = (p.max_sandboxes if max_sandboxes is None else max_sandboxes,
                    p.max_cpu_cores if max_cpu_cores is None else max_cpu_cores,
                    p.max_memory_mb if max_memory_mb is None else max_memory_mb)
            if p.parent_id is not None:
                parent = self._get_project(tx, p.parent_id, field="parent_id")
                limits = (parent.max_sandboxes, parent.max_cpu_cores, parent.max_memory_mb)
            else:
                limits = (ROOT_MAX_SANDBOXES, ROOT_MAX_CPU_CORES, ROOT_MAX_MEMORY_MB)
            _check_quota(want, limits, p.parent_id)
            for c in tx.all("SELECT * FROM projects WHERE parent_id=?", (project_id,)):
                child = _row_project(c)
                for f, v in zip(QUOTA_FIELDS, want):
                    if getattr(child, f) > v:
                        raise Conflict(f"{f}={v} is below sub-project {child.name} ({child.id})'s "
                                       f"{getattr(child, f)}", field=f,
                                       fix=f"lower {child.id}'s {f} first (`dsec project quota {child.id} "
                                           f"--{f.replace('_', '-')} N`), or ask for at least {getattr(child, f)}")
            tx.execute("UPDATE projects SET max_sandboxes=?, max_cpu_cores=?, max_memory_mb=? WHERE id=?",
                       (int(want[0]), float(want[1]), int(want[2]), project_id))
            return p.model_copy(update=dict(zip(QUOTA_FIELDS, (int(want[0]), float(want[1]), int(want[2])))))
        p = self.db.run(go)
        self._changed()
        log.info("set quota of project %s: %s", project_id, {f: getattr(p, f) for f in QUOTA_FIELDS})
        return p

    def delete_project(self, project_id: str, *, by: Principal | None = None) -> None:
        """Remove an empty project (no sub-projects, no sandboxes holding quota) with its keys
        and policy. `by` must act for a strict ancestor; the root project stays."""
        def go(tx: Tx) -> None:
            p = self._get_project(tx, project_id, field="project_id")
            if p.parent_id is None:
                raise Forbidden(f"project {project_id} is the root project", field="project_id",
                                fix="the root project cannot be removed")
            if by is not None and by.project_id not in self._ancestors(tx, p.parent_id):
                raise Forbidden(f"project {by.project_id} may not remove {project_id}", field="project_id",
                                fix="use a key of a parent project")
            kids = tx.all("SELECT id FROM projects WHERE parent_id=?", (project_id,))
            if kids:
                raise Conflict(f"project {project_id} has {len(kids)} sub-project(s)", field="project_id",
                               fix="remove its sub-projects first: " + ", ".join(k["id"] for k in kids[:5]))
            held = tx.one("SELECT COUNT(*) AS n FROM quota_reservations WHERE project_id=?", (project_id,))
            if held and held["n"]:
                raise Conflict(f"project {project_id} has {held['n']} sandbox(es)", field="project_id",
                               fix="stop its sandboxes first (`dsec sandbox ls`, `dsec sandbox rm`)")
            tx.execute("DELETE FROM projects WHERE id=?", (project_id,))
        self.db.run(go)
        self._changed()
        log.info("removed project %s", project_id)

    def project(self, project_id: str) -> Project:
        return self.db.run(lambda tx: self._get_project(tx, project_id, field="project_id"), write=False)

    def root(self) -> Project:
        """The root project created by bootstrap()."""
        r = self._root.get("", lambda: self.db.run(lambda tx: tx.one(
            "SELECT * FROM projects WHERE parent_id IS NULL AND name=?", (ROOT_PROJECT,)), write=False))
        if r is None:
            raise NotFound("IAM is not bootstrapped: no root project", fix="call IAM.bootstrap() first")
        return _row_project(r)

    def children(self, project_id: str) -> list[Project]:
        rows = self.db.run(lambda tx: tx.all("SELECT * FROM projects WHERE parent_id=? ORDER BY created_at, id",
                                             (project_id,)), write=False)
        return [_row_project(r) for r in rows]

    def subtree(self, project_id: str) -> list[Project]:
        """The project and every project below it, top down."""
        def go(tx: Tx) -> list[Project]:
            ids = [r["id"] for r in tx.all(_SUBTREE, (project_id,))]
            if not ids:
                return []
            rows = {r["id"]: r for r in tx.all(
                f"SELECT * FROM projects WHERE id IN ({','.join('?' * len(ids))})", ids)}
            return [_row_project(rows[i]) for i in ids if i in rows]
        return self.db.run(go, write=False)

    def ancestors(self, project_id: str) -> list[str]:
        """Ids from project_id itself up to its top-level project (empty if unknown)."""
        return list(self._ancestry.get(project_id, lambda: self.db.run(
            lambda tx: self._ancestors(tx, project_id), write=False)))

    def can_access(self, principal: Principal, project_id: str) -> bool:
        """True if the principal's project is project_id or one of its ancestors."""
        return principal.project_id in self.ancestors(project_id)

    # ------------------------------------------------------------------ sandbox policy

    def own_policy(self, project_id: str) -> SandboxPolicy:
        def go(tx: Tx) -> Row | None:
            self._get_project(tx, project_id, field="project_id")
            return tx.one("SELECT policy FROM project_policies WHERE project_id=?", (project_id,))
        r = self.db.run(go, write=False)
        return SandboxPolicy.model_validate_json(r["policy"]) if r else SandboxPolicy()

    def effective_policy(self, project_id: str) -> SandboxPolicy:
        """The project's policy narrowed by every ancestor's (what its sandboxes may loosen)."""
        def go(tx: Tx) -> tuple[list[str], dict[str, str]]:
            chain = self._ancestors(tx, project_id)          # self first, top-level last
            if not chain:
                return chain, {}
            marks = ",".join("?" * len(chain))
            return chain, {r["project_id"]: r["policy"] for r in tx.all(
                f"SELECT project_id, policy FROM project_policies WHERE project_id IN ({marks})", chain)}
        chain, rows = self._policies.get(project_id, lambda: self.db.run(go, write=False))
        if not chain:
            raise NotFound(f"no project {project_id!r}", field="project_id", fix=_PROJECT_FIX)
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
        self.db.run(lambda tx: tx.execute(
            "INSERT INTO project_policies (project_id, policy, updated_at) VALUES (?,?,?) "
            "ON CONFLICT(project_id) DO UPDATE SET policy=excluded.policy, updated_at=excluded.updated_at",
            (project_id, policy.model_dump_json(exclude_none=True), time.time())))
        self._changed()
        log.info("set sandbox policy of project %s: %s", project_id, policy.model_dump(exclude_none=True))
        return policy

    # ------------------------------------------------------------------ keys

    def create_key(self, project_id: str, *, role: str = "admin", by: Principal | None = None) -> str:
        """Mint a key for the project; the plaintext is returned once and never stored.
        `by` must act for the project or an ancestor, with an admin key."""
        if role not in KEY_ROLES:
            raise InvalidArgument(f"unknown key role {role!r}", field="role", fix="one of: " + ", ".join(KEY_ROLES))
        if by is not None and not self.can_access(by, project_id):
            raise NotFound(f"no project {project_id!r}", field="project_id", fix=_PROJECT_FIX)
        if by is not None:
            require_admin(by, "create API keys")
        key, key_id = self._new_key(project_id, role)
        log.info("created api key %s for project %s", key_id, project_id)
        return key

    def _new_key(self, project_id: str, role: str = "admin") -> tuple[str, str]:
        key = KEY_PREFIX + secrets.token_urlsafe(32)

        def go(tx: Tx) -> str:
            self._get_project(tx, project_id, field="project_id")
            return self._insert_key(tx, key, project_id, role)
        return key, self.db.run(go)

    def key_info(self, key_id: str) -> ApiKeyInfo:
        r = self.db.run(lambda tx: tx.one("SELECT * FROM api_keys WHERE id=?", (key_id,)), write=False)
        if r is None:
            raise NotFound(f"no api key {key_id!r}", field="key_id", fix="use a key id from `dsec key ls`")
        return _row_key(r)

    def revoke_key(self, key_id: str, *, by: Principal | None = None) -> None:
        """Revoke a key by id (idempotent). `by` must act for the key's project or an ancestor."""
        if by is not None and not self.can_access(by, self.key_info(key_id).project_id):
            raise NotFound(f"no api key {key_id!r}", field="key_id", fix="use a key id from `dsec key ls`")
        if by is not None and key_id != by.key_id:
            require_admin(by, "revoke other API keys")
        if self.db.run(lambda tx: tx.execute("UPDATE api_keys SET revoked=1 WHERE id=?", (key_id,))) == 0:
            raise NotFound(f"no api key {key_id!r}", field="key_id", fix="use a key id from list_keys()")
        self._changed()
        log.info("revoked api key %s", key_id)

    def rotate_key(self, key_id: str, *, grace_s: float = DEFAULT_ROTATION_GRACE_S,
                   by: Principal | None = None) -> tuple[str, str]:
        """A new key of the same project, and the old one ends after `grace_s` seconds (0: at
        once): clients switch to the new key meanwhile, with no moment when neither works.
        Returns (new key, its id). `by` must act for the key's project or an ancestor."""
        if not 0 <= grace_s <= MAX_ROTATION_GRACE_S:
            raise InvalidArgument(f"grace_s {grace_s} is out of range", field="grace_s",
                                  fix=f"0 (end the old key now) to {MAX_ROTATION_GRACE_S:.0f} seconds")
        old = self.key_info(key_id)
        if by is not None and not self.can_access(by, old.project_id):
            raise NotFound(f"no api key {key_id!r}", field="key_id", fix="use a key id from `dsec key ls`")
        if by is not None and key_id != by.key_id:
            require_admin(by, "rotate other API keys")     # the new key takes the old one's role
        if old.revoked:
            raise Conflict(f"api key {key_id} is revoked", field="key_id", fix="create a new key instead")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        ends = time.time() + grace_s

        def go(tx: Tx) -> str:
            new_id = self._insert_key(tx, key, old.project_id, old.role)
            # an earlier, shorter grace is kept: rotating again never extends the old key's life
            tx.execute("UPDATE api_keys SET expires_at=? WHERE id=? AND (expires_at IS NULL OR expires_at > ?)",
                       (ends, key_id, ends))
            return new_id
        new_id = self.db.run(go)
        self._changed()
        log.info("rotated api key %s -> %s (old one ends in %.0fs)", key_id, new_id, grace_s)
        return key, new_id

    def list_keys(self, project_id: str) -> list[ApiKeyInfo]:
        rows = self.db.run(lambda tx: tx.all(
            "SELECT * FROM api_keys WHERE project_id=? ORDER BY created_at, id", (project_id,)), write=False)
        return [_row_key(r) for r in rows]

    def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise Unauthorized("no API key given", field="authorization", fix=_AUTH_FIX)
        key = key.strip()
        if not key.startswith(KEY_PREFIX):
            raise Unauthorized(f"not a dsec API key (they start with {KEY_PREFIX!r})",
                               field="authorization", fix=_AUTH_FIX)
        # Looking up by hash means no comparison ever runs over the secret itself.
        h = _hash(key)
        r = self._keys.get(h, lambda: self.db.run(lambda tx: tx.one(
            "SELECT k.id, k.hash, k.revoked, k.expires_at, k.role, p.id AS pid, p.name FROM api_keys k "
            "JOIN projects p ON p.id = k.project_id WHERE k.hash=?", (h,)), write=False))
        if r is None or not hmac.compare_digest(r["hash"], h):
            raise Unauthorized("unknown API key", field="authorization", fix=_AUTH_FIX)
        if r["revoked"]:
            raise Unauthorized(f"API key {r['id']} was revoked", field="authorization",
                               fix=_AUTH_FIX + "; ask a project admin for a new key")
        if r["expires_at"] is not None and float(r["expires_at"]) <= time.time():
            raise Unauthorized(f"API key {r['id']} was rotated and its grace period is over", field="authorization",
                               fix="use the key that replaced it (`dsec key rotate` printed it)")
        return Principal(project_id=r["pid"], key_id=r["id"], project_name=r["name"], role=r["role"] or "admin")

    # ------------------------------------------------------------------ internals

    def _ancestors(self, tx: Tx, project_id: str) -> list[str]:
        return [r["id"] for r in tx.all(_ANCESTORS, (project_id,))]

    def _get_project(self, tx: Tx, project_id: str, *, field: str) -> Project:
        r = tx.one("SELECT * FROM projects WHERE id=?", (project_id,))
        if r is None:
            raise NotFound(f"no project {project_id!r}", field=field, fix=_PROJECT_FIX)
        return _row_project(r)

    def _insert_project(self, tx: Tx, name: str, parent_id: str | None, max_sandboxes: int,
                        max_cpu_cores: float, max_memory_mb: int) -> Project:
        pid = "prj-" + secrets.token_hex(6)
        now = time.time()
        tx.execute("INSERT INTO projects (id, name, parent_id, max_sandboxes, max_cpu_cores, max_memory_mb,"
                   " created_at) VALUES (?,?,?,?,?,?,?)",
                   (pid, name, parent_id, max_sandboxes, max_cpu_cores, max_memory_mb, now))
        tx.execute("INSERT INTO quota_usage (project_id) VALUES (?)", (pid,))
        return Project(id=pid, name=name, parent_id=parent_id, max_sandboxes=max_sandboxes,
                       max_cpu_cores=max_cpu_cores, max_memory_mb=max_memory_mb, created_at=_ts(now))

    def _insert_key(self, tx: Tx, key: str, project_id: str, role: str = "admin") -> str:
        key_id = "key-" + secrets.token_hex(6)
        tx.execute("INSERT INTO api_keys (id, project_id, prefix, hash, created_at, role) VALUES (?,?,?,?,?,?)",
                   (key_id, project_id, key[:len(KEY_PREFIX) + 6], _hash(key), time.time(), role))
        return key_id


def require_admin(who: Principal, what: str) -> None:
    """Refuse a member key what only its project's admin keys may do, naming the role."""
    if who.role != "admin":
        raise Forbidden(f"API key {who.key_id} has the role {who.role!r}; only a key with the role 'admin' may {what}",
                        field="role", fix="use an admin key of the project (or of a parent project); "
                                          "`dsec key create PROJECT --role admin` makes one")


def _check_quota(want: tuple[int | float, ...], limits: tuple[int | float, ...], parent_id: str | None) -> None:
    """A delegated quota is >= 0 and never more than the parent holds."""
    for field, value, limit in zip(QUOTA_FIELDS, want, limits):
        if value < 0:
            raise InvalidArgument(f"{field} must be >= 0, got {value}", field=field,
                                  fix=f"pass a {field} between 0 and {limit}")
        if value > limit:
            where = "the parent project's" if parent_id is not None else "the most a top-level project may hold,"
            raise Forbidden(f"{field}={value} exceeds {where} {limit}", field=field,
                            fix=f"ask for at most {limit}, or raise the parent's quota first")
