"""Polls every edge for health and load.

Holds no durable state: after a restart the view is rebuilt by the next poll. A node that
fails or does not answer within timeout_s is reported unhealthy (with its last known capacity
so operators can still see it), which keeps placement away from it until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from dsec.types import NodeCapacity, NodeStatus

log = logging.getLogger("dsec.watcher")


@runtime_checkable
class EdgeLike(Protocol):
    async def status(self) -> NodeStatus: ...


class Watcher:
    def __init__(self, edges: Mapping[str, EdgeLike], interval_s: float = 1.0,
                 timeout_s: float = 2.0):
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._edges: dict[str, EdgeLike] = dict(edges)
        self._status: dict[str, NodeStatus] = {}
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Poll once (so nodes() is populated on return), then keep polling in a task."""
        if self._task is not None:
            return
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="dsec-watcher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            # Our own cancellation of the task; re-raise only if *we* are being cancelled.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def __aenter__(self) -> "Watcher":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:   # poll_once handles per-node failures; this is a bug guard
                log.exception("watcher poll failed")

    # ------------------------------------------------------------------ edges

    def add_edge(self, node_id: str, edge: EdgeLike) -> None:
        """Register (or replace) an edge; it shows as unhealthy until its first poll."""
        self._edges[node_id] = edge
        self._status.pop(node_id, None)

    def remove_edge(self, node_id: str) -> None:
        self._edges.pop(node_id, None)
        self._status.pop(node_id, None)

    # ------------------------------------------------------------------ polling

    async def poll_once(self) -> None:
        """Poll every edge concurrently and replace the view with the results."""
        edges = list(self._edges.items())
        results = await asyncio.gather(*(self._poll(node_id, edge) for node_id, edge in edges))
        for (node_id, edge), status in zip(edges, results):
            # Drop results for edges removed or replaced while we were polling.
            if self._edges.get(node_id) is edge:
                self._status[node_id] = status

    async def _poll(self, node_id: str, edge: EdgeLike) -> NodeStatus:
        try:
            st = await asyncio.wait_for(edge.status(), self.timeout_s)
        except TimeoutError:
            return self._unhealthy(node_id, f"no status within {self.timeout_s:g}s")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any edge failure means "unhealthy", never a crashed watcher
            return self._unhealthy(node_id, f"status failed: {type(e).__name__}: {e}")
        if st.node_id != node_id:
            return self._unhealthy(node_id, f"edge answered as node {st.node_id!r}")
        if not st.healthy and self._status.get(node_id, st).healthy:
            log.warning("node %s reports unhealthy: %s", node_id, st.reason)
        return st

    def _unhealthy(self, node_id: str, reason: str) -> NodeStatus:
        prev = self._status.get(node_id)
        if prev is None or prev.healthy:
            log.warning("node %s unhealthy: %s", node_id, reason)
        if prev is None:
            return NodeStatus(node_id=node_id, healthy=False, backends=[],
                              capacity=NodeCapacity(cpu_cores=0, memory_mb=0, max_sandboxes=0),
                              reason=reason)
        return prev.model_copy(update={"healthy": False, "reason": reason})

    # ------------------------------------------------------------------ view

    def nodes(self) -> list[NodeStatus]:
        """Latest known status of every registered edge, sorted by node id."""
        return [self._view(node_id) for node_id in sorted(self._edges)]

    def node(self, node_id: str) -> NodeStatus | None:
        return self._view(node_id) if node_id in self._edges else None

    def _view(self, node_id: str) -> NodeStatus:
        st = self._status.get(node_id)
        if st is None:
            st = NodeStatus(node_id=node_id, healthy=False, backends=[],
                            capacity=NodeCapacity(cpu_cores=0, memory_mb=0, max_sandboxes=0),
                            reason="not polled yet")
        return st
