"""The operator states of nodes (store/nodes.py: cordoned, draining, forgotten), as placement
reads them: cached per apiserver for STATES_TTL_S (a cordon reaches every replica within it),
the last known kept while the store does not answer."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from dsec.store.nodes import NodeRegistry, NodeRow

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

log = logging.getLogger("dsec.apiserver.node_states")

STATES_TTL_S = 1.0


class NodeStates:
    """The operator states, cached per replica for STATES_TTL_S."""

    def __init__(self, registry: NodeRegistry):
        self.registry = registry
        self._rows: dict[str, NodeRow] = {}
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def rows(self) -> dict[str, NodeRow]:
        async with self._lock:
            if time.monotonic() - self._at >= STATES_TTL_S:
                try:
                    self._rows = await asyncio.to_thread(self.registry.all)
                    self._at = time.monotonic()
                except Exception as e:    # the store unreachable: the last known states hold
                    self._at = time.monotonic()     # until the next try, one TTL later
                    log.warning("node states unreadable", extra={"error": f"{type(e).__name__}: {e}"})
            return self._rows

    async def unschedulable(self) -> dict[str, str]:
        """{node: state} of the nodes placement must skip."""
        return {n: r.state for n, r in (await self.rows()).items() if r.state != "active"}

    async def forgotten(self) -> set[str]:
        return {n for n, r in (await self.rows()).items() if r.state == "forgotten"}

    def invalidate(self) -> None:
        self._at = float("-inf")


def node_states(ctx: "ApiContext") -> NodeStates:
    """The apiserver's (one per ApiContext, made on first use)."""
    s = ctx.runtime.node_states
    if s is None:
        s = ctx.runtime.node_states = NodeStates(NodeRegistry(ctx.iam.db))
    return s
