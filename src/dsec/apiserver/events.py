"""Lifecycle events into the control store (docs/events.md): the apiserver pulls each edge's
event log every DSEC_EVENTS_POLL_S (as the sandbox index pulls listings, D38: an edge knows no
apiserver), stores what is new once (store/events.py: a cursor per node, under the events row
lock, so replicas sharing one store do not double it) and queues the webhook deliveries in the
same transaction. A node gone from discovery (index.py) yields node_lost for its sandboxes.
Streams wait on `changed` (this process's ingests) or poll the store (another replica's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from dsec.apiserver import egress_secrets
from dsec.store.events import KEEP_S, EventStore
from dsec.store.sandboxes import IndexedSandbox
from dsec.types import EventType, SandboxEvent

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext, EdgeHandle

log = logging.getLogger("dsec.apiserver.events")

BATCH = 1000
PRUNE_EVERY_S = 3600.0


class EventPump:
    def __init__(self, ctx: "ApiContext"):
        self.ctx = ctx
        # webhook signing secrets sealed with the egress secrets' key (D57; iam/secrets.py)
        self.store = EventStore(ctx.iam.db, sealer=lambda: egress_secrets.store(ctx).fernet)
        self.changed = asyncio.Event()       # set (and replaced) after each ingest that stored something
        self._ancestors: dict[str, list[str]] = {}
        self._task: asyncio.Task[None] | None = None
        self._pruned = 0.0
        self.on_new: list[Callable[[], None]] = []   # callbacks after new events (the webhook worker's wake-up)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="dsec-events-pump")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def audience(self, project: str) -> list[str]:
        """The project and its ancestors: whose webhooks get its events (cached; ids are stable)."""
        got = self._ancestors.get(project)
        if got is None:
            got = self._ancestors[project] = self.ctx.iam.ancestors(project) or [project]
        return got

    async def _loop(self) -> None:
        try:       # webhook secrets stored in plain text by an earlier version: encrypted now
            if sealed := await asyncio.to_thread(self.store.seal_plain):
                log.info("encrypted stored webhook secrets", extra={"webhooks": sealed})
        except Exception as e:        # the next start tries again; deliveries read both forms
            log.warning("could not encrypt stored webhook secrets", extra={"error": f"{type(e).__name__}: {e}"})
        while True:
            try:
                await self.pull_once()
                if time.monotonic() - self._pruned > PRUNE_EVERY_S:
                    self._pruned = time.monotonic()
                    await asyncio.to_thread(self.store.prune, time.time() - KEEP_S)
            except Exception as e:      # the edges keep their logs: the next pass catches up
                log.warning("lifecycle event pull failed", extra={"error": f"{type(e).__name__}: {e}"})
            await asyncio.sleep(self.ctx.settings.events.poll_s)

    async def pull_once(self) -> int:
        """Pull every node's new events now; how many were stored."""
        nodes = list(self.ctx.edges.items())
        got = await asyncio.gather(*(self._pull(node, edge) for node, edge in nodes), return_exceptions=True)
        stored = 0
        for (node, _), r in zip(nodes, got):
            if isinstance(r, BaseException):
                if isinstance(r, asyncio.CancelledError):
                    raise r
                log.warning("could not pull a node's events", extra={"node": node, "error": f"{type(r).__name__}: {r}"})
            else:
                stored += r
        if stored:
            self._notify()
        return stored

    async def _pull(self, node: str, edge: "EdgeHandle") -> int:
        deadline = self.ctx.settings.server.list_node_deadline_s
        total = 0
        while True:
            cursor = await asyncio.to_thread(self._cursor, node)
            batch = await asyncio.wait_for(edge.events_since(cursor, BATCH), deadline)
            if not batch.events and batch.last_seq >= cursor:
                return total
            for e in batch.events:
                e.node = node
            total += await asyncio.to_thread(self.store.ingest, node, batch.events, batch.last_seq, self.audience)
            if len(batch.events) < BATCH:
                return total

    def _cursor(self, node: str) -> int:
        r = self.store.db.run(lambda tx: tx.one("SELECT seq FROM event_cursors WHERE source=?", (node,)), write=False)
        return int(r["seq"]) if r else 0

    def _notify(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
        for cb in self.on_new:
            cb()

    async def node_lost(self, node: str, rows: list[IndexedSandbox]) -> None:
        """The sandboxes of a node gone from the cluster ended with it (infrastructure)."""
        now = datetime.now(timezone.utc)
        added = 0
        for r in rows:
            ev = SandboxEvent(type=EventType.ended, sandbox_id=r.id, project=r.project_id, node=node,
                              reason="node_lost", infrastructure=True, at=now,
                              message=f"node {node} left the cluster (absent from discovery for "
                                      f"{self.ctx.settings.cluster.index_lost_s:g} s)")
            added += await asyncio.to_thread(self.store.add_once, ev, self.audience)
        if added:
            self._notify()


def pump(ctx: "ApiContext") -> EventPump:
    """The apiserver's pump (one per ApiContext, made on first use)."""
    p = ctx.runtime.event_pump
    if p is None:
        p = ctx.runtime.event_pump = EventPump(ctx)
    return p
