"""Helpers of the no-root unit tests: a hand-moved clock and a node whose edges come and go."""

from __future__ import annotations

import time as _time

from dsec.settings import Settings
from dsec.backends.base import Backend
from dsec.config import Paths
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge, EdgeSettings
from dsec.images.service import ImageService
from dsec.types import NodeCapacity


class Clock:
    """The edge's wall clock (`time.time` as dsec.edge.edge sees it), moved by hand: TTLs and
    idle parking without sleeping. Monotonic time (durations, poll schedules) stays real."""

    def __init__(self) -> None:
        self.offset = 0.0

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def time(self) -> float:
        return _time.time() + self.offset

    def monotonic(self) -> float:
        return _time.monotonic()


def roomy() -> Admission:
    """Admission that never rejects (mem_reserve 0: the host's free memory does not matter)."""
    return Admission(NodeCapacity(cpu_cores=64, memory_mb=1 << 20, max_sandboxes=100), mem_reserve_mb=0)


class Node:
    """One node: its home, images and runtime (fake backends) outlive the edges built on it,
    so `restart()` is an edge restart with sandboxes still running."""

    def __init__(self, paths: Paths, images: ImageService, backends: list[Backend]):
        self.paths, self.images, self.backends = paths, images, backends
        self.edge: Edge | None = None

    async def start(self, *, admission: Admission | None = None,
                    unavailable: dict[str, tuple[str, str | None]] | None = None) -> Edge:
        # reaper practically off: tests call reap_once() themselves
        self.edge = Edge(self.paths, self.images, self.backends, EdgeSettings(reap_interval_s=3600),
                         admission or roomy(), unavailable, conf=Settings.from_env())   # as a server would
        await self.edge.start()
        return self.edge

    async def stop_edge(self) -> None:
        if self.edge is not None:
            edge, self.edge = self.edge, None
            await edge.close()

    async def restart(self, **kw) -> Edge:   # type: ignore[no-untyped-def]
        await self.stop_edge()
        return await self.start(**kw)
