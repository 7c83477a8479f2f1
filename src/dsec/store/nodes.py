"""The cluster's nodes in the control store, by name (cluster/names.py): what outlives any one
process, so that every replica and every `cluster up` agree on it.

- subnet: the edge's sandbox subnet, given once per name and kept: an edge restarted on a new
  raylet (a host reboot) gets the same one, so the sandboxes it adopts keep their addresses.
- state: what an operator set (`dsec nodes`): active; cordoned (no new placement there);
  draining (no new sandbox there at all, restores from its snapshots included); forgotten (gone
  for good: should it come back, what it still runs is destroyed, then it is active again).
- missing_since: when a replica first found the node absent from discovery (wall clock,
  shared by the replicas): the lost timer survives replica restarts.
A node with no row is active (the single-machine server, a node seen before this table).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from dsec.store.db import Database, Tx

STATES = ("active", "cordoned", "draining", "forgotten")


@dataclass(frozen=True)
class NodeRow:
    node: str
    state: str
    subnet: str | None
    missing_since: float | None


class NodeRegistry:
    def __init__(self, db: Database):
        self.db = db

    def all(self) -> dict[str, NodeRow]:
        rows = self.db.run(lambda tx: tx.all("SELECT node, state, subnet, missing_since FROM cluster_nodes"),
                           write=False)
        return {r["node"]: NodeRow(r["node"], r["state"], r["subnet"],
                                   None if r["missing_since"] is None else float(r["missing_since"])) for r in rows}

    def assign_subnet(self, node: str, pool: list[str]) -> str | None:
        """The node's subnet: the one it was given before, else the first of `pool` no node
        holds (None: the pool is full)."""
        def go(tx: Tx) -> str | None:
            r = tx.one("SELECT subnet FROM cluster_nodes WHERE node=?", (node,))
            if r is not None and r["subnet"]:
                return str(r["subnet"])
            held = {x["subnet"]: x["state"] for x in tx.all("SELECT subnet, state FROM cluster_nodes "
                                                            "WHERE subnet IS NOT NULL")}
            # a forgotten node's subnet is kept for it while the pool has others
            free = (next((s for s in pool if s not in held), None)
                    or next((s for s in pool if held.get(s) == "forgotten"), None))
            if free is None:
                return None
            tx.execute("DELETE FROM cluster_nodes WHERE subnet=? AND state='forgotten'", (free,))
            self._ensure(tx, node)
            tx.execute("UPDATE cluster_nodes SET subnet=?, updated_at=? WHERE node=?", (free, time.time(), node))
            return free
        return self.db.run(go)

    def set_state(self, node: str, state: str) -> None:
        assert state in STATES, state

        def go(tx: Tx) -> None:
            self._ensure(tx, node)
            tx.execute("UPDATE cluster_nodes SET state=?, updated_at=? WHERE node=?", (state, time.time(), node))
        self.db.run(go)


    def missing(self, absent: Iterable[str], present: Iterable[str], now: float | None = None) -> dict[str, float]:
        """Record who discovery misses now: `absent` nodes get a missing_since (kept if they had
        one), `present` ones lose theirs. Returns {absent node: missing since}."""
        t = time.time() if now is None else now
        absent = sorted(set(absent))

        back = set(present)

        def go(tx: Tx) -> dict[str, float]:
            # only the few rows that have a timer are touched for present nodes (not one per node)
            for r in tx.all("SELECT node FROM cluster_nodes WHERE missing_since IS NOT NULL"):
                if r["node"] in back:
                    tx.execute("UPDATE cluster_nodes SET missing_since=NULL WHERE node=?", (r["node"],))
            out = {}
            for n in absent:
                self._ensure(tx, n)
                tx.execute("UPDATE cluster_nodes SET missing_since=? WHERE node=? AND missing_since IS NULL", (t, n))
                r = tx.one("SELECT missing_since FROM cluster_nodes WHERE node=?", (n,))
                assert r is not None
                out[n] = float(r["missing_since"])
            return out
        return self.db.run(go)

    @staticmethod
    def _ensure(tx: Tx, node: str) -> None:
        tx.execute("INSERT INTO cluster_nodes (node, state, updated_at) VALUES (?, 'active', ?) "
                   "ON CONFLICT(node) DO NOTHING", (node, time.time()))
