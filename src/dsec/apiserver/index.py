"""Keeps the cross-node sandbox index (store/sandboxes.py) true from one apiserver (D38).

- Creates and stops through this apiserver are queued and written in one transaction per
  BATCH_S (a burst is one write; the create's answer never waits for it).
- Every listing that reached a node refreshes the node's rows (at most every SYNC_MIN_S per
  node, in the background, writing only what differs): sandboxes that ended on the node by
  themselves (TTL, failure, a stop through the E2B API) leave the index.
- A loop every DSEC_INDEX_SYNC_S lists every node the same way (so the index follows nodes
  nobody lists), ends the rows of a node that has been absent from discovery for DSEC_INDEX_LOST_S
  (counted in the control store from the first replica's notice: store/nodes.py; a node that
  comes back within it, or whose edge restarts, keeps its sandboxes), stops what a forgotten node
  that came back still runs (`dsec nodes forget`), and prunes old ended rows and idempotency claims.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dsec.apiserver.events import pump     # node_lost events (docs/events.md)
from dsec.apiserver.fanout import fan_out
from dsec.store.idempotency import IdempotencyClaims
from dsec.store.nodes import NodeRegistry
from dsec.store.sandboxes import IndexedSandbox, SandboxIndex
from dsec.types import SandboxInfo, SandboxState

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

log = logging.getLogger("dsec.apiserver.index")

BATCH_S = 0.05
SYNC_MIN_S = 1.0
KEEP_ENDED_S = 86400.0      # ended rows are pruned after a day (listing with include_ended asks the edges)


def indexed(info: SandboxInfo) -> IndexedSandbox:
    """The index row of a sandbox as an edge answered it (usage figures left out: they age)."""
    blob = info.model_dump_json(exclude={"host_swap_mb", "host_pss_mb"})
    return IndexedSandbox(id=info.id, node=info.node, project_id=info.project, state=info.state.value,
                          labels=dict(info.labels), created_at=info.created_at.timestamp(), info=blob)


def from_index(row: IndexedSandbox) -> SandboxInfo | None:
    """The sandbox as last seen, with its indexed state (None: never seen whole)."""
    if not row.info:
        return None
    return SandboxInfo.model_validate_json(row.info).model_copy(update={"state": SandboxState(row.state)})


class IndexKeeper:
    def __init__(self, ctx: "ApiContext"):
        self.ctx = ctx
        self.index = SandboxIndex(ctx.iam.db)
        self.claims = IdempotencyClaims(ctx.iam.db)
        self.nodes = NodeRegistry(ctx.iam.db)
        self._put: dict[str, IndexedSandbox] = {}
        self._end: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[None]] = set()
        self._synced: dict[str, float] = {}         # node -> monotonic time of its last sync
        self._lock = asyncio.Lock()                 # one flush at a time

    # -- writes from the create and stop paths -------------------------------------------
    def created(self, info: SandboxInfo) -> None:
        self._ensure_started()
        self._put[info.id] = indexed(info)
        self._wake.set()

    def ended(self, sandbox_id: str, state: str) -> None:
        self._ensure_started()
        self._put.pop(sandbox_id, None)
        self._end[sandbox_id] = state
        self._wake.set()

    async def flush(self) -> None:
        """Write what is queued now (before the index is read for an unreachable node)."""
        async with self._lock:
            put, self._put = list(self._put.values()), {}
            end, self._end = list(self._end.items()), {}
            if put:
                await asyncio.to_thread(self.index.upsert_many, put)
            if end:
                await asyncio.to_thread(self.index.end_many, end)

    # -- refresh from listings -------------------------------------------------------------
    def listed(self, node: str, infos: Sequence[SandboxInfo], listed_at: float) -> None:
        """A node answered a listing of its live sandboxes asked at `listed_at`: bring its
        rows up to date in the background (at most every SYNC_MIN_S per node)."""
        now = time.monotonic()
        if now - self._synced.get(node, -1e9) < SYNC_MIN_S:
            return
        self._synced[node] = now
        self._ensure_started()
        rows = [indexed(i) for i in infos]
        task = asyncio.get_running_loop().create_task(self._sync(node, rows, listed_at))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _sync(self, node: str, rows: list[IndexedSandbox], listed_at: float) -> None:
        try:
            await self.flush()       # this apiserver's own creates first: they are not "new" then
            put, gone = await asyncio.to_thread(self.index.sync_node, node, rows, listed_at)
            if put or gone:
                log.info("sandbox index synced", extra={"node": node, "upserted": put, "ended": gone})
        except Exception as e:      # the index is a cache of the edges: the next sync repairs it
            log.warning("sandbox index sync failed", extra={"node": node, "error": f"{type(e).__name__}: {e}"})

    # -- background ------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        # a context of their own: not the first request's (its short store budget, store/wait.py)
        self._tasks = [loop.create_task(self._writer(), name="dsec-index-writer", context=contextvars.Context()),
                       loop.create_task(self._loop(), name="dsec-index-sync", context=contextvars.Context())]

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(BATCH_S)      # gather a burst into one transaction
            self._wake.clear()
            try:
                await self.flush()
            except Exception as e:
                log.warning("sandbox index write failed", extra={"error": f"{type(e).__name__}: {e}"})

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.settings.cluster.index_sync_s)
            try:
                answers, _, listed_at = await fan_out(self.ctx.edges, False,
                                                                      self.ctx.settings.server.list_node_deadline_s)
                for node, infos in answers.items():
                    self.listed(node, infos, listed_at)
                await self._end_forgotten(answers)
                await self._end_lost()
                await asyncio.to_thread(self.index.prune, time.time() - KEEP_ENDED_S)
                await asyncio.to_thread(self.claims.prune)
            except Exception as e:
                log.warning("sandbox index upkeep failed", extra={"error": f"{type(e).__name__}: {e}"})

    async def _end_forgotten(self, answers: dict[str, list[SandboxInfo]]) -> None:
        """A node forgotten (`dsec nodes forget`) that came back still runs sandboxes whose quota
        and index rows were given up: stop them, then the node is active (empty) again."""
        rows = await asyncio.to_thread(self.nodes.all)
        for node, infos in answers.items():
            row = rows.get(node)
            if row is None or row.state != "forgotten" or node not in self.ctx.edges:
                continue
            edge = self.ctx.edges[node]
            for info in infos:
                try:
                    await edge.stop(info.id, reason="its node was forgotten (dsec nodes forget)")
                    self.ended(info.id, "stopped")
                except Exception as e:
                    log.warning("could not stop a forgotten node's sandbox",
                                extra={"node": node, "sandbox": info.id, "error": f"{type(e).__name__}: {e}"})
                    break
            else:
                await asyncio.to_thread(self.nodes.set_state, node, "active")
                log.warning("forgotten node came back: its sandboxes were stopped",
                            extra={"node": node, "sandboxes": len(infos)})

    async def _end_lost(self) -> None:
        """End the rows of nodes discovery has not known for DSEC_INDEX_LOST_S (not at once: an edge
        that restarts or a node that returns adopts its sandboxes). Since when a node is missing
        is kept in the control store (store/nodes.py): every replica counts from the first that
        noticed, and a replica's restart does not start the count again."""
        now = time.time()
        present = set(self.ctx.edges)
        absent = await asyncio.to_thread(self.index.live_nodes) - present
        since = await asyncio.to_thread(self.nodes.missing, absent, present, now)
        for node, t in since.items():
            if now - t >= self.ctx.settings.cluster.index_lost_s:
                rows = await asyncio.to_thread(self.index.list, node=node)
                n = await asyncio.to_thread(self.index.end_node, node, "lost")
                await pump(self.ctx).node_lost(node, rows)
                log.warning("node gone: its sandboxes left the index", extra={"node": node, "sandboxes": n})

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in [*tasks, *self._bg]:
            t.cancel()
        await asyncio.gather(*tasks, *list(self._bg), return_exceptions=True)
        try:
            await self.flush()
        except Exception as e:
            log.warning("sandbox index write failed at shutdown", extra={"error": f"{type(e).__name__}: {e}"})


def keeper(ctx: "ApiContext") -> IndexKeeper:
    """The apiserver's keeper (one per ApiContext, made on first use)."""
    k = ctx.runtime.index_keeper
    if k is None:
        k = ctx.runtime.index_keeper = IndexKeeper(ctx)
    return k
