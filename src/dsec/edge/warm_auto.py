"""Automatic warm pools: the node keeps a trainer's burst shape warm on its own (D99).

RL trainers send the same shape of burst step after step (one step's rollouts). The edge
counts the creates of each (image, pool key) as they come; a run of at least MIN_BURST of
them, each within GAP_S of the previous, is a burst, and it sets that image's automatic pool
to the burst's size (never more than DSEC_WARM_POOL_AUTO over all automatic pools). Claims
count as much as cold creates: a burst answered by the pool keeps it. The pool ends after
DSEC_WARM_POOL_AUTO_IDLE_S without such a burst, and every automatic pool ends at once when
admission refuses a tenant's create or makes one wait (then none is made for the same period:
a node short of room does not rebuild it at the next burst).

This module only decides sizes; WarmPools (warm_pool.py) starts and drains sandboxes for them,
merged under the operator's targets (an image the operator configured is never automatic),
and the edge (warm.py) checks room before each automatic start. Nothing here touches a
sandbox: pool sandboxes stay the node's and single use, as for configured pools (D28).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass

log = logging.getLogger("dsec.edge.warm_pool")

MIN_BURST = 8        # creates of one shape that make a burst
GAP_S = 3.0          # a burst's creates each come within this of the previous one


@dataclass
class _Run:
    """Creates of one (image, key) that arrived close together."""
    n: int
    last: float


@dataclass
class AutoPool:
    image: str
    key: Hashable       # the shape of the bursts that made it (the create's pool key)
    size: int
    burst: int          # the largest burst seen (size is this, capped by what N leaves)
    last_burst: float   # monotonic: when a burst last renewed it


class AutoPools:
    def __init__(self, max_total: int, idle_s: float):
        self.max_total = max_total
        self.idle_s = idle_s
        self.pools: dict[str, AutoPool] = {}
        self._runs: dict[tuple[str, Hashable], _Run] = {}
        self._not_poolable: set[tuple[str, Hashable]] = set()   # bursts whose shape no pool of the image has
        self.off_until = 0.0          # monotonic: no automatic pool before this (after a drop)
        self.dropped: str | None = None   # why they were last dropped (status)

    @property
    def on(self) -> bool:
        return self.max_total > 0

    def observe(self, image: str, key: Hashable, now: float | None = None) -> bool:
        """One create of this image and pool key (claimed or cold). True when an automatic
        pool was made or grew (the caller re-merges its targets)."""
        if not self.on:
            return False
        now = time.monotonic() if now is None else now
        run = self._runs.get((image, key))
        if run is None or now - run.last > GAP_S:
            if len(self._runs) > 256:      # shapes seen once and long ago: forget them
                self._runs = {k: r for k, r in self._runs.items() if now - r.last <= GAP_S}
            run = self._runs[(image, key)] = _Run(0, now)
        run.n += 1
        run.last = now
        if run.n < MIN_BURST or now < self.off_until or (image, key) in self._not_poolable:
            return False
        pool = self.pools.get(image)
        if pool is not None and pool.key != key:
            return False     # another shape holds this image's pool: the first one keeps it
        others = sum(p.size for p in self.pools.values() if p.image != image)
        size = min(run.n, self.max_total - others)
        if pool is None:
            if size <= 0:
                return False
            self.pools[image] = AutoPool(image, key, size, run.n, now)
            log.info("automatic warm pool", extra={"image": image, "size": size, "burst": run.n})
            return True
        pool.last_burst = now
        pool.burst = max(pool.burst, run.n)
        if size > pool.size:
            pool.size = size
            return True
        return False

    def not_poolable(self, image: str) -> None:
        """The image's own pool key differs from the burst's (another memory size, workdir,
        user, layers...): a pool of the image would not answer it. Dropped, and not made again
        for that shape."""
        pool = self.pools.pop(image, None)
        if pool is not None:
            self._not_poolable.add((image, pool.key))
            log.info("automatic warm pool dropped: the burst's shape is not the image's pool shape",
                     extra={"image": image})

    def expire(self, now: float | None = None) -> bool:
        """Drop the pools no burst renewed for idle_s. True when any was dropped."""
        now = time.monotonic() if now is None else now
        old = [i for i, p in self.pools.items() if now - p.last_burst > self.idle_s]
        for image in old:
            del self.pools[image]
            log.info("automatic warm pool ended: no burst of its shape", extra={"image": image,
                                                                               "idle_s": self.idle_s})
        return bool(old)

    def drop_all(self, reason: str, now: float | None = None) -> bool:
        """A tenant's create was refused or waited: every automatic pool ends, and none is made
        for idle_s. True when there were any."""
        if not self.on:
            return False
        now = time.monotonic() if now is None else now
        self.off_until = now + self.idle_s
        self.dropped = reason
        had = bool(self.pools)
        if had:
            log.warning("automatic warm pools dropped", extra={"images": sorted(self.pools), "reason": reason})
        self.pools.clear()
        self._runs.clear()
        return had

    def set_max(self, max_total: int) -> None:
        """Change N at run time (admin route): 0 ends every automatic pool; an operator's
        setting also ends the pause after a drop."""
        self.max_total = max_total
        self.off_until, self.dropped = 0.0, None
        if max_total <= 0:
            self.pools.clear()
            self._runs.clear()
            return
        total = 0
        for p in sorted(self.pools.values(), key=lambda p: p.last_burst, reverse=True):
            p.size = max(0, min(p.size, max_total - total))
            total += p.size
        self.pools = {i: p for i, p in self.pools.items() if p.size > 0}

    def status(self, now: float | None = None) -> dict[str, object]:
        now = time.monotonic() if now is None else now
        return {"auto_max": self.max_total, "auto_idle_s": self.idle_s,
                "auto_off_s": round(max(0.0, self.off_until - now), 1), "auto_dropped": self.dropped}
