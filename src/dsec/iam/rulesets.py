"""Operators' named network rule sets (`pypi`, `github`, ...) in the control store.

Defined once by an operator (a key of the root project: PUT /v1/network/rulesets/{name},
`dsec ruleset set`), turned on by name in a sandbox's policy (`network.rulesets`) and bounded
per project (policy `rulesets`, `egress`). The apiserver pushes the whole set to every edge
after each change and at its start (apiserver/rulesets.py); edges resolve names locally.
"""

from __future__ import annotations

import re
import time

from dsec.store import Database, Tx
from dsec.types import RULESET_NAME_RE, InvalidArgument, NetworkRuleSet, NotFound

MAX_RULESETS = 256


def check_name(name: str) -> str:
    if not re.match(RULESET_NAME_RE, name):
        raise InvalidArgument(f"rule set name {name[:80]!r} is not valid", field="name",
                              fix="use 1-64 characters [A-Za-z0-9_.-], starting with a letter or digit")
    return name


class RulesetStore:
    def __init__(self, db: Database):
        self.db = db

    def all(self) -> dict[str, NetworkRuleSet]:
        rows = self.db.run(lambda tx: tx.all("SELECT name, body FROM network_rulesets ORDER BY name"), write=False)
        return {r["name"]: NetworkRuleSet.model_validate_json(r["body"]) for r in rows}

    def put(self, name: str, body: NetworkRuleSet) -> None:
        check_name(name)

        def go(tx: Tx) -> None:
            n = tx.one("SELECT COUNT(*) AS n FROM network_rulesets WHERE name <> ?", (name,))
            if n is not None and int(n["n"]) >= MAX_RULESETS:
                raise InvalidArgument(f"at most {MAX_RULESETS} rule sets", field="name",
                                      fix="delete unused rule sets (`dsec ruleset rm NAME`)")
            tx.execute("INSERT INTO network_rulesets (name, body, updated_at) VALUES (?,?,?) "
                       "ON CONFLICT(name) DO UPDATE SET body=excluded.body, updated_at=excluded.updated_at",
                       (name, body.model_dump_json(), time.time()))
        self.db.run(go)

    def delete(self, name: str) -> None:
        def go(tx: Tx) -> bool:
            return tx.one("DELETE FROM network_rulesets WHERE name=? RETURNING name", (name,)) is not None
        if not self.db.run(go):
            raise NotFound(f"no rule set {name!r}", field="name", fix="list them with `dsec ruleset ls`")
