"""Idempotency keys of creates, claimed in the shared control store (D38).

A node's edge remembers the keys of its own sandboxes only; in a cluster a retried create may
land on another replica and be placed on another node. So the apiserver claims (project, key)
here before it places anything: the first claimant creates and binds the sandbox id to the
claim; a retry finds the claim and returns that sandbox (or waits while it is being made); a
failed first attempt releases the claim so a retry may create. A claim whose creator died
before binding it (its apiserver killed mid-create) is taken over after STALE_S.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from dsec.store.db import Database, Tx
from dsec.types import SDK_KEY_PREFIX

STALE_S = 600.0          # an unbound claim this old lost its creator (creates end well within it)
KEEP_S = 7 * 86400.0     # bound claims are forgotten after this (a retry a week later creates anew)
# keys the SDK made itself (one per create, only for its own resends within seconds): an hour
SDK_KEEP_S = 3600.0


@dataclass(frozen=True)
class Claim:
    token: str                 # whose claim: only its holder binds or releases it
    sandbox_id: str | None     # the sandbox the first create made; None while it is being made
    mine: bool                 # this call claimed it (it must create, then bind or release)


class IdempotencyClaims:
    def __init__(self, db: Database):
        self.db = db

    def claim(self, project: str, key: str) -> Claim:
        """Claim the key, or the claim that holds it already (taken over if stale and unbound)."""
        token = secrets.token_hex(8)
        now = time.time()

        def run(tx: Tx) -> Claim:
            if tx.execute("INSERT INTO idempotency_claims (project_id, key, sandbox_id, claim, claimed_at) "
                          "VALUES (?,?,NULL,?,?) ON CONFLICT (project_id, key) DO NOTHING",
                          (project, key, token, now)):
                return Claim(token, None, True)
            if tx.execute("UPDATE idempotency_claims SET claim=?, claimed_at=? WHERE project_id=? AND key=? "
                          "AND sandbox_id IS NULL AND claimed_at < ?", (token, now, project, key, now - STALE_S)):
                return Claim(token, None, True)
            r = tx.one("SELECT claim, sandbox_id FROM idempotency_claims WHERE project_id=? AND key=?",
                       (project, key))
            if r is None:       # released between our insert and select: ours on the next try
                return Claim("", None, False)
            return Claim(r["claim"], r["sandbox_id"], False)
        return self.db.run(run)

    def get(self, project: str, key: str) -> Claim | None:
        r = self.db.run(lambda tx: tx.one("SELECT claim, sandbox_id FROM idempotency_claims "
                                          "WHERE project_id=? AND key=?", (project, key)), write=False)
        return None if r is None else Claim(r["claim"], r["sandbox_id"], False)

    def bind(self, project: str, key: str, token: str, sandbox_id: str) -> None:
        """The claim's create made this sandbox: retries return it from now on."""
        self.db.run(lambda tx: tx.execute("UPDATE idempotency_claims SET sandbox_id=? "
                                          "WHERE project_id=? AND key=? AND claim=?",
                                          (sandbox_id, project, key, token)))

    def release(self, project: str, key: str, token: str) -> None:
        """The claim's create failed: the key is free for a retry."""
        self.db.run(lambda tx: tx.execute("DELETE FROM idempotency_claims WHERE project_id=? AND key=? "
                                          "AND claim=? AND sandbox_id IS NULL", (project, key, token)))

    def prune(self, now: float | None = None) -> int:
        """Forget bound claims older than KEEP_S, and those of keys the SDK made (SDK_KEY_PREFIX)
        older than SDK_KEEP_S."""
        now = now if now is not None else time.time()
        return self.db.run(lambda tx: tx.execute(
            "DELETE FROM idempotency_claims WHERE sandbox_id IS NOT NULL AND "
            "(claimed_at < ? OR (key LIKE ? AND claimed_at < ?))",
            (now - KEEP_S, SDK_KEY_PREFIX + "%", now - SDK_KEEP_S)))
