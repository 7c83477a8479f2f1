"""Secrets at rest (issue 30): project-owned credentials in the control store, encrypted.

The value is stored as a Fernet token (AES-128-CBC + HMAC-SHA256, `cryptography`) under a key
in a file of the operator's (DSEC_SECRETS_KEY_FILE, default DSEC_HOME/secrets.key, 0600, made
on first use; every apiserver of a cluster needs the same file). Why: the control store is the
thing most often copied (backups, a PostgreSQL replica, a support dump); with the key kept
apart, such a copy holds no usable credential. It does not protect against someone who holds
both the database and the key file (root on an apiserver). Reads return SecretInfo only:
no route, CLI or SDK call returns a value; the only consumer is `rules()`, which the apiserver
hands to the edge that runs a sandbox.
"""

from __future__ import annotations

import base64
import json
import os
import secrets as pysecrets
import time
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from dsec.store.db import Database, Tx
from dsec.types import Conflict, EgressSecret, InvalidArgument, NotFound, SecretCreate, SecretInfo, Unavailable


def load_key(path: Path) -> Fernet:
    """The operator's key (made 0600 on first use; O_EXCL so concurrent starters agree)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(Fernet.generate_key() + b"\n")
        except FileExistsError:
            pass
    try:
        return Fernet(path.read_bytes().strip())
    except (OSError, ValueError) as e:
        raise Unavailable(f"cannot use the secrets key file {path}: {e}",
                          fix="set DSEC_SECRETS_KEY_FILE to a file holding a Fernet key (32 url-safe "
                              "base64 bytes), the same on every apiserver") from e


def _info(r: dict) -> SecretInfo:
    return SecretInfo(name=r["name"], project=r["project_id"], hosts=json.loads(r["hosts"]),
                      ports=json.loads(r["ports"]), header=r["header"], basic_auth=bool(r["basic_auth"]),
                      created_at=r["created_at"])


class SecretStore:
    def __init__(self, db: Database, key_file: Path) -> None:
        self.db, self.key_file = db, key_file
        self._fernet: Fernet | None = None

    @property
    def fernet(self) -> Fernet:
        if self._fernet is None:
            self._fernet = load_key(self.key_file)
        return self._fernet

    def create(self, project: str, req: SecretCreate) -> SecretInfo:
        token = self.fernet.encrypt(req.value.encode()).decode()
        sid = "sec_" + pysecrets.token_hex(8)

        def go(tx: Tx) -> None:
            if tx.one("SELECT id FROM egress_secrets WHERE project_id=? AND name=?", (project, req.name)):
                raise Conflict(f"project {project} already has a secret {req.name!r}", field="name",
                               fix=f"remove it first (`dsec secret rm {req.name}`) or choose another name")
            tx.execute("INSERT INTO egress_secrets (id, project_id, name, hosts, ports, header, basic_auth, "
                       "value_enc, created_at) VALUES (?,?,?,?,?,?,?,?,?)",
                       (sid, project, req.name, json.dumps(req.hosts), json.dumps(req.ports), req.header,
                        int(req.basic_auth), token, time.time()))
        self.db.run(go)
        return self.get(project, req.name)

    def get(self, project: str, name: str) -> SecretInfo:
        r = self.db.run(lambda tx: tx.one("SELECT * FROM egress_secrets WHERE project_id=? AND name=?",
                                          (project, name)), write=False)
        if r is None:
            raise NotFound(f"project {project} has no secret {name!r}", field="name",
                           fix="list them with `dsec secret ls`")
        return _info(r)

    def list(self, project: str) -> list[SecretInfo]:
        rows = self.db.run(lambda tx: tx.all("SELECT * FROM egress_secrets WHERE project_id=? ORDER BY name",
                                             (project,)), write=False)
        return [_info(r) for r in rows]

    def delete(self, project: str, name: str) -> str:
        """Remove it; its id (what the edges drop)."""
        def go(tx: Tx) -> str:
            r = tx.one("SELECT id FROM egress_secrets WHERE project_id=? AND name=?", (project, name))
            if r is None:
                raise NotFound(f"project {project} has no secret {name!r}", field="name",
                               fix="list them with `dsec secret ls`")
            tx.execute("DELETE FROM egress_secrets WHERE id=?", (r["id"],))
            return str(r["id"])
        return self.db.run(go)

    def rules(self, project: str, names: list[str], field: str = "secrets") -> list[EgressSecret]:
        """The decrypted rules of the named secrets, for the edge that runs the sandbox."""
        out = []
        for i, name in enumerate(names):
            r = self.db.run(lambda tx: tx.one("SELECT * FROM egress_secrets WHERE project_id=? AND name=?",
                                              (project, name)), write=False)
            if r is None:
                raise InvalidArgument(f"project {project} has no secret {name!r}", field=f"{field}[{i}]",
                                      fix="create it first with `dsec secret create` (or POST /v1/secrets)")
            try:
                value = self.fernet.decrypt(r["value_enc"].encode()).decode()
            except InvalidToken:
                raise Unavailable(f"secret {name!r} cannot be decrypted with {self.key_file}",
                                  fix="every apiserver needs the same DSEC_SECRETS_KEY_FILE; re-create the "
                                      "secret if the key was replaced") from None
            if r["basic_auth"]:
                headers = {"Authorization": "Basic " + base64.b64encode(value.encode()).decode()}
            else:
                headers = {r["header"]: value}
            out.append(EgressSecret(id=r["id"], hosts=json.loads(r["hosts"]), ports=json.loads(r["ports"]),
                                    headers=headers))
        return out
